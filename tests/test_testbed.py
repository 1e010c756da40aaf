"""The Linux testbed: command construction everywhere; real namespaces, real UDP, real
kernel shaping where we are root (CI is), kernel netem where the kernel has it."""

import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtransport.netem import load_profile
from kvtransport.netem.relay import clock_offset, segment_udp4
from kvtransport.netem.testbed import (
    RCV_ADDR,
    SND_ADDR,
    Testbed,
    TestbedError,
    build_plan,
    netem_available,
    status,
    teardown,
)

PREFIX = f"kvtt{os.getpid() % 100000}"  # our own namespaces: other runs may use kvt-*
CLI = [sys.executable, "-m", "kvtransport"]


def _root_and_netns() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc); CI runs as root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = subprocess.run(["ip", "netns", "add", f"{PREFIX}-probe"], capture_output=True)
    if probe.returncode != 0:
        return f"no network namespace support: {probe.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", f"{PREFIX}-probe"], capture_output=True)
    return None


SKIP = _root_and_netns()
netns = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _relays() -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if b"kvtransport.netem.relay" in cmd and f"/{PREFIX}/".encode() in cmd:
                pids.append(int(p.name))
    return pids


# ---------------------------------------------------------------------------
# command construction (no root needed)
# ---------------------------------------------------------------------------


def _joined(cmds):
    return [" ".join(c) for c in cmds]


def test_netem_backend_commands():
    cmds = _joined(build_plan(load_profile("ge-heavy"), "netem", "delay", prefix="kvt"))
    assert cmds[:2] == ["ip netns add kvt-snd", "ip netns add kvt-rcv"]
    assert (
        "ip link add kvt-s address 02:4b:56:00:00:01 netns kvt-snd type veth "
        "peer name kvt-r address 02:4b:56:00:00:02 netns kvt-rcv" in cmds
    )
    assert "ip -n kvt-snd addr add 10.77.0.1/24 dev kvt-s" in cmds
    assert "ip -n kvt-snd link set dev kvt-s gso_max_segs 1 up" in cmds
    assert (
        "ip -n kvt-rcv neigh replace 10.77.0.1 lladdr 02:4b:56:00:00:01 dev kvt-r "
        "nud permanent" in cmds
    )
    # data direction: netem (loss, delay) at the root, tbf (rate, byte queue) below it
    assert cmds[-3:] == [
        "tc -n kvt-snd qdisc add dev kvt-s root handle 1: netem limit 11718 delay 5ms "
        "loss gemodel 5% 30% 80% 0.5%",
        "tc -n kvt-snd qdisc add dev kvt-s parent 1:1 handle 10: tbf rate 100mbit burst 12500 "
        "limit 625000",
        "tc -n kvt-rcv qdisc add dev kvt-r root handle 1: netem limit 19531 delay 5ms",
    ]
    assert not any("kvt-mid" in c for c in cmds)


def test_netem_backend_full_reverse_and_overrides():
    prof = load_profile("4state-bursty").with_overrides(rate_mbps=20, delay_ms=10)
    cmds = _joined(build_plan(prof, "netem", "full", prefix="kvtq"))
    netem = [c for c in cmds if " netem " in c]
    assert netem == [
        f"tc -n kvtq-{side} qdisc add dev kvt-{side[0]} root handle 1: netem limit 2734 "
        "delay 10ms loss state 1% 10% 30% 50% 0.5%"
        for side in ("snd", "rcv")
    ]
    tbf = [c for c in cmds if " tbf " in c]
    assert len(tbf) == 2 and all("rate 20mbit burst 3028 limit 125000" in c for c in tbf)
    none = _joined(build_plan(prof, "netem", "none", prefix="kvtq"))
    assert not any("kvtq-rcv qdisc" in c for c in none)


