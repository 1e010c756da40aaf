"""scripts/evaluate.py's transport figures: 1 (utility vs rho), 4 (overhead), 6 (multi-user).

Figure 1 plays the held-out episodes of scripts/eval_policy.py (same episode specs, same
simulator) for every scheme; figure 4 runs scripts/bench_transport.py and
scripts/bench_policy.py through their command lines several times; figure 6 runs
scripts/eval_multiuser.py through its command line. See scripts/evaluate.py for what each
figure reproduces.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.eval.figures import md_table, pyplot
from kvtransport.eval.harness import ROOT, Run
from kvtransport.eval.provenance import machine
from kvtransport.eval.registries import LABELS, make_scheme
from kvtransport.eval.statistics import ci_cell, summary

PUBLISHED_OVERHEAD_MS = 30.0
"""The paper's Table II: about 30 ms of online overhead per 1000 packets."""
PUBLISHED_CONTROL_US = (76.0, 94.0)
"""The paper's control latency, mean and p99 (us), as scripts/bench_policy.py quotes it."""
TARGET_CONTROL_US = (5.0, 20.0)
"""The DDQN issue's decision-latency targets, mean and p99 (us)."""
PAIRS = (
    ("ddqn", "tail-rule"),
    ("ddqn", "adaptive"),
    ("ddqn", "oracle"),
    ("adaptive", "none"),
    ("fixed:4/32", "block-rs:4/32"),
)
"""Paired differences figure 1 reports (same episodes)."""


# ---------------------------------------------------------------------------- figure 1


def _policy(name: str, actions: list[int]) -> Any:
    """A fresh policy for one episode (:func:`kvtransport.eval.registries.make_scheme`);
    the DDQN also counts its actions into ``actions``."""
    if name == "ddqn":
        from kvtransport.policies.ddqn import DDQNPolicy

        class CountingDDQN(DDQNPolicy):
            def act(self, obs: np.ndarray) -> int:
                a = super().act(obs)
                actions.append(a)
                return a

        return CountingDDQN()
    return make_scheme(name, None)


