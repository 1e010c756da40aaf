"""What the demo runs and what it reports: the schemes, the configuration, one result row
per scheme, the whole report, and its two forms (the table people read, the JSON programs
read).

kvtransport.demo fills these in; this module only holds and formats them (no model, no
link), so the table's layout can be read and changed in one place.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SCHEMES: tuple[tuple[str, str], ...] = (
    ("no FEC", "none"),
    ("block RS 4/32", "block-rs:4/32"),
    ("RLC 4/32", "fixed:4/32"),
    ("adaptive", "adaptive"),
    ("DDQN", "ddqn"),
)
"""(label, kvtransport.policy spec) of the schemes in the table, in table order."""

DEFAULT_TOKENS = 512
QUICK_TOKENS = 128
MAX_TOKENS = 2048  # 94 MiB of fp32 cache: each scheme's delivery is held until the answers
DEFAULT_MAX_NEW_TOKENS = 24
QUICK_MAX_NEW_TOKENS = 12


@dataclass(frozen=True)
class DemoConfig:
    """What to run. ``quick()`` gives the faster variant (smaller context, shorter answers).

    card_dir: where cache cards are kept between runs (None: no caching).
    threads: torch threads for prefill and decoding (the TTFT figures depend on it).
    """

    task: str = "facts_qa"
    tokens: int = DEFAULT_TOKENS
    seed: int = 1
    rho: float = 0.8
    link: str = "auto"
    threads: int = 1
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    card_dir: Path | None = None
    progress: bool = True

    @classmethod
    def quick(cls, **overrides: Any) -> DemoConfig:
        base = {"tokens": QUICK_TOKENS, "max_new_tokens": QUICK_MAX_NEW_TOKENS}
        return cls(**{**base, **overrides})


@dataclass
class SchemeResult:
    """One row of the table."""

    label: str
    policy: str
    utility: float | None = None
    blocks_missing: int | None = None
    blocks_total: int | None = None
    reason: str = ""
    answer: str = ""
    f1: float | None = None
    transfer_s: float | None = None
    rebuild_s: float | None = None
    first_token_s: float | None = None
    ttft_s: float | None = None
    speedup: float | None = None  # re-prefill TTFT / this TTFT
    counters: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # why the scheme did not run (e.g. no shipped DDQN weights)


@dataclass
class DemoReport:
    """Everything the demo measured (``to_dict`` for --json, ``render_table`` for people)."""

    config: dict[str, Any]
    link: dict[str, Any]
    task: dict[str, Any]
    cache: dict[str, Any]
    deadline_s: float
    send_time_s: float
    full_answer: str
    reprefill: dict[str, Any]
    answers_agree: bool
    schemes: list[SchemeResult]
    timings: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schemes"] = [asdict(s) for s in self.schemes]
        return d

    def deterministic_view(self) -> dict[str, Any]:
        """The parts a seed fixes on the emulated link (measured timings left out)."""
        keep = ("label", "utility", "blocks_missing", "reason", "answer", "f1", "transfer_s")
        return {
            "full_answer": self.full_answer,
            "cache": {k: v for k, v in self.cache.items() if k != "card_cached"},
            "schemes": [{k: getattr(s, k) for k in keep} | s.counters for s in self.schemes],
        }


def determinism_text(link: str, seed: int) -> str:
    if link == "emulated":
        return (
            f"yes for seed {seed}: utility, blocks, answers, F1 and link times repeat exactly "
            "(the link runs on its own clock); TTFT's compute part is measured and varies"
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
    """The human-readable report: header, side-by-side table, what the columns mean."""
    c, t = rep.cache, rep.task
    lines = [
        "kvtransport demo: a KV-cache handoff across a burst-loss link",
        f"  link      {rep.link['description']}",
    ]
    if rep.link["note"]:
        lines.append(f"  note      {rep.link['note']}")
    lines += [
        f"  repeats   {rep.link['deterministic']}",
        f"  task      {t['name']} (seed {t['seed']}): {t['question']}  "
        f"[gold: {'; '.join(t['gold'])}]",
        f"  cache     {c['model_id']}: {c['context_tokens']} context tokens, {c['layers']} "
        f"layers, {c['blocks']} blocks of {c['block_tokens']} tokens, "
        f"{c['bytes'] / 2**20:.1f} MiB {c['dtype']}"
        + (" (card from the cache directory)" if c["card_cached"] else ""),
        f"  deadline  rho {rep.config['rho']:g}: {rep.deadline_s * 1e3:.0f} ms "
        f"(the whole cache takes {rep.send_time_s * 1e3:.0f} ms loss-free at the link rate)",
        "",
    ]
    head = ("scheme", "utility", "blocks missing", "answer", "F1", "TTFT s", "speed-up")
    rows: list[tuple[str, ...]] = [
        ("full cache", "1.000", f"0/{c['blocks']}", _clip(rep.full_answer, 34), "1.00", "-", "-")
    ]
    for s in rep.schemes:
        if s.utility is None:
            rows.append((s.label, "-", "-", _clip(s.error or "did not run", 34), "-", "-", "-"))
            continue
        rows.append(
            (
                s.label,
                f"{s.utility:.3f}",
                f"{s.blocks_missing}/{s.blocks_total}",
                _clip(s.answer, 34),
                f"{s.f1:.2f}",
                f"{s.ttft_s:.2f}",
                f"{s.speedup:.1f}x" if s.speedup else "-",
            )
        )
    rp = rep.reprefill
    rows.append(
        ("re-prefill", "-", "-", _clip(rp["answer"], 34),
         f"{_f1(rp['answer'], rep.full_answer):.2f}", f"{rp['ttft_s']:.2f}", "1.0x")
    )  # fmt: skip
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
    right = {1, 2, 4, 5, 6}

    def fmt(r: tuple[str, ...]) -> str:
        cells = [
            x.rjust(w) if k in right else x.ljust(w)
            for k, (x, w) in enumerate(zip(r, widths, strict=True))
        ]
        return "  " + "  ".join(cells).rstrip()

    lines.append(fmt(head))
    lines.append("  " + "  ".join("-" * w for w in widths))
    lines += [fmt(r) for r in rows]
    agree = "equals" if rep.answers_agree else "DIFFERS FROM"
    lines += [
        "",
        f"  The full-cache answer {agree} the re-prefill answer.",
        "  utility: share of the cache's utility in blocks complete at the receiver's deadline;",
        "  F1: token F1 of the answer against the full-cache answer;",
        "  TTFT: transfer until the receiver's result + rebuild + injection + first token,",
        f"  against re-prefilling the context ({rp['prefill_s']:.2f} s) + first token; "
        f"torch threads: {rep.config['threads']}.",
        f"  wall time {rep.timings['total']:.1f} s "
        f"(transfers {rep.timings['transfers']:.1f} s, answers {rep.timings['answers']:.1f} s).",
    ]
    return "\n".join(lines)


def _f1(a: str, b: str) -> float:
    from kvtransport.metrics import token_f1

    return token_f1(a, b)


def report_json(rep: DemoReport) -> str:
    """One JSON object (``--json``)."""
    return json.dumps(rep.to_dict(), default=_json_default)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer | np.floating):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)
