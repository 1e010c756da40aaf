"""Refresh the measured tables in docs/results.md from the files the evaluations wrote.

docs/results.md is prose written by people around tables written by scripts. Each table
sits between two markers naming the file it comes from::

    <!-- table: results/evaluate/fig1_utility.md -->
    ...replaced by that file's content...
    <!-- /table -->

so a table on the page is always a verbatim copy of what the command named next to it
wrote, never numbers typed by hand. Run it after re-running an evaluation:

    .venv/bin/python scripts/evaluate.py            # or --only N
    .venv/bin/python scripts/results_page.py        # refresh docs/results.md

``--check`` changes nothing and exits 1 when the page is stale (a table differs from its
file) or a named file is missing.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"(<!-- table: (?P<src>[^ ]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.DOTALL)


def refresh(page: str, root: Path) -> tuple[str, list[str]]:
    """The page with every marked table replaced by its source file; and the problems
    (missing source files), one line each."""
    problems: list[str] = []

    def fill(m: re.Match[str]) -> str:
        src = root / m["src"]
        if not src.is_file():
            problems.append(f"missing {m['src']} (run the command that writes it)")
            return m.group(0)
        return m.group(1) + src.read_text().rstrip("\n") + "\n" + m.group(4)

    return MARKER.sub(fill, page), problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--page", default=str(ROOT / "docs" / "results.md"), help="the page")
    p.add_argument("--check", action="store_true", help="report staleness, change nothing")
    args = p.parse_args(argv)
    page_path = Path(args.page)
    if not page_path.is_file():
        raise SystemExit(f"no page at {page_path}")
    old = page_path.read_text()
    new, problems = refresh(old, ROOT)
    for line in problems:
        print(line, file=sys.stderr)
    n = len(MARKER.findall(old))
    if args.check:
        stale = new != old
        print(f"{n} tables: {'stale' if stale else 'up to date'}")
        return 1 if stale or problems else 0
    page_path.write_text(new)
    print(f"refreshed {n} tables in {page_path}" + (" (some missing)" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
