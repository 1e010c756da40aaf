"""ZeroMQ CURVE for the daemons' control and result sockets off loopback.

Control requests and published results are not authenticated by themselves, so without
CURVE a daemon binds only ``ipc://`` (a private directory) or loopback ``tcp://``
(kvtransport.daemons.api.check_endpoint). With CURVE (libzmq's CurveZMQ: Curve25519 key exchange,
then every message encrypted and authenticated) a daemon may bind any ``tcp://`` address:

- the daemon: ``--curve-secret FILE``, the daemon's secret key (Z85 text, 40
  characters). Made on first use, mode 0600 in a 0700 directory, with its public key
  beside it in ``FILE.pub``; a file that other users may read is refused.
- a client (:class:`kvtransport.embed.client.SenderClient`, ``ReceiverClient``,
  ``ResultSubscriber``): ``curve_server_key=``, the daemon's public key (the Z85 text, or
  the ``FILE.pub`` path). The client makes a throwaway key pair of its own per socket. A
  client without the right server key never completes the handshake, so it gets no
  answer (and no result), and the daemon gets no request from it.

Whoever holds the server's public key can talk to the daemon: hand ``FILE.pub`` only to
the hosts that should (as the pre-shared key, kvtransport.core.keys). Every refusal here is a
one-line :class:`UserError`, including a libzmq built without CURVE.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from kvtransport.errors import UserError

Z85_KEY_CHARS = 40


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


def serve(sock: Any, secret: bytes) -> None:
    """Make ``sock`` (before it binds) a CURVE server with ``secret``."""
    import zmq

    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def connect_as_client(sock: Any, server_public: bytes) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the daemon whose public key is
    ``server_public``, with a throwaway key pair of its own."""
    import zmq

    public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