def test_relay_backend_commands():
    cmds = _joined(build_plan(load_profile("ge-heavy"), "relay", "delay", prefix="kvt"))
    assert "ip netns add kvt-mid" in cmds
    assert (
        "ip link add kvt-s address 02:4b:56:00:00:01 netns kvt-snd type veth peer name "
        "kvt-ms netns kvt-mid" in cmds
    )
    shaping = [c for c in cmds if c.startswith("tc ")]
    assert shaping == [
        "tc -n kvt-mid qdisc add dev kvt-mr root handle 1: tbf rate 100mbit burst 12500 "
        "limit 625000"
    ]
    with pytest.raises(TestbedError, match="backend must be"):
        build_plan(load_profile("clean"), "ebpf")


def test_segment_udp4_cuts_a_gso_frame_into_valid_datagrams():
    payload = bytes(range(256)) * 11  # 2816 bytes -> 1300 + 1300 + 216
    ip = bytearray(
        struct.pack(
            "!BBHHHBBH4s4s",
            0x45,
            0,
            20 + 8 + len(payload),
            7,
            0x4000,
            64,
            17,
            0,
            socket.inet_aton(SND_ADDR),
            socket.inet_aton(RCV_ADDR),
        )
    )
    udp = struct.pack("!HHHH", 5000, 9000, 8 + len(payload), 0)
    frame = b"\x02" * 6 + b"\x04" * 6 + b"\x08\x00" + bytes(ip) + udp + payload
    segs = segment_udp4(frame, 1300)
    assert [len(s) - 42 for s in segs] == [1300, 1300, 216]
    assert b"".join(s[42:] for s in segs) == payload
    for k, s in enumerate(segs):
        hdr = s[14:34]
        words = struct.unpack("!10H", hdr)
        assert (sum(words) + (sum(words) >> 16)) & 0xFFFF == 0xFFFF  # IP checksum valid
        total, ident = struct.unpack_from("!HH", hdr, 2)
        assert total == len(s) - 14 and ident == 7 + k
        sport, dport, ulen, csum = struct.unpack_from("!HHHH", s, 34)
        assert (sport, dport, ulen, csum) == (5000, 9000, len(s) - 34, 0)


# ---------------------------------------------------------------------------
# real namespaces
# ---------------------------------------------------------------------------


@pytest.fixture
def clean_prefix():
    yield PREFIX
    if SKIP is None:
        teardown(PREFIX)


@netns
@pytest.mark.netns
def test_clock_offset_ignores_a_read_preempted_between_the_two_clocks():
    """The relay converts kernel arrival stamps (realtime) to its monotonic clock. With the
    true offset 100 s, a first bracket where the relay lost 300 us between its reads
    would put the offset 150 us off (frames released that much early); the next, tight
    bracket is the one kept. Real clocks: the offset agrees with a bracketed reading."""
    real = iter([1000.0, 1000.0003, 1000.001, 1000.001001]).__next__
    mono = iter([1100.0, 1100.0010005]).__next__
    assert abs(clock_offset(real, mono) - 100.0) < 1e-6
    r1 = time.time()
    off = clock_offset()
    m = time.monotonic()
    r2 = time.time()
    assert m - r2 - 1e-3 <= off <= m - r1 + 1e-3


def test_up_down_lifecycle(clean_prefix):
    tb = Testbed("ge-light", prefix=PREFIX, seed=3, reverse="delay")
    tb.up()
    try:
        names = _namespaces()
        expected = {f"{PREFIX}-snd", f"{PREFIX}-rcv"}
        if tb.backend == "relay":
            expected.add(f"{PREFIX}-mid")
            assert len(_relays()) == 1
        assert expected <= names
        addr = tb.run(
            "snd",
            ["ip", "-o", "-4", "addr", "show", "dev", "kvt-s"],
            capture_output=True,
            text=True,
        ).stdout
        assert f"{SND_ADDR}/24" in addr
        st = status(PREFIX)
        assert st["up"] and st["state"]["profile"] == "ge-light"
        assert st["state"]["backend"] == tb.backend
        with pytest.raises(TestbedError, match="already up"):
            Testbed("clean", prefix=PREFIX).up()
        # the feedback direction: the profile's delay, no loss
        back = tb.measure_udp(rate_mbps=5, count=300, reverse=True)
        assert back["loss_rate"] == 0.0
        assert 4.95 <= back["owd_ms"]["min"] < 5.5, back["owd_ms"]
    finally:
        removed = tb.down()
    assert any("namespace" in r for r in removed)
    assert not (expected & _namespaces())
    assert _relays() == []
    assert not status(PREFIX)["up"]
    assert not Path(f"/run/kvtransport/netem/{PREFIX}").exists()
    assert teardown(PREFIX) == []  # idempotent


