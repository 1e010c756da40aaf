"""``--config FILE``: the daemons' options from a TOML file, with the flags' own names.

::

    # kvtransport.toml: top-level keys apply to the command that reads the file,
    # a table named after a command only to that command (one file for both daemons)
    key = "/etc/kvtransport/psk.hex"
    metrics-port = 9464

    [sender-daemon]
    rate-mbps = 200
    policy = "adaptive"
    stats = "/var/log/kvtransport/sender.jsonl"

    [receiver-daemon]
    listen = "0.0.0.0:9400"
    out-dir = "/var/lib/kvtransport/results"
    no-gro = true

A key is a long option without its dashes (``rate-mbps`` or ``rate_mbps``); its value is
checked and converted exactly as the flag's text would be (type, choices). A switch
(``--no-gro``) takes true or false; an option with an optional value (``--stats``,
``--realtime``) takes true for its bare form. Flags on the command line override the
file. Anything unknown or mistyped is a one-line UserError naming the file and key.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from kvtransport.errors import UserError

_SKIP = {"help", "config"}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Long option name without dashes -> its action (positionals and --help excluded)."""
    out = {}
    for action in parser._actions:
        if action.dest in _SKIP:
            continue
        for opt in action.option_strings:
            if opt.startswith("--"):
                out[opt[2:]] = action
    return out


def _convert(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    where = f"config {path}: {key}"
    if isinstance(value, dict | list):
        raise UserError(f"{where} must be a single value")
    if action.nargs == 0:  # store_true / store_false / count
        if isinstance(action, argparse._CountAction):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UserError(f"{where} must be a count (0, 1, 2...)")
            return value
        if not isinstance(value, bool):
            raise UserError(f"{where} is a switch: true or false")
        return action.const if value else action.default
    if isinstance(value, bool):
        if action.nargs == "?" and action.const is not None:
            return action.const if value else action.default
        raise UserError(f"{where} needs a value, not {str(value).lower()}")
    try:  # exactly what the flag's text would give
        out = action.type(str(value)) if callable(action.type) else str(value)
    except argparse.ArgumentTypeError as exc:  # a bounded type says what it wants
        raise UserError(f"{where}: {exc}") from None
    except (TypeError, ValueError):
        kind = getattr(action.type, "__name__", "value")
        raise UserError(f"{where} must be a {kind}, not {value!r}") from None
    if action.choices is not None and out not in action.choices:
        raise UserError(f"{where} must be one of {', '.join(map(str, action.choices))}")
    return out


def config_defaults(path: str, parser: argparse.ArgumentParser, command: str) -> dict[str, Any]:
    """The defaults ``--config path`` gives the options of ``command`` (see the module doc)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"config {path}: no such file") from None
    except OSError as exc:
        raise UserError(f"cannot read config {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"config {path} is not TOML: {exc}") from None
    options = _options(parser)
    values = {k: v for k, v in data.items() if not isinstance(v, dict)}
    section = data.get(command, {})
    if not isinstance(section, dict):
        raise UserError(f"config {path}: {command} must be a table")
    values.update(section)
    out: dict[str, Any] = {}
    for raw_key, value in values.items():
        key = raw_key.replace("_", "-")
        action = options.get(key)
        if action is None:
            known = ", ".join(sorted(options))
            raise UserError(f"config {path}: unknown key {raw_key!r} for {command} ({known})")
        out[action.dest] = _convert(path, raw_key, action, value)
    return out


def apply_config(
    parser: argparse.ArgumentParser, subparser: argparse.ArgumentParser, argv: list[str] | None
) -> argparse.Namespace:
    """Parse ``argv`` again with ``--config``'s values as the subcommand's defaults."""
    args = parser.parse_args(argv)
    subparser.set_defaults(**config_defaults(args.config, subparser, args.command))
    return parser.parse_args(argv)
