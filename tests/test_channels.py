"""Userspace channel models: netem-exact loss statistics, rate limiter, delay, clone, traces."""

import gzip
import math

import numpy as np
import pytest
from kvtransport.netem import (
    UDP_OVERHEAD_BYTES,
    Bernoulli,
    Channel,
    DelaySampler,
    FourState,
    GilbertElliott,
    NoLoss,
    Profile,
    TraceError,
    TraceReplay,
    make_channel,
    parse_loss,
    read_trace,
    write_trace,
)
from kvtransport.netem.trace import trace_from_irtt

from kvtransport.errors import UserError

Z = 4.0  # confidence multiplier: a seeded run outside 4 sigma means the model is wrong


def _runs(lost: np.ndarray) -> np.ndarray:
    """Lengths of runs of consecutive True values."""
    x = np.concatenate([[0], lost.astype(np.int8), [0]])
    d = np.diff(x)
    return np.flatnonzero(d == -1) - np.flatnonzero(d == 1)


def _check_against_theory(spec, n: int, seed: int) -> None:
    lost = spec.sampler(np.random.default_rng(seed)).draw(n)
    st = spec.stats()
    # loss rate: the asymptotic variance includes the chain's autocorrelation
    sd = math.sqrt(st.asymptotic_var / n)
    assert abs(lost.mean() - st.loss_rate) < Z * sd, (lost.mean(), st.loss_rate, sd)
    runs = _runs(lost)
    se = runs.std(ddof=1) / math.sqrt(len(runs))
    assert abs(runs.mean() - st.mean_burst) < Z * se, (runs.mean(), st.mean_burst, se)


@pytest.mark.parametrize(
    "text",
    [
        "gemodel 5% 30% 80% 0.5%",
        "gemodel 1% 40% 50% 0.1%",
        "gemodel 2%",
        "state 1% 10% 30% 50% 0.5%",
        "random 5%",
    ],
)
def test_loss_statistics_match_analytic_values(text):
    _check_against_theory(parse_loss(text), 200_000, seed=11)


def test_ge_heavy_closed_form():
    # pi_bad = p / (p + r); loss = pi_good (1-k) + pi_bad (1-h): about 12% as the issue says
    ge = GilbertElliott(0.05, 0.30, 0.80, 0.005)
    pi_bad = 0.05 / 0.35
    assert ge.stationary_loss() == pytest.approx((1 - pi_bad) * 0.005 + pi_bad * 0.80, rel=1e-12)
    assert 0.11 < ge.stationary_loss() < 0.13
    # a Simple Gilbert (1-h = 100%, 1-k = 0) has geometric runs of mean 1/r
    assert GilbertElliott(0.05, 0.25).mean_burst_length() == pytest.approx(4.0)


def test_gilbert_elliott_uses_the_state_the_packet_started_in():
    # netem draws the transition first, then the loss with the OLD state's probability:
    # with p = 100% the first packet is judged in the good state (never lost), every
    # later one in the bad state (always lost).
    s = GilbertElliott(1.0, 0.0, 1.0, 0.0).sampler(np.random.default_rng(0))
    fates = s.draw(50)
    assert not fates[0]
    assert fates[1:].all()


def test_four_state_loses_on_entering_a_loss_state():
    # netem's loss_4state: the packet's fate is the state it moves to. p13 = 100% and
    # p31 = 100%: state 1 -> 3 (lost) -> 1 (received) -> 3 ...
    s = FourState(1.0, 1.0, 0.0, 1.0, 0.0).sampler(np.random.default_rng(0))
    fates = s.draw(10)
    assert fates.tolist() == [True, False] * 5
    # isolated losses only (p14): every loss is a run of exactly one
    iso = FourState(0.0, 1.0, 0.0, 1.0, 0.2).sampler(np.random.default_rng(1)).draw(50_000)
    assert iso.any() and _runs(iso).max() == 1


def test_netem_defaults_for_omitted_parameters():
    assert parse_loss("gemodel 10%") == GilbertElliott(0.10, 0.90, 1.0, 0.0)
    assert parse_loss("loss gemodel 10% 20%") == GilbertElliott(0.10, 0.20, 1.0, 0.0)
    assert parse_loss("state 5%") == FourState(0.05, 0.95, 0.0, 1.0, 0.0)
    assert parse_loss("5%") == Bernoulli(0.05)
    assert parse_loss("random 5") == Bernoulli(0.05)  # tc reads a bare number as percent
    assert parse_loss("none") == NoLoss()


