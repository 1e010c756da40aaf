"""`kvtransport demo`: the quick demo on the emulated link (the real model, two link
processes), its repeatability, and the emulated link against the simulator.

The emulated link runs the daemons' sender and receiver hosts in two processes on the link's own
clock (kvtransport.demo.run), so for a seed its table is fixed: these tests can assert exact
repetition and the ordering of the schemes on the demo's seed without tolerating noise.
"""

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys

import pytest

from kvtransport.core.transfer import synthetic_transfer
from kvtransport.demo.run import (
    SCHEMES,
    DemoConfig,
    EmulatedLink,
    render_table,
    report_json,
    run_demo,
)
from kvtransport.model import metrics
from kvtransport.sim.simulator import full_send_time, simulate

FEC = [label for label, spec in SCHEMES if spec != "none"]
STREAMING = ["RLC 4/32", "adaptive", "DDQN"]  # the sliding-window RLC schemes


@pytest.mark.model
def test_quick_demo_on_the_emulated_link_repeats_and_fec_recovers_more(smollm, tmp_path):
    speed = (0.01, 0.004)  # a fixed compute speed: the same plan, the same transfers
    cfg = DemoConfig.quick(link="emulated", card_dir=tmp_path, progress=False,
                           compute_speed=speed, repeats=1)  # fmt: skip
    first = run_demo(cfg, loaded=smollm)
    # reads the card the first run cached; one scheme is enough to see the link repeat
    # (and to time every TTFT in three interleaved rounds)
    second = run_demo(dataclasses.replace(cfg, schemes=("DDQN",), repeats=3), loaded=smollm)

    assert not first.cache["card_cached"] and second.cache["card_cached"]
    assert first.link["mode"] == "emulated" and "yes for seed 1" in first.link["deterministic"]
    n_tok = first.cache["context_tokens"]
    # the plan: at this size the question's pass (about 38 tokens at 4 ms) takes longer
    # than the link needs for the whole context, so the receiver computes no prefix and
    # the link carries every range, layer by layer so that the pass runs while they come
    # (kvtransport.model.plan's tail); int8 or better, int4 only for the least useful
    # blocks (the plan's fidelity floor)
    plan = first.plan
    assert plan["split_tokens"] == 0 and plan["tail_tokens"] == n_tok
    assert set(plan["blocks"]) <= {"fp16", "int8", "int4"}
    assert plan["blocks"].get("int4", 0) < sum(plan["blocks"].values()) / 2
    assert plan["fits"] and plan["planned_compute_s"] <= first.budget_s
    # every scheme ran, in table order
    assert [s.label for s in first.schemes] == [label for label, _ in SCHEMES]
    by = {s.label: s for s in first.schemes}
    for s in [*first.schemes, first.link_down]:
        assert not s.error, s.error
        assert 0.0 <= s.utility <= 1.0
        # every race builds the whole cache: the prefix and what never came are computed
        assert s.computed_tokens + s.loaded_tokens == n_tok
        # (at least the receiver's first call: the prefix less the hedge the link may bring)
        assert s.computed_tokens >= plan["split_tokens"] - plan["hedge_tokens"]
        assert s.ttft_s > s.race_s > 0
    norm = metrics.normalize_answer
    # five questions about the one context: the task's own first, no question twice
    qs = [q["question"] for q in first.questions]
    assert len(qs) == 5 == len(set(qs)) and qs[0] == first.task["question"]
    assert [q["full_answer"] for q in first.questions][0] == first.full_answer
    # injecting the whole cache answers every question exactly as re-prefilling does
    assert first.answers_agree and first.reprefill["answer"] == first.full_answer
    full = [norm(q["full_answer"]) for q in first.questions]
    for s in [*first.schemes, first.link_down]:
        assert len(s.answers) == len(s.f1s) == 5 and s.answer == s.answers[0]
        assert s.f1 == pytest.approx(sum(s.f1s) / 5)
        same = [norm(a) == f for a, f in zip(s.answers, full, strict=True)]
        assert s.matches == sum(same)
    # the link down: nothing arrives, the receiver computes everything, exactly
    down = first.link_down
    assert down.computed_tokens == n_tok and down.loaded_tokens == 0 and down.matches == 5
    # on the burst-loss link every FEC scheme recovers more than sending without repair,
    # and the streaming RLC schemes leave the receiver less to recompute
    for label in FEC:
        assert by[label].utility > by["no FEC"].utility, (label, by[label].utility)
    for label in STREAMING:
        assert by[label].recomputed_tokens < by["no FEC"].recomputed_tokens, label
    # the same seed gives the same transfers (everything but measured compute times)
    again, once = second.deterministic_view(), first.deterministic_view()
    once["schemes"] = [s for s in once["schemes"] if s["label"] == "DDQN"]
    assert len(again["schemes"]) == 1 and again == once
    # one round without repeats; with them, the medians over the rounds, and each ratio
    # pairs a round's re-prefill with the same round's handoff
    assert first.reprefill["ttft_rounds"] == [first.reprefill["ttft_s"]]
    assert by["DDQN"].ttft_rounds == [by["DDQN"].ttft_s]
    re_t = second.reprefill["ttft_rounds"]
    assert len(re_t) == 3 and second.reprefill["ttft_s"] == statistics.median(re_t)
    for row in (second.schemes[0], second.link_down):
        assert len(row.ttft_rounds) == 3 and row.ttft_s == statistics.median(row.ttft_rounds)
        ratios = [r / t for r, t in zip(re_t, row.ttft_rounds, strict=True)]
        assert row.speedup == statistics.median(ratios)
    # what people and programs read
    table = render_table(first)
    for label, _ in SCHEMES:
        assert f"\n  {label} " in table
    assert "emulated" in table and "re-prefill" in table and "\n  no cache " in table
    assert "\n  link down " in table
    for i, q in enumerate(qs, 1):
        assert f"\n    Q{i}  {q}  " in table
    assert f"  {by['DDQN'].matches}/5  " in table.split("\n  DDQN ")[1].split("\n")[0]
    doc = json.loads(report_json(first))
    assert [s["label"] for s in doc["schemes"]] == [label for label, _ in SCHEMES]
    assert doc["schemes"][0]["utility"] == by["no FEC"].utility
    assert doc["schemes"][-1]["f1s"] == by["DDQN"].f1s and len(doc["questions"]) == 5
    assert doc["link_down"]["computed_tokens"] == n_tok


