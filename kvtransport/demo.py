"""The demo: one KV-cache handoff across a burst-loss link, five repair schemes side by side.

What :func:`run_demo` (``kvtransport demo``) does:

1. The real model (kvtransport.model; SmolLM2-135M-Instruct by default) prefills the
   context of a seeded task (kvtransport.tasks: facts QA or a RULER-style needle) once. The
   cache becomes a cache card (kvtransport.card: blocks in utility order), kept in
   ``$KVT_CACHE/demo`` so that the next run with the same task skips this prefill.
2. A sender and a receiver start once, in processes of their own, and the card crosses
   between them once per scheme: no FEC, block Reed-Solomon, fixed-rate RLC, the adaptive
   heuristic and the shipped Double-DQN policy (kvtransport.policy names ``none``,
   ``block-rs:4/32``, ``fixed:4/32``, ``adaptive``, ``ddqn``). The deadline is rho times
   the loss-free send time; the link is the ``ge-heavy`` profile (100 Mbit/s, 5 ms,
   Gilbert-Elliott bursts, about 12 % loss) in both directions. Two links:

   - ``netns`` (root): the real ``kvtransport sender-daemon`` and ``receiver-daemon`` in
     the two network namespaces of the testbed (kvtransport.netem.testbed: kernel netem,
     or rate limiting plus the userspace relay where the kernel has no sch_netem), at
     real-time priority, driven through the ZeroMQ client API (kvtransport.client).
   - ``emulated`` (any user, and the fallback when not root): the sender and receiver
     sessions (kvtransport.session, the code inside the daemons) in two processes, joined
     by the userspace channel of the same profile (kvtransport.netem.Channel: the loss
     models the simulator and the relay use) on the link's own clock (below).
3. For each scheme the receiver rebuilds the partial cache, injects it with the missing
   blocks masked per layer (kvtransport.hf) and answers; the answer is scored with token
   F1 against the full-cache answer (kvtransport.metrics). TTFT is measured both ways:
   the handoff's (transfer until the receiver's result, rebuild, injection, first token)
   and re-prefilling the context (prefill, first token).

Why the emulated link keeps its own clock. Seeding each packet's loss is not enough for a
repeatable result: on the wall clock the host's scheduler decides how many slots the
sender gets before the deadline and when each feedback arrives, and with them which
packets a feedback-driven policy sends; the same loss fates then fall on different
packets (and an unprivileged sender on a busy machine loses slots outright). So the
emulated link is a discrete-event link between the two processes: every time is the
link's, datagrams cross each direction's Channel in the order they were sent, and a
process runs its session only up to a horizon that no datagram from the other side can
precede (the one-way delay is the look-ahead, so a round covers milliseconds of link
time). The same seed then gives the same packets, the same partial caches and the same
answers; only the TTFT's compute part is measured (and varies). Every scheme sees the
same loss pattern (the channels are re-seeded per scheme), a like-for-like comparison.
Events run in the simulator's order over the simulator's channels, so a transfer ends
exactly as ``kvtransport simulate`` says for the same seed (tests/test_demo.py checks it).
The netns link runs on real clocks and kernel queues and is not repeatable; its relay
draws loss fates from the seed per packet in arrival order.

The emulated link's processes run ``python -m kvtransport.demo --peer sender|receiver FD``
and speak pickled messages over a socket pair (:class:`EmulatedLink`).
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.errors import UserError

SCHEMES: tuple[tuple[str, str], ...] = (
    ("no FEC", "none"),
    ("block RS 4/32", "block-rs:4/32"),
    ("RLC 4/32", "fixed:4/32"),
    ("adaptive", "adaptive"),
    ("DDQN", "ddqn"),
)
"""(label, kvtransport.policy spec) of the schemes in the table, in table order."""

PROFILE = "ge-heavy"
LINKS = ("auto", "netns", "emulated")
BLOCK_TOKENS = 16
INITIAL_RTT_S = 0.011  # 2 x the profile's 5 ms + 1 ms, as the simulator assumes
RECEIVER_PORT = 9400
DAEMON_PRIORITY = 5  # SCHED_FIFO of the netns daemons (the relay runs above them)
WARM_UP_BYTES = 256 * 1024
DEFAULT_TOKENS = 512
QUICK_TOKENS = 128
MAX_TOKENS = 2048  # 94 MiB of fp32 cache: each scheme's delivery is held until the answers
DEFAULT_MAX_NEW_TOKENS = 24
QUICK_MAX_NEW_TOKENS = 12
_TID_BASE = 0x6B76_7464_0000_0000  # "kvtd": transfer ids are derived from the seed


# ---------------------------------------------------------------------------------------
# configuration and results


@dataclass(frozen=True)
class DemoConfig:
    """What to run. ``quick()`` gives the faster variant (smaller context, shorter answers).

    card_dir: where cache cards are kept between runs (None: no caching).
    threads: torch threads for prefill and decoding (the TTFT figures depend on it).
    """

    task: str = "facts_qa"
    tokens: int = DEFAULT_TOKENS
    seed: int = 1
    rho: float = 0.8
    link: str = "auto"
    threads: int = 1
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    card_dir: Path | None = None
    progress: bool = True

    @classmethod
    def quick(cls, **overrides: Any) -> DemoConfig:
        base = {"tokens": QUICK_TOKENS, "max_new_tokens": QUICK_MAX_NEW_TOKENS}
        return cls(**{**base, **overrides})


@dataclass
class LinkOutcome:
    """What one transfer delivered, whichever link carried it.

    transfer_s: from the first datagram's departure (emulated: link time) or the submit
    request (netns: wall time) until the receiver's result.
    """

    utility: float
    reason: str
    complete: np.ndarray  # bool per block (empty if the manifest never arrived)
    payload: np.ndarray  # uint8: every complete block's bytes at its offset
    app_metadata: bytes | None  # the blocks manifest, None if it never arrived
    transfer_s: float
    counters: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchemeResult:
    """One row of the table."""

    label: str
    policy: str
    utility: float | None = None
    blocks_missing: int | None = None
    blocks_total: int | None = None
    reason: str = ""
    answer: str = ""
    f1: float | None = None
    transfer_s: float | None = None
    rebuild_s: float | None = None
    first_token_s: float | None = None
    ttft_s: float | None = None
    speedup: float | None = None  # re-prefill TTFT / this TTFT
    counters: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # why the scheme did not run (e.g. no shipped DDQN weights)


@dataclass
class DemoReport:
    """Everything the demo measured (``to_dict`` for --json, ``render_table`` for people)."""

    config: dict[str, Any]
    link: dict[str, Any]
    task: dict[str, Any]
    cache: dict[str, Any]
    deadline_s: float
    send_time_s: float
    full_answer: str
    reprefill: dict[str, Any]
    answers_agree: bool
    schemes: list[SchemeResult]
    timings: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schemes"] = [asdict(s) for s in self.schemes]
        return d

    def deterministic_view(self) -> dict[str, Any]:
        """The parts a seed fixes on the emulated link (measured timings left out)."""
        keep = ("label", "utility", "blocks_missing", "reason", "answer", "f1", "transfer_s")
        return {
            "full_answer": self.full_answer,
            "cache": {k: v for k, v in self.cache.items() if k != "card_cached"},
            "schemes": [{k: getattr(s, k) for k in keep} | s.counters for s in self.schemes],
        }


# ---------------------------------------------------------------------------------------
# choosing the link


def choose_link(requested: str) -> tuple[str, str]:
    """(link, note): "netns" or "emulated", and why when "auto" did not pick netns.

    ``auto`` takes the namespaces when the process is root and ``ip``/``tc`` exist, else
    the emulated link (a note, not an error). Asking for ``netns`` without root is a
    UserError.
    """
    if requested not in LINKS:
        raise UserError(f"--link must be one of {', '.join(LINKS)}, not {requested!r}")
    if requested == "emulated":
        return "emulated", ""
    from kvtransport.netem.testbed import check_environment

    try:
        check_environment()
    except UserError as exc:
        if requested == "netns":
            raise
        return "emulated", f"network namespaces unavailable ({exc}); using the emulated link"
    return "netns", ""


# ---------------------------------------------------------------------------------------
# progress


class _Progress:
    """tqdm bars on stderr (only on a terminal, and only when asked for)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()

    def bar(self, total: float, desc: str, unit: str = "it", fmt: str | None = None) -> Any:
        from tqdm import tqdm

        return tqdm(
            total=total,
            desc=desc,
            unit=unit,
            bar_format=fmt,
            disable=not self.enabled,
            leave=False,
            file=sys.stderr,
            dynamic_ncols=True,
        )

    def note(self, text: str) -> None:
        if self.enabled:
            from tqdm import tqdm

            tqdm.write(text, file=sys.stderr)


