"""The simulator drives the real sessions over the real channel models."""

import json
import subprocess
import sys

import numpy as np
import pytest
from kvtransport.netem import make_channel

from kvtransport.core.transfer import synthetic_transfer
from kvtransport.policies.heuristics import Adaptive, ExternalPolicy
from kvtransport.sim.simulator import SimResult, Simulation, full_send_time, simulate


def _drop_cpu(d):
    d = dict(d)
    d.pop("cpu_s")
    return d


def test_same_seed_same_result_bit_for_bit():
    a = simulate(policy="adaptive", seed=3, size_bytes=2_000_000)
    b = simulate(policy="adaptive", seed=3, size_bytes=2_000_000)
    c = simulate(policy="adaptive", seed=4, size_bytes=2_000_000)
    assert _drop_cpu(a.to_dict(timeseries=True)) == _drop_cpu(b.to_dict(timeseries=True))
    assert a.packets_lost != c.packets_lost or a.utility_recovered != c.utility_recovered
    assert len(a.timeseries["t"]) > 10


def test_utility_order_with_adaptive_rlc_beats_no_fec_and_block_rs_on_ge_heavy():
    seeds = range(4)
    mean = {}
    for name in ("none", "block-rs:4/32", "adaptive"):
        runs = [simulate(policy=name, channel="ge-heavy", rho=0.8, seed=s, size_bytes=1_000_000)
                for s in seeds]  # fmt: skip
        mean[name] = float(np.mean([r.utility_recovered for r in runs]))
        assert all(r.receiver_finish == "deadline" for r in runs)
    assert mean["adaptive"] > mean["block-rs:4/32"] + 0.1
    assert mean["adaptive"] > mean["none"] + 0.3
    assert mean["adaptive"] > 0.85


def test_no_policy_beats_the_genie_bound():
    for seed in (0, 1):
        for name in ("none", "fixed:4/32", "arq", "adaptive", "oracle"):
            r = simulate(policy=name, seed=seed, size_bytes=2_000_000, rho=0.8)
            assert 0.0 < r.utility_recovered <= r.utility_bound + 1e-12, (name, seed)
        assert r.utility_recovered > r.utility_bound - 0.02  # the oracle comes close


def test_the_hosts_share_the_clock_the_receiver_ends_at_the_senders_deadline():
    """The simulator runs the daemons' hosts; its receiver host is told the deadline (it
    shares the sender's clock), so a transfer cut by its deadline ends exactly there, not
    a one-way delay later (the manifest's deadline counted from its first datagram)."""
    from kvtransport.hosts.receiver_host import ReceiverHost
    from kvtransport.hosts.sender_host import SenderHost
    from kvtransport.sim.simulator import make_simulation

    sim = make_simulation(policy="adaptive", channel="ge-heavy", seed=2, size_bytes=500_000)
    assert isinstance(sim.loop.endpoint(0), SenderHost)
    assert isinstance(sim.loop.endpoint(1), ReceiverHost)
    sim.run()
    assert sim.receiver.result.reason == "deadline"
    assert sim.receiver.timings["finished"] == sim.deadline
    assert sim.sender_host.next_event().transfer.session is sim.sender


def test_clean_link_with_time_to_spare_delivers_everything_early():
    r = simulate(channel="clean", policy="adaptive", rho=1.2, seed=0, size_bytes=3_000_000)
    assert r.utility_recovered == pytest.approx(1.0) and r.blocks_missing == 0
    assert r.packets_lost == 0 and r.complete_at < r.deadline_s
    assert r.receiver_finish == "complete" and r.sender_finish == "receiver done"


def test_ten_megabytes_with_authentication():
    r = simulate(policy="adaptive", seed=5, key=b"simulation key, 16+ bytes")
    assert r.size_bytes == 10_000_000 and r.n_source == 7813
    assert r.deadline_s == pytest.approx(0.8 * full_send_time(10_000_000, 100e6, 1280, True))
    assert 0.9 < r.utility_recovered <= r.utility_bound
    assert 0.08 < r.packets_lost / r.packets_sent < 0.16  # ge-heavy loses about 12%


def test_step_mode_is_the_same_protocol_as_the_policy_itself():
    """Driving the sender decision by decision from outside (the Gymnasium environment's
    way) with the adaptive heuristic's choices gives exactly the adaptive run."""
    tr = synthetic_transfer(1_500_000, 120, "zipf", seed=2)
    deadline = 0.8 * full_send_time(tr.nbytes, 100e6, 1280)

    def sim(policy):
        ss = np.random.SeedSequence(9)
        a, b = ss.spawn(2)
        return Simulation(tr, policy, make_channel("ge-heavy", a), make_channel("ge-heavy", b),
                          rate_bps=100e6, deadline=deadline, transfer_id=5)  # fmt: skip

    direct = sim(Adaptive())
    direct.run()
    brain = Adaptive()
    stepped = sim(ExternalPolicy())
    brain.reset(stepped.sender.policy.ctx)
    steps, utilities = 0, []
    while stepped.run_until_decision():
        stepped.apply_action(brain.act(stepped.sender.obs.copy()))
        utilities.append(stepped.utility)
        steps += 1
    assert steps == direct.sender.stats["decisions"] > 20
    assert stepped.receiver.result.utility_recovered == direct.receiver.result.utility_recovered
    assert np.all(np.diff(utilities) >= 0)  # the reward signal never goes negative


def test_simulate_command_json():
    out = subprocess.run(
        [sys.executable, "-m", "kvtransport", "simulate", "--channel", "ge-heavy", "--rate-mbps",
         "100", "--rho", "0.8", "--policy", "fixed:4/32", "--seed", "1", "--size-mb", "1",
         "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    for k in ("utility_recovered", "source_sent", "repair_sent", "packets_lost", "blocks_missing"):
        assert k in d
    assert 0.0 <= d["utility_recovered"] <= 1.0 and d["policy"] == "fixed:4/32"
    assert set(d) >= set(SimResult.__dataclass_fields__) - {"timeseries"}


def test_simulate_command_text_seeds_plot_and_errors(capsys, tmp_path):
    from kvtransport.cli import main

    png = tmp_path / "run.png"
    assert main(["simulate", "--size-mb", "0.5", "--seeds", "2", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "utility recovered" in text and "mean of 2 seeds" in text
    assert png.read_bytes()[:4] == b"\x89PNG"
    for bad in (["--policy", "bogus"], ["--rho", "0"], ["--channel", "no-such-profile"],
                ["--size-mb", "-1"], ["--seeds", "0"], ["--plot", "/no/such/dir/x.png",
                "--size-mb", "0.1"]):  # fmt: skip
        assert main(["simulate", *bad]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