@netns
@pytest.mark.netns
def test_ge_heavy_loss_over_real_udp_matches_the_profile(clean_prefix):
    prof = load_profile("ge-heavy")
    st = prof.loss.stats()
    n = 20_000
    # the relay backend shapes with the simulator's own bucket here (kernel tbf is tested
    # by the rate-limit test): queue drops then follow the model even when the machine
    # is so busy that the kernel delivers frames late and in bunches
    backend = "netem" if netem_available() else "relay"
    with Testbed(prof, prefix=PREFIX, seed=11, backend=backend, shaper="relay") as tb:
        r = tb.measure_udp(rate_mbps=50, count=n)
        queue_drops = tb.queue_drops()
        relay = tb.relay_status()
    diag = {"probe": r, "queue_drops": queue_drops, "relay": relay}
    assert r["sent"] == n and r["duplicates"] == 0 and r["sender"]["send_errors"] == 0, diag
    # paced at half the link rate, the queue must not overflow (a broken shaper would)
    assert queue_drops <= 0.002 * n, diag
    link_lost = n - r["received"] - queue_drops
    rate = link_lost / n
    sd = math.sqrt(st.asymptotic_var / n)  # includes the burst correlation
    assert abs(rate - st.loss_rate) < 4 * sd, (rate, st.loss_rate, sd, diag)
    if relay is not None:  # the relay's own books agree with what the receiver saw
        assert relay["forward"]["lost"] == link_lost
        assert relay["forward"]["overruns"] == 0
    # bursts: the mean run of consecutive losses is the model's (queue drops excluded)
    se = r["loss_run_sd"] / math.sqrt(r["loss_runs"])
    assert abs(r["mean_loss_run"] - st.mean_burst) < 4 * se, (r["mean_loss_run"], se, diag)
    # every packet gets the 5 ms delay (the minimum is robust to a busy machine's stalls)
    assert 4.95 <= r["owd_ms"]["min"] < 5.5, r["owd_ms"]


MAX_BLAST_ATTEMPTS = 4


@netns
@pytest.mark.netns
@pytest.mark.parametrize(("shaper", "set_later"), [("tbf", False), ("relay", False), ("tbf", True)])
def test_rate_limit_holds_when_blasting(clean_prefix, shaper, set_later):
    # The claim needs a sender that really offers twice the rate. A probe the host
    # descheduled resumes at its rate without catching up, so it offered less and the
    # link idled meanwhile (seen on this 2-core VM: 47 instead of 60 Mbit/s offered, 27
    # Mbit/s through): such a run is not a sample of the experiment and is run again.
    # set_later: the link comes up at 90 Mbit/s and set_rate changes it to 30, with the
    # queue limit of 90 Mbit/s (50 ms there: about 150 ms at 30)
    starved = []
    for _ in range(MAX_BLAST_ATTEMPTS):
        with Testbed(
            "clean", rate_mbps=90 if set_later else 30, prefix=PREFIX, shaper=shaper
        ) as tb:
            if set_later:
                tb.set_rate(30)
            r = tb.measure_udp(rate_mbps=60, count=8000)
            drops = tb.queue_drops()
        if r["sender"]["offered_mbps"] >= 0.95 * 60:
            break
        starved.append(round(r["sender"]["offered_mbps"], 1))
    else:
        pytest.fail(f"the host never let the probe offer 60 Mbit/s: {starved}")
    assert r["throughput_wire_mbps"] == pytest.approx(30, rel=0.05), (r, starved)
    assert r["received"] + drops == r["sent"]
    assert drops > 0.4 * r["sent"]
    # the queue is 50 ms at the rate it was set up with: a full queue adds ~50 ms to the
    # 5 ms delay, or 150 ms once the rate is a third of that
    queue_ms = 150 if set_later else 50
    assert queue_ms < r["owd_ms"]["median"] < queue_ms + 10, r["owd_ms"]


