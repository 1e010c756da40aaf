"""End to end across a real impaired link: the sender daemon in one network namespace, the
receiver daemon in another, ge-heavy between them (kvtransport.netem.testbed: kernel netem
where the kernel has it, else tbf plus the userspace relay), clients talking to both over
ipc:// from the root namespace.

Agreement with the simulator: the same transfer (synthetic stream, same size, blocks and
utilities), policy, rho, profile and initial RTT, simulated over ``SIM_SEEDS`` seeds. The
real mean over ``RUNS`` transfers must lie within ``Z`` standard errors of the simulated
mean, where the standard error combines both sample sizes with the simulator's own
seed-to-seed spread: tol = Z * sd_sim * sqrt(1/RUNS + 1/SIM_SEEDS) (a real run is one more
draw of the same random experiment if the shells agree). Z is the two-sided 4-sigma level
(a false failure in 1 of 16,000 runs, room for the real clock's jitter without hiding a
systematic gap) of Student's t with SIM_SEEDS - 1 degrees of freedom, since sd_sim is
estimated from the seeds (5.10 at 20 seeds; the normal's 4 failed about 1 run in 1,300).
A floor of 0.01 covers what a sample of 20 seeds cannot: the real receiver's
deadline counts from the first datagram's arrival (one one-way delay later than the
simulator's exact deadline).

Both daemons run at real-time priority (``--realtime``): on a machine busy with other jobs
an ordinary-priority sender is descheduled for milliseconds at a time and loses about a
third of its slots (measured here: utility 0.61-0.68 against the simulator's 0.89), which
is the host's doing, not the protocol's. A first small transfer warms the fresh link up.

Even at real-time priority a loaded host can stall the sender for several milliseconds
(the sender reports its worst lateness behind its pacing timer, ``max_lag_ms``). The
simulator models a sender that gets every slot, so a run whose sender fell more than
``MAX_LAG_MS`` behind (2 % of the ~260 ms window; a 10 ms stall costs ~0.04 utility) is not
a sample of the same experiment: it is reported and replaced, up to ``MAX_ATTEMPTS``
runs in all. The daemons run --insecure: the simulator models the protocol, not the CPU,
and sealing every datagram (AES-GCM, about 6 us of Python per datagram on each side
here) lowered the daemons' utility by about 0.02 on this 2-core host (lags of 2-4 ms
instead of 1.3-2.6), which is a cost of the host's CPU, not a protocol difference. The
same holds for a sender that started late: its deadline counts from the
submit, so a run whose first datagram left more than ``MAX_START_MS`` after the submit
(``deadline_s - elapsed_s`` of a run that ended at its deadline: 5-6 ms in every run here,
the submit's round trip with its 2.6 MB payload; an outlier of 65 ms lost a quarter of the
slots) is replaced too. Too few valid runs fail the test with the
lags, they are never averaged in.

Needs root; CI runs as root."""

import math
import os
import shutil
import subprocess

import numpy as np
import pytest
from kvtransport.netem.testbed import RCV_ADDR, Testbed, netem_available, teardown
from scipy import stats
from test_daemon import Daemons, assert_blocks_exact

from kvtransport.core.sender import STOP_RTTVAR
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.sim.simulator import DEFAULT_BLOCK_BYTES, simulate

PREFIX = f"kvti{os.getpid() % 100000}"
PROFILE = "ge-heavy"
SIZE = 4_000_000
RHO = 0.8
POLICY = "adaptive"
UTILITY = "linear"  # spreads utility over the stream, so the comparison has teeth
RUNS = 3
MAX_ATTEMPTS = 6
MAX_LAG_MS = 5.0
MAX_START_MS = 20.0
SIM_SEEDS = 20
Z = float(stats.t.isf(math.erfc(4.0 / math.sqrt(2.0)) / 2.0, SIM_SEEDS - 1))
FLOOR = 0.01
INITIAL_RTT_MS = 11.0  # what the simulator assumes for the profile: 2 x 5 ms + 1 ms


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc); CI runs as root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = subprocess.run(["ip", "netns", "add", f"{PREFIX}-p"], capture_output=True)
    if probe.returncode != 0:
        return f"no network namespace support: {probe.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", f"{PREFIX}-p"], capture_output=True)
    return None


SKIP = _skip_reason()


def simulated_utilities() -> np.ndarray:
    return np.array(
        [
            simulate(
                channel=PROFILE,
                rho=RHO,
                policy=POLICY,
                seed=seed,
                size_bytes=SIZE,
                utility_profile=UTILITY,
                record=False,
            ).utility_recovered
            for seed in range(1, SIM_SEEDS + 1)
        ]
    )


def _testbed(profile: str, profiles_file: str | None = None) -> Testbed:
    """The testbed on ``profile``: kernel netem where the kernel has it, else the relay.
    The relay backend shapes with the simulator's own token bucket (robust to the kernel
    handing the relay frames in bunches on a busy machine; see netem.testbed)."""
    return Testbed(
        profile,
        profiles_file=profiles_file,
        prefix=PREFIX,
        seed=5,
        backend="netem" if netem_available() else "relay",
        shaper="relay",
        relay_priority=5,
    )


