"""A small Python client for the daemons' ZeroMQ API (kvtransport.daemons.api).

::

    from kvtransport.embed.client import SenderClient, ResultSubscriber

    with ResultSubscriber() as results, SenderClient() as sender:   # default ipc:// paths
        tid = sender.submit(transfer, to="10.77.0.2:9400", rho=0.8)  # sent as it is
        # a cache card (path), planned for the deadline; the racing receiver computes the front
        tid = sender.submit("notes.card", to="10.77.0.2:9400", deadline_ms=500,
                            receiver_speed=speed)
        print(sender.status(tid))
        result = results.wait_for(tid, timeout_s=5)                  # DeliveredResult
        print(result.utility_recovered, result.missing)

Requests use a REQ socket with ``REQ_RELAXED``/``REQ_CORRELATE`` and a receive timeout,
so a daemon that is not running gives an :class:`~kvtransport.daemons.api.ApiError` after
``timeout_s`` rather than a hang. Transfers are sent zero-copy: the payload frame is the
caller's buffer (numpy array, bytes or a CPU torch tensor), which must not change until
``submit`` returns.

A daemon on another host (a ``tcp://`` endpoint off loopback) must run with CURVE
(``--curve-secret FILE``); every client then names its public key, ``curve_server_key=
"FILE.pub"`` (kvtransport.daemons.curve). Without it such an endpoint is refused in one line.
"""

from __future__ import annotations

import os
import time
from typing import Any, Self

from kvtransport.core.protocol import DEFAULT_INITIAL_RTT
from kvtransport.core.transfer import Transfer
from kvtransport.daemons.api import (
    DEFAULT_RECEIVER_CONTROL,
    DEFAULT_RESULTS,
    DEFAULT_SENDER_CONTROL,
    RESULT_TOPIC,
    ApiError,
    DeliveredResult,
    check_endpoint,
    dump_json,
    format_tid,
    load_json_header,
    result_from_frames,
    transfer_frames,
)
from kvtransport.errors import UserError

DEFAULT_TIMEOUT_S = 5.0


def _tid_text(tid: int | str) -> str:
    return format_tid(tid) if isinstance(tid, int) else str(tid)


class _Closing:
    """``with`` closes it."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Socket(_Closing):
    """A ZeroMQ socket (no linger) in the caller's context, or in one of its own that
    closing it ends; a CURVE client of the daemon whose public key is ``curve_server_key``
    (kvtransport.daemons.curve: the Z85 text or its file), which any tcp:// endpoint then
    needs, with the key pair in the file ``curve_client_key`` (the daemon admits only the
    clients its allowlist names; without one a throwaway pair, which none does)."""

    def __init__(
        self,
        kind: str,
        context: Any,
        endpoint: str,
        curve_server_key: str | bytes | None,
        curve_client_key: str | None = None,
    ) -> None:
        import zmq

        server_key = None
        if curve_server_key is not None:
            from kvtransport.daemons.curve import server_public_key

            server_key = server_public_key(curve_server_key)
        # no request to, or result from, a socket another user could have put there
        check_endpoint(endpoint, curve=server_key is not None)
        self._zmq = zmq
        self._own = context is None
        self.context = context or zmq.Context()
        self.sock = self.context.socket(getattr(zmq, kind))
        self.sock.setsockopt(zmq.LINGER, 0)
        if server_key is not None:
            from kvtransport.daemons.curve import connect_as_client

            connect_as_client(self.sock, server_key, curve_client_key)
        elif curve_client_key is not None:
            raise UserError("curve_client_key needs curve_server_key (the daemon's FILE.pub)")

    def close(self) -> None:
        self.sock.close(linger=0)
        if self._own:
            self.context.term()


class _Requester(_Socket):
    """One REQ socket to a daemon's control endpoint."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float,
        context: Any,
        curve_server_key: str | bytes | None,
        curve_client_key: str | None = None,
    ) -> None:
        super().__init__("REQ", context, endpoint, curve_server_key, curve_client_key)
        zmq = self._zmq
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.sock.setsockopt(zmq.REQ_RELAXED, 1)
        self.sock.setsockopt(zmq.REQ_CORRELATE, 1)
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self.sock.connect(endpoint)

    def request(self, head: dict[str, Any], frames: list | None = None) -> dict[str, Any]:
        """Send one request; return the reply's JSON (ApiError when ``ok`` is false)."""
        zmq = self._zmq
        try:
            self.sock.send_multipart([dump_json(head), *(frames or [])], copy=False)
            reply = self.sock.recv_multipart()
        except zmq.Again:
            raise ApiError(
                f"no answer from {self.endpoint} within {self.timeout_s:g} s (is the daemon "
                "running?)"
            ) from None
        out = load_json_header(reply[0])
        if not out.get("ok"):
            raise ApiError(f"{head.get('op')}: {out.get('error', 'refused')}")
        return out