@netns
@pytest.mark.netns
def test_rate_steps_play_on_time_and_stop_with_the_testbed(clean_prefix):
    held_out = Path(__file__).resolve().parents[1] / "netem" / "data" / "held-out.toml"
    with Testbed("rate-dip", profiles_file=held_out, prefix=PREFIX) as tb:
        player = tb.play_rate_steps(priority=6)
        player.wait(timeout_s=5)
        assert [(t, r) for t, _, r in player.applied] == [(0.1, 25.0), (0.3, 100.0)]
        assert all(0 <= at - t < 0.05 for t, at, _ in player.applied), player.applied
        late = tb.play_rate_steps()  # its first step is due in 0.1 s: down() comes first
    assert late.applied == [] and not late._thread.is_alive()


@netns
@pytest.mark.netns
def test_relay_cuts_gso_batches_and_survives_garbage(clean_prefix):
    with Testbed("clean", prefix=PREFIX, backend="relay") as tb:
        rx = tb.socket("rcv")
        rx.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE: we read at the end
        rx.bind((RCV_ADDR, 9100))
        rx.settimeout(2.0)
        tx = tb.socket("snd")
        tx.setsockopt(socket.IPPROTO_UDP, 103, 1000)  # UDP_SEGMENT: 1000-byte datagrams
        for i in range(50):
            tx.sendto(bytes([i]) * 8000, (RCV_ADDR, 9100))  # 8 datagrams per send
            time.sleep(0.002)
        got = []
        with pytest.raises(TimeoutError):
            while True:
                got.append(rx.recv(65536))
        # garbage frames (truncated IPv4, unknown ethertype, header only) do not stop the relay
        raw = tb.socket("snd", socket.AF_PACKET, socket.SOCK_RAW)
        raw.bind(("kvt-s", 0))
        eth = bytes.fromhex("024b56000002024b56000001")
        for frame in (
            eth + b"\x08\x00" + b"\x45\x00\x01",
            eth + b"\x88\xb5" + bytes(60),
            eth + b"\x08\x00",
        ):
            raw.send(frame)
        raw.close()
        tx.sendto(b"still alive", (RCV_ADDR, 9100))
        rx.settimeout(5.0)
        assert rx.recv(100) == b"still alive"
        relay = tb.relay_status()
        assert status(tb.prefix)["relay_running"]
        tx.close()
        rx.close()
    # one datagram per segment whoever cut them (the kernel, given gso_max_segs 1 on the
    # veth, or the relay): the loss model saw 400 packets, not 50
    assert len(got) == 400 and all(len(d) == 1000 for d in got)
    assert relay["forward"]["forwarded"] >= 400


@netns
@pytest.mark.netns
def test_kernel_netem_backend_applies_the_profile(clean_prefix):
    if not netem_available():
        pytest.skip("this kernel has no sch_netem (the relay backend is tested instead)")
    with Testbed("bernoulli-5", prefix=PREFIX, backend="netem") as tb:
        out = tb.run(
            "snd", ["tc", "qdisc", "show", "dev", "kvt-s"], capture_output=True, text=True
        ).stdout
        r = tb.measure_udp(rate_mbps=50, count=10_000)
    assert "netem" in out and "loss 5%" in out and "tbf" in out
    assert abs(r["loss_rate"] - 0.05) < 4 * math.sqrt(0.05 * 0.95 / 10_000)