def figure1(run: Run) -> dict[str, Any]:
    from kvtransport.agents.episodes import HELD_OUT_SEED, eval_spec
    from kvtransport.agents.training import play

    s, t0, before = run.settings, time.perf_counter(), machine()
    util: dict[str, dict[str, list[float]]] = {}
    actions: list[int] = []
    work = [(rho, name) for rho in s.rhos for name in s.fig1_schemes]
    for rho, name in run.bar(work, desc="fig 1: scheme x rho", unit="cell"):
        vals = []
        for i in range(s.episodes):
            vals.append(float(play(eval_spec(s.channel, rho, i), _policy(name, actions))))
        util.setdefault(f"{rho:g}", {})[name] = vals
    summ = {r: {n: summary(v) for n, v in cell.items()} for r, cell in util.items()}
    paired: dict[str, dict[str, Any]] = {}
    for r, cell in util.items():
        paired[r] = {}
        for a, b in PAIRS:
            if a in cell and b in cell:
                d = np.array(cell[a]) - np.array(cell[b])
                paired[r][f"{a} - {b}"] = {**summary(d), "equal": int(np.sum(d == 0.0))}
    counts = np.bincount(np.asarray(actions, dtype=np.int64), minlength=9)
    share0 = float(counts[0] / counts.sum()) if counts.sum() else None
    record = {
        "channel": s.channel,
        "episodes": s.episodes,
        "schemes": list(s.fig1_schemes),
        "summary": summ,
        "paired": paired,
        "ddqn_actions": {"counts": counts.tolist(), "share_action0": share0},
        "utilities": util,
    }
    header = ["rho", *(LABELS[n] for n in s.fig1_schemes)]
    rows = [[r, *(ci_cell(summ[r][n], 4) for n in s.fig1_schemes)] for r in summ]
    table = (
        f"Utility recovered before the deadline (mean ± 95% CI over {s.episodes} "
        "held-out episodes):\n\n" + md_table(header, rows)
    )
    names = list(next(iter(paired.values())).keys())
    if names:
        prow = [
            [
                r,
                *(
                    f"{p[k]['mean']:+.4f} ± {p[k]['ci95']:.4f} ({p[k]['equal']}/{p[k]['n']} equal)"
                    for k in names
                ),
            ]
            for r, p in paired.items()
        ]
        table += "\nPaired differences on the same episodes (mean ± 95% CI; episodes equal):\n\n"
        table += md_table(["rho", *names], prow)
    if share0 is not None:
        table += (
            f"\nDDQN decisions: {int(counts.sum())}; action 0 (no proactive repair, keep "
            f"admitting) {100 * share0:.1f} %; counts per action {counts.tolist()}.\n"
        )
    seeds = (
        f"held-out episodes 0..{s.episodes - 1} of kvtransport.agents.episodes.eval_spec "
        f"(channel seeds {HELD_OUT_SEED}+i, measured block utilities of held-out contexts),"
        " the same for every scheme"
    )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5.4))
    rhos = [float(r) for r in summ]
    for n in s.fig1_schemes:
        st = [summ[r][n] for r in summ]
        ax.errorbar(
            rhos,
            [c["mean"] for c in st],
            yerr=np.nan_to_num([c["ci95"] for c in st]),
            fmt="-" if n in ("ddqn", "oracle", "adaptive") else "--",
            marker="o",
            ms=3,
            capsize=2,
            lw=2.2 if n == "ddqn" else 1.0,
            label=LABELS[n],
        )
    ax.set_xlabel("rho (deadline / loss-free send time)")
    ax.set_ylabel("normalized KV utility recovered before the deadline")
    ax.set_title(
        f"Fig. 5 reproduced: {s.channel} (100 Mbit/s Gilbert-Elliott, ~12% bursty "
        f"loss), {s.episodes} episodes per point, 95% CI",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.subplots_adjust(bottom=0.2)
    return run.finish(1, record, table, fig, seeds, before, t0)


# ---------------------------------------------------------------------------- figure 4


def _bench(script: str, args: tuple[str, ...], out: Path) -> dict[str, Any]:
    """Run a benchmark script through its command line: its JSON, or {"error": why}."""
    cmd = [sys.executable, str(ROOT / "scripts" / script), *args, "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0 or not out.is_file():
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"error": f"{shlex.join(cmd[1:])} exited {p.returncode}: {' / '.join(tail)}"}
    return json.loads(out.read_text())


STAGES = ("state/feedback handling", "policy (DDQN)", "encoding", "decoding")


LATENCY_PARTS = {
    "in_situ": "in situ (the sender's own timer)",
    "warm": "warm (fused kernel back to back)",
}
"""The two readings of bench_policy.py's decision latency that figure 4 shows."""


def _latency(policy: dict[str, Any], part: str) -> dict[str, float]:
    if part == "in_situ":
        return policy["decision_in_situ"]["decision"]
    return policy["warm_calls"]["ddqn decide (numba, fused)"]


def overhead_stages(
    transport: dict[str, Any],
    policy: dict[str, Any],
    config: str = "adaptive+auth",
    decision_packets: int = 32,
) -> dict[str, float]:
    """Microseconds per packet (= milliseconds per 1000 packets), sender + receiver, of
    each stage the paper's Table II counts, from one bench_transport and one bench_policy
    run.

    state/feedback: both sessions' state work in bench_transport's per-packet split,
    less the adaptive heuristic's own decisions (that run's sender policy; bench_policy's
    adaptive act time, one decision per ``decision_packets`` packets); policy: the DDQN's
    in-situ decision (state packing, observation and inference, as the sender timed it) per
    packet; encoding and
    decoding: the RLC coder's calls on each side. Header/authentication and socket calls
    are outside the paper's stages and reported apart."""
    pp = transport["per_packet"][config]
    adaptive = policy["warm_calls"]["adaptive act (python)"]["mean_us"] / decision_packets
    st = {
        "state/feedback handling": pp["sender"]["state_us"] + pp["receiver"]["state_us"] - adaptive,
        "policy (DDQN)": policy["decision_in_situ"]["decision"]["mean_us"] / decision_packets,
        "encoding": pp["sender"]["coding_us"],
        "decoding": pp["receiver"]["coding_us"],
    }
    st["total"] = sum(st[k] for k in STAGES)
    st["header + authentication (not counted)"] = (
        pp["sender"]["header_auth_us"] + pp["receiver"]["header_auth_us"]
    )
    sock = transport["socket"]["gso_gro"]
    st["socket send + receive, GSO/GRO (not counted)"] = sock["send_us"] + sock["recv_us"]
    return st


def figure4(run: Run) -> dict[str, Any]:
    from kvtransport.core.policy_base import DECISION_PACKETS

    s = run.settings
    t0, before = time.perf_counter(), machine()
    bdir = run.data / "bench"
    bdir.mkdir(parents=True, exist_ok=True)
    transport: list[dict] = []
    policy: list[dict] = []
    errors: list[str] = []
    # decisions timed as a daemon run with --realtime would make them (SCHED_FIFO, so other
    # processes cannot preempt one), where this process may ask for it
    policy_args = s.bench_policy_args + (("--realtime",) if os.geteuid() == 0 else ())
    jobs = [(k, kind) for k in range(s.bench_runs) for kind in ("transport", "policy")]
    for k, kind in run.bar(jobs, desc="fig 4: benchmark runs", unit="run"):
        script, args = (
            ("bench_transport.py", s.bench_transport_args)
            if kind == "transport"
            else ("bench_policy.py", policy_args)
        )
        doc = _bench(script, args, bdir / f"{script[:-3]}_{k}.json")
        if "error" in doc:
            errors.append(doc["error"])
        else:
            (transport if kind == "transport" else policy).append(doc)
    per_run = [
        overhead_stages(t, p, decision_packets=DECISION_PACKETS)
        for t, p in zip(transport, policy, strict=False)
    ]
    summ = {k: summary([r[k] for r in per_run]) for k in (per_run[0] if per_run else {})}
    lat = {
        f"{part}.{stat}": summary([_latency(p, part)[stat] for p in policy])
        for part in LATENCY_PARTS
        for stat in ("mean_us", "p99_us")
    }
    record = {
        "per_packet_config": "adaptive+auth",
        "decision_packets": DECISION_PACKETS,
        "runs": len(per_run),
        "errors": errors,
        "stages_ms_per_1000_packets": summ,
        "control_latency_us": lat if policy else {},
        "published": {
            "ms_per_1000_packets": PUBLISHED_OVERHEAD_MS,
            "control_latency_us": PUBLISHED_CONTROL_US,
        },
        "bench_args": {
            "transport": list(s.bench_transport_args),
            "policy": list(policy_args),
        },
        "per_run": per_run,
    }
    table = (
        f"Online overhead per 1000 packets, sender + receiver (ms; mean ± 95% CI over "
        f"{len(per_run)} benchmark runs):\n\n"
    )
    table += md_table(
        ["stage", "this implementation", "published (Table II)"],
        [
            [k, ci_cell(v, 2), f"~{PUBLISHED_OVERHEAD_MS:.0f}" if k == "total" else ""]
            for k, v in summ.items()
        ],
    )
    if policy:
        table += (
            "\nControl latency of one DDQN decision (sender state, observation and inference "
            "in one call; in situ: every decision of the runs, each transfer's first "
            "included; us):\n\n"
        )
        table += md_table(
            ["measure", "mean", "p99", "published mean / p99"],
            [
                [
                    label,
                    ci_cell(lat[f"{part}.mean_us"], 1),
                    ci_cell(lat[f"{part}.p99_us"], 1),
                    "{:.0f} / {:.0f}".format(*PUBLISHED_CONTROL_US),
                ]
                for part, label in LATENCY_PARTS.items()
            ],
        )
    for e in errors:
        table += f"\nA benchmark run failed: {e}\n"
    seeds = (
        f"{len(per_run)} runs each of scripts/bench_transport.py "
        f"{' '.join(s.bench_transport_args)} and scripts/bench_policy.py "
        f"{' '.join(policy_args)} (their own fixed seeds)"
    )
    fig = _plot4(summ, lat) if summ and policy else None
    return run.finish(4, record, table, fig, seeds, before, t0)


def _plot4(summ: dict[str, Any], lat: dict[str, Any]) -> Any:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.6), gridspec_kw={"width_ratios": [1.3, 1]})
    bottom = 0.0
    for k in STAGES:
        v = summ[k]["mean"]
        a1.bar(0, v, 0.5, bottom=bottom, label=f"{k}: {v:.2f}")
        bottom += v
    tot = summ["total"]
    a1.errorbar(0, tot["mean"], yerr=np.nan_to_num(tot["ci95"]), color="k", capsize=4)
    a1.bar(1, PUBLISHED_OVERHEAD_MS, 0.5, color="0.6", label="published prototype (total)")
    a1.set_xticks([0, 1], ["this implementation", "published (Table II)"])
    a1.set_ylabel("ms per 1000 packets (sender + receiver)")
    a1.legend(fontsize=7)
    a1.grid(alpha=0.3, axis="y")
    xs = np.arange(2)
    for j, (part, label) in enumerate(LATENCY_PARTS.items()):
        vals = [lat[f"{part}.mean_us"], lat[f"{part}.p99_us"]]
        a2.bar(
            xs + (j - 1) * 0.27,
            [v["mean"] for v in vals],
            0.27,
            capsize=3,
            yerr=np.nan_to_num([v["ci95"] for v in vals]),
            label=f"DDQN ({label})",
        )
    a2.bar(xs + 0.27, PUBLISHED_CONTROL_US, 0.27, color="0.6", label="published prototype")
    a2.hlines(TARGET_CONTROL_US, xs - 0.45, xs + 0.45, colors="k", linestyles="--", lw=1)
    a2.plot([], [], "k--", lw=1, label="target (5 us mean, 20 us p99)")
    a2.set_xticks(xs, ["mean", "p99"])
    a2.set_ylabel("control latency per decision (us)")
    a2.legend(fontsize=7)
    a2.grid(alpha=0.3, axis="y")
    fig.suptitle(
        "Table II reproduced: online overhead per 1000 packets, control latency", fontsize=10
    )
    fig.subplots_adjust(bottom=0.22, top=0.9, wspace=0.3)
    return fig


