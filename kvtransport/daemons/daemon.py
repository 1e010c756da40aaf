"""What both daemons share: the event loop, the ZeroMQ control server, signals, logs.

A daemon is an *engine* (kvtransport.daemons.daemon_sender.SenderEngine or
kvtransport.daemons.daemon_receiver.ReceiverEngine: a sans-I/O host and its UDP socket, no ZeroMQ)
plus control sockets. :func:`serve` runs them on one thread:

    loop:  engine.run_due(now)       timers due: paced datagrams, feedback, deadlines
           control.drain()           every waiting ZeroMQ request, answered at once
           select(UDP socket, ZeroMQ descriptors, signal pipe; timeout = engine's next wake)
           engine.on_readable(now)   every datagram waiting, in one batch

ZeroMQ's descriptor is edge-triggered: it signals that the socket's state *changed*, so
the loop drains each control socket (``zmq.EVENTS`` says what is left) before every sleep;
a message that arrives during the sleep then always wakes it. Control sockets are only
polled this way, never blocked on, so a slow client cannot stall pacing.

SIGTERM and SIGINT set a flag and write to a wake-up pipe (``signal.set_wakeup_fd``), so
the loop notices at once even in a long sleep; the daemon then shuts its engine down
cleanly (the sender aborts transfers in flight, telling receivers to deliver; the receiver
delivers what it holds), closes its sockets and exits 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import numpy as np

from kvtransport.daemons.api import (
    MAX_HEADER_BYTES,
    ApiError,
    check_endpoint,
    dump_json,
    load_json_header,
)
from kvtransport.daemons.curve import CurveServer
from kvtransport.daemons.udp import clock, set_timer_slack, wait_readable
from kvtransport.errors import UserError

if TYPE_CHECKING:
    from kvtransport.core.wire import SealKey

log = logging.getLogger("kvtransport.daemon")

MAX_IDLE_SLEEP_S = 0.5
"""Longest sleep with nothing scheduled (housekeeping and expiry run at least this often)."""


class Engine(Protocol):
    """The data plane a daemon drives (see the module docstring)."""

    def fileno(self) -> int: ...

    def run_due(self, now: float) -> None: ...

    def on_readable(self, now: float) -> None: ...

    def next_wake(self) -> float | None: ...


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (Unix seconds), ``level``, ``daemon``,
    ``logger``, ``msg`` (and ``exc`` with a traceback's last line)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "daemon": self.name,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info).splitlines()[-1]
        return json.dumps(out, separators=(",", ":"), default=str)


def setup_logging(verbose: int = 0, name: str = "kvtransport", json_lines: bool = False) -> None:
    """Log lines to stderr: time, level, what happened (INFO by default, -v for DEBUG);
    ``json_lines``: one JSON object per line instead (:class:`JsonLogFormatter`)."""
    level = logging.DEBUG if verbose else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonLogFormatter(name))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {name} %(levelname)s %(message)s"))
    root = logging.getLogger("kvtransport")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


class StatsWriter:
    """One JSON line per finished transfer (``--stats``: to stdout, or appended to a file)."""

    def __init__(self, target: str | None) -> None:
        self._fh: IO[str] | None = None
        self._own = False
        if target == "-":
            self._fh = sys.stdout
        elif target:
            try:
                self._fh = open(target, "a", buffering=1)  # noqa: SIM115 (lives with the daemon)
            except OSError as exc:
                raise UserError(f"cannot open stats file {target}: {exc.strerror}") from None
            self._own = True

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._own and self._fh is not None:
            self._fh.close()
        self._fh = None


class StopSignal:
    """SIGTERM/SIGINT -> ``requested`` (and a readable ``fd`` that wakes the loop)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._old: dict[int, Any] = {}
        self._old_fd = -1

    def install(self) -> StopSignal:
        self._old_fd = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def request(self, why: str = "requested") -> None:
        """Stop from inside the process (a ``shutdown`` request, a test)."""
        self.requested = True
        self.signal_name = why
        with contextlib.suppress(OSError):
            self._w.send(b"\0")

    def fileno(self) -> int:
        return self._r.fileno()

    def drain(self) -> None:
        with contextlib.suppress(OSError):
            while self._r.recv(4096):
                pass

    def close(self) -> None:
        """Close the wake-up pair of a stop that was never installed (an in-process loop
        in a worker thread: the application keeps its signal handlers)."""
        self._r.close()
        self._w.close()

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._old_fd)
        self._r.close()
        self._w.close()


