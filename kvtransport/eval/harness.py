"""One run of scripts/evaluate.py: how much of each figure (:class:`Settings`), where the
outputs go, its provenance, the real model and the prompts it prefilled, and the
memoized real-model handoffs figures 2 and 3 share (:class:`Run`)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtransport.demo.demo_report import json_default
from kvtransport.eval.figures import caption, pyplot
from kvtransport.eval.handoffs import Case, deliver, prepare_case, samples
from kvtransport.eval.provenance import machine, machine_text, provenance_md
from kvtransport.eval.registries import FAMILIES, SCHEMES

ROOT = Path(__file__).resolve().parents[2]
"""The checkout the evaluation runs from (its scripts/ run as subprocesses)."""
FIGURES = {1: "utility", 2: "f1", 3: "ablation", 4: "overhead", 5: "ttft", 6: "multiuser"}
"""Figure number -> short name (file names: fig<N>_<name>.png/.md/.json)."""


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