# ---------------------------------------------------------------------------------------
# the cache card


def default_card_dir() -> Path:
    """``$KVT_CACHE/demo`` (default ``~/.cache/kvtransport/demo``)."""
    from kvtransport.model import cache_root

    return cache_root().parent / "demo"


def _card_key(model_id: str, context_ids: list[int], weights: np.ndarray | None) -> str:
    from kvtransport import __version__, utility

    h = hashlib.sha256()
    h.update(f"{__version__}|{model_id}|{BLOCK_TOKENS}|{utility.OBSERVATION_WINDOW}|".encode())
    h.update(np.asarray(context_ids, dtype="<i8").tobytes())
    if weights is not None:
        h.update(np.asarray(weights, dtype="<f8").tobytes())
    return h.hexdigest()[:16]


def prepare_card(
    loaded: Any, task: Any, context_ids: list[int], card_dir: Path | None
) -> tuple[Any, bool, float]:
    """The context's block stream (kvtransport.blocks.EncodedStream), from the card cache
    or from one prefill; returns (stream, cached, prefill seconds).

    The manifest's creation info holds no time stamp, so the same context always gives
    the same bytes (the emulated link's repeatability starts here).
    """
    from kvtransport import __version__, blocks, card, hf, utility

    weights = utility.default_layer_weights(loaded.model_id, loaded.num_layers)
    path = None
    if card_dir is not None:
        key = _card_key(loaded.model_id, context_ids, weights)
        path = Path(card_dir) / f"{task.task}-seed{task.seed}-{len(context_ids)}tok-{key}.card"
        if path.is_file():
            try:
                stored = card.read_card(path)
            except card.CardError:
                stored = None  # damaged: rebuilt below
            if stored is not None and stored.manifest.model_id == loaded.model_id:
                ids = stored.manifest.token_ids
                if ids is not None and ids.tolist() == list(context_ids):
                    m = stored.manifest
                    return blocks.EncodedStream(m, m.to_bytes(), stored.payload), True, 0.0
    t0 = time.perf_counter()
    kv = hf.prefill(loaded.model, loaded.tokenizer, context_ids, window=utility.OBSERVATION_WINDOW)
    prefill_s = time.perf_counter() - t0
    stream = card.encode_cache(
        kv,
        layer_weights=weights,
        block_tokens=BLOCK_TOKENS,
        window=utility.OBSERVATION_WINDOW,
        created={"tool": f"kvtransport {__version__}", "by": "kvtransport demo",
                 "task": task.task, "seed": task.seed},
    )  # fmt: skip
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            card.write_card(path, stream)
        except (OSError, UserError):
            pass  # a read-only cache directory only costs the next run a prefill
    return stream, False, prefill_s


# ---------------------------------------------------------------------------------------
# the emulated link: two processes on the link's clock


def _peer_command(role: str, fd: int) -> list[str]:
    return [sys.executable, "-m", "kvtransport.demo", "--peer", role, str(fd)]


