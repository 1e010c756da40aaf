"""Keep numba's on-disk kernel cache honest across modules.

``@njit(cache=True)`` keys a cached kernel on the stamp (mtime and size) of the one file
that defines it. A kernel that calls another module's kernels, or reads its constants, has
that code compiled into it, so an edit to the other module alone (a ``git pull`` in an
editable install that changes only gf256.py) would leave it running the old code without a
word. Each such module calls :func:`depends_on` before it defines its kernels: when a file
it compiles in is newer than its own, its own mtime moves up to match, numba sees a new
stamp and recompiles. The cost is a few ``stat`` calls at import.
"""

from __future__ import annotations

import os


def depends_on(module_file: str, *dependency_files: str) -> bool:
    """Make ``module_file`` no older than any of ``dependency_files``; True if it moved.

    Read-only installs (and files that vanished) are left alone: there every file arrives
    together from one package, so nothing can be stale."""
    try:
        own = os.stat(module_file).st_mtime_ns
        newest = max(os.stat(f).st_mtime_ns for f in dependency_files)
    except (OSError, ValueError):
        return False
    if newest <= own:
        return False
    try:
        os.utime(module_file, ns=(newest, newest))
    except OSError:
        return False
    return True
