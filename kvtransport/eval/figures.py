"""Tables and figures: Markdown tables, matplotlib on the Agg backend and the provenance
caption under a figure."""

from __future__ import annotations

from typing import Any

from kvtransport.extras import require


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of ``header`` and ``rows`` (cells already text)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (a UserError naming the ``eval`` extra
    without matplotlib)."""
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    return require("matplotlib.pyplot")


def caption(fig: Any, command: str, seeds: str, machine_line: str) -> None:
    """Put the provenance under a figure (three short lines, small type)."""
    text = f"command: {command}\nseeds: {seeds}\nmachine: {machine_line}"
    fig.text(0.005, 0.005, text, fontsize=6.5, va="bottom", ha="left", family="monospace")