class _Peer:
    """The coordinator's handle on one peer process."""

    def __init__(self, role: str) -> None:
        from multiprocessing.connection import Connection

        self.role = role
        parent, child = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                _peer_command(role, child.fileno()),
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self.pending = 0  # requests sent with post() whose replies are not read yet

    def post(self, *msg: Any) -> None:
        """Send a request without waiting; its reply is read (and dropped) by the next call."""
        self._send(msg)
        self.pending += 1

    def call(self, *msg: Any) -> Any:
        """Send a request and return its reply (a tuple); a refusal raises _PeerError."""
        while self.pending:
            self._recv()
            self.pending -= 1
        self._send(msg)
        reply = self._recv()
        if reply[0] == "error":
            raise _PeerError(reply[1])
        return reply[1:]

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except OSError as exc:
            raise self._died() from exc

    def _recv(self) -> tuple:
        try:
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            raise self._died() from exc

    def _died(self) -> RuntimeError:
        return RuntimeError(
            f"the emulated link's {self.role} process died (exit {self.proc.poll()})"
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("quit",))
        with contextlib.suppress(Exception):
            self.conn.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _PeerError(Exception):
    """A peer refused a request (its message is one line)."""


def _transfer_message(transfer: Any) -> dict[str, Any]:
    b = transfer.blocks
    return {
        "payload": transfer.payload,
        "offsets": b.offsets,
        "lengths": b.lengths,
        "utilities": b.utilities,
        "app_metadata": transfer.app_metadata,
    }


class EmulatedLink:
    """A sender process and a receiver process joined by ``profile`` in both directions.

    Each transfer runs as a discrete-event exchange (see the module docstring): the
    coordinator (this object) alternately advances the sender up to ``receiver's time +
    feedback delay`` and the receiver up to ``sender's time + data delay``, handing each
    the datagrams that arrive by then and passing what it sent through that direction's
    Channel. Fresh channels per transfer, seeded from ``seed``: every scheme meets the
    same loss pattern. Needs a positive minimum one-way delay (the look-ahead).

    ``policies``: the processes load these policies' code (numba kernels, the DDQN
    network) at once, in parallel with whatever the caller does next; :meth:`ready`
    is then instant. Loading costs link time nothing either way (the link's clock
    does not run), only wall time.
    """

    name = "emulated"

    def __init__(
        self,
        profile: str = PROFILE,
        *,
        symbol_size: int | None = None,
        policies: tuple[str, ...] = (),
    ) -> None:
        from kvtransport.netem import load_profile
        from kvtransport.protocol import DEFAULT_SYMBOL_SIZE

        self.profile = load_profile(profile)
        self.symbol_size = symbol_size or DEFAULT_SYMBOL_SIZE
        self.lookahead = self._min_delay()
        self.peers: list[_Peer] = []
        self.sender = self._spawn("sender")
        self.receiver = self._spawn("receiver")
        self.loaded = False
        if policies:
            for peer in self.peers:
                peer.post("warm", list(policies))

    def describe(self) -> str:
        return (
            f"emulated: sender and receiver sessions in two processes, {self.profile.describe()} "
            "each way, on the link's clock"
        )

    def _min_delay(self) -> float:
        if self.profile.is_trace:
            raise UserError("the emulated link needs a profile with a fixed delay, not a trace")
        _loss, delay = self.profile.samplers(0)
        low = delay.bounds()[0]
        if not low > 0:
            raise UserError(
                f"profile {self.profile.name}: the emulated link needs a positive minimum "
                "one-way delay (it is the processes' look-ahead)"
            )
        return low

    def _spawn(self, role: str) -> _Peer:
        peer = _Peer(role)
        self.peers.append(peer)
        return peer

    def load(self, transfer: Any) -> None:
        """Hand the transfer to the sender process once (every scheme sends it)."""
        self.sender.call("load", _transfer_message(transfer))
        self.loaded = True

    def transfer(
        self,
        policy: str,
        *,
        deadline_s: float,
        transfer_id: int,
        seed: int,
        on_progress: Callable[[float], None] | None = None,
    ) -> LinkOutcome:
        """Send the loaded transfer with ``policy``; returns what the receiver delivered."""
        from kvtransport.netem import make_channel

        if not self.loaded:
            raise RuntimeError("load() a transfer first")
        data_seed, fb_seed = np.random.SeedSequence(seed).spawn(2)
        data_ch = make_channel(self.profile, data_seed)
        fb_ch = make_channel(self.profile, fb_seed)
        rate_bps = self.profile.rate_bps
        self.sender.call(
            "start",
            {
                "policy": policy,
                "rate_bps": rate_bps,
                "deadline_s": deadline_s,
                "transfer_id": transfer_id,
                "symbol_size": self.symbol_size,
                "initial_rtt": INITIAL_RTT_S,
            },
        )
        self.receiver.call("start", {"transfer_id": transfer_id})
        to_rx: list[tuple[float, int, bytes]] = []
        to_tx: list[tuple[float, int, bytes]] = []
        order = 0
        t_r = 0.0  # the receiver has handled every event up to here
        s_done = False
        result = None
        s_next: float | None = 0.0
        r_next: float | None = None
        limit = deadline_s + 30.0
        look = self.lookahead
        while True:
            if not to_rx and not to_tx:  # nothing in flight: skip to the next timer
                timers = [t for t in (s_next, r_next) if t is not None]
                if not timers:
                    break
                t_r = max(t_r, min(timers) - look)
            h_s = t_r + look
            ins = _pop_until(to_tx, h_s)
            out, s_next, s_done = self.sender.call("advance", h_s, ins)
            for t, d in out:
                arrival = data_ch.transmit(t, len(d))
                if arrival is not None:
                    order += 1
                    heapq.heappush(to_rx, (arrival, order, d))
            h_r = h_s + look
            ins = _pop_until(to_rx, h_r)
            out, r_next, rx_result = self.receiver.call("advance", h_r, ins)
            for t, d in out:
                arrival = fb_ch.transmit(t, len(d))
                if arrival is not None:
                    order += 1
                    heapq.heappush(to_tx, (arrival, order, d))
            t_r = h_r
            if rx_result is not None and result is None:
                result = rx_result
            if on_progress is not None:
                on_progress(min(t_r / deadline_s, 1.0))
            if result is not None and (s_done or (not to_rx and not to_tx)):
                break
            if t_r > limit:
                break
        (stats,) = self.sender.call("stats")
        counters = {
            "datagrams_sent": data_ch.sent,
            "datagrams_lost": data_ch.lost + data_ch.dropped,
            "source_sent": stats["source_sent"],
            "repair_sent": stats["repair_sent"],
        }
        if result is None:
            raise RuntimeError(f"the receiver delivered no result by link time {t_r:.3f} s")
        return LinkOutcome(
            utility=result["utility"],
            reason=result["reason"],
            complete=result["complete"],
            payload=result["payload"],
            app_metadata=result["app_metadata"],
            transfer_s=result["at"],
            counters=counters,
        )

    def ready(self) -> None:
        """Wait for the processes' warm-up (started by the constructor)."""
        for peer in self.peers:
            peer.call("ping")

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.peers.clear()


