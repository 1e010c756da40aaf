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

Identities (kvtransport.core.wire, "Peers"): a host's static X25519 key pair, made by
:func:`generate_identity` (``kvtransport keygen``): the private key in hex in a file of the
same rules as a key file (default :func:`default_identity_path`), the public key in hex in
``FILE.pub`` beside it, which may be world-readable and is all a peer needs. A sender names
its receiver's public key file, a receiver lists the public key files (or directories of
``*.pub`` files) of the senders it allows; :func:`peer_keys` makes their pairwise secrets.
With identities the pre-shared key is mixed in only when one is named (``--key-file``,
``--key``, ``--key-stdin``, ``$KVT_KEY``): the default key file is then neither read nor
made.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from kvtransport.core.wire import (
    MAX_KEY_BYTES,
    MAX_PEERS,
    MIN_KEY_BYTES,
    PUBLIC_KEY_BYTES,
    PeerKeys,
    pairwise,
)
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


def _read_text(p: Path, what: str) -> bytes:
    """The bytes of ``p``, a regular file (never a FIFO's wait); one line naming ``what``
    when it cannot be read."""
    from kvtransport.core.replay import read_regular_file

    try:
        return read_regular_file(p.resolve())
    except OSError as exc:
        raise UserError(f"cannot read {what} {p}: {exc.strerror}") from None


def _read_private(path: str | Path, what: str) -> bytes:
    """The text of a secret file ``path``: refused when it is missing, unreadable, not a
    regular file, owned by another user or open to other users."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise UserError(f"cannot read {what} {p}: {exc.strerror}") from None
    raw = _read_text(p, what)
    if st.st_uid != os.getuid():
        raise UserError(
            f"{what} {p} belongs to another user (uid {st.st_uid}); use a {what} you own"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise UserError(
            f"{what} {p} is accessible by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"run: chmod 600 {p}"
        )
    return raw


def read_key_file(path: str | Path) -> bytes:
    """The key in ``path``, hex text. Refused when the file is missing, unreadable, not a
    regular file, owned by another user, open to other users, not hex, or the key's size
    is off."""
    return parse_hex(_read_private(path, "key file"), f"key file {Path(path)}")


def generate_key_file(path: str | Path) -> bytes:
    """Write a new random key to ``path`` (hex, mode 0600; a missing directory is made
    0700) and return it. Never overwrites: the file appears whole or not at all (written
    aside, then hard-linked into place), and when another process made it first, that
    process's key is read and returned, so two programs started together agree."""
    p = Path(path)
    key = secrets.token_bytes(GENERATED_KEY_BYTES)
    if not _write_secret(p, key, "key file"):
        return read_key_file(p)
    return key


def _write_secret(p: Path, secret: bytes, what: str) -> bool:
    """Write ``secret`` to ``p`` as hex (mode 0600; a missing directory is made 0700),
    whole or not at all: written aside, fsynced, then hard-linked into place. False when
    ``p`` already exists (nothing replaced); a failure to write is one line (UserError)."""
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret.hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, p)
        except FileExistsError:
            return False
    except OSError as exc:
        raise UserError(f"cannot create {what} {p}: {exc.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return True


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


IDENTITY_HINT = "make one with: kvtransport keygen"


def default_identity_path() -> Path:
    """The identity file used when none is named: beside the default key file's directory
    (``$XDG_CONFIG_HOME/kvtransport/identity``, else ``~/.config/kvtransport/identity``)."""
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "kvtransport" / "identity"


def public_path(identity: str | Path) -> Path:
    """Where an identity file's public key lives: ``FILE.pub``."""
    p = Path(identity)
    return p.with_name(p.name + ".pub")


def _exact_hex(raw: bytes, size: int, source: str) -> bytes:
    """``raw`` as strict hex of exactly ``size`` bytes; one line naming ``source`` else."""
    try:
        value = bytes.fromhex(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        value = b""
    if len(value) != size:
        raise UserError(f"{source} is not {size} bytes in hex digits; {IDENTITY_HINT}")
    return value


def read_identity(path: str | Path) -> X25519PrivateKey:
    """The X25519 private key in ``path`` (hex, the rules of a key file)."""
    raw = _read_private(path, "identity file")
    return X25519PrivateKey.from_private_bytes(
        _exact_hex(raw, PUBLIC_KEY_BYTES, f"identity file {Path(path)}")
    )


def read_public(path: str | Path) -> bytes:
    """The X25519 public key in ``path`` (hex; any mode: it is public)."""
    p = Path(path)
    return _exact_hex(_read_text(p, "public key file"), PUBLIC_KEY_BYTES, f"public key file {p}")


def allowed_publics(paths: list[str]) -> list[tuple[Path, bytes]]:
    """The public keys ``paths`` name: each a public key file, or a directory whose
    ``*.pub`` files are read (an empty one refused); at most ``MAX_PEERS`` distinct."""
    found: dict[bytes, Path] = {}
    for name in paths:
        p = Path(name)
        files = sorted(p.glob("*.pub")) if p.is_dir() else [p]
        if not files:
            raise UserError(f"--allow-pub {p}: a directory without *.pub files")
        for f in files:
            found.setdefault(read_public(f), f)
    if len(found) > MAX_PEERS:
        raise UserError(f"--allow-pub names {len(found)} public keys; at most {MAX_PEERS}")
    return [(f, pub) for pub, f in found.items()]


def generate_identity(path: str | Path) -> bytes:
    """Write a new X25519 key pair: the private key to ``path`` (hex, mode 0600, a missing
    directory made 0700) and the public key to :func:`public_path` (hex, mode 0644); return
    the public key. Never overwrites: an existing identity file is refused (its public key
    file is written again from it when missing)."""
    p = Path(path)
    if p.exists() or p.is_symlink():
        own = read_identity(p).public_key().public_bytes_raw()
        if not public_path(p).exists():
            _write_public(p, own)
        raise UserError(f"{p} exists (public key {own.hex()} in {public_path(p)}); not replaced")
    private = X25519PrivateKey.generate()
    if not _write_secret(p, private.private_bytes_raw(), "identity file"):
        raise UserError(f"{p} appeared while writing; not replaced")
    public = private.public_key().public_bytes_raw()
    _write_public(p, public)
    return public


def _write_public(identity: Path, public: bytes) -> None:
    """The public key beside ``identity`` (hex, mode 0644), written whole (a failure is
    one line: AtomicWriteError)."""
    from kvtransport.atomic import atomic_write

    atomic_write(public_path(identity), (public.hex() + "\n").encode(), mode=0o644)


def peer_keys(
    identity: str | Path | None, peers: list[tuple[Path, bytes]], *, sending: bool,
    psk: bytes | None,
) -> PeerKeys:  # fmt: skip
    """The :class:`PeerKeys` of this host's identity (``identity``, else the default
    identity file) with ``peers`` (public key files and keys): a sender's one receiver, or
    a receiver's allowed senders; ``psk`` mixed in when given."""
    path = default_identity_path() if identity is None else Path(identity)
    if identity is None and not path.exists():
        raise UserError(f"no identity file {path}: {IDENTITY_HINT} (or name one with --identity)")
    own = read_identity(path)
    pairs = []
    for f, pub in peers:
        try:
            pairs.append(pairwise(own, pub, sending=sending, psk=psk))
        except ValueError as exc:
            raise UserError(f"public key file {f}: {exc}") from None
    return PeerKeys(pairs)
