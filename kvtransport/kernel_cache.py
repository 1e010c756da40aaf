"""Keep numba's on-disk kernel cache honest across modules.

numba (0.68) accepts a cached kernel when a hash of the text of the one file that defines
it matches. A kernel that calls another module's kernels, or reads its constants, has that
code compiled in, so an edit to the other module alone (gf256.py under rlc's kernels,
policy.py's observation layout under the DDQN's feature kernel) leaves it running the old
code without a word. It happened: DDQN training runs were validated through a kernel with
the previous feature layout compiled in.

The fix goes through numba's documented cache location (``NUMBA_CACHE_DIR``): the cache
lives in a folder named by a digest of every kernel source and of every package module they
import (found by scanning the sources, so a new kernel module is covered without a list to
maintain). Any edit to one of them starts a fresh folder, and every kernel compiles once
(about 15 s for the data path on these machines); edits anywhere else cost nothing. Only
the newest few folders are kept.

Whether a folder is warm: the data path's warm-up (kvtransport.daemons.daemon.warm_up)
leaves a stamp in it (``WARM_STAMP``: the index files numba wrote, the seconds compiling
took) once every kernel a transfer can use is in it; :func:`is_warm` says whether that
stamp is there and every index file it lists still is. A folder without one (just created,
cleared, or warmed by an older version) is cold: the next warm-up compiles and says so.

:func:`configure` runs from ``kvtransport/__init__.py``, before any kernel is defined.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

SUBPACKAGES = ("codecs", "agents", "netem")
"""Folders imported as kvtransport.<name>: beside kvtransport/ in an editable install (the
package-dir mapping), inside it in a regular one."""
KEEP = 3
"""Digest folders kept (the newest by modification time)."""
DIGEST_ENV = ("KVTRANSPORT_GF_KERNEL",)
"""Environment variables that change which code the kernels compile in (a forced GF(2^8)
region kernel, see kvtransport.codecs.gf256): when set, their values join the digest."""
_IMPORT = re.compile(r"^\s*(?:from|import)\s+(kvtransport(?:\.\w+)*)", re.MULTILINE)
_DIGEST_NAME = re.compile(r"[0-9a-f]{16}")


def package_dirs(kvtransport_dir: Path) -> dict[str, Path]:
    """Module prefix -> folder, for kvtransport and its mapped subpackages."""
    out = {"kvtransport": kvtransport_dir}
    for sub in SUBPACKAGES:
        for cand in (kvtransport_dir / sub, kvtransport_dir.parent / sub):
            if cand.is_dir():
                out[f"kvtransport.{sub}"] = cand
                break
    return out


def _module_file(name: str, dirs: dict[str, Path]) -> Path | None:
    """The source file of module ``name`` (kvtransport.x.y), or None if not ours."""
    parts = name.split(".")
    for n in (2, 1):
        prefix = ".".join(parts[:n])
        if prefix in dirs and len(parts) > n:
            path = dirs[prefix].joinpath(*parts[n:])
            for cand in (path.with_suffix(".py"), path / "__init__.py"):
                if cand.is_file():
                    return cand
            return None
    return None


def kernel_sources(dirs: dict[str, Path]) -> list[Path]:
    """Every source defining numba kernels (in any folder of the packages), and the
    package modules they import (transitively), sorted."""
    todo = [
        p
        for folder in dirs.values()
        for p in folder.rglob("*.py")
        if "njit" in p.read_text(encoding="utf-8", errors="replace")
    ]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _IMPORT.findall(path.read_text(encoding="utf-8", errors="replace")):
            dep = _module_file(name, dirs)
            if dep is not None and dep not in seen:
                todo.append(dep)
    return sorted(seen)


def source_digest(files: list[Path], root: Path, env: dict[str, str] | None = None) -> str:
    """16 hex digits over the files' paths (relative to ``root``) and contents, and the
    set variables of DIGEST_ENV in ``env`` (none: the same digest as without them)."""
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    for name in DIGEST_ENV:
        value = (env or {}).get(name)
        if value:
            h.update(f"{name}={value}".encode() + b"\0")
    return h.hexdigest()[:16]


def _default_base() -> Path:
    """~/.cache/kvtransport/numba, or a per-user temp folder when home is not writable
    (an unprivileged daemon user without a home)."""
    home = Path.home()
    if os.access(home, os.W_OK):
        return home / ".cache" / "kvtransport" / "numba"
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"kvtransport-numba-{uid}"


def prune(base: Path, keep: int = KEEP) -> None:
    """Remove all but the ``keep`` newest digest folders in ``base`` (other folders stay)."""
    try:
        olds = sorted(
            (p for p in base.iterdir() if p.is_dir() and _DIGEST_NAME.fullmatch(p.name)),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )[keep:]
    except OSError:
        return
    for p in olds:
        shutil.rmtree(p, ignore_errors=True)


def configure(kvtransport_dir: Path) -> Path | None:
    """Point numba's cache at the folder of the current kernel sources; returns it.

    A ``NUMBA_CACHE_DIR`` the user set is the base the digest folder goes in; one that
    already names this digest (inherited from a parent process) is kept as it is, unless
    this process cannot write there (a child running as another user): then the default
    base. Does nothing (None) if the sources cannot be read or no folder is writable."""
    dirs = package_dirs(kvtransport_dir)
    try:
        digest = source_digest(kernel_sources(dirs), kvtransport_dir.parent, dict(os.environ))
    except OSError:
        return None
    current = os.environ.get("NUMBA_CACHE_DIR")
    candidates = []
    if current:  # inherited from a parent process (already this digest), or the user's base
        candidates.append(Path(current) if Path(current).name == digest else Path(current) / digest)
    candidates.append(_default_base() / digest)  # e.g. a child running as another user
    for target in candidates:
        try:
            fresh = not target.exists()
            target.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if not os.access(target, os.W_OK | os.X_OK):
            continue
        if fresh:
            prune(target.parent)
        break
    else:
        return None
    with contextlib.suppress(OSError):
        os.utime(target)  # in use: pruning keeps the recently used folders
    os.environ["NUMBA_CACHE_DIR"] = str(target)
    config: Any = sys.modules.get("numba.core.config")
    if config is not None:  # numba imported first: its config has read the variable already
        config.CACHE_DIR = str(target)
    return target


WARM_STAMP = "warm-up.json"
"""The stamp the data path's warm-up leaves in a digest folder it filled (module docstring)."""
FIRST_COMPILE_S = 120.0
"""What a first compile of the data path's kernels is announced to take when no folder of
this base says how long one took here (a rough figure for a 2-core host, on the side of
too long: docs/results.md has the measured range)."""