def _pop_until(heap: list[tuple[float, int, bytes]], t: float) -> list[tuple[float, bytes]]:
    out = []
    while heap and heap[0][0] <= t:
        arrival, _o, d = heapq.heappop(heap)
        out.append((arrival, d))
    return out


class _PeerRole:
    """What both peer processes answer besides their own requests."""

    def ping(self) -> tuple:
        return ()

    def warm(self, policies: list[str]) -> tuple:
        """Load the sessions' and policies' compiled code in this process: a small
        simulated transfer per policy (sender and receiver code alike). A policy that
        cannot be made is left for the transfer that names it to report."""
        from kvtransport.simulator import simulate

        for policy in policies:
            with contextlib.suppress(UserError):
                simulate(policy=policy, size_bytes=120_000, seed=0, record=False)
        return ()


class _SenderPeer(_PeerRole):
    """The sender process of the emulated link: a SenderSession on the link's clock."""

    def __init__(self) -> None:
        self.transfer = None
        self.session = None

    def load(self, msg: dict[str, Any]) -> tuple:
        from kvtransport.transfer import BlockTable, Transfer

        blocks = BlockTable(msg["offsets"], msg["lengths"], msg["utilities"])
        self.transfer = Transfer(msg["payload"], blocks, msg["app_metadata"])
        return ()

    def start(self, msg: dict[str, Any]) -> tuple:
        from kvtransport.policy import make_policy
        from kvtransport.sender import SenderSession

        if self.transfer is None:
            raise ValueError("no transfer loaded")
        self.session = SenderSession(
            self.transfer,
            make_policy(msg["policy"]),
            rate_bps=msg["rate_bps"],
            deadline=msg["deadline_s"],
            now=0.0,
            transfer_id=msg["transfer_id"],
            symbol_size=msg["symbol_size"],
            initial_rtt=msg["initial_rtt"],
        )
        return ()

    def advance(self, horizon: float, inputs: list[tuple[float, bytes]]) -> tuple:
        """Feedback arrivals and pacing timers up to ``horizon``, in time order (arrivals
        first on a tie, as in kvtransport.simulator); returns what was sent and when."""
        s = self.session
        out: list[tuple[float, bytes]] = []
        inf = math.inf
        i, n = 0, len(inputs)
        while True:
            tt = s.next_timer()
            tt = inf if tt is None else tt
            ti = inputs[i][0] if i < n else inf
            t = ti if ti <= tt else tt
            if t > horizon or t == inf:
                break
            if ti <= tt:
                s.receive_datagram(inputs[i][1], ti)
                i += 1
            else:
                s.handle_timer(t)
                out.extend((t, d) for d in s.datagrams_to_send(t))
        return out, s.next_timer(), bool(s.done)

    def stats(self) -> tuple:
        s = self.session
        return ({"source_sent": s.stats["source_sent"], "repair_sent": s.repair_sent},)


class _ReceiverPeer(_PeerRole):
    """The receiver process of the emulated link: a ReceiverSession on the link's clock,
    opened by the transfer's first datagram with the deadline from the manifest, counted
    from that datagram's arrival (as the receiver daemon does)."""

    def __init__(self) -> None:
        self.transfer_id = 0
        self.session = None
        self.reported = False

    def start(self, msg: dict[str, Any]) -> tuple:
        self.transfer_id = int(msg["transfer_id"])
        self.session = None
        self.reported = False
        return ()

    def advance(self, horizon: float, inputs: list[tuple[float, bytes]]) -> tuple:
        from kvtransport.receiver import ReceiverSession

        out: list[tuple[float, bytes]] = []
        inf = math.inf
        i, n = 0, len(inputs)
        result = None
        while True:
            s = self.session
            tt = s.next_timer() if s is not None else None
            tt = inf if tt is None else tt
            ti = inputs[i][0] if i < n else inf
            t = ti if ti <= tt else tt
            if t > horizon or t == inf:
                break
            if ti <= tt:
                if s is None:
                    s = self.session = ReceiverSession(self.transfer_id, now=ti)
                s.receive_datagram(inputs[i][1], ti)
                i += 1
            else:
                s.handle_timer(t)
            out.extend((t, d) for d in s.datagrams_to_send(t))
            if s.finished and not self.reported:
                self.reported = True
                result = _result_message(s.result, t)
        s = self.session
        return out, (s.next_timer() if s is not None else None), result


def _result_message(res: Any, at: float) -> dict[str, Any]:
    return {
        "utility": float(res.utility_recovered),
        "reason": res.reason,
        "complete": np.asarray(res.complete, dtype=bool),
        "payload": np.asarray(res.payload, dtype=np.uint8),
        "app_metadata": res.app_metadata,
        "at": float(at),
    }


