"""Named profiles: built-ins, user files, bad files, netem/tbf rendering, overrides."""

import json

import numpy as np
import pytest
from kvtransport.netem import (
    SAMPLE_TRACE,
    FourState,
    GilbertElliott,
    Profile,
    ProfileError,
    TraceReplay,
    builtin_profiles,
    load_profile,
    load_profiles_file,
    make_channel,
    parse_loss,
    write_trace,
)

BUILTIN_NETEM = {
    "clean": "limit 11718 delay 5ms",
    "bernoulli-5": "limit 11718 delay 5ms loss random 5%",
    "ge-light": "limit 11718 delay 5ms loss gemodel 1% 40% 50% 0.1%",
    "ge-heavy": "limit 11718 delay 5ms loss gemodel 5% 30% 80% 0.5%",
    "4state-bursty": "limit 11718 delay 5ms loss state 1% 10% 30% 50% 0.5%",
}


def test_builtin_profiles_are_the_issue_s_list():
    profs = builtin_profiles()
    assert set(profs) == set(BUILTIN_NETEM)
    for p in profs.values():
        assert p.rate_mbps == 100 and p.delay_ms == 5 and p.jitter_ms == 0
    assert profs["ge-heavy"].loss == GilbertElliott(0.05, 0.30, 0.80, 0.005)
    assert profs["ge-light"].loss == GilbertElliott(0.01, 0.40, 0.50, 0.001)
    assert isinstance(profs["4state-bursty"].loss, FourState)
    assert profs["bernoulli-5"].stationary_loss() == pytest.approx(0.05)
    assert profs["clean"].stationary_loss() == 0.0
    assert 0.11 < profs["ge-heavy"].stationary_loss() < 0.13
    assert profs["ge-heavy"].mean_burst_length() > 2.0


@pytest.mark.parametrize("name", sorted(BUILTIN_NETEM))
def test_netem_and_tbf_arguments_for_every_builtin(name):
    p = load_profile(name)
    assert " ".join(p.netem_args()) == BUILTIN_NETEM[name]
    assert " ".join(p.netem_args(rate=True)) == BUILTIN_NETEM[name] + " rate 100mbit"
    # 100 Mbit/s: burst = 1 ms at the rate, queue = 50 ms at the rate
    assert p.tbf_args() == ["rate", "100mbit", "burst", "12500", "limit", "625000"]
    # the rendered loss arguments parse back to the same model (tc notation round trip)
    loss_args = p.loss.netem_args()
    assert parse_loss(" ".join(loss_args)) == p.loss


def test_rendering_of_overrides_jitter_and_odd_rates():
    p = Profile(
        "x",
        loss=parse_loss("gemodel 2.5% 25%"),
        rate_mbps=12.5,
        delay_ms=2.5,
        jitter_ms=0.5,
        jitter_distribution="normal",
    )
    args = p.netem_args(rate=True)
    assert args[2:] == [
        "delay",
        "2.5ms",
        "0.5ms",
        "distribution",
        "normal",
        "loss",
        "gemodel",
        "2.5%",
        "25%",
        "100%",
        "0%",
        "rate",
        "12500kbit",
    ]
    assert p.tbf_args()[:4] == ["rate", "12500kbit", "burst", str(2 * 1514)]
    q = load_profile("ge-heavy").with_overrides(rate_mbps=1000, delay_ms=20)
    assert q.netem_args()[2:4] == ["delay", "20ms"] and q.tbf_args()[1] == "1000mbit"
    assert q.effective_queue_bytes() == 6_250_000


def test_user_toml_file(tmp_path):
    trace = tmp_path / "traces" / "office.csv.gz"
    trace.parent.mkdir()
    write_trace(trace, np.array([False, True, False, False]), np.array([5e3, 0, 6e3, 7e3]))
    f = tmp_path / "links.toml"
    f.write_text(
        """
[profiles.wifi-bad]
description = "lunch time"
loss = "gemodel 3% 25% 70% 0.2%"
rate_mbps = 50
delay_ms = 8
jitter_ms = 1
jitter_distribution = "normal"
queue_bytes = 300000

[profiles.office]
trace = "traces/office.csv.gz"
trace_offset = 1
"""
    )
    profs = load_profiles_file(f)
    w = profs["wifi-bad"]
    assert w.loss == GilbertElliott(0.03, 0.25, 0.70, 0.002)
    assert (w.rate_mbps, w.delay_ms, w.jitter_ms, w.effective_queue_bytes()) == (50, 8, 1, 300000)
    assert load_profile("wifi-bad", profiles_file=f) == w
    office = profs["office"]
    assert isinstance(office.loss, TraceReplay) and office.loss.path == str(trace)
    assert office.stationary_loss() == pytest.approx(0.25)
    ch = make_channel(office, seed=0)
    assert [ch.transmit(i * 1e-3, 100) is None for i in range(4)] == [True, False, False, False]
    with pytest.raises(ProfileError, match="takes its delay from the trace"):
        make_channel(office, seed=0, delay_ms=3)
    with pytest.raises(ProfileError, match="cannot be replayed by kernel netem"):
        office.netem_args()