class _DaemonClient(_Closing):
    """What both daemons answer: status, stats, ping (see kvtransport.daemons.api)."""

    DEFAULT_ENDPOINT = ""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        context: Any = None,
        curve_server_key: str | bytes | None = None,
        curve_client_key: str | None = None,
    ) -> None:
        self._req = _Requester(
            endpoint or self.DEFAULT_ENDPOINT, timeout_s, context, curve_server_key,
            curve_client_key,
        )  # fmt: skip

    def status(self, transfer_id: int | str | None = None) -> Any:
        """One transfer's status (a dict) or, without an id, a list of all of them."""
        head: dict[str, Any] = {"op": "status"}
        if transfer_id is not None:
            head["transfer_id"] = _tid_text(transfer_id)
            return self._req.request(head)["transfers"][0]
        return self._req.request(head)["transfers"]

    def stats(self) -> dict[str, Any]:
        return self._req.request({"op": "stats"})["stats"]

    def ping(self) -> dict[str, Any]:
        return self._req.request({"op": "ping"})

    def close(self) -> None:
        self._req.close()


class SenderClient(_DaemonClient):
    """Submit transfers to a sender daemon, ask their status, cancel them."""

    DEFAULT_ENDPOINT = DEFAULT_SENDER_CONTROL

    def submit(
        self,
        transfer: Transfer | str | os.PathLike,
        to: str,
        *,
        deadline_ms: float | None = None,
        rho: float | None = None,
        policy: str | None = None,
        weight: float = 1.0,
        utility: dict[str, float] | None = None,
        model: str | None = None,
        context_tokens: int | None = None,
        label: str = "",
        transfer_id: int | str | None = None,
        initial_rtt_ms: float | None = None,
        precision: str | tuple[str, ...] = "auto",
        loss_estimate: float = 0.05,
        receiver_speed: Any = None,
        rate_mbps: float | None = None,
        question_tokens: int | None = None,
    ) -> str:
        """Start a transfer to the receiver at ``to`` (HOST:PORT); returns its transfer id
        (16 hex digits). ``transfer``: a :class:`Transfer` (sent as it is), or a cache card
        (path), KVCache or block stream, which with ``deadline_ms`` is sent as the handoff
        plan encodes it, planned here as kvtransport.send does (``precision``,
        ``loss_estimate``, ``receiver_speed``, ``question_tokens``: see
        kvtransport.embed.inprocess.send) for
        ``rate_mbps`` (default: the daemon's link rate); "keep" sends it as it is."""
        if not isinstance(transfer, Transfer):
            from kvtransport.embed.inprocess import as_transfer, handoff_plan

            plan = None
            if deadline_ms is not None and precision != "keep":
                rate = rate_mbps if rate_mbps is not None else float(self.stats()["rate_mbps"])
                rtt_ms = DEFAULT_INITIAL_RTT * 1e3 if initial_rtt_ms is None else initial_rtt_ms
                plan = handoff_plan(
                    deadline_ms, precision, rate, loss_estimate=loss_estimate,
                    initial_rtt_ms=rtt_ms, receiver_speed=receiver_speed,
                    question_tokens=question_tokens,
                )  # fmt: skip
            transfer = as_transfer(transfer, plan)
        head: dict[str, Any] = {"op": "submit", "to": to, "weight": weight, "label": label}
        for name, value in (
            ("deadline_ms", deadline_ms),
            ("rho", rho),
            ("policy", policy),
            ("utility", utility),
            ("model", model),
            ("context_tokens", context_tokens),
            ("initial_rtt_ms", initial_rtt_ms),
        ):
            if value is not None:
                head[name] = value
        if transfer_id is not None:
            head["transfer_id"] = _tid_text(transfer_id)
        if transfer.whole_ranges:
            head["whole_ranges"] = True
        return str(self._req.request(head, transfer_frames(transfer))["transfer_id"])

    def cancel(self, transfer_id: int | str) -> bool:
        """Abort a transfer in flight; False if it was not (or no longer) in flight."""
        head = {"op": "cancel", "transfer_id": _tid_text(transfer_id)}
        return bool(self._req.request(head)["cancelled"])

    def wait(
        self, transfer_id: int | str, timeout_s: float = 30.0, poll_s: float = 0.02
    ) -> dict[str, Any]:
        """Poll until the transfer is done; returns its final status."""
        end = time.monotonic() + timeout_s
        while True:
            st = self.status(transfer_id)
            if st["state"] == "done":
                return st
            if time.monotonic() > end:
                raise ApiError(f"transfer {_tid_text(transfer_id)} not done after {timeout_s} s")
            time.sleep(poll_s)