def _peer_main(role: str, fd: int) -> int:
    """A peer process: answer the coordinator's requests until told to quit."""
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator decides when to stop
    conn = Connection(fd)
    peer: Any = _SenderPeer() if role == "sender" else _ReceiverPeer()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 0
        if msg[0] == "quit":
            return 0
        try:
            reply = ("ok", *getattr(peer, msg[0])(*msg[1:]))
        except UserError as exc:
            reply = ("error", str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, one line
            reply = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(reply)


# ---------------------------------------------------------------------------------------
# the netns link: the real daemons in the testbed's namespaces


class NetnsLink:
    """The real sender and receiver daemons in the testbed's two namespaces, ``profile``
    between them, real-time priority, driven over ZeroMQ from this process.

    The constructor builds the testbed and starts both daemons without waiting for them
    (they load their code while the caller works); :meth:`ready` waits until they answer
    and sends one small warm-up transfer per policy in ``policies``. The testbed is private
    to this process (prefix from the pid) and removed by :meth:`close`; the daemons'
    control and result sockets are ipc:// files in a private temporary directory, so
    nothing collides with other runs.
    """

    name = "netns"

    def __init__(self, seed: int, profile: str = PROFILE, policies: tuple[str, ...] = ()) -> None:
        from kvtransport.netem.testbed import RCV_ADDR, Testbed

        self.policies = policies
        self.dir = Path(tempfile.mkdtemp(prefix="kvt-demo-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.clients: list[Any] = []
        self.endpoints = {
            name: f"ipc://{self.dir}/{name}.ipc" for name in ("sender", "receiver", "results")
        }
        self.dest = f"{RCV_ADDR}:{RECEIVER_PORT}"
        self.tb = Testbed(profile, prefix=f"kvd{os.getpid() % 100000}", seed=seed, shaper="relay")
        self.tb.up()
        try:
            cli = [sys.executable, "-m", "kvtransport"]
            rt = ["--realtime", str(DAEMON_PRIORITY)]
            ep = self.endpoints
            self._spawn("receiver", "rcv", [*cli, "receiver-daemon", "--listen", self.dest,
                        "--control", ep["receiver"], "--publish", ep["results"], *rt])  # fmt: skip
            # kernel netem drops or keeps a UDP GSO batch whole: one datagram per send there
            gso = ["--no-gso"] if self.tb.backend == "netem" else []
            self._spawn("sender", "snd", [*cli, "sender-daemon", "--control", ep["sender"],
                        "--rate-mbps", f"{self.tb.profile.rate_mbps:g}", *rt, *gso])  # fmt: skip
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        return (
            f"netns: sender-daemon in {self.tb.snd_ns}, receiver-daemon in {self.tb.rcv_ns}, "
            f"{self.tb.profile.describe()} each way via the {self.tb.backend} backend, "
            f"real time (SCHED_FIFO {DAEMON_PRIORITY})"
        )

    def _spawn(self, name: str, side: str, argv: list[str]) -> None:
        err = open(self.dir / f"{name}.log", "w")  # noqa: SIM115 (the child writes it)
        try:
            self.procs[name] = subprocess.Popen(
                self.tb.command(side, argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        finally:
            err.close()

    def _wait_for(self, name: str, client_type: Any, timeout_s: float = 60.0) -> None:
        """Ping a daemon until it answers; a daemon that exits gives its last log line."""
        from kvtransport.api import ApiError

        end = time.monotonic() + timeout_s
        with client_type(self.endpoints[name], timeout_s=0.5) as client:
            while True:
                if self.procs[name].poll() is not None:
                    raise UserError(f"the {name} daemon failed to start: {self._last_log(name)}")
                try:
                    client.ping()
                    return
                except ApiError:
                    if time.monotonic() > end:
                        raise UserError(
                            f"the {name} daemon did not answer within {timeout_s:g} s"
                        ) from None

    def _last_log(self, name: str) -> str:
        text = (self.dir / f"{name}.log").read_text(errors="replace").strip()
        return text.splitlines()[-1] if text else "no output"

    def ready(self) -> None:
        """Wait for both daemons, subscribe to results, warm each policy up (one small
        transfer each: the daemons load its compiled code, RLC, Reed-Solomon or the DDQN
        network, before a measured transfer would pay for it inside its deadline)."""
        from kvtransport.client import ReceiverClient, ResultSubscriber, SenderClient
        from kvtransport.transfer import synthetic_transfer

        self._wait_for("receiver", ReceiverClient)
        self._wait_for("sender", SenderClient)
        self.sender = SenderClient(self.endpoints["sender"], timeout_s=30)
        self.results = ResultSubscriber(self.endpoints["results"])
        self.clients = [self.sender, self.results]
        time.sleep(0.2)  # the subscription reaches the PUB socket before any result
        for i, policy in enumerate(self.policies):
            tr = synthetic_transfer(WARM_UP_BYTES, 16, "linear", seed=i)
            tid = self.sender.submit(tr, self.dest, rho=2.0, policy=policy, label="warm-up")
            self.results.wait_for(tid, timeout_s=30)
            self.sender.wait(tid, timeout_s=10)

    def load(self, transfer: Any) -> None:
        self._transfer = transfer

    def transfer(
        self,
        policy: str,
        *,
        deadline_s: float,
        transfer_id: int,
        seed: int,
        on_progress: Callable[[float], None] | None = None,
    ) -> LinkOutcome:
        t0 = time.perf_counter()
        tid = self.sender.submit(
            self._transfer,
            self.dest,
            deadline_ms=deadline_s * 1e3,
            policy=policy,
            transfer_id=transfer_id,
            initial_rtt_ms=INITIAL_RTT_S * 1e3,
            label=f"demo {policy}",
        )
        res = self._wait_result(tid, t0, deadline_s, on_progress)
        transfer_s = time.perf_counter() - t0
        st = self.sender.wait(tid, timeout_s=10)
        if on_progress is not None:
            on_progress(1.0)
        rs = res.stats
        counters = {
            "datagrams_sent": st["datagrams_sent"],
            "datagrams_lost": rs.get("datagrams_lost"),
            "source_sent": st["source_sent"],
            "repair_sent": st["repair_sent"],
        }
        return LinkOutcome(
            utility=float(res.utility_recovered),
            reason=res.reason,
            complete=np.asarray(res.complete, dtype=bool),
            payload=np.asarray(res.payload, dtype=np.uint8),
            app_metadata=res.app_metadata,
            transfer_s=transfer_s,
            counters=counters,
        )

    def _wait_result(
        self, tid: str, t0: float, deadline_s: float, on_progress: Callable[[float], None] | None
    ) -> Any:
        """The transfer's published result; meanwhile the progress follows the clock."""
        from kvtransport.api import ApiError

        end = t0 + deadline_s + 30.0
        while True:
            try:
                return self.results.wait_for(tid, timeout_s=0.1)
            except ApiError:
                now = time.perf_counter()
                if now > end:
                    raise UserError(
                        f"no result for transfer {tid} {now - t0:.0f} s after it started "
                        f"(sender daemon: {self._last_log('sender')}; receiver daemon: "
                        f"{self._last_log('receiver')})"
                    ) from None
                if on_progress is not None:
                    on_progress(min((now - t0) / deadline_s, 1.0))

    def close(self) -> None:
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.close()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(Exception):
            self.tb.down()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def open_link(
    link: str, seed: int, policies: tuple[str, ...] = (), *, fallback: bool = False
) -> Iterator[tuple[Any, str]]:
    """(link object, note) for "netns" or "emulated", closed on exit; both start loading
    ``policies`` at once. With ``fallback``, a testbed that cannot come up gives the
    emulated link and a note saying why."""
    note = ""
    if link == "netns":
        try:
            obj: Any = NetnsLink(seed, policies=policies)
        except UserError as exc:
            if not fallback:
                raise
            note = f"the netns testbed did not come up ({exc}); using the emulated link"
            obj = EmulatedLink(policies=policies)
    else:
        obj = EmulatedLink(policies=policies)
    try:
        yield obj, note
    finally:
        obj.close()


# ---------------------------------------------------------------------------------------
# answering


def _answer(loaded: Any, kv: Any, present: np.ndarray | None, question_ids: list[int],
            max_new_tokens: int) -> tuple[str, float]:  # fmt: skip
    """(answer text, seconds from injection start to the first token)."""
    from kvtransport import hf

    if present is not None and present.all():
        present = None
    gen = hf.greedy_generate(
        loaded.model, kv, question_ids, present=present, max_new_tokens=max_new_tokens
    )
    text = loaded.tokenizer.decode(gen.tokens, skip_special_tokens=True).strip()
    return text, gen.first_token_seconds


def _rebuild(stream: Any, outcome: LinkOutcome, context_ids: list[int]) -> tuple[Any, np.ndarray]:
    """The receiver's cache and presence mask from what arrived (all masked if the
    manifest never came: the receiver then knows nothing of the context)."""
    from kvtransport import blocks
    from kvtransport.kvcache import KVCache

    if outcome.app_metadata is None:
        g = stream.manifest.geometry
        shape = (g.num_layers, g.num_kv_heads, g.num_tokens, g.head_dim)
        zeros = np.zeros(shape, dtype=np.float32)
        kv = KVCache(zeros, zeros.copy(), np.asarray(context_ids, dtype=np.int64),
                     stream.manifest.model_id)  # fmt: skip
        return kv, np.zeros((g.num_layers, g.num_tokens), dtype=bool)
    got = blocks.decode_stream(
        outcome.app_metadata, outcome.payload, outcome.complete, token_ids=context_ids
    )
    return got.cache, got.present


# ---------------------------------------------------------------------------------------
# the whole demo


def transfer_id_for(seed: int, index: int) -> int:
    """The transfer id of scheme ``index`` for ``seed`` (ids are part of the datagrams, so
    a repeatable run needs repeatable ids)."""
    return (_TID_BASE + (int(seed) & 0xFFFF) * 256 + index) & (2**64 - 1)


def run_demo(cfg: DemoConfig, loaded: Any = None) -> DemoReport:
    """Run the demo (see the module docstring); ``loaded`` reuses a loaded model.

    The link opens first, so a link that cannot work fails before the slow model load and
    its processes load their code while the model prefills.
    """
    _check_config(cfg)
    t_all = time.perf_counter()
    link, note = choose_link(cfg.link)
    ui = _Progress(cfg.progress)
    timings: dict[str, float] = {}
    rows = _scheme_rows()
    policies = tuple(r.policy for r in rows if not r.error)
    with open_link(link, cfg.seed, policies, fallback=cfg.link == "auto") as (lk, fell_back):
        if fell_back:
            link, note = lk.name, fell_back
        if note:
            ui.note(f"note: {note}")
        link_text = lk.describe()
        prep = _prepare(cfg, loaded, ui, timings)
        t = time.perf_counter()
        lk.ready()
        lk.load(prep.transfer)
        outcomes = _run_transfers(lk, rows, prep.deadline_s, cfg.seed, ui)
        timings["transfers"] = time.perf_counter() - t
    t = time.perf_counter()
    baseline = _answer_all(cfg, prep, rows, outcomes, ui)
    timings["answers"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t_all
    return _report(cfg, link, note, link_text, prep, baseline, rows, timings)


def _scheme_rows() -> list[SchemeResult]:
    """One row per scheme; a policy that cannot be made here (no shipped DDQN weights, say)
    keeps its row with the reason instead of stopping the demo."""
    from kvtransport.policy import make_policy

    rows = [SchemeResult(label, spec) for label, spec in SCHEMES]
    for row in rows:
        try:
            make_policy(row.policy)
        except UserError as exc:
            row.error = f"unavailable: {exc}"
    return rows


@dataclass
class _Prepared:
    """The model, the task's two halves and the block stream that crosses the link."""

    loaded: Any
    sample: Any
    context_ids: list[int]
    question_ids: list[int]
    stream: Any
    cached: bool
    transfer: Any
    send_time_s: float
    deadline_s: float


def _prepare(cfg: DemoConfig, loaded: Any, ui: _Progress, timings: dict[str, float]) -> _Prepared:
    from kvtransport import tasks
    from kvtransport.model import load_model, set_threads
    from kvtransport.protocol import DEFAULT_SYMBOL_SIZE
    from kvtransport.simulator import full_send_time
    from kvtransport.transfer import Transfer

    t = time.perf_counter()
    if loaded is None:
        ui.note("loading the model ...")
        loaded = load_model(threads=cfg.threads)
    else:
        set_threads(cfg.threads)
    timings["load_model"] = time.perf_counter() - t
    tok = loaded.tokenizer
    sample = tasks.generate(cfg.task, tok, target_tokens=cfg.tokens, seed=cfg.seed)
    context_ids, question_ids = sample.prompt(tok)
    ui.note(f"prefilling {len(context_ids)} context tokens ({cfg.task}, seed {cfg.seed}) ...")
    stream, cached, timings["card_prefill"] = prepare_card(
        loaded, sample, context_ids, cfg.card_dir
    )
    transfer = Transfer.from_encoded_stream(stream)
    send_time = full_send_time(transfer.nbytes, _profile_rate_bps(), DEFAULT_SYMBOL_SIZE)
    return _Prepared(
        loaded, sample, context_ids, question_ids, stream, cached, transfer, send_time,
        cfg.rho * send_time,
    )  # fmt: skip


def _run_transfers(
    lk: Any, rows: list[SchemeResult], deadline_s: float, seed: int, ui: _Progress
) -> dict[int, LinkOutcome]:
    """Each runnable scheme's transfer over the open link, with a progress bar each."""
    outcomes: dict[int, LinkOutcome] = {}
    total_ms = deadline_s * 1e3
    fmt = "{desc:<13} {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} ms to the deadline"
    for i, row in enumerate(rows):
        if row.error:
            continue
        with ui.bar(total_ms, row.label, fmt=fmt) as bar:

            def step(frac: float, bar: Any = bar, total_ms: float = total_ms) -> None:
                bar.n = round(total_ms * frac)
                bar.refresh()

            try:
                outcomes[i] = lk.transfer(
                    row.policy,
                    deadline_s=deadline_s,
                    transfer_id=transfer_id_for(seed, i),
                    seed=seed,
                    on_progress=step,
                )
            except _PeerError as exc:
                row.error = str(exc)
    return outcomes


def _answer_all(
    cfg: DemoConfig,
    prep: _Prepared,
    rows: list[SchemeResult],
    outcomes: dict[int, LinkOutcome],
    ui: _Progress,
) -> dict[str, Any]:
    """Re-prefill (the TTFT baseline), the full-cache answer (the F1 reference), then each
    scheme's answer from its partial cache; fills the rows, returns the baselines."""
    from kvtransport import blocks, hf, metrics

    lm, q = prep.loaded, prep.question_ids
    with ui.bar(2 + len(outcomes), "answering", unit="answer") as bar:
        t0 = time.perf_counter()
        kv_plain = hf.prefill(lm.model, lm.tokenizer, prep.context_ids, attention=False)
        prefill_s = time.perf_counter() - t0
        re_answer, re_first = _answer(lm, kv_plain, None, q, cfg.max_new_tokens)
        del kv_plain
        bar.update(1)
        stream = prep.stream
        full = blocks.decode_stream(stream.manifest, stream.payload, token_ids=prep.context_ids)
        full_answer, _ = _answer(lm, full.cache, None, q, cfg.max_new_tokens)
        bar.update(1)
        reprefill_ttft = prefill_s + re_first
        n_blocks = stream.manifest.num_blocks
        for i, out in outcomes.items():
            row = rows[i]
            t0 = time.perf_counter()
            kv, present = _rebuild(stream, out, prep.context_ids)
            row.rebuild_s = time.perf_counter() - t0
            row.answer, row.first_token_s = _answer(lm, kv, present, q, cfg.max_new_tokens)
            row.utility = out.utility
            row.blocks_total = n_blocks
            missing = int((~out.complete).sum()) if out.app_metadata is not None else n_blocks
            row.blocks_missing = missing
            row.reason = out.reason
            row.f1 = metrics.token_f1(row.answer, full_answer)
            row.transfer_s = out.transfer_s
            row.ttft_s = out.transfer_s + row.rebuild_s + row.first_token_s
            row.speedup = reprefill_ttft / row.ttft_s
            row.counters = out.counters
            bar.update(1)
    return {
        "full_answer": full_answer,
        "reprefill": {"answer": re_answer, "prefill_s": prefill_s, "ttft_s": reprefill_ttft},
    }


def _report(
    cfg: DemoConfig,
    link: str,
    note: str,
    link_text: str,
    prep: _Prepared,
    baseline: dict[str, Any],
    rows: list[SchemeResult],
    timings: dict[str, float],
) -> DemoReport:
    from kvtransport import metrics

    g = prep.stream.manifest.geometry
    sample = prep.sample
    full_answer = baseline["full_answer"]
    return DemoReport(
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        link={
            "mode": link,
            "note": note,
            "description": link_text,
            "deterministic": _determinism_text(link, cfg.seed),
        },
        task={
            "name": sample.task,
            "seed": sample.seed,
            "question": sample.question,
            "gold": list(sample.answers),
            "gold_f1_full": metrics.token_f1(full_answer, sample.answers),
        },
        cache={
            "model_id": prep.loaded.model_id,
            "context_tokens": len(prep.context_ids),
            "question_tokens": len(prep.question_ids),
            "layers": g.num_layers,
            "blocks": prep.stream.manifest.num_blocks,
            "block_tokens": g.block_tokens,
            "dtype": g.dtype,
            "bytes": prep.transfer.nbytes,
            "card_cached": prep.cached,
        },
        deadline_s=prep.deadline_s,
        send_time_s=prep.send_time_s,
        full_answer=full_answer,
        reprefill=baseline["reprefill"],
        answers_agree=baseline["reprefill"]["answer"] == full_answer,
        schemes=rows,
        timings=timings,
    )


def _profile_rate_bps() -> float:
    from kvtransport.netem import load_profile

    return load_profile(PROFILE).rate_bps


def _check_config(cfg: DemoConfig) -> None:
    from kvtransport.tasks import TASK_NAMES

    if cfg.task not in TASK_NAMES:
        raise UserError(f"--task must be one of {', '.join(TASK_NAMES)}, not {cfg.task!r}")
    if not 32 <= cfg.tokens <= MAX_TOKENS:
        raise UserError(f"--tokens must be 32..{MAX_TOKENS}, not {cfg.tokens}")
    if not (cfg.rho > 0 and math.isfinite(cfg.rho)) or cfg.rho > 10:
        raise UserError(f"--rho must be in (0, 10], not {cfg.rho:g}")
    if cfg.threads < 1:
        raise UserError(f"--threads must be at least 1, not {cfg.threads}")
    if cfg.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if cfg.link not in LINKS:
        raise UserError(f"--link must be one of {', '.join(LINKS)}, not {cfg.link!r}")


def _determinism_text(link: str, seed: int) -> str:
    if link == "emulated":
        return (
            f"yes for seed {seed}: utility, blocks, answers, F1 and link times repeat exactly "
            "(the link runs on its own clock); TTFT's compute part is measured and varies"
        )
    return (
        "no: real clocks and kernel queues decide when packets leave and when feedback "
        "arrives, so each run differs a little; --link emulated gives a repeatable table"
    )


# ---------------------------------------------------------------------------------------
# the table


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def render_table(rep: DemoReport) -> str:
    """The human-readable report: header, side-by-side table, what the columns mean."""
    c, t = rep.cache, rep.task
    lines = [
        "kvtransport demo: a KV-cache handoff across a burst-loss link",
        f"  link      {rep.link['description']}",
    ]
    if rep.link["note"]:
        lines.append(f"  note      {rep.link['note']}")
    lines += [
        f"  repeats   {rep.link['deterministic']}",
        f"  task      {t['name']} (seed {t['seed']}): {t['question']}  "
        f"[gold: {'; '.join(t['gold'])}]",
        f"  cache     {c['model_id']}: {c['context_tokens']} context tokens, {c['layers']} "
        f"layers, {c['blocks']} blocks of {c['block_tokens']} tokens, "
        f"{c['bytes'] / 2**20:.1f} MiB {c['dtype']}"
        + (" (card from the cache directory)" if c["card_cached"] else ""),
        f"  deadline  rho {rep.config['rho']:g}: {rep.deadline_s * 1e3:.0f} ms "
        f"(the whole cache takes {rep.send_time_s * 1e3:.0f} ms loss-free at the link rate)",
        "",
    ]
    head = ("scheme", "utility", "blocks missing", "answer", "F1", "TTFT s", "speed-up")
    rows: list[tuple[str, ...]] = [
        ("full cache", "1.000", f"0/{c['blocks']}", _clip(rep.full_answer, 34), "1.00", "-", "-")
    ]
    for s in rep.schemes:
        if s.utility is None:
            rows.append((s.label, "-", "-", _clip(s.error or "did not run", 34), "-", "-", "-"))
            continue
        rows.append(
            (
                s.label,
                f"{s.utility:.3f}",
                f"{s.blocks_missing}/{s.blocks_total}",
                _clip(s.answer, 34),
                f"{s.f1:.2f}",
                f"{s.ttft_s:.2f}",
                f"{s.speedup:.1f}x" if s.speedup else "-",
            )
        )
    rp = rep.reprefill
    rows.append(
        ("re-prefill", "-", "-", _clip(rp["answer"], 34),
         f"{_f1(rp['answer'], rep.full_answer):.2f}", f"{rp['ttft_s']:.2f}", "1.0x")
    )  # fmt: skip
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
    right = {1, 2, 4, 5, 6}

    def fmt(r: tuple[str, ...]) -> str:
        cells = [
            x.rjust(w) if k in right else x.ljust(w)
            for k, (x, w) in enumerate(zip(r, widths, strict=True))
        ]
        return "  " + "  ".join(cells).rstrip()

    lines.append(fmt(head))
    lines.append("  " + "  ".join("-" * w for w in widths))
    lines += [fmt(r) for r in rows]
    agree = "equals" if rep.answers_agree else "DIFFERS FROM"
    lines += [
        "",
        f"  The full-cache answer {agree} the re-prefill answer.",
        "  utility: share of the cache's utility in blocks complete at the receiver's deadline;",
        "  F1: token F1 of the answer against the full-cache answer;",
        "  TTFT: transfer until the receiver's result + rebuild + injection + first token,",
        f"  against re-prefilling the context ({rp['prefill_s']:.2f} s) + first token; "
        f"torch threads: {rep.config['threads']}.",
        f"  wall time {rep.timings['total']:.1f} s "
        f"(transfers {rep.timings['transfers']:.1f} s, answers {rep.timings['answers']:.1f} s).",
    ]
    return "\n".join(lines)


def _f1(a: str, b: str) -> float:
    from kvtransport.metrics import token_f1

    return token_f1(a, b)


def report_json(rep: DemoReport) -> str:
    """One JSON object (``--json``)."""
    return json.dumps(rep.to_dict(), default=_json_default)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer | np.floating):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def _main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--peer" and argv[1] in ("sender", "receiver"):
        return _peer_main(argv[1], int(argv[2]))
    print("usage: python -m kvtransport.demo --peer sender|receiver FD "
          "(started by kvtransport demo)", file=sys.stderr)  # fmt: skip
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
