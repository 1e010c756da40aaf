"""kvtransport: FEC-protected KV-cache transport for multi-agent LLM handoffs."""

import os as _os
import tempfile as _tempfile

__version__ = "0.1.0"


def _numba_cache_fallback() -> None:
    """Give numba's on-disk cache a writable home when the package folder is read-only.

    ``@njit(cache=True)`` writes next to the source, else in the user's cache folder; an
    unprivileged user without a home (e.g. ``nobody`` running a daemon) has neither and
    numba raises at import. Point it at a per-user temp folder instead, before any kernel
    is compiled (every kernel lives in a subpackage, so this runs first).
    """
    if "NUMBA_CACHE_DIR" in _os.environ:
        return
    here = _os.path.dirname(_os.path.abspath(__file__))
    if _os.access(here, _os.W_OK) and _os.access(_os.path.expanduser("~"), _os.W_OK):
        return
    uid = _os.getuid() if hasattr(_os, "getuid") else 0
    _os.environ["NUMBA_CACHE_DIR"] = _os.path.join(
        _tempfile.gettempdir(), f"kvtransport-numba-{uid}"
    )


_numba_cache_fallback()