def test_user_json_file_and_single_profile_path(tmp_path):
    f = tmp_path / "one.json"
    f.write_text(json.dumps({"profiles": {"lossy": {"loss": "random 2%", "rate_mbps": 10}}}))
    p = load_profile(str(f))
    assert p.name == "lossy" and p.rate_mbps == 10 and p.stationary_loss() == pytest.approx(0.02)
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"profiles": {"a": {}, "b": {"loss": "1%"}}}))
    with pytest.raises(ProfileError, match="holds 2 profiles"):
        load_profile(str(two))


def test_netem_notation_and_trace_path_as_profile(tmp_path):
    p = load_profile("gemodel 3% 30% 80% 0.5%")
    assert p.loss == GilbertElliott(0.03, 0.30, 0.80, 0.005) and p.rate_mbps == 100
    t = tmp_path / "m.csv"
    write_trace(t, np.array([True, False]), np.array([0.0, 5e3]))
    assert isinstance(load_profile(str(t)).loss, TraceReplay)


BAD_FILES = [
    ("x.toml", "[profiles.a]\nloss = 'gemodel 5%'\nrate = 3\n", "unknown key 'rate'"),
    ("x.toml", "[profiles.a]\nrate_mbps = 'fast'\n", "rate_mbps must be a number"),
    ("x.toml", "[profiles.a]\nrate_mbps = 0\n", "rate_mbps must be > 0"),
    ("x.toml", "[profiles.a]\nloss = 'gemodel 5% 300%'\n", "gemodel r"),
    ("x.toml", "[profiles.a]\nloss = 'bursty'\n", "expected 'none'"),
    ("x.toml", "[profiles.ge-heavy]\nloss = '1%'\n", "is built in"),
    ("x.toml", "[profiles.Bad_Name]\n", "profile name"),
    ("x.toml", "[profiles.a\n", "invalid TOML"),
    ("x.toml", "[other]\nx = 1\n", "'profiles' table"),
    ("x.toml", "profiles = {}\n", "empty"),
    ("x.toml", "[profiles.a]\ntrace = 'nope.csv'\n", "no such trace file"),
    ("x.toml", "[profiles.a]\ntrace_offset = 3\n", "needs a trace"),
    ("x.toml", "[profiles.a]\njitter_distribution = 'pareto'\n", "uniform' or 'normal"),
    ("x.toml", "[profiles.a]\nqueue_bytes = 10\n", "queue_bytes must be >="),
    ("x.toml", "[profiles.a]\nrate_steps = '0.2'\n", "SECONDS:MBIT_S pairs"),
    ("x.toml", "[profiles.a]\nrate_steps = '0.2:fast'\n", "SECONDS:MBIT_S pairs"),
    ("x.toml", "[profiles.a]\nrate_steps = '0.2:0'\n", "rates must be > 0"),
    ("x.toml", "[profiles.a]\nrate_steps = '0.3:5, 0.2:5'\n", "times must be >= 0 and increasing"),
    ("x.json", '{"profiles": {"a": {"loss": 5}}}', "loss must be a str"),
    ("x.json", '{"profiles": {"a": ', "invalid JSON"),
    ("x.json", '{"profiles": {"a": {}}, "extra": 1}', "unknown top-level key"),
]


@pytest.mark.parametrize("name, content, fragment", BAD_FILES)
def test_bad_profile_files_get_one_line_errors(tmp_path, name, content, fragment):
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(ProfileError) as err:
        load_profiles_file(f)
    msg = str(err.value)
    assert fragment in msg, msg
    assert "\n" not in msg and str(f) in msg


def test_trace_profile_refuses_delay_keys(tmp_path):
    t = tmp_path / "m.csv"
    write_trace(t, np.array([False]), np.array([5e3]))
    f = tmp_path / "p.toml"
    f.write_text(f"[profiles.a]\ntrace = '{t}'\ndelay_ms = 3\n")
    with pytest.raises(ProfileError, match="does not apply to a trace"):
        load_profiles_file(f)