Handler = Callable[[dict[str, Any], list], tuple[dict[str, Any], list] | dict[str, Any]]


def bind_endpoint(sock: Any, endpoint: str, curve_secret: CurveServer | None = None) -> None:
    """Bind a ZeroMQ socket to a checked endpoint (kvtransport.daemons.api.check_endpoint: loopback
    tcp, or ipc in a private directory, made 0700 when missing; with ``curve_secret`` the
    socket is a CURVE server, kvtransport.daemons.curve, and any tcp address will do); an ipc://
    socket file is made owner-only. UserError on failure."""
    import zmq

    check_endpoint(endpoint, curve=curve_secret is not None)
    if curve_secret is not None:
        from kvtransport.daemons.curve import serve

        serve(sock, curve_secret)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise UserError(f"cannot bind {endpoint}: {exc.strerror}") from None
    if endpoint.startswith("ipc://"):
        with contextlib.suppress(OSError):
            Path(endpoint[len("ipc://") :]).chmod(0o600)


def curve_secret(path: str | None) -> CurveServer | None:
    """The daemon's CURVE configuration from ``--curve-secret`` (its secret key, made on
    first use with its public key beside it, and the allowed clients in ``FILE.clients``;
    kvtransport.daemons.curve), or None without one. The key itself is not logged."""
    if path is None:
        return None
    from kvtransport.daemons.curve import server_config

    server = server_config(path)
    log.info(
        "CURVE on: clients need %s.pub; %d client key(s) allowed (%s)",
        path,
        len(server.clients),
        server.clients_path,
    )
    return server


def remove_ipc_file(endpoint: str) -> None:
    """Remove the socket file of a bound ipc:// endpoint (after its socket is closed)."""
    if endpoint.startswith("ipc://"):
        with contextlib.suppress(OSError):
            Path(endpoint[len("ipc://") :]).unlink()