def _daemons(tmp_path, tb: Testbed) -> Daemons:
    """The receiver daemon (listening on port 9400) and the sender daemon in the testbed's
    namespaces, both --insecure at real-time priority: on a machine busy with other work a
    stalled sender loses its slots, which is the host's doing, not the protocol's (the
    testbed's probe runs the same way). Kernel netem drops a whole GSO batch as one
    packet, so no GSO under it."""
    return Daemons(
        tmp_path,
        netns=tb.command,
        receiver_args=["--listen", f"{RCV_ADDR}:9400", "--realtime", "--insecure"],
        sender_args=["--realtime", "6", "--insecure"]
        + (["--no-gso"] if tb.backend == "netem" else []),
    )


@pytest.mark.netns
@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_daemons_across_ge_heavy_agree_with_the_simulator(tmp_path):
    real, results = [], []
    queue_cuts = None
    stalled = []
    with _testbed(PROFILE) as tb:
        backend = tb.backend
        try:
            d = _daemons(tmp_path, tb)
            # a first small transfer takes the fresh link's start-up (the relay's first
            # frames wait while it loads its kernels); it is not measured
            warm = synthetic_transfer(300_000, 24, UTILITY, seed=99)
            tid = d.sender.submit(warm, f"{RCV_ADDR}:9400", rho=2.0)
            d.sub.wait_for(tid, timeout_s=30)
            for run in range(MAX_ATTEMPTS):
                if len(real) == RUNS:
                    break
                tr = synthetic_transfer(SIZE, SIZE // DEFAULT_BLOCK_BYTES, UTILITY, seed=100 + run)
                tid = d.sender.submit(
                    tr,
                    f"{RCV_ADDR}:9400",
                    rho=RHO,
                    policy=POLICY,
                    initial_rtt_ms=INITIAL_RTT_MS,
                )
                res = d.sub.wait_for(tid, timeout_s=30)
                sst = d.sender.wait(tid, timeout_s=10)
                # no delivered block differs from what was sent, stalled or not
                assert_blocks_exact(res, tr)
                assert res.reason in ("deadline", "complete"), res.stats
                late_ms = 1e3 * (sst["deadline_s"] - sst["elapsed_s"])  # start behind submit
                started_late = sst["finish_reason"] == "deadline" and late_ms > MAX_START_MS
                if sst["max_lag_ms"] > MAX_LAG_MS or started_late:
                    stalled.append((res.utility_recovered, sst["max_lag_ms"], round(late_ms, 1)))
                    continue
                real.append(res.utility_recovered)
                results.append((res.stats, sst))
            # (a host stall the guard took for a queue would pace the runs below the link)
            queue_cuts = d.sender.stats()["queue_cuts"]
        finally:
            rcs = d.stop()
            teardown(PREFIX)
    assert rcs == (0, 0)
    assert len(real) == RUNS, f"host stalled the sender in too many runs: {stalled}"
    sim = simulated_utilities()
    sd = float(sim.std(ddof=1))
    tol = max(Z * sd * math.sqrt(1 / RUNS + 1 / SIM_SEEDS), FLOOR)
    diag = {
        "backend": backend,
        "real": real,
        "sim_mean": float(sim.mean()),
        "sim_sd": sd,
        "tol": tol,
        "loss": [r[0]["loss_rate"] for r in results],
        "sent": [(r[1]["source_sent"], r[1]["repair_sent"]) for r in results],
        "idle": [r[1]["idle_polls"] for r in results],
        "lag_ms": [r[1]["max_lag_ms"] for r in results],
        "stalled (utility, lag_ms, start_ms)": stalled,
        "queue_cuts": queue_cuts,
    }
    print("netns agreement:", diag)
    # the link really was ge-heavy (about 12% loss in bursts), not a clean one
    assert 0.05 < np.mean([r[0]["loss_rate"] for r in results]) < 0.25, diag
    assert abs(np.mean(real) - sim.mean()) <= tol, diag


@pytest.mark.netns
@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_a_jittered_real_link_gives_the_sender_its_stop_margin(tmp_path):
    """bernoulli-5-jitter (held-out.toml: 5 ms +- 1 ms normal jitter each way, which
    reorders at 100 Mbit/s) between the daemons: the receiver daemon's feedback says the
    path reorders (``FB_REORDERED``) and the sender daemon's stop time keeps
    ``STOP_RTTVAR`` mean deviations of its real RTT samples, which its status shows."""
    with _testbed("bernoulli-5-jitter", "netem/data/held-out.toml") as tb:
        try:
            d = _daemons(tmp_path, tb)
            tr = synthetic_transfer(SIZE, SIZE // DEFAULT_BLOCK_BYTES, UTILITY, seed=7)
            tid = d.sender.submit(
                tr, f"{RCV_ADDR}:9400", rho=RHO, policy="tail-rule", initial_rtt_ms=INITIAL_RTT_MS
            )
            res = d.sub.wait_for(tid, timeout_s=30)
            sst = d.sender.wait(tid, timeout_s=10)
        finally:
            rcs = d.stop()
            teardown(PREFIX)
    assert rcs == (0, 0)
    assert_blocks_exact(res, tr)
    # normal jitter of 1 ms each way: the RTT's mean deviation is about 1.1 ms
    assert 0.3 < sst["rttvar_ms"] < 5.0, sst
    assert sst["jitter_margin_ms"] == pytest.approx(STOP_RTTVAR * sst["rttvar_ms"], abs=0.002)
