"""The pre-shared key: where it comes from, how it is made, and the explicit insecure mode.

Every datagram is sealed with a key both hosts share (kvtransport.core.wire), so every program
that sends or receives needs one. :func:`resolve_key` decides, in this order:

1. ``--insecure``: no key, plaintext datagrams anyone can read or forge; logged loudly.
2. ``--key-file FILE`` (or ``--key FILE``): the key in FILE, as hex text (whitespace
   around it ignored). The CLI also reads hex from standard input (``--key-stdin``); the
   key in hex on the command line (``--key HEX``) is refused, since every local user can
   read a command line in ``ps``; the Python API's ``key=`` still takes hex.
3. ``$KVT_KEY``: the key in hex, from the environment.
4. Nothing given: the default key file, :func:`default_key_path`
   (``$KVT_KEY_FILE``, else ``$XDG_CONFIG_HOME/kvtransport/key``, else
   ``~/.config/kvtransport/key``). If it does not exist, 32 random bytes are written there
   as hex, in a file only its owner may read or write (mode 0600, directory 0700).

Sharing the key with the peer host: both ends must hold the same file. Copy it over a
channel you trust and keep its mode, e.g. ``scp -p ~/.config/kvtransport/key
peer:.config/kvtransport/key`` (create the directory there first with ``mkdir -m 700 -p
~/.config/kvtransport``), or pass ``--key-file`` on both hosts.

Keys shorter than 16 bytes (or longer than 64) are refused, and so is a key file that
is not strict hex, is not a regular file (a FIFO would block), is owned by another user,
or that other users may read or write; every refusal is a one-line :class:`UserError`.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from kvtransport.core.wire import MAX_KEY_BYTES, MIN_KEY_BYTES
from kvtransport.errors import UserError

log = logging.getLogger("kvtransport.keys")

GENERATED_KEY_BYTES = 32
KEY_ENV = "KVT_KEY"
"""The environment variable that may hold the key in hex."""
INSECURE_WARNING = (
    "INSECURE: running without a key (--insecure): datagrams are plaintext and "
    "unauthenticated; anyone on the path can read the cache and forge or end transfers"
)


def default_key_path() -> Path:
    """The key file used when none is named (module docstring)."""
    env = os.environ.get("KVT_KEY_FILE")
    if env:
        return Path(env)
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "kvtransport" / "key"


def check_key(key: bytes, source: str) -> bytes:
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise UserError(
            f"{source}: the key must be {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes "
            f"(got {len(key)}); make one with: head -c 32 /dev/urandom | xxd -p -c 64"
        )
    return key


def parse_hex(text: str | bytes, source: str) -> bytes:
    """The key written as hex digits in ``text`` (whitespace around it ignored); a
    one-line UserError naming ``source`` for anything else (a passphrase, a typo)."""
    try:
        raw = text.decode("ascii") if isinstance(text, bytes) else text
        key = bytes.fromhex(raw.strip())
    except (UnicodeDecodeError, ValueError):
        raise UserError(
            f"{source} is not a key in hex digits; make one with: "
            "head -c 32 /dev/urandom | xxd -p -c 64"
        ) from None
    return check_key(key, source)


def read_key_file(path: str | Path) -> bytes:
    """The key in ``path``, hex text. Refused when the file is missing, unreadable, not a
    regular file, owned by another user, open to other users, not hex, or the key's size
    is off."""
    from kvtransport.core.replay import read_regular_file

    p = Path(path)
    try:
        st = p.stat()
        raw = read_regular_file(p.resolve())
    except OSError as exc:
        raise UserError(f"cannot read key file {p}: {exc.strerror}") from None
    if st.st_uid != os.getuid():
        raise UserError(
            f"key file {p} belongs to another user (uid {st.st_uid}); use a key file you own"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise UserError(
            f"key file {p} is accessible by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"run: chmod 600 {p}"
        )
    return parse_hex(raw, f"key file {p}")


def generate_key_file(path: str | Path) -> bytes:
    """Write a new random key to ``path`` (hex, mode 0600; a missing directory is made
    0700) and return it. Never overwrites: the file appears whole or not at all (written
    aside, then hard-linked into place), and when another process made it first, that
    process's key is read and returned, so two programs started together agree."""
    p = Path(path)
    key = secrets.token_bytes(GENERATED_KEY_BYTES)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, p)
        except FileExistsError:
            return read_key_file(p)
    except OSError as exc:
        raise UserError(f"cannot create key file {p}: {exc.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return key


def parse_key(spec: str) -> bytes:
    """``--key``: an existing file holding the key, or the key itself in hex."""
    if spec and Path(spec).is_file():
        return read_key_file(spec)
    try:
        key = bytes.fromhex(spec)
    except ValueError:
        raise UserError(f"--key {spec!r} is neither a key file nor hex digits") from None
    return check_key(key, "--key")


def resolve_key(
    key_file: str | None = None, key: str | None = None, insecure: bool = False
) -> bytes | None:
    """The pre-shared key a command runs with, or None with ``insecure`` (module
    docstring for the order). Generating the default key file is logged with the way to
    share it."""
    if insecure:
        if key_file is not None or key is not None:
            raise UserError("--insecure runs without a key; drop --key/--key-file or --insecure")
        log.warning(INSECURE_WARNING)
        return None
    if key_file is not None and key is not None:
        raise UserError("give --key-file or --key, not both")
    if key_file is not None:
        return read_key_file(key_file)
    if key is not None:
        return parse_key(key)
    env = os.environ.get(KEY_ENV)
    if env:
        return parse_hex(env, f"${KEY_ENV}")
    path = default_key_path()
    if path.exists():
        return read_key_file(path)
    new = generate_key_file(path)
    log.warning(
        "generated a new pre-shared key in %s (mode 0600); the peer host needs the same "
        "file: scp -p %s PEER:%s (or pass --key-file on both hosts)",
        path,
        path,
        path,
    )
    return new
