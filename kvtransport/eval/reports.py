"""A per-prompt evaluation's report: the prompts measured with a progress bar, then the
JSON document, the plot and the table."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtransport.extras import require


def run_prompts(
    samples: list[Any], measure: Callable[[Any], dict[str, Any]]
) -> list[dict[str, Any]]:
    """``measure(sample)`` for every sample, with a progress bar on stderr."""
    tqdm = require("tqdm").tqdm

    return [measure(s) for s in tqdm(samples, desc="prompts", file=sys.stderr)]


def save_report(
    out_dir: str,
    name: str,
    meta: dict[str, Any],
    summary: dict[str, Any],
    records: list[dict[str, Any]],
    plot_to: Callable[[Path], None],
    table: str,
) -> None:
    """Write NAME.json (meta, summary, records) and NAME.png (``plot_to(path)``) into
    ``out_dir``, then print the table and where the files went."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "records": records}, indent=1)
    )
    plot_to(out / f"{name}.png")
    print(table)
    print(f"wrote {out / f'{name}.json'} and {out / f'{name}.png'}")