# ---------------------------------------------------------------------------- figure 6


def multiuser_command(helptext: str, out: Path, extra: tuple[str, ...]) -> list[str]:
    """scripts/eval_multiuser.py's command line, with the options its --help offers."""
    cmd = [sys.executable, str(ROOT / "scripts" / "eval_multiuser.py")]
    if "--out" in helptext:
        cmd += ["--out", str(out)]
    for i in range(0, len(extra), 2):
        if extra[i] in helptext:
            cmd += list(extra[i : i + 2])
    return cmd


def multiuser_summary(doc: dict[str, Any]) -> tuple[list[str], dict[tuple, dict[str, Any]]]:
    """(policies, {(rate, arrivals, users): {name: summary over seeds}}) from
    eval_multiuser's JSON (its ``scenarios``: one entry per seed)."""
    policies = list(doc["meta"]["policies"])
    groups: dict[tuple, list[dict]] = {}
    for sc in doc["scenarios"]:
        groups.setdefault((sc["rate_mbps"], sc["arrivals"], sc["users"]), []).append(sc)
    out = {}
    for key, scs in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2])):
        cell = {p: summary([sc["policies"][p]["accuracy"] for sc in scs]) for p in policies}
        for p in policies:
            cell[f"{p} / clairvoyant"] = summary([sc["policies"][p]["ratio"] for sc in scs])
        cell["clairvoyant"] = summary([sc["clairvoyant"] for sc in scs])
        cell["ceiling"] = summary([sc["ceiling"] for sc in scs])
        out[key] = cell
    return policies, out