@pytest.mark.parametrize(
    "text",
    [
        "gemodel",
        "gemodel 5% 30% 80% 0.5% 1%",
        "gemodel 120%",
        "random 5% 25%",
        "state 60% 10% 10% 10% 50%",
        "bursty 5%",
        "random five",
    ],
)
def test_bad_loss_notation_is_rejected_with_one_line(text):
    with pytest.raises(ValueError) as err:
        parse_loss(text)
    assert "\n" not in str(err.value) and len(str(err.value)) > 10


def _blast_channel(**kw) -> Channel:
    rng = np.random.default_rng(0)
    return Channel(NoLoss().sampler(rng), DelaySampler(0.0, 0.0, "uniform", rng), **kw)


def test_rate_limiter_burst_then_queue_then_drops():
    size = 1300 + UDP_OVERHEAD_BYTES  # 1342 bytes on the wire
    ch = _blast_channel(rate_bps=8e6, queue_bytes=10 * size, burst_bytes=2 * size + 100)
    out = [ch.transmit(0.0, 1300) for _ in range(40)]
    accepted = [t for t in out if t is not None]
    # two packets leave at once on the full bucket; ten wait in the queue; the rest drop
    assert len(accepted) == 12 and ch.dropped == 28
    assert accepted[:2] == [0.0, 0.0]
    gaps = np.diff(accepted[2:])
    assert np.allclose(gaps, size / 1e6)  # 8 Mbit/s = 1e6 bytes/s
    # the first queued packet waited only for the missing tokens (100 left in the bucket)
    assert accepted[2] == pytest.approx((size - 100) / 1e6)
    # once the queue has drained, packets are accepted again
    assert ch.transmit(1.0, 1300) == 1.0


def test_rate_limiter_long_run_throughput_equals_the_rate():
    ch = make_channel("clean", seed=0, rate_mbps=50, delay_ms=0)
    size = 1200
    t, arrivals, sojourn = 0.0, [], []
    while t < 2.0:  # offer twice the link rate for two seconds
        a = ch.transmit(t, size)
        if a is not None:
            arrivals.append(a)
            sojourn.append(a - t)
        t += (size + UDP_OVERHEAD_BYTES) * 8 / 100e6
    arrivals = np.array(arrivals)
    # a full queue (50 ms at the rate) bounds the waiting time, and it does fill up
    queue_s = Profile("x", rate_mbps=50).effective_queue_bytes() * 8 / 50e6
    assert max(sojourn) <= queue_s + 1e-9 and max(sojourn) > 0.95 * queue_s
    window = (arrivals > 0.5) & (arrivals <= 1.5)
    rate = window.sum() * (size + UDP_OVERHEAD_BYTES) * 8 / 1.0
    assert rate == pytest.approx(50e6, rel=0.01)
    assert ch.dropped > 0.45 * ch.sent
    assert 0 < ch.backlog_bytes(1.0) <= Profile("x", rate_mbps=50).effective_queue_bytes()


def test_paced_sender_sees_pure_propagation_delay():
    ch = make_channel("clean", seed=0, rate_mbps=100, delay_ms=5)
    gap = (1300 + UDP_OVERHEAD_BYTES) * 8 / 90e6  # 90% of the link rate
    out = np.array([ch.transmit(i * gap, 1300) for i in range(5000)])
    sent = np.arange(5000) * gap
    assert ch.dropped == 0 and ch.lost == 0
    assert np.allclose(out - sent, 0.005)


def test_uniform_jitter_bounds_mean_and_reordering():
    prof = Profile("j", delay_ms=5, jitter_ms=2)
    ch = make_channel(prof, seed=4)
    sent = np.arange(20_000) * 1e-4
    arr = np.array([ch.transmit(t, 200) for t in sent])
    d = arr - sent
    assert d.min() >= 0.003 - 1e-12 and d.max() <= 0.007 + 1e-12
    # uniform on [3, 7] ms: sd = 4 ms / sqrt(12)
    assert abs(d.mean() - 0.005) < Z * (0.004 / math.sqrt(12)) / math.sqrt(d.size)
    assert (np.diff(arr) < 0).any()  # jitter larger than the spacing reorders, as netem


def test_normal_jitter_is_truncated_at_four_sigma():
    rng = np.random.default_rng(2)
    ds = DelaySampler(0.010, 0.001, "normal", rng)
    d = ds.draw(200_000)
    lo, hi = ds.bounds()
    assert lo == pytest.approx(0.006) and hi == pytest.approx(0.014)
    assert d.min() >= lo and d.max() <= hi
    assert d.std() == pytest.approx(0.001, rel=0.02)
    # a jitter larger than the delay never yields a negative delay
    assert DelaySampler(0.001, 0.005, "uniform", rng).draw(10_000).min() >= 0.0