def test_emulated_link_reproduces_the_simulator():
    """The two link processes exchange datagrams in the simulator's event order over the
    same seeded channels, so a transfer ends exactly as kvtransport.sim.simulator's does (the
    receiver takes its deadline from the manifest, as the daemon does; the sender's stop
    time leaves nothing to arrive in the extra one-way delay)."""
    tr = synthetic_transfer(1_500_000, 122, "zipf", seed=4)
    deadline = 0.8 * full_send_time(tr.nbytes, 100e6, 1280, True)  # sealed: 16-byte tags
    link = EmulatedLink()
    procs = [p.proc for p in link.peers]
    try:
        link.load(tr)
        for policy in ("none", "block-rs:4/32", "adaptive"):
            got = link.transfer(policy, deadline_s=deadline, transfer_id=77, seed=9)
            sim = simulate(
                tr, channel="ge-heavy", rho=0.8, policy=policy, seed=9, record=False,
                key=b"any key of 16+ bytes",  # the link seals with its own per-run key
            )  # fmt: skip
            assert got.utility == sim.utility_recovered, policy
            assert int((~got.complete).sum()) == sim.blocks_missing, policy
            assert got.counters["datagrams_sent"] == sim.packets_sent, policy
            assert got.counters["datagrams_lost"] == sim.packets_lost, policy
            assert got.counters["repair_sent"] == sim.repair_sent, policy
    finally:
        link.close()
    assert [p.returncode for p in procs] == [0, 0]  # both processes left when told to


