"""Shared pieces of scripts/evaluate.py: provenance, statistics, tables, real-model handoffs.

Provenance. Every figure states the command that made it, its seeds and the machine (CPU
model, cores, load average before and after): :func:`machine` reads them, :func:`caption`
puts them under a matplotlib figure, :func:`provenance_md` under a Markdown table.

Statistics. Means with 95 % t-intervals come from scripts/eval_policy.py's ``mean_ci``
(the same intervals as the policy evaluation's table).

Real-model handoffs (figures 2, 3 and 5). A :class:`Case` is one task prompt that the real
model (kvtransport.model.loader) prefilled once: its KV cache, block utilities
(kvtransport.model.utility with the packaged layer weights, as the demo and the cards use) and the
full cache's greedy answer, which is both the clean reference answer and the teacher-forcing
reference for top-1 agreement (scripts/eval_retention.py's ``reference_answer``).
:meth:`Case.stream` serializes the cache as a block stream (kvtransport.model.encoding.encode_cache,
fp16 blocks of 16 tokens by default: 12 KiB blocks, the unit the policy evaluation uses) in utility
or position order. :func:`deliver` sends it through the simulator (kvtransport.sim.simulator:
the real sender and receiver sessions over the channel model, the run ``kvtransport
simulate`` and the demo's emulated link make for the same seed) and rebuilds what arrived
(kvtransport.demo.run's rebuild: kvtransport.kvformat.blocks.decode_stream, all masked if the
manifest never came). :meth:`Case.answer` injects the partial cache with the missing blocks masked
per layer and decodes greedily (kvtransport.demo.run's answer step); answers and agreements are
memoized per presence mask, because two deliveries that hold the same blocks hold the same
cache and get the same greedy answer (at rho >= 1 most schemes deliver everything).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from eval_policy import mean_ci  # scripts/ is on sys.path when a script imports this

ROOT = Path(__file__).resolve().parents[1]
FIGURES = {1: "utility", 2: "f1", 3: "ablation", 4: "overhead", 5: "ttft", 6: "multiuser"}
"""Figure number -> short name (file names: fig<N>_<name>.png/.md/.json)."""
SCHEMES = ("none", "fixed:4/32", "block-rs:4/32", "arq", "adaptive", "ddqn", "oracle")
"""Policy names (kvtransport.sim.oracle.make_sim_policy) of the repair schemes compared (the demo's
and eval_policy's)."""
LABELS = {
    "none": "no FEC",
    "fixed:4/32": "RLC 4/32",
    "block-rs:4/32": "block RS 4/32",
    "arq": "ARQ",
    "adaptive": "adaptive",
    "ddqn": "DDQN",
    "oracle": "oracle",
    "tail-rule": "tail rule (action 0)",
}
BLOCK_TOKENS = 16
FAMILIES: dict[str, tuple[str, ...]] = {
    "qa": ("facts_qa",),
    "ruler": ("niah_single", "niah_multikey", "niah_multivalue"),
}
"""Task families of figure 2: worlddatax facts QA, and the RULER-style needle tasks."""
CASE_SEED = 50_000
"""Prompt seeds of the real-model figures start here: disjoint from the sensitivity
calibration's (small), the utility development's (20000+), eval_retention's (10000+) and
eval_quant's (30000+)."""


# ---------------------------------------------------------------------------- provenance


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo; the platform's processor string else)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """CPU model, core count and load average now (the machines are shared and noisy)."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "time_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def machine_text(before: dict[str, Any], after: dict[str, Any] | None = None) -> str:
    """'AMD EPYC, 2 cores, load 1.9 -> 2.4 (1-min average)'."""
    load = f"{before['load_avg'][0]:.1f}"
    if after is not None:
        load += f" -> {after['load_avg'][0]:.1f}"
    return (
        f"{before['cpu']}, {before['cores']} cores, load {load} (1-min avg), {before['time_utc']}"
    )


def caption(fig: Any, command: str, seeds: str, machine_line: str) -> None:
    """Put the provenance under a figure (three short lines, small type)."""
    text = f"command: {command}\nseeds: {seeds}\nmachine: {machine_line}"
    fig.text(0.005, 0.005, text, fontsize=6.5, va="bottom", ha="left", family="monospace")


def provenance_md(command: str, seeds: str, machine_line: str, wall_s: float) -> str:
    return (
        f"command: `{command}`  \nseeds: {seeds}  \nmachine: {machine_line}; "
        f"this figure's wall time {wall_s:.0f} s\n"
    )


def fmt_ci(mean: float, half: float, digits: int = 3) -> str:
    """'0.961 ± 0.006' ('0.961' when the interval is undefined, n < 2)."""
    if half != half:  # NaN: one sample
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {half:.{digits}f}"


def summary(values: list[float] | np.ndarray) -> dict[str, float]:
    """{"mean", "ci95" (half-width), "n"} of a sample."""
    m, h = mean_ci(np.asarray(values, dtype=np.float64))
    return {"mean": m, "ci95": h, "n": int(len(values))}


def best_seconds(
    fn: Callable[[], object], rounds: int, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The shortest of ``rounds`` timed calls of ``fn`` (after one untimed call that
    compiles and warms it), in seconds of ``clock`` (the benchmarks' "best of N")."""
    fn()
    best = math.inf
    for _ in range(rounds):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- handoffs


def layer_weights(lm: Any) -> np.ndarray | None:
    from kvtransport.model import utility

    return utility.default_layer_weights(lm.model_id, lm.num_layers)


@dataclass(eq=False)
class Case:
    """One prompt prefilled once by the real model (see the module docstring)."""

    family: str
    sample: Any
    context_ids: list[int]
    question_ids: list[int]
    kv: Any  # kvtransport.kvformat.kvcache.KVCache (fp32, as prefilled)
    utilities: np.ndarray  # [layers, token_blocks]
    reference: list[int]  # the full cache's greedy answer (+ its stop token)
    full_answer: str
    precision: str = "fp16"
    prefill_s: float = 0.0
    _streams: dict[str, tuple[Any, Any]] = field(default_factory=dict, repr=False)
    _answers: dict[bytes, str] = field(default_factory=dict, repr=False)
    _top1: dict[bytes, float] = field(default_factory=dict, repr=False)

    @property
    def golds(self) -> tuple[str, ...]:
        return tuple(self.sample.answers)

    def stream(self, order: str = "utility") -> tuple[Any, Any]:
        """(kvtransport.kvformat.blocks.EncodedStream, kvtransport.core.transfer.Transfer) in
        ``order`` (utility or position; the block utilities are the same either way)."""
        if order not in self._streams:
            from kvtransport.model import encoding

            st = encoding.encode_cache(
                self.kv,
                utilities=self.utilities,
                block_tokens=BLOCK_TOKENS,
                precision=self.precision,
                order=order,
                created={
                    "by": "scripts/evaluate.py",
                    "task": self.sample.task,
                    "seed": self.sample.seed,
                },
            )
            self._streams[order] = (st, st.to_transfer())
        return self._streams[order]

    def answer(self, lm: Any, kv: Any, present: np.ndarray, max_new_tokens: int) -> str:
        """The greedy answer from a (partial) cache, memoized per presence mask."""
        from kvtransport.demo.run import _answer

        key = mask_key(present)
        if key not in self._answers:
            self._answers[key] = _answer(lm, kv, present, self.question_ids, max_new_tokens)[0]
        return self._answers[key]

    def top1(self, lm: Any, kv: Any, present: np.ndarray) -> float:
        """Teacher-forced top-1 agreement with the full cache's answer, memoized."""
        from kvtransport.model import hf

        key = mask_key(present)
        if key not in self._top1:
            p = None if present.all() else present
            self._top1[key] = hf.top1_agreement(
                lm.model, kv, self.question_ids, self.reference, present=p
            )
        return self._top1[key]


def mask_key(present: np.ndarray) -> bytes:
    """A short key for a presence mask (all present: b"all")."""
    if present.all():
        return b"all"
    return hashlib.blake2b(np.packbits(present).tobytes(), digest_size=16).digest()


def samples(lm: Any, family: str, n: int, tokens: int, seed: int = CASE_SEED) -> list[Any]:
    """``n`` task samples of a family (cycling through its tasks), seeds from ``seed``."""
    from kvtransport.model import tasks

    names = FAMILIES[family]
    return [
        tasks.generate(names[i % len(names)], lm.tokenizer, target_tokens=tokens, seed=seed + i)
        for i in range(n)
    ]


def prepare_case(
    lm: Any, sample: Any, family: str, *, precision: str = "fp16", max_new_tokens: int = 24
) -> Case:
    """Prefill one prompt (with the SnapKV attention probe), score its blocks and take the
    full cache's greedy answer."""
    from eval_retention import reference_answer

    from kvtransport.model import hf, utility

    ctx, question = sample.prompt(lm.tokenizer)
    t0 = time.perf_counter()
    kv = hf.prefill(lm.model, lm.tokenizer, ctx, window=utility.OBSERVATION_WINDOW)
    prefill_s = time.perf_counter() - t0
    u = utility.cache_utility(kv, BLOCK_TOKENS, layer_weights(lm))
    ref = reference_answer(lm.model, lm.tokenizer, kv, question, max_new_tokens)
    text = lm.tokenizer.decode(ref, skip_special_tokens=True).strip()
    return Case(family, sample, ctx, question, kv, u, ref, text, precision, prefill_s)


@dataclass
class Delivery:
    """What one transfer of a case's stream delivered, rebuilt for injection."""

    utility: float  # utility recovered before the deadline (0..1)
    blocks_missing: int
    blocks_total: int
    reason: str  # the receiver's: "complete" or "deadline" (or "idle", ...)
    transfer_s: float  # link time until the receiver's result
    rebuild_s: float  # decode_stream: verify and place every complete block
    kv: Any
    present: np.ndarray  # [layers, tokens] per-layer presence mask


def deliver(
    case: Case, order: str, policy: Any, *, channel: str, rho: float, seed: int
) -> Delivery:
    """Send the case's stream through the simulator once and rebuild what arrived."""
    from kvtransport.demo.run import LinkOutcome, _rebuild
    from kvtransport.sim.simulator import make_simulation

    stream, transfer = case.stream(order)
    sim = make_simulation(
        transfer, channel=channel, rho=rho, policy=policy, seed=seed, record=False
    )
    sim.run()
    res = sim.receiver.result
    end = res.timings.get("complete") if res.reason == "complete" else None
    transfer_s = float(end if end is not None else res.timings.get("finished", sim.deadline))
    outcome = LinkOutcome(
        utility=float(res.utility_recovered),
        reason=res.reason,
        complete=res.complete,
        payload=res.payload,
        app_metadata=res.app_metadata,
        transfer_s=transfer_s,
    )
    t0 = time.perf_counter()
    kv, present = _rebuild(stream, outcome, case.context_ids)
    rebuild_s = time.perf_counter() - t0
    n = stream.manifest.num_blocks
    missing = int((~res.complete).sum()) if res.app_metadata is not None else n
    return Delivery(outcome.utility, missing, n, res.reason, transfer_s, rebuild_s, kv, present)


def ci_cell(stat: dict[str, float], digits: int = 3, scale: float = 1.0) -> str:
    """A table cell from a :func:`summary` ('mean ± half-width')."""
    return fmt_ci(scale * stat["mean"], scale * stat["ci95"], digits)


def json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer | np.floating):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class Settings:
    """How much of each figure to run: :meth:`full` (the default) or :meth:`small`."""

    channel: str = "ge-heavy"
    rhos: tuple[float, ...] = (0.6, 0.8, 1.0, 1.2)
    episodes: int = 24  # figure 1, per rho and scheme
    fig1_schemes: tuple[str, ...] = (*SCHEMES, "tail-rule")
    prompts: int = 6  # figures 2-3, per task family
    tokens: int = 512  # context tokens of figures 2-3
    channel_seeds: int = 2  # figures 2-3, per prompt, rho and scheme
    fig2_schemes: tuple[str, ...] = SCHEMES
    max_new_tokens: int = 16  # answers (gold answers are a few tokens)
    ttft_sizes: tuple[int, ...] = (512, 1024, 2048, 4096)
    ttft_rhos: tuple[float, ...] = (1.0, 0.8)
    ttft_precisions: tuple[str, ...] = ("fp16", "int8")
    ttft_repeats: int = 3
    bench_runs: int = 3
    bench_transport_args: tuple[str, ...] = ("--no-goodput", "--repeats", "1")
    bench_policy_args: tuple[str, ...] = ("--episodes", "10")
    multiuser_args: tuple[str, ...] = ("--seeds", "5")  # n=2 gives t-intervals wider than the range

    @classmethod
    def full(cls) -> Settings:
        return cls()

    @classmethod
    def small(cls) -> Settings:
        return cls(
            rhos=(0.6, 1.0),
            episodes=3,
            fig1_schemes=("none", "fixed:4/32", "block-rs:4/32", "ddqn", "tail-rule"),
            prompts=1,
            tokens=192,
            channel_seeds=1,
            fig2_schemes=("none", "ddqn"),
            max_new_tokens=8,
            ttft_sizes=(128,),
            ttft_precisions=("fp16",),
            ttft_repeats=2,
            bench_runs=2,
            bench_transport_args=("--no-goodput", "--quick"),
            bench_policy_args=("--episodes", "1"),
            multiuser_args=(
                "--users",
                "2,4",
                "--rates",
                "100",
                "--arrivals",
                "together",
                "--seeds",
                "2",
            ),
        )


@dataclass
class Run:
    """One invocation: settings, where outputs go, provenance, the model and the cases."""

    settings: Settings
    out: Path  # PNGs
    data: Path  # JSON and Markdown
    command: str
    seed: int = 1
    threads: int = 1
    progress: bool = True
    _lm: Any = None
    _cases: list[Case] | None = None
    _measured: dict[tuple, dict[str, Any]] = field(default_factory=dict)

    @property
    def lm(self) -> Any:
        """The real model (kvtransport.model.loader.load_model), loaded on first use."""
        if self._lm is None:
            from kvtransport.model.loader import load_model

            self._lm = load_model(threads=self.threads)
        return self._lm

    def bar(self, iterable: Any = None, **kw: Any) -> Any:
        """A tqdm progress bar on stderr (none with --quiet)."""
        from tqdm import tqdm

        return tqdm(
            iterable,
            disable=not self.progress,
            file=sys.stderr,
            dynamic_ncols=True,
            leave=False,
            **kw,
        )

    def cases(self) -> list[Case]:
        """Figures 2-3's prompts, prefilled once (QA first, then RULER-style)."""
        if self._cases is None:
            s = self.settings
            todo = [
                (fam, smp) for fam in FAMILIES for smp in samples(self.lm, fam, s.prompts, s.tokens)
            ]
            self._cases = [
                prepare_case(self.lm, smp, fam, max_new_tokens=s.max_new_tokens)
                for fam, smp in self.bar(todo, desc="prefill prompts", unit="prompt")
            ]
        return self._cases

    def channel_seed(self, case_index: int, k: int) -> int:
        """Channel seed ``k`` of case ``case_index`` (the same for every scheme and order)."""
        return self.seed + 1000 * case_index + k

    def measure(
        self, i: int, order: str, scheme: str, rho: float, k: int, top1: bool = False
    ) -> dict[str, Any]:
        """One real-model handoff of case ``i``, scored: utility, answer, F1 and, with
        ``top1``, teacher-forced top-1 agreement (a forward pass more). Memoized: figures 2
        and 3 share handoffs; a handoff measured without top-1 is sent again when asked
        for it (the simulator is deterministic, so it delivers the same blocks)."""
        key = (i, order, scheme, rho, k)
        rec = self._measured.get(key)
        if rec is not None and (not top1 or "top1" in rec):
            return rec
        from kvtransport.model import metrics
        from kvtransport.policies.registry import make_policy

        case = self.cases()[i]
        seed = self.channel_seed(i, k)
        d = deliver(case, order, make_policy(scheme), channel=self.settings.channel, rho=rho,
                    seed=seed)  # fmt: skip
        ans = case.answer(self.lm, d.kv, d.present, self.settings.max_new_tokens)
        rec = {
            "case": i,
            "order": order,
            "scheme": scheme,
            "rho": rho,
            "channel_seed": seed,
            "utility": d.utility,
            "blocks_missing": d.blocks_missing,
            "blocks_total": d.blocks_total,
            "answer": ans,
            "f1": metrics.token_f1(ans, case.golds),
            "f1_vs_full": metrics.token_f1(ans, case.full_answer),
        }
        if top1:
            rec["top1"] = case.top1(self.lm, d.kv, d.present)
        self._measured[key] = rec
        return rec

    def finish(
        self,
        n: int,
        record: dict[str, Any],
        table: str,
        fig: Any,
        seeds: str,
        before: dict[str, Any],
        t0: float,
    ) -> dict[str, Any]:
        """Write figure ``n``: its PNG (provenance in the caption), Markdown and JSON."""
        wall = time.perf_counter() - t0
        after = machine()
        line = machine_text(before, after)
        name = f"fig{n}_{FIGURES[n]}"
        record = {
            "figure": n,
            "name": FIGURES[n],
            "command": self.command,
            "seeds": seeds,
            "machine": {"before": before, "after": after, "text": line},
            "wall_s": wall,
            **record,
        }
        if fig is not None:
            caption(fig, self.command, seeds, line)
            self.out.mkdir(parents=True, exist_ok=True)
            fig.savefig(self.out / f"{name}.png", dpi=100)
            pyplot().close(fig)
            record["png"] = str(self.out / f"{name}.png")
        self.data.mkdir(parents=True, exist_ok=True)
        md = table + "\n" + provenance_md(self.command, seeds, line, wall)
        (self.data / f"{name}.md").write_text(md)
        text = json.dumps(record, indent=1, default=json_default) + "\n"
        (self.data / f"{name}.json").write_text(text)
        return record