@netns
@pytest.mark.netns
def test_cli_up_status_down(clean_prefix):
    def cli(*args):
        return subprocess.run(
            [*CLI, "netem", *args, "--prefix", PREFIX], capture_output=True, text=True, timeout=60
        )

    up = cli("up", "--profile", "bernoulli-5", "--rate-mbps", "50", "--backend", "relay")
    assert up.returncode == 0, up.stderr
    assert "backend relay" in up.stdout and "50 Mbit/s" in up.stdout
    st = cli("status")
    assert "bernoulli-5" in st.stdout and "running" in st.stdout and "tbf" in st.stdout
    again = cli("up", "--profile", "clean")
    assert again.returncode == 2 and "already up" in again.stderr
    assert "Traceback" not in again.stderr and len(again.stderr.strip().splitlines()) == 1
    rate = cli("rate", "20")
    assert rate.returncode == 0 and "20 Mbit/s" in rate.stdout, rate.stderr
    assert "rate 20Mbit" in cli("status").stdout
    for argv, why in ((("rate", "--steps"), "no rate steps"), (("rate",), "either a rate")):
        bad = cli(*argv)
        assert bad.returncode == 2 and why in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    down = cli("down")
    assert down.returncode == 0 and "removed" in down.stdout
    assert cli("down").stdout.strip() == "netem down: nothing up"
    for argv in (("rate", "20"), ("rate", "--steps")):
        gone = cli(*argv)
        assert gone.returncode == 2 and "no testbed is up" in gone.stderr, gone.stderr
    alone = cli("rate", "20", "--priority", "6")
    assert alone.returncode == 2 and "--priority goes with --steps" in alone.stderr
    # the relay's own token bucket keeps one rate: said in one line, at up and at rate
    relay = cli("up", "--profile", "clean", "--backend", "relay", "--shaper", "relay")
    assert relay.returncode == 0, relay.stderr
    fixed = cli("rate", "20")
    assert fixed.returncode == 2 and "keeps the profile's rate" in fixed.stderr, fixed.stderr
    assert cli("down").returncode == 0


@pytest.mark.skipif(
    shutil.which("setpriv") is None or os.geteuid() != 0,
    reason="needs root and setpriv to run the CLI as an unprivileged user",
)
def test_cli_refuses_without_root_or_tools():
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    out = subprocess.run(
        [*nobody, *CLI, "netem", "up", "--profile", "clean"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "needs root" in out.stderr and "Traceback" not in out.stderr
    env = dict(os.environ, PATH="/nonexistent")
    out = subprocess.run(
        [*CLI, "netem", "down"], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 2 and "`ip` not found" in out.stderr


def test_cli_profiles_and_bad_profile_file(tmp_path):
    out = subprocess.run([*CLI, "netem", "profiles"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "ge-heavy: loss gemodel 5% 30% 80% 0.5% (expected loss 11.86%)" in out.stdout
    bad = tmp_path / "p.toml"
    bad.write_text("[profiles.x]\nloss = 'gemodel 5% 30% 80% 0.5% 1% 2%'\n")
    out = subprocess.run(
        [*CLI, "netem", "profiles", "--profiles", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "gemodel takes 1 to 4" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_cli_trace_from_irtt(tmp_path):
    import gzip
    import json

    trips = [
        {
            "seqno": i,
            "lost": "true_up" if i % 10 == 3 else "false",
            "delay": {"send": 5_000_000 + 1000 * i, "rtt": 10_000_000},
        }
        for i in range(100)
    ]
    src = tmp_path / "run.json.gz"
    src.write_bytes(gzip.compress(json.dumps({"round_trips": trips}).encode()))
    dest = tmp_path / "run.csv.gz"
    out = subprocess.run(
        [*CLI, "netem", "trace-from-irtt", str(src), str(dest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "100 packets, 10.00% lost" in out.stdout
    tr = load_profile(str(dest)).loss.trace()
    assert tr.lost.sum() == 10 and tr.owd_s[0] == pytest.approx(0.005)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    out = subprocess.run(
        [*CLI, "netem", "trace-from-irtt", str(bad), str(dest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "not an irtt JSON result" in out.stderr