class ControlServer:
    """A ROUTER socket answering JSON requests (see kvtransport.daemons.api) without blocking.

    ``handlers`` maps an ``op`` to ``handler(header, frames) -> reply`` (a dict, or
    ``(dict, frames)``). A handler raising UserError/ValueError answers ``ok: false`` with
    its message; any other exception (a bug) is logged with its traceback and answered
    ``ok: false`` too: the daemon keeps running whatever a client sends. A handler must
    therefore change nothing until it has validated the whole request (kvtransport.bounds).
    """

    def __init__(
        self,
        context: Any,
        endpoint: str,
        handlers: dict[str, Handler],
        curve_secret: CurveServer | None = None,
    ) -> None:
        import zmq

        self._zmq = zmq
        self.endpoint = endpoint
        self.handlers = handlers
        self.sock = context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        bind_endpoint(self.sock, endpoint, curve_secret)
        self.fd = self.sock.getsockopt(zmq.FD)
        self.requests = 0
        self.errors = 0

    def fileno(self) -> int:
        return self.fd

    def pending(self) -> bool:
        """Is a request waiting (one :meth:`drain` left for the next turn)?"""
        return bool(self.sock.getsockopt(self._zmq.EVENTS) & self._zmq.POLLIN)

    def drain(self, max_requests: int = 64) -> int:
        """Answer every waiting request (at most ``max_requests`` per call, so a burst of
        requests cannot hold back pacing; the loop comes back at once for the rest)."""
        zmq = self._zmq
        sock = self.sock
        done = 0
        while done < max_requests and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            done += 1
            self._answer(msg)
        return done

    def _answer(self, msg: list) -> None:
        zmq = self._zmq
        try:
            split = next(i for i, f in enumerate(msg) if len(f) == 0)
        except StopIteration:
            return  # not REQ framing: nobody to answer
        envelope, body = msg[: split + 1], msg[split + 1 :]
        self.requests += 1
        frames: list = []
        try:
            if not body:
                raise ApiError("empty request")
            head = load_json_header(body[0], MAX_HEADER_BYTES)
            op = head.get("op")
            handler = self.handlers.get(op) if isinstance(op, str) else None
            if handler is None:
                raise ApiError(f"unknown op {op!r}; expected one of {', '.join(self.handlers)}")
            reply = handler(head, body[1:])
            if isinstance(reply, tuple):
                reply, frames = reply
            reply = {"ok": True, **reply}
        except (UserError, ValueError, KeyError, TypeError) as exc:
            self.errors += 1
            text = str(exc) if not isinstance(exc, KeyError) else f"missing field {exc}"
            reply = {"ok": False, "error": text.splitlines()[0] if text else type(exc).__name__}
            frames = []
        except Exception as exc:  # a bug a request reached: answer it, keep serving
            self.errors += 1
            log.exception("control request failed")
            text = str(exc).splitlines()[0] if str(exc) else ""
            reply = {"ok": False, "error": f"internal error: {type(exc).__name__} {text}"[:300]}
            frames = []
        try:
            sock_frames = [*envelope, dump_json(reply), *frames]
            self.sock.send_multipart(sock_frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # the client went away: nothing to do
            log.debug("control reply dropped: %s", exc)

    def close(self) -> None:
        self.sock.close(linger=0)
        remove_ipc_file(self.endpoint)


def cipher_text(keyed: bool) -> str:
    """The start-up log's words on the datagram cipher: none, or which AES-GCM runs and on
    which libcrypto (its speed differs several-fold between OpenSSL releases, and
    ``KVTRANSPORT_LIBCRYPTO`` can name another: kvtransport.codecs.aesgcm)."""
    if not keyed:
        return "no key: datagrams plaintext and unauthenticated"
    from kvtransport.codecs import aesgcm

    version = aesgcm.libcrypto_version()
    if version is None:
        return "AES-256-GCM per datagram (the compiled kernels are off or have no libcrypto)"
    return f"AES-256-GCM on {version} ({aesgcm.LIBCRYPTO_ENV} names another)"


class DaemonShell:
    """What both daemons share around their engine: the ZeroMQ context and control socket,
    the ``status``/``stats``/``ping`` requests, the stats lines and the lifecycle.

    A subclass sets ``role`` ("sender" or "receiver") and ``log``, makes ``self.sock``,
    ``self.engine`` and ``self.stats_out``, then calls :meth:`_start_control`; it says what
    its start-up log line adds (:meth:`_describe`) and what shutdown did to the transfers
    still in flight (``STOP_TEXT``). The engine must have ``host`` (a SenderHost or
    ReceiverHost: ``active``, ``status(now, tid)``), ``stats()`` and ``close(now)``.
    """

    role = ""
    STOP_TEXT = ""
    log = log
    sock: Any
    engine: Any
    stats_out: StatsWriter
    context: Any
    control: ControlServer
    curve_secret: CurveServer | None = None
    """The CURVE keys and client allowlist of the control (and result) sockets
    (kvtransport.daemons.curve)."""
    _zap: Any = None

    def _start_control(
        self, control: str, handlers: dict[str, Handler], before: Callable[[], None] | None = None
    ) -> None:
        """Make the context and the control server: ``handlers`` (the daemon's own ops, in
        the order errors list them) then ``stats`` and ``ping``. ``before`` may open more
        sockets first; on failure everything opened so far is closed and the error raised."""
        import zmq

        self.context = zmq.Context()
        try:
            if self.curve_secret is not None:  # before any socket binds
                from kvtransport.daemons.curve import start_authenticator

                self._zap = start_authenticator(self.context, self.curve_secret)
            if before is not None:
                before()
            self.control = ControlServer(
                self.context,
                control,
                {**handlers, "stats": self._stats, "ping": self._ping},
                self.curve_secret,
            )
        except BaseException:
            self.sock.close()
            self._stop_zap()
            self.context.destroy(linger=0)
            raise

    def _stop_zap(self) -> None:
        if self._zap is not None:
            self._zap.stop()
            self._zap = None

    def _status(self, head: dict[str, Any], frames: list) -> dict[str, Any]:
        from kvtransport.daemons.api import parse_tid

        tid = parse_tid(head["transfer_id"]) if head.get("transfer_id") is not None else None
        return {"transfers": self.engine.host.status(clock(), tid)}

    def _stats(self, head: dict[str, Any], frames: list) -> dict[str, Any]:
        return {"stats": self.engine.stats()}

    def _ping(self, head: dict[str, Any], frames: list) -> dict[str, Any]:
        import os

        host, port = self.sock.address
        return {"pid": os.getpid(), "udp": f"{host}:{port}", "role": self.role}

    def _on_idle(self, now: float) -> None:
        """Once per loop turn, after the control requests (a subclass's housekeeping)."""

    def _describe(self) -> str:
        """The start-up log line's last part (link rate, endpoints, offloads)."""
        return ""

    def run(self, stop: StopSignal) -> None:
        """Serve until ``stop.requested``; then shut the engine down and close."""
        host, port = self.sock.address
        self.log.info(
            "%s daemon up: UDP %s:%d, control %s, %s; %s",
            self.role,
            host,
            port,
            self.control.endpoint,
            self._describe(),
            cipher_text(self.engine.host.key is not None),
        )
        try:
            serve(self.engine, [self.control], stop, on_idle=self._on_idle)
        finally:
            n = len(self.engine.host.active)
            self.engine.close(clock())
            self.log.info(
                "%s daemon stopping (%s): %d %s",
                self.role,
                stop.signal_name or "stopped",
                n,
                self.STOP_TEXT,
            )
            self.close()

    def run_until_signalled(self) -> None:
        """:meth:`run` with SIGTERM/SIGINT as the stop (the commands' way)."""
        stop = StopSignal().install()
        try:
            self.run(stop)
        finally:
            stop.restore()

    def close(self) -> None:
        self.control.close()
        self.sock.close()
        self._stop_zap()
        self.context.term()
        self.stats_out.close()


def serve(
    engine: Engine,
    controls: list[ControlServer],
    stop: StopSignal,
    *,
    on_idle: Callable[[float], None] | None = None,
) -> None:
    """Run the daemon loop until ``stop.requested`` (see the module docstring)."""
    set_timer_slack()
    udp_fd = engine.fileno()
    fds = [udp_fd, stop.fileno(), *(c.fileno() for c in controls)]
    while not stop.requested:
        engine.run_due(clock())
        for c in controls:
            c.drain()
        if on_idle is not None:
            on_idle(clock())
        if stop.requested:
            break
        timeout = _sleep_s(engine, controls)
        ready = wait_readable(fds, timeout)
        if udp_fd in ready:
            engine.on_readable(clock())
        if stop.fileno() in ready:
            stop.drain()


def _sleep_s(engine: Engine, controls: list[ControlServer]) -> float:
    """How long the loop may wait for a descriptor: 0 while a control socket still holds
    requests (its descriptor is edge-triggered: it would not wake the wait for them), else
    until the engine's next timer, at most ``MAX_IDLE_SLEEP_S``."""
    if any(c.pending() for c in controls):
        return 0.0
    wake = engine.next_wake()
    return MAX_IDLE_SLEEP_S if wake is None else min(MAX_IDLE_SLEEP_S, wake - clock())


class _WarmUpPath:
    """The warm-up's channel: ``delay`` one way; every fifth datagram lost, every third
    one a further 50 us late (reordered: repairs may arrive before their sources), and
    everything sent before ``quiet_until`` lost (feedback lost, as on a long round trip:
    the manifest's repairs go out too)."""

    def __init__(self, delay: float, quiet_until: float = 0.0) -> None:
        self.delay = delay
        self.quiet_until = quiet_until
        self.n = 0

    def transmit(self, t: float, size: int) -> float | None:
        self.n += 1
        if t < self.quiet_until or self.n % 5 == 0:
            return None
        return t + self.delay + (50e-6 if self.n % 3 == 0 else 0.0)


def _warm_source_runs(key: bytes | None) -> None:
    """Seal a run of sources as a sender does (``Framer.seal_sources``, its payload a
    read-only array) and open it as a receiver does a socket read's (``Parser.source_run``
    over :class:`~kvtransport.core.wire.LaidOutDatagrams`, into a writable array): on the
    virtual clock one slot is due per call, and the tiny transfers leave few runs of
    in-order sources, so the run kernels would otherwise load in the first real transfer."""
    from kvtransport.core.wire import Framer, LaidOutDatagrams, Parser

    payload = np.zeros(128, np.uint8)
    payload.flags.writeable = False
    sealed = Framer(1, key).seal_sources(
        0, 0, 2, payload, 64, 1, np.frombuffer(bytes(64), np.uint8)
    )
    run = LaidOutDatagrams.join(sealed)
    parser = Parser(key)
    parser.parse(run[0])  # a receiver's first datagram of a transfer derives its key
    parser.source_run(run, 0, len(run), 1, 0, 0, 64, memoryview(np.zeros(128, np.uint8)))


def _warm_block_codec() -> None:
    """Encode a small float32 cache at int8 and int4 (a sender planning a card or cache)
    and decode it range by range from a writable buffer (a receiver's payload) and a
    read-only one (a racer's mirror of a daemon's transfer): the block codec's kernels
    (kvtransport.codecs.quant, through kvtransport.kvformat.blocks; numpy only, no torch)."""
    from kvtransport.kvformat import blocks
    from kvtransport.kvformat.kvcache import KVCache

    bt = blocks.DEFAULT_BLOCK_TOKENS
    shape = (1, 1, 2 * bt, 64)
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((2, *shape), dtype=np.float32)
    cache = KVCache(kv[0], kv[1], np.arange(2 * bt, dtype=np.int64), "warm-up")
    for precision in ("int8", "int4"):
        s = blocks.encode_stream(cache, np.ones((1, 2)), np.arange(2), precision)
        for payload in (s.payload.copy(), np.frombuffer(s.payload.tobytes(), np.uint8)):
            blocks.RangeDecoder(s.manifest).take(payload, 0, 2 * bt)


def _warm_transfers(key: bytes | None, runs: Sequence[Sequence[str]]) -> None:
    """Run each of ``runs`` (the policies of transfers sharing one link) as a tiny lossy
    transfer between the daemons' own hosts on the virtual-clock loop
    (kvtransport.sim.virtual_clock). The receiver daemon hands a read's datagrams over in
    one call (runs of them in one RLCDecoder.add_packets call), so what each receiver got
    is handed once more that way to a fresh host, laid out in one buffer as a socket read
    leaves it (its runs of sources open in one compiled call)."""
    from kvtransport.core.transfer import synthetic_transfer
    from kvtransport.core.wire import LaidOutDatagrams, ReceivedBatch
    from kvtransport.hosts.receiver_host import ReceiverHost
    from kvtransport.hosts.sender_host import SenderHost
    from kvtransport.sim.virtual_clock import VirtualClockLoop

    transfer = synthetic_transfer(64 * 1024, 8, seed=0)
    for names in runs:
        sender = SenderHost(rate_bps=1e9, key=key, burst_s=0.0)
        receiver = ReceiverHost(key=key)
        for name in names:
            sender.submit(transfer, "receiver", now=0.0, deadline_s=0.5, policy=name)
        trace: list[tuple[Any, ...]] = []
        loop = VirtualClockLoop(trace)
        loop.add(sender, "sender", channel=_WarmUpPath(1e-3))
        rx = loop.add(receiver, "receiver", channel=_WarmUpPath(1e-3, quiet_until=2e-3))
        loop.run(until=1.0)
        got = LaidOutDatagrams.join([e[3] for e in trace if e[0] == "recv" and e[2] == rx])
        batch = ReceivedBatch([(d, "sender") for d in got], got.buf, got.starts, got.ends)
        ReceiverHost(key=key).receive_datagrams(batch, 0.0)  # as a socket read: laid out


def data_path_policies() -> tuple[str, ...]:
    """One policy of every kind a transfer can run (kvtransport.policies.registry.make_policy's
    names; one rate of ``fixed`` and of ``block-rs``), hence every built-in repair scheme
    (rlc, block-rs, arq, none): ``ddqn`` where the package ships its weights. ``oracle``
    is not one: it reads a simulated channel's future and runs in no real transfer."""
    from kvtransport.policies.registry import default_policy

    names = ("fixed:1/4", "block-rs:2/8", "adaptive", "tail-rule", "arq", "none")
    return (*names, "ddqn") if default_policy() == "ddqn" else names


def _stderr_note(text: str) -> None:
    print(f"kvtransport: {text}", file=sys.stderr, flush=True)


_warm_lock = threading.Lock()
_warm_keyed: set[bool] = set()
"""Whether a keyed / keyless data path is warm in this process (:func:`warm_data_path`)."""


def warm_data_path(key: bytes | None = None, note: Callable[[str], None] | None = None) -> float:
    """Compile or load every kernel a transfer with ``key`` (or keyless, for None) can use
    on either side, once per process; returns the seconds spent (0 once done).

    What runs: a source run sealed and opened (AES-GCM with a key), tiny lossy, reordered
    transfers sharing one link (the allocator), one per policy of
    :func:`data_path_policies` (every repair scheme's encoder and decoder, the
    observation, the DDQN's features and network), the receiver's datagrams handed over
    once more as a socket read lays them out, and the block codec
    (:func:`_warm_block_codec`).
    The first call of each numba kernel in a process loads it from numba's cache or, on
    a fresh install, compiles it (seconds in all): paid inside a transfer, that stall
    would count as round-trip time and could cost the transfer its deadline.

    ``note`` (default: a line on stderr) hears, only when the kernel cache is cold
    (kvtransport.kernel_cache.is_warm), that kernels are compiling and about how long
    that takes, before compiling, and the time it took afterwards; a warm cache is
    silent. A cold run stamps the cache warm when done."""
    from kvtransport import kernel_cache

    with _warm_lock:
        keyed = key is not None
        if keyed in _warm_keyed:
            return 0.0
        t0 = clock()
        folder = kernel_cache.current()
        cold = not kernel_cache.is_warm(folder)
        say = note or _stderr_note
        if cold:
            estimate = kernel_cache.compile_estimate(folder)
            say(f"compiling kernels (first run only, about {estimate:.0f} s)...")
        policies = data_path_policies()
        _warm_source_runs(key)
        _warm_transfers(key, [policies])
        _warm_block_codec()
        if not keyed:  # a keyless process has no keyed peer; warm the cache for those who do
            _warm_source_runs(bytes(32))
        spent = clock() - t0
        if cold:
            kernel_cache.record_warm(folder, spent)
            say(f"kernels compiled in {spent:.1f} s")
        _warm_keyed.add(keyed)
        return spent


def warm_up(
    key: SealKey | None = None,
    policies: Sequence[str] = ("fixed:1/4",),
    allocator: bool = False,
    note: Callable[[str], None] | None = None,
) -> float:
    """Make every kernel a transfer can use ready before a shell serves
    (:func:`warm_data_path`: every policy, scheme and decoder, the allocator, the block
    codec), then run a tiny transfer for each of ``policies`` that is not one of
    :func:`data_path_policies` (a policy registered by the application), with
    ``allocator`` two of the first sharing the link; returns the seconds spent.
    ``note``: where the cold cache's lines go (:func:`warm_data_path`). A ``key`` of peers
    warms with a stand-in (kvtransport.core.wire.kernel_stand_in): the same kernels."""
    from kvtransport.core.wire import kernel_stand_in

    t0 = clock()
    stand_in = kernel_stand_in(key)
    warm_data_path(stand_in, note)
    known = set(data_path_policies())
    runs = [[name] for name in dict.fromkeys(policies) if name not in known]
    if allocator and runs:
        runs.append(runs[0] * 2)
    _warm_transfers(stand_in, runs)
    return clock() - t0