def test_clone_has_the_identical_future_and_is_independent():
    prof = Profile("c", loss=parse_loss("gemodel 5% 30% 80% 0.5%"), jitter_ms=1, rate_mbps=20)
    ch = make_channel(prof, seed=9)
    for i in range(3000):  # move into the middle of a chunk, with a busy queue
        ch.transmit(i * 4e-4, 1300)
    twin = ch.clone()
    spare = ch.clone()
    predicted = ch.lookahead_losses(10_000)
    dropped_before = ch.dropped
    times = 1.2 + np.arange(10_000) * 4e-4  # 27 Mbit/s offered: the queue overflows
    a = [ch.transmit(t, 1300) for t in times]
    b = [twin.transmit(t, 1300) for t in times]
    assert a == b and ch.dropped == twin.dropped
    none = np.array([x is None for x in a])
    assert none[predicted].all()  # every loss-model loss shows up as a drop ...
    assert none.sum() == predicted.sum() + ch.dropped - dropped_before  # ... plus queue drops
    assert ch.dropped > dropped_before
    # independence: advancing one copy leaves the others where they were
    for i in range(5000):
        twin.transmit(10.0 + i * 1e-3, 100)
    assert spare.sent == 3000
    assert [spare.transmit(t, 1300) for t in times] == a


def test_lookahead_losses_predict_the_loss_model():
    ch = make_channel("ge-heavy", seed=5, rate_mbps=1000)
    ch.transmit(0.0, 100)
    predicted = ch.lookahead_losses(9000)  # crosses chunk boundaries
    fates = [ch.transmit(1e-3 * (i + 1), 100) is None for i in range(9000)]
    assert ch.dropped == 0
    assert predicted.tolist() == fates


def test_same_seed_same_channel_different_seed_different_losses():
    def run(seed):
        ch = make_channel("ge-heavy", seed=seed)
        return [ch.transmit(i * 1e-4, 1000) for i in range(5000)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_decreasing_send_times_are_refused():
    ch = make_channel("clean", seed=0)
    ch.transmit(1.0, 100)
    with pytest.raises(ValueError):
        ch.transmit(0.5, 100)


# ---------------------------------------------------------------------------
# traces
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["t.csv", "t.csv.gz"])
def test_trace_round_trip_and_replay(tmp_path, name):
    rng = np.random.default_rng(3)
    n = 3000
    lost = GilbertElliott(0.05, 0.3, 0.8, 0.005).sampler(rng).draw(n)
    owd = 4000 + rng.uniform(0, 2000, n)
    path = tmp_path / name
    write_trace(path, lost, owd, comment="synthetic\nsecond line")
    if name.endswith(".gz"):
        assert path.read_bytes()[:2] == b"\x1f\x8b"
    tr = read_trace(path)
    assert len(tr) == n and (tr.lost == lost).all()
    assert np.allclose(tr.owd_s[~lost] * 1e6, owd[~lost], atol=0.05)
    assert np.isnan(tr.owd_s[lost]).all()

    # replay from row 100 through an unconstrained channel: same fates, same delays
    prof = Profile("tr", loss=TraceReplay(str(path), offset=100), delay_ms=0, rate_mbps=1e4)
    ch = make_channel(prof, seed=0)
    sent = np.arange(n) * 1e-3  # wraps around after n - 100 packets
    out = [ch.transmit(t, 100) for t in sent]
    rows = (100 + np.arange(n)) % n
    assert [o is None for o in out] == lost[rows].tolist()
    got = np.array([o - t for o, t in zip(out, sent, strict=True) if o is not None])
    assert np.allclose(got * 1e6, owd[rows][~lost[rows]], atol=0.06)


def test_trace_without_offset_starts_where_the_seed_says(tmp_path):
    path = tmp_path / "t.csv"
    lost = np.zeros(1000, dtype=bool)
    lost[::7] = True
    write_trace(path, lost, np.full(1000, 5000.0))
    prof = Profile("tr", loss=TraceReplay(str(path)), delay_ms=0)

    def first(seed):
        ch = make_channel(prof, seed=seed)
        return [ch.transmit(i * 1e-3, 100) is None for i in range(70)]

    assert first(1) == first(1)
    assert len({tuple(first(s)) for s in range(6)}) > 1


