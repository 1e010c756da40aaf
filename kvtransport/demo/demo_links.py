"""The links the demo's transfers cross, and what a transfer delivers.

:class:`Link` is what kvtransport.demo.run needs of a link; two implement it:

- :class:`~kvtransport.demo.demo_netns.NetnsLink` (root): the real ``kvtransport
  sender-daemon`` and ``receiver-daemon`` in the netem testbed's two network namespaces;
- :class:`~kvtransport.demo.demo_emulated.EmulatedLink` (any user): the daemons' sender and
  receiver hosts in two processes joined by the userspace channel, on the link's own clock.

Both carry the ``ge-heavy`` profile in both directions; kvtransport.demo.run picks and opens
one (``choose_link``, ``open_link``). This module knows neither implementation.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PROFILE = "ge-heavy"
LINKS = ("auto", "netns", "emulated")
INITIAL_RTT_S = 0.011  # 2 x the profile's 5 ms + 1 ms, as the simulator assumes


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
    # per block (stream order): seconds from the transfer's start until the block was
    # complete at the receiver, inf if it never was (None: the link did not record it)
    arrival_s: np.ndarray | None = None

    @classmethod
    def from_result(
        cls, res: Any, transfer_s: float, counters: dict[str, Any] | None = None
    ) -> LinkOutcome:
        """From a receiver's result (kvtransport.core.transfer.TransferResult, or the daemon's
        published kvtransport.daemons.api.DeliveredResult); block arrival times are counted back
        from the result, which came ``transfer_s`` after the transfer's start."""
        age = getattr(res, "complete_age_s", None)
        return cls(
            utility=float(res.utility_recovered),
            reason=res.reason,
            complete=np.asarray(res.complete, dtype=bool),
            payload=np.asarray(res.payload, dtype=np.uint8),
            app_metadata=res.app_metadata,
            transfer_s=float(transfer_s),
            counters=counters if counters is not None else {},
            arrival_s=None if age is None else _arrival(res.complete, age, transfer_s),
        )


def _arrival(complete: Any, age: Any, transfer_s: float) -> np.ndarray:
    """Per block: seconds from the transfer's start to its completion (inf: never)."""
    age = np.asarray(age, dtype=np.float64)
    done = np.asarray(complete, dtype=bool) & np.isfinite(age)
    return np.where(done, float(transfer_s) - np.where(done, age, 0.0), np.inf)


class NoTimeToSend(Exception):
    """The link's sender refused a transfer whose deadline leaves no time to send
    (kvtransport.hosts.sender_host.NoTimeToSend): nothing of it crossed. The message is the
    sender's one line."""


def refusal_is_no_time(message: str) -> bool:
    """Whether a sender's refusal, as text from another process, is the no-time one."""
    from kvtransport.hosts.sender_host import NO_TIME_TO_SEND

    return NO_TIME_TO_SEND in message


def _no_progress(fraction: float) -> None:
    pass


@dataclass(frozen=True)
class TransferRequest:
    """One scheme's transfer, as :meth:`Link.transfer` was asked for it.

    seed: the link's loss pattern (the emulated link re-seeds its channels with it; the
    netns relay's pattern is fixed when the testbed starts). progress: called with the
    fraction of the deadline gone (0..1).
    """

    policy: str
    deadline_s: float
    transfer_id: int
    seed: int
    progress: Callable[[float], None]


class Link(abc.ABC):
    """A link between a sender and a receiver that the demo drives.

    Its life: the constructor starts it (and starts loading the code of the policies it
    is given, in parallel with the caller's work), :meth:`ready` waits for that,
    :meth:`load` hands it the transfer once, :meth:`transfer` sends it once per scheme,
    :meth:`close` stops everything it started.
    """

    name = ""
    rtt_s: float | None = None
    """The round trip the link measured once :meth:`ready` (None: the profile's): the plan
    and the measured transfers' initial RTT use it."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the table's header: what carries the cache, and how."""

    @abc.abstractmethod
    def ready(self) -> None:
        """Wait until the link can carry a measured transfer."""

    @abc.abstractmethod
    def load(self, transfer: Any) -> None:
        """The transfer (kvtransport.core.transfer.Transfer) every scheme sends."""

    def transfer(
        self,
        policy: str,
        *,
        deadline_s: float,
        transfer_id: int,
        seed: int,
        on_progress: Callable[[float], None] | None = None,
    ) -> LinkOutcome:
        """Send the loaded transfer with ``policy``; returns what the receiver delivered.

        ``on_progress(fraction)`` follows the transfer towards its deadline (0..1). A
        deadline the sender finds too short to send anything in raises
        :class:`NoTimeToSend` (nothing crossed)."""
        progress = on_progress or _no_progress
        return self._transfer(TransferRequest(policy, deadline_s, transfer_id, seed, progress))

    @abc.abstractmethod
    def _transfer(self, req: TransferRequest) -> LinkOutcome: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the processes (and remove the namespaces) the link started."""
