"""What the demo runs and what it reports: the schemes, the configuration, one result row
per scheme, the whole report, and its two forms (the table people read, the JSON programs
read).

kvtransport.demo.run fills these in; this module only holds and formats them (no model, no
link), so the table's layout can be read and changed in one place.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.demo.host_load import load_text
from kvtransport.model.plan import DEFAULT_HEDGE_SHARE, DEFAULT_LEVELS

SCHEMES: tuple[tuple[str, str], ...] = (
    ("no FEC", "none"),
    ("block RS 4/32", "block-rs:4/32"),
    ("RLC 4/32", "fixed:4/32"),
    ("adaptive", "adaptive"),
    ("DDQN", "ddqn"),
)
"""(label, kvtransport.policies.registry spec) of the schemes in the table, in table order."""

DEFAULT_TOKENS = 512
QUICK_TOKENS = 128
MAX_TOKENS = 32768  # the longest --tokens; the model's own positions and the memory
# available are checked once the model is loaded (kvtransport.demo.run, _check_context)
DEMO_CACHE_COPIES = 3
"""fp32 copies of the context's cache the demo holds besides a receiver's own (the card,
the full cache answered from, one scheme's delivery), for its memory check."""
DEFAULT_MAX_NEW_TOKENS = 24
QUICK_MAX_NEW_TOKENS = 12
DEFAULT_QUESTIONS = 5
DEFAULT_BUDGET = 0.3
QUICK_BUDGET = 0.6
DEFAULT_PRECISIONS = DEFAULT_LEVELS  # the plan's own default (kvtransport.model.plan)
DEFAULT_OBJECTIVE = "ttft"
DEFAULT_ORDER = "position"
MAX_QUESTIONS = 10
MAX_REPEATS = 20
DEFAULT_REPEATS = 3  # interleaved TTFT rounds: a slow moment of a shared host hits one round


@dataclass(frozen=True)
class DemoConfig:
    """What to run. ``quick()`` gives the faster variant (smaller context, shorter answers).

    card_dir: where cache cards are kept between runs (None: no caching).
    threads: torch threads for prefill and decoding (the TTFT figures depend on it).
    budget: the TTFT budget as a share of the receiver's own estimate of re-prefilling
        (the handoff plan fits the cache into it; kvtransport.model.plan).
    rate_mbps: the link's rate (None: the profile's 100 Mbit/s).
    precision: the precisions the plan may send, best first (the last is the floor).
    objective: the plan's objective (kvtransport.model.plan.OBJECTIVES): ``ttft`` answers as soon
        as it can and treats the budget as a cap, ``fidelity`` spends the budget on
        precision.
    order: the stream order of the plan (kvtransport.model.plan.ORDERS): ``position`` sends
        the token ranges front first, ``back`` the last first, so that the receiver
        computing from the front meets the link wherever the real speeds put them.
    hedge: the share of the receiver's planned prefix the sender also sends, last, as a
        hedge against a receiver slower than measured (kvtransport.model.plan
        DEFAULT_HEDGE_SHARE; 0: none).
    tail: the plan sends the context's last ranges layer by layer and the receiver answers
        while they arrive (kvtransport.model.plan, the tail); False: the question's pass
        runs once the whole cache is in place.
    link_rate_mbps: the rate the link really carries when it is not the one the plan
        assumes (``rate_mbps``): a link worse (or better) than planned; None: the same.
    compute_speed: (seconds per call, seconds per token[, seconds per token pair[,
        spread]]) of the receiver's compute (kvtransport.model.cache_builder.ComputeSpeed;
        a spread above its TRUST_LIMIT: a measurement not trusted), used by the plan
        instead of measuring it (a fixed plan makes the emulated link's
        transfers repeat exactly).
    questions: how many questions each received cache answers (the task's own first, then
        other facts of the same context: kvtransport.model.tasks.question_set; fewer when the
        context states fewer facts). One answer flips on small cache differences; the
        mean F1 and the count of answers equal to the full cache's over several do not.
    repeats: how many times the TTFTs are measured, in rounds that time re-prefilling and
        then every row's race once each (the first round also answers); a row's TTFT is
        its median, its speed-up the median of the rounds' ratios, so a slow moment of
        the host hits both sides of a ratio instead of one (``--rounds``).
    """

    task: str = "fiction_qa"
    tokens: int = DEFAULT_TOKENS
    seed: int = 1
    budget: float = DEFAULT_BUDGET
    rate_mbps: float | None = None
    precision: tuple[str, ...] = DEFAULT_PRECISIONS
    objective: str = DEFAULT_OBJECTIVE
    order: str = DEFAULT_ORDER
    hedge: float = DEFAULT_HEDGE_SHARE
    tail: bool = True
    link_rate_mbps: float | None = None
    compute_speed: tuple[float, ...] | None = None
    schemes: tuple[str, ...] | None = None  # labels of SCHEMES to run (None: all)
    link: str = "auto"
    threads: int = 1
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    card_dir: Path | None = None
    progress: bool = True
    questions: int = DEFAULT_QUESTIONS
    repeats: int = DEFAULT_REPEATS

    @classmethod
    def quick(cls, **overrides: Any) -> DemoConfig:
        base = {"tokens": QUICK_TOKENS, "max_new_tokens": QUICK_MAX_NEW_TOKENS,
                "budget": QUICK_BUDGET}  # fmt: skip
        return cls(**{**base, **overrides})


@dataclass
class SchemeResult:
    """One row of the table.

    answers, f1s: per question (DemoReport.questions' order); answer is the first (the
    task's own question), f1 the mean over all of them, matches how many answers equal the
    full cache's (SQuAD-normalized exact match).
    """

    label: str
    policy: str
    utility: float | None = None
    blocks_missing: int | None = None
    blocks_total: int | None = None
    reason: str = ""
    answer: str = ""
    f1: float | None = None
    answers: list[str] = field(default_factory=list)
    f1s: list[float] = field(default_factory=list)
    matches: int | None = None
    transfer_s: float | None = None
    race_s: float | None = None  # the receiver's cache complete (kvtransport.model.race)
    computed_tokens: int | None = None  # by the receiver: its prefix and what it recomputed
    recomputed_tokens: int | None = None  # of those, after the planned prefix
    loaded_tokens: int | None = None  # from the link
    waited_s: float | None = None
    rebuild_s: float | None = None
    first_token_s: float | None = None
    ttft_s: float | None = None  # the median of ttft_rounds
    speedup: float | None = None  # the median over the rounds of re-prefill TTFT / this TTFT
    ttft_rounds: list[float] = field(default_factory=list)  # DemoConfig.repeats of them
    counters: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # why the scheme did not run (e.g. no shipped DDQN weights)
    note: str = ""  # one line under the table: why the row is as it is (degraded, late)


@dataclass
class DemoReport:
    """Everything the demo measured (``to_dict`` for --json, ``render_table`` for people).

    task and full_answer are about the task's own question (Q1); questions holds every
    question asked: {question, gold, full_answer, reprefill_answer, gold_f1_full}.
    no_cache is the floor: the answers with every block masked (nothing of the context),
    which a question the model can answer from what it knows already matches.
    """

    config: dict[str, Any]
    link: dict[str, Any]
    task: dict[str, Any]
    cache: dict[str, Any]
    deadline_s: float
    send_time_s: float
    full_answer: str
    reprefill: dict[str, Any]
    answers_agree: bool  # the full cache answered every question as re-prefilling did
    schemes: list[SchemeResult]
    timings: dict[str, float]
    budget_s: float = 0.0  # the TTFT budget
    plan: dict[str, Any] = field(default_factory=dict)
    link_down: SchemeResult | None = None  # the receiver alone (100 % loss): the fallback
    questions: list[dict[str, Any]] = field(default_factory=list)
    # the floor: every block masked (answers, f1s, f1, matches as in SchemeResult)
    no_cache: dict[str, Any] = field(default_factory=dict)
    # the host's load over the run (kvtransport.demo.host_load.LoadWatch.summary)
    host: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schemes"] = [asdict(s) for s in self.schemes]
        d["link_down"] = asdict(self.link_down) if self.link_down is not None else None
        return d

    def deterministic_view(self) -> dict[str, Any]:
        """The parts a seed fixes on the emulated link (measured timings left out)."""
        keep = ("label", "utility", "blocks_missing", "reason", "transfer_s")
        plan = {k: v for k, v in self.plan.items() if k != "compute_speed"}
        return {
            "questions": [(q["question"], q["full_answer"]) for q in self.questions],
            "no_cache": self.no_cache,
            "cache": {k: v for k, v in self.cache.items() if k != "card_cached"},
            "plan": plan,
            "schemes": [{k: getattr(s, k) for k in keep} | s.counters for s in self.schemes],
        }


def determinism_text(link: str, seed: int) -> str:
    if link == "emulated":
        return (
            f"yes for seed {seed} and one plan: utility, blocks and link times repeat exactly "
            "(the link runs on its own clock); the plan follows the measured compute speed "
            "(fixed with --compute-speed) and TTFT's compute part is measured"
        )
    return (
        "no: real clocks and kernel queues decide when packets leave and when feedback "
        "arrives, so each run differs a little; --link emulated gives a repeatable table"
    )


# ---------------------------------------------------------------------------------------
# the table


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def render_table(rep: DemoReport) -> str:
    """The human-readable report: header, side-by-side table, the questions, what the
    columns mean."""
    c, t = rep.cache, rep.task
    k = len(rep.questions)
    lines = [
        "kvtransport demo: a KV-cache handoff across a burst-loss link, against re-prefill",
        f"  link      {rep.link['description']}"
        + (
            f"; round trip {rtt * 1e3:.1f} ms as measured with warm daemons (plan and "
            "transfers use it)"
            if (rtt := rep.link.get("rtt_s"))
            else ""
        ),
    ]
    if rep.link["note"]:
        lines.append(f"  note      {rep.link['note']}")
    if rep.host:
        lines.append(f"  host      {load_text(rep.host, rep.config.get('repeats', 1))}")
    lines += [
        f"  repeats   {rep.link['deterministic']}",
        f"  task      {t['name']} (seed {t['seed']}): {_count(k, 'question')} about one context, "
        "each answered on every scheme's received cache (listed below the table)",
        f"  cache     {c['model_id']}: {c['context_tokens']} context tokens, {c['layers']} "
        f"layers, {c['blocks']} blocks of {c['block_tokens']} tokens, "
        f"{c['bytes'] / 2**20:.1f} MiB {c['dtype']}"
        + (" (card from the cache directory)" if c["card_cached"] else ""),
        f"  budget    TTFT {rep.budget_s * 1e3:.0f} ms ({rep.config['budget']:g} of the "
        f"receiver's re-prefill estimate); transport deadline {rep.deadline_s * 1e3:.0f} ms",
        f"  plan      {rep.plan.get('text', '')}",
        "",
    ]
    aw = 30
    head = ("scheme", "utility", "blocks missing", "computed", "answer to Q1", "F1",
            "same answer", "TTFT s", "speed-up")  # fmt: skip
    n_tok = c["context_tokens"]
    rows: list[tuple[str, ...]] = [
        ("full cache", "1.000", f"0/{c['blocks']}", "-", _clip(rep.full_answer, aw), "1.00",
         f"{k}/{k}", "-", "-")
    ]  # fmt: skip
    race_rows = [*rep.schemes, *([rep.link_down] if rep.link_down is not None else [])]
    for s in race_rows:
        if s.ttft_s is None:
            rows.append((s.label, "-", "-", "-", _clip(s.error or "did not run", aw), "-", "-",
                         "-", "-"))  # fmt: skip
            continue
        rows.append(
            (
                s.label,
                f"{s.utility:.3f}",
                f"{s.blocks_missing}/{s.blocks_total}",
                f"{s.computed_tokens}/{n_tok}",
                _clip(s.answer, aw),
                f"{s.f1:.2f}",
                f"{s.matches}/{len(s.answers)}",
                f"{s.ttft_s:.2f}",
                f"{s.speedup:.1f}x" if s.speedup else "-",
            )
        )
    nc = rep.no_cache
    rows.append(
        ("no cache", "0.000", "-", "-", _clip(nc["answers"][0], aw),
         f"{nc['f1']:.2f}", f"{nc['matches']}/{k}", "-", "-")
    )  # fmt: skip
    rp = rep.reprefill
    re_answers = [q["reprefill_answer"] for q in rep.questions]
    full_answers = [q["full_answer"] for q in rep.questions]
    re_f1 = [_f1(a, b) for a, b in zip(re_answers, full_answers, strict=True)]
    re_same = sum(_same(a, b) for a, b in zip(re_answers, full_answers, strict=True))
    rows.append(
        ("re-prefill", "-", "-", f"{n_tok}/{n_tok}", _clip(rp["answer"], aw),
         f"{sum(re_f1) / max(k, 1):.2f}", f"{re_same}/{k}", f"{rp['ttft_s']:.2f}", "1.0x")
    )  # fmt: skip
    widths = [max(len(r[j]) for r in [head, *rows]) for j in range(len(head))]
    right = {1, 2, 3, 5, 6, 7, 8}

    def fmt(r: tuple[str, ...]) -> str:
        cells = [
            x.rjust(w) if j in right else x.ljust(w)
            for j, (x, w) in enumerate(zip(r, widths, strict=True))
        ]
        return "  " + "  ".join(cells).rstrip()

    lines.append(fmt(head))
    lines.append("  " + "  ".join("-" * w for w in widths))
    lines += [fmt(r) for r in rows]
    notes = [s for s in race_rows if s.note]
    if notes:
        lines += ["", "  notes:"]
        lines += [f"    {s.label}: {s.note}" for s in notes]
    lines += ["", "  questions (the full cache's answer; the gold answer in brackets):"]
    for i, q in enumerate(rep.questions, 1):
        lines.append(
            f"    Q{i}  {q['question']}  {_clip(q['full_answer'], 40)}  [{'; '.join(q['gold'])}]"
        )
    agree = "equal" if rep.answers_agree else "DIFFER FROM"
    n = rep.config.get("repeats", 1)
    rounds = f"; TTFT and speed-up: medians of {n} interleaved rounds." if n > 1 else "."
    lines += [
        "",
        f"  The full-cache answers {agree} the re-prefill answers.",
        "  utility: share of the cache's utility in place at the transport's deadline (the",
        "  receiver's planned prefix and the blocks complete); blocks missing: of those sent;",
        "  computed: context tokens the receiver computed itself (its planned prefix, and what",
        "  never arrived, recomputed exactly); every scheme answers from a complete cache;",
        f"  F1: token F1 of each answer against the full-cache answer, mean of the {k} questions;",
        "  same answer: answers equal to the full cache's (after SQuAD normalization);",
        "  no cache: every block masked, the question alone (what the model knows anyway);",
        "  TTFT (Q1): the receiver's race until Q1's first token (computing while loading,",
        "  each received range decoded as it comes; Q1 runs through the model while the",
        "  context's last ranges arrive layer by layer); link down: the receiver alone,",
        "  nothing arrives (100 % loss); against re-prefilling the context "
        f"({rp['prefill_s']:.2f} s) + first token; torch threads: {rep.config['threads']}" + rounds,
        f"  wall time {rep.timings['total']:.1f} s "
        f"(transfers {rep.timings['transfers']:.1f} s, answers {rep.timings['answers']:.1f} s).",
    ]
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _same(a: str, b: str) -> bool:
    from kvtransport.model.metrics import exact_match

    return bool(exact_match(a, b))


def _f1(a: str, b: str) -> float:
    from kvtransport.model.metrics import token_f1

    return token_f1(a, b)


def report_json(rep: DemoReport) -> str:
    """One JSON object (``--json``)."""
    return json.dumps(rep.to_dict(), default=json_default)


def json_default(obj: Any) -> Any:
    """``json.dumps``'s default for numpy scalars and arrays (anything else as text)."""
    if isinstance(obj, np.integer | np.floating):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)