def test_trace_gaps_in_seq_are_losses(tmp_path):
    path = tmp_path / "g.csv"
    path.write_text("# captured at the receiver\nseq,lost,owd_us\n10,0,100\n13,0,120.5\n14,1,\n")
    tr = read_trace(path)
    assert tr.lost.tolist() == [False, True, True, False, True]
    assert tr.first_seq == 10
    assert tr.owd_s[3] == pytest.approx(120.5e-6)
    assert tr.loss_rate == pytest.approx(0.6) and tr.mean_burst_length() == pytest.approx(1.5)


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("", "empty trace"),
        ("seq,lost\n0,0\n", "header"),
        ("seq,lost,owd_us\n", "no packets"),
        ("seq,lost,owd_us\n0,0,10\n0,0,10\n", ":3: seq 0 does not increase"),
        ("seq,lost,owd_us\n0,2,10\n", ":2: lost must be 0 or 1"),
        ("seq,lost,owd_us\n0,0,\n", ":2: owd_us"),
        ("seq,lost,owd_us\n0,0,-5\n", ":2: owd_us"),
        ("seq,lost,owd_us\nx,0,5\n", "not an integer"),
        ("seq,lost,owd_us\n0,0,5,7\n", "expected 3 fields"),
        ("seq,lost,owd_us\n0,1,\n1,1,\n", "every packet"),
    ],
)
def test_bad_trace_files_get_one_line_errors(tmp_path, content, fragment):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(TraceError) as err:
        read_trace(path)
    msg = str(err.value)
    assert fragment in msg and "\n" not in msg and str(path) in msg
    assert isinstance(err.value, UserError)


def test_truncated_gzip_and_missing_trace(tmp_path):
    good = gzip.compress(b"seq,lost,owd_us\n" + b"".join(b"%d,0,5\n" % i for i in range(5000)))
    path = tmp_path / "cut.csv.gz"
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(path)
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "absent.csv")


def test_irtt_json_converts_to_the_forward_direction(tmp_path):
    import json

    trips = [
        {"seqno": 0, "lost": "false", "delay": {"send": 5_000_000, "rtt": 9_000_000}},
        {"seqno": 1, "lost": "true_up"},
        {"seqno": 2, "lost": "true_down", "delay": {"send": 6_000_000}},
        {"seqno": 3, "lost": "true"},
        {"seqno": 4, "lost": "false", "delay": {"send": 5_500_000, "rtt": 11_000_000}},
    ]
    src = tmp_path / "irtt.json"
    src.write_text(json.dumps({"round_trips": trips}))
    seq, lost, owd = trace_from_irtt(src)
    assert lost.tolist() == [False, True, False, True, False]
    assert owd[[0, 2, 4]].tolist() == [5000.0, 6000.0, 5500.0]
    _, _, half = trace_from_irtt(src, owd="rtt/2", base_owd_ms=2.0)
    assert half[0] == pytest.approx(2000.0) and half[4] == pytest.approx(3000.0)
    out = tmp_path / "from-irtt.csv.gz"
    write_trace(out, lost, owd, seq)
    assert read_trace(out).lost.tolist() == lost.tolist()


def test_rate_steps_change_what_the_link_carries_when_they_say():
    """A blast at twice the rate through a link at 100 Mbit/s that drops to 25 from 0.1 s
    and recovers at 0.3 s: arrivals come at each moment's rate (the queue drains at the new
    rate at once, both ways), and a channel without steps is exactly as before."""
    steps = ((0.1, 25e6), (0.3, 100e6))
    wire = 1200 + UDP_OVERHEAD_BYTES

    def arrivals(rate_steps):
        ch = Channel(Bernoulli(0.0).sampler(np.random.default_rng(0)),
                     DelaySampler(0.005, 0.0, "uniform", np.random.default_rng(1)),
                     100e6, 625_000, 12_500, rate_steps=rate_steps)  # fmt: skip
        out, t = [], 0.0
        while t < 0.45:
            out.append(ch.transmit(t, 1200))
            t += wire * 8 / 200e6
        return np.array([a for a in out if a is not None]), ch

    got, ch = arrivals(steps)
    for lo, hi, want in ((0.02, 0.1, 100e6), (0.12, 0.3, 25e6), (0.32, 0.45, 100e6)):
        n = int(((got >= lo) & (got < hi)).sum())
        assert n * wire * 8 / (hi - lo) == pytest.approx(want, rel=0.02), (lo, hi)
    assert ch.dropped > 0 and np.all(np.diff(got) >= 0)
    plain, _ = arrivals(())
    base = Channel(Bernoulli(0.0).sampler(np.random.default_rng(0)),
                   DelaySampler(0.005, 0.0, "uniform", np.random.default_rng(1)),
                   100e6, 625_000, 12_500)  # fmt: skip
    t, same = 0.0, []
    while t < 0.45:
        same.append(base.transmit(t, 1200))
        t += wire * 8 / 200e6
    assert np.array_equal(plain, np.array([a for a in same if a is not None]))
    twin = ch.clone()  # the schedule is part of the future a clone repeats
    assert twin.transmit(0.5, 1200) == ch.transmit(0.5, 1200)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="rate-limited"):
        Channel(NoLoss().sampler(rng), DelaySampler(0.0, 0.0, "uniform", rng), rate_steps=steps)
