"""The console command explains itself and rejects bad arguments with one line."""

import re
import subprocess
import sys
from pathlib import Path

from kvtransport.cli import build_parser


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtransport", *args], capture_output=True, text=True, timeout=120
    )


def test_the_readme_names_exactly_the_subcommands_there_are():
    """The README's list of subcommands (a user's map) against the parser: a command added
    without documentation, or documented after it was removed, fails here."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index("Everything else is a subcommand")
    listed = readme[start : readme.index("\n\n", start)]
    documented = set(re.findall(r"`([a-z][a-z-]*)", listed)) | {"demo"}  # demo: "make demo"
    parser = build_parser()
    names = set(parser._subparsers._group_actions[0].choices)  # noqa: SLF001
    assert documented == names, (sorted(documented - names), sorted(names - documented))
    out = _run("--help")
    assert out.returncode == 0 and all(n in out.stdout for n in names)


def test_every_subcommand_help_explains_itself():
    parser = build_parser()
    choices = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    for name, sub in choices.items():
        text = sub.format_help()
        assert len(text.splitlines()) >= 3, f"{name} --help is too thin"
        assert sub.description and len(sub.description) > 20, f"{name} lacks a description"


def test_unknown_subcommand_is_one_line_error():
    out = _run("no-such-command")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) <= 2


def test_a_race_dir_others_may_write_to_is_refused_in_one_line(tmp_path):
    """A mirror planted in the receiver daemon's --race-dir would be loaded as the
    sender's cache: a folder other users may write to (or none) is refused at start."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    for where, needle in ((shared, "writable by other users"), (tmp_path / "none", "not a dir")):
        out = _run("receiver-daemon", "--insecure", "--listen", "127.0.0.1:0", "--control",
                   f"ipc://{tmp_path}/c.ipc", "--publish", f"ipc://{tmp_path}/p.ipc",
                   "--race-dir", str(where))  # fmt: skip
        assert out.returncode != 0 and "Traceback" not in out.stderr
        assert needle in out.stderr and len(out.stderr.strip().splitlines()) <= 2, out.stderr


def test_answer_races_only_a_context_as_it_is(tmp_path):
    """--race-dir races the cache of --context's tokens: with a card, or with a degraded
    or completed cache, there is nothing to race, and the user is told in one line."""
    (tmp_path / "ctx.txt").write_text("Some context.")
    for extra in (("--card", str(tmp_path / "x.card")),
                  ("--context", str(tmp_path / "ctx.txt"), "--drop", "0.5")):  # fmt: skip
        out = _run("answer", *extra, "--question", "Why?", "--race-dir", str(tmp_path))
        assert out.returncode != 0 and "Traceback" not in out.stderr
        assert "--race-dir goes with --context" in out.stderr, out.stderr