def figure6(run: Run) -> dict[str, Any]:
    """scripts/eval_multiuser.py's result (through its command line), or "pending"."""
    t0, before = time.perf_counter(), machine()
    script = ROOT / "scripts" / "eval_multiuser.py"
    if not script.is_file():
        record: dict[str, Any] = {
            "status": "pending",
            "reason": "scripts/eval_multiuser.py does not exist yet",
        }
        table = (
            "**Pending**: the multi-user evaluation (scripts/eval_multiuser.py, issue 6) "
            "has not landed; this figure runs it once it does.\n"
        )
        return run.finish(6, record, table, None, "-", before, t0)
    helptext = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    mdir = run.data / "multiuser"
    cmd = multiuser_command(helptext, mdir, run.settings.multiuser_args)
    with run.bar(total=1, desc="fig 6: eval_multiuser.py", unit="run") as bar:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        bar.update(1)
    sub = shlex.join([Path(cmd[1]).relative_to(ROOT).as_posix(), *cmd[2:]])
    found = mdir / "multiuser.json"
    try:
        doc = json.loads(found.read_text()) if p.returncode == 0 else None
        policies, cells = multiuser_summary(doc) if doc else ([], {})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        doc, policies, cells = None, [], {}
        p = subprocess.CompletedProcess(cmd, p.returncode, "", f"unreadable result: {exc!r}")
    if not cells:
        tail = " / ".join((p.stderr or p.stdout).strip().splitlines()[-3:])
        record = {"status": "failed", "subcommand": sub, "reason": tail}
        table = f"**Pending**: `{sub}` gave no result ({tail}).\n"
        return run.finish(6, record, table, None, "-", before, t0)
    summ = {f"{r:g} Mbit/s, {a}, {u} users": c for (r, a, u), c in cells.items()}
    record = {
        "status": "ok",
        "subcommand": sub,
        "policies": policies,
        "summary": summ,
        "result": doc,
    }
    header = ["scenario", *policies, "clairvoyant", "full-cache ceiling"]
    rows = [
        [
            k,
            *(f"{ci_cell(c[p])} ({100 * c[p + ' / clairvoyant']['mean']:.1f} %)" for p in policies),
            ci_cell(c["clairvoyant"]),
            ci_cell(c["ceiling"]),
        ]
        for k, c in summ.items()
    ]
    table = (
        f"Average accuracy per user (mean ± 95% CI over seeds; in brackets the ratio to "
        f"the clairvoyant bound), from `{sub}`:\n\n" + md_table(header, rows)
    )
    assert doc is not None  # cells came from it
    used = sorted({sc["seed"] for sc in doc["scenarios"]})
    seeds = f"eval_multiuser's scenario seeds {used} in every cell"
    return run.finish(6, record, table, _plot6(policies, cells), seeds, before, t0)


