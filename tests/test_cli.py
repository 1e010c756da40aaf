"""The console command explains itself and rejects bad arguments with one line."""

import subprocess
import sys

from kvtransport.cli import build_parser


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtransport", *args], capture_output=True, text=True, timeout=120
    )


def test_top_level_help_lists_every_subcommand():
    out = _run("--help")
    assert out.returncode == 0
    parser = build_parser()
    names = parser._subparsers._group_actions[0].choices.keys()  # noqa: SLF001
    for name in names:
        assert name in out.stdout


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
