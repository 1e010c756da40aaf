"""Repair schemes by name: the registry (the interface is kvtransport.core.schemes.base).

Every module of this package but ``base`` defines one scheme as ``SCHEME`` and is
registered when the package is imported: adding a code is a module here plus, when its
repairs travel in a datagram type of their own, that type in kvtransport.core.wire's
``DatagramType`` and ``SCHEME_TYPES``. :func:`register` adds a scheme defined elsewhere (a test, an
experiment), with its wire type if the wire format does not list it.
"""

from __future__ import annotations

import importlib
import pkgutil

from kvtransport.core import wire
from kvtransport.core.schemes.base import (
    OWED_NONE,
    OWED_REPORTED,
    OWED_SEGMENTS,
    BadFEC,
    ReceiverRepair,
    RepairScheme,
    SenderRepair,
    SymbolStore,
    WindowDecoder,
)
from kvtransport.errors import UserError

__all__ = [
    "OWED_NONE",
    "OWED_REPORTED",
    "OWED_SEGMENTS",
    "BadFEC",
    "ReceiverRepair",
    "RepairScheme",
    "SenderRepair",
    "SymbolStore",
    "WindowDecoder",
    "by_wire_type",
    "get",
    "names",
    "register",
    "unregister",
    "window",
]

_SCHEMES: dict[str, RepairScheme] = {}
_BY_TYPE: dict[int, RepairScheme] = {}


def register(scheme: RepairScheme) -> RepairScheme:
    """Make ``scheme`` available by its name (and its repairs by their wire type).
    ValueError if the name or the wire type is taken, or the type is one the transport
    itself uses."""
    if not scheme.name or scheme.name in _SCHEMES:
        raise ValueError(f"repair scheme name {scheme.name!r} is empty or taken")
    if scheme.window:
        if scheme.wire_type is None:
            raise ValueError("a window scheme needs a wire type for its repairs")
        taken = [s.name for s in _SCHEMES.values() if s.window]
        if taken:
            raise ValueError(f"{taken[0]!r} is already the window scheme")
    t = scheme.wire_type
    if t is not None:
        if t in _BY_TYPE:
            raise ValueError(f"wire type {t} is already {_BY_TYPE[t].name!r}'s")
        if wire.is_listed_type(t) and t not in wire.SCHEME_TYPES:
            raise ValueError(f"wire type {t} is the transport's own, not a repair scheme's")
        wire.accept_type(t)
        _BY_TYPE[t] = scheme
    _SCHEMES[scheme.name] = scheme
    return scheme


def unregister(name: str) -> None:
    """Remove a scheme :func:`register` added (a wire type it brought is refused again)."""
    scheme = _SCHEMES.pop(name)
    t = scheme.wire_type
    if t is not None:
        del _BY_TYPE[t]
        wire.refuse_type(t)


def get(name: str) -> RepairScheme:
    """The scheme registered as ``name``; a one-line UserError if there is none."""
    try:
        return _SCHEMES[name]
    except KeyError:
        raise UserError(f"unknown repair scheme {name!r}; registered: {names()}") from None


def names() -> str:
    """The registered schemes' names, sorted, comma-separated (for messages)."""
    return ", ".join(sorted(_SCHEMES))


def window() -> RepairScheme:
    """The window scheme (the one registered with ``window`` set): its decoder is the
    receiver's window decoder (kvtransport.core.schemes.base)."""
    for scheme in _SCHEMES.values():
        if scheme.window:
            return scheme
    raise RuntimeError("no window scheme is registered")


def by_wire_type(dtype: int) -> RepairScheme | None:
    """The scheme whose repairs have datagram type ``dtype`` (None: not a scheme's)."""
    return _BY_TYPE.get(dtype)


def _register_builtins() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name != "base" and not info.name.startswith("_"):
            register(importlib.import_module(f"{__name__}.{info.name}").SCHEME)


_register_builtins()