def test_unknown_names_and_missing_files():
    with pytest.raises(ProfileError, match="unknown profile 'ge-medium'.*ge-heavy"):
        load_profile("ge-medium")
    with pytest.raises(ProfileError, match="no such profiles file"):
        load_profiles_file("/nonexistent/profiles.toml")
    with pytest.raises(ProfileError, match="no such trace file"):
        load_profile("/nonexistent/trace.csv.gz")


def test_make_channel_overrides_rate_and_delay():
    fast = make_channel("clean", seed=0, rate_mbps=10, delay_ms=20)
    out = [fast.transmit(0.0, 1208) for _ in range(20)]
    # the bucket (2 frames at 10 Mbit/s) lets two through at once; then 1250 B per 1 ms
    assert out[0] == pytest.approx(0.020)
    assert np.allclose(np.diff(out[2:]), 1250 * 8 / 10e6)
    ge = make_channel("ge-heavy", seed=7)
    n = 50_000
    lost = sum(ge.transmit(i * 2e-4, 1000) is None for i in range(n))
    st = load_profile("ge-heavy").loss.stats()
    assert abs(lost / n - st.loss_rate) < 4 * (st.asymptotic_var / n) ** 0.5


def test_sample_trace_ships_and_replays():
    p = load_profile(SAMPLE_TRACE)
    tr = p.loss.trace()
    assert len(tr) == 12_000 and 0.02 < tr.loss_rate < 0.15
    ch = make_channel(p, seed=0)
    out = [ch.transmit(i * 1e-3, 1300) for i in range(3000)]
    delays = np.array([a - i * 1e-3 for i, a in enumerate(out) if a is not None])
    assert 0.004 < np.median(delays) < 0.012


def test_reverse_profiles_match_the_testbed_feedback_path(tmp_path):
    p = load_profile("ge-heavy").with_overrides(delay_ms=7)
    assert p.reverse_profile("full") is p
    back = p.reverse_profile("delay")
    assert back.stationary_loss() == 0.0 and back.delay_ms == 7 and not back.rate_limited
    ch = make_channel(back, seed=1)
    # no loss, no rate limit: a burst of 1000 packets all arrive after exactly 7 ms
    assert [ch.transmit(0.0, 1300) for _ in range(1000)] == [0.007] * 1000
    assert make_channel(p.reverse_profile("none"), seed=1).transmit(1.0, 100) == 1.0
    with pytest.raises(ProfileError, match="no tbf"):
        back.tbf_args()
    t = tmp_path / "t.csv"
    write_trace(t, np.array([False, True, False]), np.array([4000.0, 0.0, 6000.0]))
    assert load_profile(str(t)).reverse_profile("delay").delay_ms == pytest.approx(5.0)
    with pytest.raises(ProfileError, match="reverse mode"):
        p.reverse_profile("half")


def test_rate_steps_round_trip_and_need_a_shaper_that_can_change_rate(tmp_path):
    """A profile whose rate changes at set times: read from a file, described, written
    back; the testbed takes it with kernel tbf (it plays the steps with tc) and refuses it
    in one line, before touching anything, with the relay backend's own token bucket (one
    rate; with backend auto that is known at up(), where kernel netem may take it)."""
    from kvtransport.netem.testbed import Testbed, TestbedError

    f = tmp_path / "p.toml"
    f.write_text("[profiles.cell]\nloss = '1%'\nrate_mbps = 50\nrate_steps = '0.2:10, 0.6:50'\n")
    p = load_profiles_file(f)["cell"]
    assert p.rate_steps == ((0.2, 10.0), (0.6, 50.0))
    assert "10 from 0.2 s, 50 from 0.6 s" in p.describe()
    again = load_profiles_file_from_mapping(p)
    assert again.rate_steps == p.rate_steps and again.loss == p.loss
    assert make_channel(p, 0).rate_bps == 50e6  # the base rate before the first step
    with pytest.raises(TestbedError, match="relay's own token bucket cannot") as err:
        Testbed(p, prefix="kvtq", backend="relay", shaper="relay")
    assert "\n" not in str(err.value)
    assert Testbed(p, prefix="kvtq").profile.rate_steps == p.rate_steps  # tbf: taken
    assert Testbed(p, prefix="kvtq", shaper="relay").shaper == "relay"  # auto: up() decides


def load_profiles_file_from_mapping(p):
    from kvtransport.netem.profiles import profile_from_mapping, profile_to_mapping

    return profile_from_mapping(p.name, profile_to_mapping(p))