def test_a_context_past_the_models_positions_is_refused_in_one_line():
    """SmolLM2 was trained to 8,192 positions: a longer context (question and answer
    included) is refused once the model is loaded, before any prefill, in one line."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvtransport", "demo", "--tokens", "8192", "--link", "emulated",
         "--rounds", "1", "--questions", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    assert last.startswith("kvtransport demo: error: --tokens 8192: ") and (
        "exceed the model's 8192 positions (max_position_embeddings)" in last
    ), last


def test_bad_arguments_give_one_line_errors():
    cases = [
        (["--tokens", "5"], "--tokens must be 32..32768"),
        (["--tokens", "40000"], "--tokens must be 32..32768"),
        (["--budget", "0"], "--budget must be in (0, 1]"),
        (["--threads", "0"], "--threads must be at least 1"),
        (["--questions", "0"], "--questions must be 1..10"),
        (["--rounds", "0"], "--rounds must be 1..20"),
        (["--link-rate-mbps", "0.5"], "--link-rate-mbps must be in [1, 10000]"),
    ]
    for extra, message in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "kvtransport", "demo", *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == f"kvtransport demo: error: {message}, not {extra[1]}", (
            proc.stderr
        )


@pytest.mark.netns
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
)
def test_relay_is_ready_when_it_says_so_and_takes_the_priority_it_is_given():
    """The netns link's first transfer follows the testbed's start at once. The relay loads
    its loss kernels before it reports ready; loaded at the first frame instead, they held
    the first frames ~0.25 s and released them in a burst that overflowed the tbf queue
    (hundreds of drops on a probe at 80% of the rate)."""
    from kvtransport.netem.testbed import Testbed

    with Testbed("ge-heavy", prefix=f"kvtd{os.getpid() % 10000}", seed=3, backend="relay",
                 relay_priority=7) as tb:  # fmt: skip
        pid = json.loads((tb.state_dir / "state.json").read_text())["relay_pid"]
        assert os.sched_getscheduler(pid) == os.SCHED_FIFO
        assert os.sched_getparam(pid).sched_priority == 7
        probe = tb.measure_udp(rate_mbps=80, count=3000, size=1300, port=9100)
        relay = tb.relay_status()["forward"]
        drops = tb.queue_drops()
    assert relay["received"] == 3000 and relay["lost"] > 0  # ge-heavy really dropped some
    assert relay["max_wait_ms"] < 50, relay
    assert drops == 0, (drops, probe["owd_ms"])


@pytest.mark.netns
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
)
def test_netns_link_carries_a_transfer_through_the_real_daemons():
    """The demo's netns link (the real sender and receiver daemons in the testbed's
    namespaces, driven over ZeroMQ) hands back what the receiver daemon published: the
    complete blocks hold the sent bytes, the utility is theirs, the counters are the
    sender daemon's, and both daemons exit cleanly when the link closes."""
    import numpy as np

    from kvtransport.demo.run import NetnsLink

    tr = synthetic_transfer(400_000, 32, "zipf", seed=2)
    # the plumbing is under test, not the scheme's margin: a deadline of 2x the send time
    # (68 ms) came back empty once on a fresh CI machine, so it has room for a stall here
    deadline = 8.0 * full_send_time(tr.nbytes, 100e6, 1280)
    progress: list[float] = []
    link = NetnsLink(seed=5, policies=("fixed:4/32",))  # warmed up as the demo does
    logs = ""
    try:
        link.ready()
        link.load(tr)
        got = link.transfer(
            "fixed:4/32", deadline_s=deadline, transfer_id=0x51, seed=5, on_progress=progress.append
        )
    finally:
        for name in ("sender", "receiver"):
            logs += f"\n{name}: " + (link.dir / f"{name}.log").read_text(errors="replace")
        link.close()
    assert [p.returncode for p in link.procs.values()] == [0, 0], logs
    assert got.app_metadata is not None and got.complete.dtype == bool
    why = f"{got.reason}, {got.counters}, {got.transfer_s:.3f} s{logs}"
    assert got.complete.size == 32 and got.complete.any(), why
    b = tr.blocks
    for i in np.flatnonzero(got.complete):
        lo, hi = int(b.offsets[i]), int(b.offsets[i] + b.lengths[i])
        assert np.array_equal(got.payload[lo:hi], tr.payload[lo:hi]), i
    assert got.utility == pytest.approx(float(b.utilities[got.complete].sum()), rel=1e-9)
    assert got.counters["source_sent"] > 0 and got.counters["repair_sent"] > 0
    assert got.counters["datagrams_sent"] >= got.counters["source_sent"]
    assert 0 < got.transfer_s < deadline + 5.0 and progress[-1] == 1.0
