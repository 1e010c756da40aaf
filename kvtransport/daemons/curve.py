"""ZeroMQ CURVE, with a client allowlist, for the daemons' control and result sockets.

Control requests and published results are not authenticated by themselves, so without
CURVE a daemon binds only ``ipc://`` (a socket file in a private 0700 directory: the
default; kvtransport.daemons.api.check_endpoint). Any ``tcp://`` endpoint, loopback
included (every local user can connect to it), needs CURVE (libzmq's CurveZMQ:
Curve25519 key exchange, then every message encrypted and authenticated) and a list of
the clients allowed in:

- the daemon: ``--curve-secret FILE``, the daemon's secret key (Z85 text, 40
  characters). Made on first use, mode 0600 in a 0700 directory, with its public key
  beside it in ``FILE.pub``; a file that other users may read is refused. The allowed
  clients' public keys are in ``FILE.clients``: a file with one Z85 key per line (a line
  starting with ``#`` is a comment), or a directory of such files; without it (or with
  no key in it) the daemon refuses to start. A ZAP handler (ZeroMQ's authentication
  protocol, one thread per daemon) admits a client only when its public key is listed.
- a client (:class:`kvtransport.embed.client.SenderClient`, ``ReceiverClient``,
  ``ResultSubscriber``; the commands' ``--curve-server-key`` and ``--curve-client-key``):
  ``curve_server_key=``, the daemon's public key (the Z85 text, or the ``FILE.pub``
  path), and ``curve_client_key=``, the client's own secret key file (made on first use
  like the daemon's, its public key in ``.pub`` beside it: add that line to the daemon's
  ``FILE.clients``). A client that is not listed, or lacks the right server key, never
  completes the handshake: it gets no answer and no result, and the daemon no request.

Every refusal here is a one-line :class:`UserError`, including a libzmq built without
CURVE.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtransport.errors import UserError

Z85_KEY_CHARS = 40
ZAP_DOMAIN = b"kvtransport"
CLIENTS_SUFFIX = ".clients"

log = logging.getLogger("kvtransport.curve")


@dataclass(frozen=True)
class CurveServer:
    """A daemon's CURVE configuration: its secret key and the allowed clients' public
    keys (Z85)."""

    secret: bytes
    public: bytes
    clients: frozenset[bytes]
    clients_path: Path


def available() -> bool:
    """Whether this pyzmq's libzmq supports CURVE (``zmq.has("curve")``)."""
    import zmq

    return bool(zmq.has("curve"))


def _require() -> None:
    if not available():
        raise UserError("this pyzmq's libzmq has no CURVE support (zmq.has('curve') is False)")


def _z85(text: bytes, source: str) -> bytes:
    from zmq.utils import z85

    key = text.strip()
    try:
        ok = len(key) == Z85_KEY_CHARS and len(z85.decode(key)) == 32
    except (ValueError, KeyError, IndexError, TypeError):
        ok = False
    if not ok:
        raise UserError(f"{source}: not a CURVE key ({Z85_KEY_CHARS} Z85 characters)")
    return key


def server_keys(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """The daemon's (public, secret) CURVE keys from its secret key file ``path``; a new
    pair is made there (and its public key written to ``path.pub``) when it is missing."""
    _require()
    import zmq

    p = Path(path)
    if not p.exists():
        public, secret = zmq.curve_keypair()
        try:
            p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secret + b"\n")
            Path(f"{p}.pub").write_bytes(public + b"\n")
        except FileExistsError:
            pass  # another daemon made it first: read theirs below
        except OSError as exc:
            raise UserError(f"cannot create CURVE key file {p}: {exc.strerror}") from None
    try:
        mode = stat.S_IMODE(p.stat().st_mode)
        raw = p.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read CURVE key file {p}: {exc.strerror}") from None
    if mode & 0o077:
        raise UserError(
            f"CURVE key file {p} is accessible by other users (mode {mode:04o}); run: chmod 600 {p}"
        )
    secret = _z85(raw, f"CURVE key file {p}")
    return zmq.curve_public(secret), secret


def client_keys(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """A client's (public, secret) CURVE keys from its secret key file ``path`` (made on
    first use, its public key in ``path.pub``: the line the daemon's allowlist needs)."""
    return server_keys(path)


def allowed_clients(path: str | os.PathLike) -> frozenset[bytes]:
    """The client public keys in ``path``: a file of Z85 keys, one per line (lines that
    start with ``#`` and blank lines skipped), or a directory of such files. A one-line
    UserError when it is missing, unreadable, holds a line that is not a key, or none."""
    p = Path(path)
    try:
        files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
        texts = [(f, f.read_text(encoding="ascii", errors="replace")) for f in files]
    except OSError as exc:
        raise UserError(
            f"CURVE needs the allowed clients' public keys in {p} (one per line): {exc.strerror}"
        ) from None
    keys = set()
    for f, text in texts:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()  # Z85 has "#": only a whole line is a comment
            if line and not line.startswith("#"):
                keys.add(_z85(line.encode(), f"{f} line {n}"))
    if not keys:
        raise UserError(f"{p} lists no client public key: no client could connect")
    return frozenset(keys)


def server_config(path: str | os.PathLike) -> CurveServer:
    """The daemon's :class:`CurveServer` from ``--curve-secret path`` and its allowlist
    ``path.clients`` (module docstring)."""
    public, secret = server_keys(path)
    clients_path = Path(f"{path}{CLIENTS_SUFFIX}")
    return CurveServer(secret, public, allowed_clients(clients_path), clients_path)


class _Allowlist:
    """The ZAP handler's decision: a client whose public key is listed."""

    def __init__(self, clients: frozenset[bytes]) -> None:
        self.clients = clients

    def callback(self, domain: str, key: bytes) -> bool:
        """``key``: the client's public key, Z85 (as pyzmq's authenticator passes it)."""
        ok = key in self.clients
        if not ok:
            log.warning("CURVE client %s refused: not in the allowlist", key.decode())
        return ok


def start_authenticator(context: Any, server: CurveServer) -> Any:
    """Start the ZAP handler of ``context`` admitting ``server.clients`` only; the
    caller stops it (``.stop()``) before terminating the context."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(context, log=logging.getLogger("kvtransport.zap"))
    auth.start()
    auth.configure_curve_callback(
        domain=ZAP_DOMAIN.decode(), credentials_provider=_Allowlist(server.clients)
    )
    return auth


def server_public_key(spec: str | bytes) -> bytes:
    """A daemon's public key: the Z85 text itself, or a file holding it."""
    _require()
    if isinstance(spec, bytes):
        return _z85(spec, "curve_server_key")
    if len(spec.strip()) != Z85_KEY_CHARS and Path(spec).is_file():
        try:
            return _z85(Path(spec).read_bytes(), f"CURVE public key file {spec}")
        except OSError as exc:
            raise UserError(f"cannot read CURVE public key file {spec}: {exc.strerror}") from None
    return _z85(spec.encode(), "curve_server_key")


def serve(sock: Any, server: CurveServer) -> None:
    """Make ``sock`` (before it binds) a CURVE server of ``server``, its clients checked
    by the context's ZAP handler (:func:`start_authenticator`)."""
    import zmq

    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, server.secret)


def connect_as_client(
    sock: Any, server_public: bytes, client_key: str | os.PathLike | None = None
) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the daemon whose public key is
    ``server_public``, with the key pair in ``client_key`` (:func:`client_keys`), else a
    throwaway one (which no allowlist holds)."""
    import zmq

    if client_key is not None:
        public, secret = client_keys(client_key)
    else:
        public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
