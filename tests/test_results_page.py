"""scripts/results_page.py: tables on docs/results.md are copies of the files named next to
them, refreshed in place; prose around them is never touched."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import results_page  # noqa: E402

PAGE = """# Page
Prose before, with numbers 0.5 written by a person.

<!-- table: out/a.md -->
| old | table |
<!-- /table -->

Between.
<!-- table: out/b.md -->
<!-- /table -->
After.
"""


def test_marked_tables_are_replaced_by_their_files_and_prose_is_kept(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.md").write_text("| new | table |\n|---|---|\n| 1 | 2 |\n\n")
    (tmp_path / "out" / "b.md").write_text("B content")
    new, problems = results_page.refresh(PAGE, tmp_path)
    assert problems == []
    assert "| old | table |" not in new
    assert "<!-- table: out/a.md -->\n| new | table |\n|---|---|\n| 1 | 2 |\n<!-- /table -->" in new
    assert "<!-- table: out/b.md -->\nB content\n<!-- /table -->\nAfter." in new
    assert new.startswith("# Page\nProse before, with numbers 0.5 written by a person.\n")
    assert results_page.refresh(new, tmp_path)[0] == new  # idempotent


def test_a_missing_source_is_reported_and_its_table_left_alone(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "b.md").write_text("B")
    new, problems = results_page.refresh(PAGE, tmp_path)
    assert problems == ["missing out/a.md (run the command that writes it)"]
    assert "| old | table |" in new and "B\n<!-- /table -->" in new


def test_check_exits_1_on_a_stale_page_and_changes_nothing(tmp_path):
    page = tmp_path / "results.md"
    page.write_text("<!-- table: README.md -->\nstale\n<!-- /table -->\n")
    script = ROOT / "scripts" / "results_page.py"
    p = subprocess.run([sys.executable, str(script), "--page", str(page), "--check"],
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 1 and "stale" in p.stdout
    assert page.read_text().endswith("stale\n<!-- /table -->\n")
    p = subprocess.run([sys.executable, str(script), "--page", str(page)],
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 0 and "# kvtransport" in page.read_text()
    p = subprocess.run([sys.executable, str(script), "--page", str(page), "--check"],
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 0 and "up to date" in p.stdout