def current() -> Path | None:
    """The digest folder numba caches into in this process (:func:`configure`'s), or None
    when there is none (numba then caches beside the sources, or nowhere)."""
    folder = os.environ.get("NUMBA_CACHE_DIR")
    if not folder or not _DIGEST_NAME.fullmatch(Path(folder).name):
        return None
    return Path(folder)


def _stamp(folder: Path) -> dict[str, Any] | None:
    try:
        stamp = json.loads((folder / WARM_STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def is_warm(folder: Path | None) -> bool:
    """Does ``folder`` hold every kernel the warm-up put there: its stamp, and every index
    file the stamp lists? False for None (no cache folder: every process compiles)."""
    stamp = None if folder is None else _stamp(folder)
    if folder is None or stamp is None or not isinstance(stamp.get("index"), list):
        return False
    return bool(stamp["index"]) and all((folder / str(f)).is_file() for f in stamp["index"])


def record_warm(folder: Path | None, seconds: float) -> None:
    """Stamp ``folder`` warm: the index files in it now, and ``seconds`` (what compiling
    them took, the next first compile's estimate). Best effort: an unwritable folder
    stays cold."""
    if folder is None:
        return
    index = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.nbi"))
    text = json.dumps({"index": index, "compile_s": round(seconds, 1)})
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".warm-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, folder / WARM_STAMP)
        except OSError:
            Path(tmp).unlink(missing_ok=True)


def compile_estimate(folder: Path | None) -> float:
    """The seconds a first compile into ``folder`` is announced to take: the latest one
    stamped in a digest folder beside it (the same host, an earlier version of the
    kernels), else ``FIRST_COMPILE_S``."""
    best: tuple[float, float] | None = None
    if folder is not None:
        with contextlib.suppress(OSError):
            for p in folder.parent.iterdir():
                stamp = _stamp(p) if _DIGEST_NAME.fullmatch(p.name) else None
                seconds = None if stamp is None else stamp.get("compile_s")
                if isinstance(seconds, int | float) and seconds > 0:
                    mtime = (p / WARM_STAMP).stat().st_mtime
                    if best is None or mtime > best[0]:
                        best = (mtime, float(seconds))
    return FIRST_COMPILE_S if best is None else best[1]