class ReceiverClient(_DaemonClient):
    """Ask a receiver daemon about its transfers, or have one deliver early."""

    DEFAULT_ENDPOINT = DEFAULT_RECEIVER_CONTROL

    def abort(self, transfer_id: int | str) -> bool:
        """Deliver the transfer's partial result now (published like any result)."""
        head = {"op": "abort", "transfer_id": _tid_text(transfer_id)}
        return bool(self._req.request(head)["aborted"])


class ResultSubscriber(_Socket):
    """Results a receiver daemon publishes (subscribe before the transfer starts: a PUB
    socket sends nothing to subscribers that were not connected yet)."""

    def __init__(
        self,
        endpoint: str = DEFAULT_RESULTS,
        *,
        context: Any = None,
        curve_server_key: str | bytes | None = None,
        curve_client_key: str | None = None,
    ) -> None:
        super().__init__("SUB", context, endpoint, curve_server_key, curve_client_key)
        self.sock.setsockopt(self._zmq.SUBSCRIBE, RESULT_TOPIC)
        self.sock.connect(endpoint)
        self._held: dict[int, DeliveredResult] = {}
        self._seq: int | None = None
        self.lost = 0
        """Results this subscriber missed: gaps in the daemon's result ``seq`` (the daemon
        holds results for a lagging subscriber, so this stays 0 unless its backlog
        overflowed; a missed result is in its --out-dir file, if it writes them)."""

    def recv(self, timeout_s: float | None = None) -> DeliveredResult | None:
        """The next result (None after ``timeout_s``)."""
        if self._held:
            return self._held.pop(next(iter(self._held)))
        return self._recv(timeout_s)

    def _recv(self, timeout_s: float | None) -> DeliveredResult | None:
        zmq = self._zmq
        ms = None if timeout_s is None else max(int(timeout_s * 1000), 0)
        if not self.sock.poll(ms, zmq.POLLIN):
            return None
        res = result_from_frames(self.sock.recv_multipart(copy=False))
        seq = res.stats.get("seq")
        if isinstance(seq, int):
            if self._seq is not None and seq > self._seq + 1:
                self.lost += seq - self._seq - 1
            self._seq = seq  # (a restarted daemon counts from 1 again)
        return res

    def wait_for(self, transfer_id: int | str, timeout_s: float = 30.0) -> DeliveredResult:
        """The result of one transfer (others that arrive meanwhile are kept for recv)."""
        tid = int(transfer_id, 16) if isinstance(transfer_id, str) else int(transfer_id)
        if tid in self._held:
            return self._held.pop(tid)
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            res = self._recv(left) if left > 0 else None
            if res is None:
                raise ApiError(f"no result for transfer {format_tid(tid)} within {timeout_s} s")
            if res.transfer_id == tid:
                return res
            self._held[res.transfer_id] = res
