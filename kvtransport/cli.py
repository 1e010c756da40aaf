"""The `kvtransport` console command: discovers subcommands in kvtransport.commands.

Subcommand modules are imported only to build the parser; their heavy imports live
inside ``run`` so ``kvtransport --help`` and the data-plane daemons start fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from types import ModuleType

from kvtransport import commands
from kvtransport.bounds import OneLineArgumentParser
from kvtransport.errors import UserError

# Order in `kvtransport --help`; subcommands not listed follow alphabetically.
PREFERRED_ORDER = [
    "demo",
    "simulate",
    "send",
    "recv",
    "sender-daemon",
    "receiver-daemon",
    "submit",
    "status",
    "cancel",
    "netem",
    "prefill",
    "answer",
    "card",
    "profile",
    "train",
    "fit-utility",
]

DESCRIPTION = """\
kvtransport ships an LLM's already-computed KV cache from one agent to the next over a
lossy link, most valuable blocks first, protected by a sliding-window erasure code
(RFC 8681) whose repair rate a Double-DQN policy schedules against the receiver's
time-to-first-token deadline. The receiver injects whatever arrived as a partial cache.
"""


class _ArgumentParser(OneLineArgumentParser):
    """The command's parser: one-line errors, and its subcommands' parsers by name."""

    commands: dict[str, _ArgumentParser]  # name -> subparser (build_parser)


def _command_modules() -> list[ModuleType]:
    mods = []
    for info in pkgutil.iter_modules(commands.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"kvtransport.commands.{info.name}")
        if hasattr(mod, "NAME") and hasattr(mod, "run"):
            mods.append(mod)

    def key(mod: ModuleType) -> tuple[int, str]:
        name = mod.NAME
        rank = PREFERRED_ORDER.index(name) if name in PREFERRED_ORDER else len(PREFERRED_ORDER)
        return rank, name

    return sorted(mods, key=key)


def build_parser() -> _ArgumentParser:
    """Build the full argument parser (used by main and by the help tests)."""
    parser = _ArgumentParser(
        prog="kvtransport",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_ArgumentParser)
    parser.commands = sub.choices  # name -> subparser (--config sets its defaults)
    for mod in _command_modules():
        p = sub.add_parser(
            mod.NAME,
            help=mod.HELP,
            description=getattr(mod, "DESCRIPTION", mod.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


EXIT_BROKEN_PIPE = 128 + 13
"""A reader closed our standard output (``kvtransport send ... | head -1``): the status a
Unix tool killed by SIGPIPE leaves."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvtransport` command; returns the exit status (a usage error
    found by argparse, such as an option value out of its bounds, returns 2 too, after
    its one-line message; ``--help`` returns 0). A reader that closes standard output
    early ends it quietly with ``EXIT_BROKEN_PIPE``, as Unix tools end."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then ours to handle
        return status
    except BrokenPipeError:
        # what is still buffered for the closed pipe goes nowhere (the interpreter's
        # final flush would otherwise print a traceback-like warning)
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # not a file descriptor (an embedding's stream)
            pass
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    try:
        parser = build_parser()
    except UserError as exc:  # an environment setting the commands' modules refuse on import
        print(f"kvtransport: error: {exc}", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        if getattr(args, "config", None):
            from kvtransport.daemons.config import apply_config

            args = apply_config(parser, parser.commands[args.command], argv)
        return int(args._run(args) or 0)
    except UserError as exc:
        print(f"kvtransport {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvtransport {args.command}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        from kvtransport.extras import missing_extra_message

        msg = missing_extra_message(exc)
        if msg is None:
            raise
        print(f"kvtransport {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