def _plot6(policies: list[str], cells: dict[tuple, dict[str, Any]]) -> Any:
    plt = pyplot()
    panels = sorted({(r, a) for r, a, _ in cells}, key=lambda x: (x[0], str(x[1])))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(max(7.0, 4.2 * len(panels)), 4.6), squeeze=False, sharey=True
    )
    for ax, (rate, arr) in zip(axes[0], panels, strict=True):
        keys = sorted(k for k in cells if k[:2] == (rate, arr))
        users = [k[2] for k in keys]
        for name in (*policies, "clairvoyant", "ceiling"):
            st = [cells[k][name] for k in keys]
            ax.errorbar(
                users,
                [c["mean"] for c in st],
                yerr=np.nan_to_num([c["ci95"] for c in st]),
                marker="o",
                ms=3,
                capsize=2,
                label=name,
                ls=":" if name in ("clairvoyant", "ceiling") else "-",
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(users, [str(u) for u in users])
        ax.set_title(f"{rate:g} Mbit/s, {arr}", fontsize=9)
        ax.set_xlabel("concurrent handovers")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("average accuracy per user")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(
        "Multi-user: average accuracy vs concurrent handovers (500 ms windows), 95% CI", fontsize=10
    )
    fig.subplots_adjust(bottom=0.25, top=0.86)
    return fig
