"""Whether the host is loaded while the demo runs: the 1-minute load average against the
cores the demo leaves to other work.

The rule (:func:`others_load`, :meth:`LoadWatch.summary`): the demo computes on
``threads`` torch threads, so while it runs about ``threads`` of the load average are its
own; the rest is other work. The host is loaded when that other work exceeds the cores the
demo leaves free (the cores less its threads): then the demo's compute waits for a core and
its timings stretch, re-prefilling and the handoff's race alike, by amounts that differ
from moment to moment. The daemons' and relay's own bursts are short and not counted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return None


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def others_load(load1: float, own: float) -> float:
    """The load average less the demo's own share ``own`` (never below 0)."""
    return max(load1 - own, 0.0)


@dataclass
class LoadWatch:
    """Samples of the 1-minute load average over a run: :meth:`sample` at its stages
    (``own``: how much of the load is the demo's own at that moment: 0 before it computes,
    its threads while it does), :meth:`summary` for the report."""

    threads: int
    ncores: int = field(default_factory=cores)
    samples: list[tuple[float, float]] = field(default_factory=list)  # (load1, own)

    def sample(self, own: float) -> None:
        load = load_average()
        if load is not None:
            self.samples.append((load, own))

    def summary(self) -> dict[str, Any]:
        """cores, the samples, the highest load average, the other work's highest share, the
        cores the demo leaves free, and ``loaded``: whether that share exceeded them."""
        free = max(self.ncores - self.threads, 0)
        others = max((others_load(load, own) for load, own in self.samples), default=None)
        return {
            "cores": self.ncores,
            "threads": self.threads,
            "load1": [round(load, 2) for load, _ in self.samples],
            "max_load1": max((load for load, _ in self.samples), default=None),
            "others": others,
            "free_cores": free,
            "loaded": others is not None and others > free,
        }


def load_text(summary: dict[str, Any], rounds: int) -> str:
    """The table's host line: the load, and a warning when the host was loaded."""
    if summary.get("max_load1") is None:
        return "the load average is unknown here"
    n = summary["cores"]
    plural = "s" if n != 1 else ""
    text = f"{n} core{plural}, 1-minute load average up to {summary['max_load1']:.1f}"
    if not summary["loaded"]:
        return text + " (not loaded)"
    free = summary["free_cores"]
    medians = (f"TTFT and speed-up are medians of {rounds} interleaved rounds" if rounds > 1
               else "TTFT and speed-up are from one round")  # fmt: skip
    return (
        f"WARNING: loaded host: {text}; other work wanted {summary['others']:.1f} cores "
        f"where the demo leaves {free} free, so its timings stretch unevenly ({medians}; "
        "--rounds N for more)"
    )
