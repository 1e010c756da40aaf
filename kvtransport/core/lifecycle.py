"""The sessions' lifecycles as explicit states and finish reasons (h11's ``_state.py``).

A sender is ``SENDING``, ``AWAITING_ACTION`` (an ExternalPolicy deferred its decision) or
``DONE`` with a :class:`FinishReason`; a receiver is open until it finishes with a
:class:`ReceiverFinish`. Both enums are str-valued (``StrEnum``): their values are the
strings logs, JSON and the daemons' status have always carried, and the sessions' public
``finish_reason`` / ``result.reason`` stay plain strings of those values.
"""

from __future__ import annotations

from enum import StrEnum


class SenderState(StrEnum):
    SENDING = "sending"
    AWAITING_ACTION = "awaiting action"  # an ExternalPolicy deferred: apply_action resumes
    DONE = "done"


class FinishReason(StrEnum):
    """Why a sender finished."""

    DEADLINE = "deadline"  # past its stop time (a CONTROL FIN went out)
    ALL_SENT = "all sent"  # a scheme that finishes once every source is out (FIN)
    CANCELLED = "cancelled"  # cancel(): a CONTROL ABORT went out
    RECEIVER_DONE = "receiver done"  # feedback: everything decoded (FB_ALL_DONE)
    RECEIVER_FINISHED = "receiver finished"  # feedback: the receiver finished (FB_FINISHED)
    REFUSED = "refused"  # feedback carried a refusal: "refused (REASON)"


class ReceiverFinish(StrEnum):
    """Why a receiver finished (``TransferResult.reason``)."""

    COMPLETE = "complete"  # every source known
    DEADLINE = "deadline"
    FIN = "fin"  # the sender's FIN, and no deadline known: after a short grace
    IDLE = "idle"  # no datagram for ``idle_timeout`` and no deadline known
    ABORT = "abort"  # the sender's ABORT
    SHUTDOWN = "shutdown"  # close() without a reason: the shell is shutting down
    REFUSED = "refused"  # bounded state or budget refused the manifest
    REPLAYED = "replayed"  # the shell's replay record refused the manifest


class SenderLifecycle:
    """Where a sender is in its life, why it finished and when, and the control datagrams
    it owes the shell (an ABORT ``cancel`` queued)."""

    __slots__ = ("done", "reason", "refused", "finished_at", "pending", "pending_at")

    def __init__(self, now: float) -> None:
        self.done = False
        self.reason: FinishReason | None = None
        self.refused = ""  # the receiver's refusal (kvtransport.core.feedback.REFUSALS)
        self.finished_at: float | None = None
        self.pending: list[bytes] = []  # datagrams due at ``pending_at`` (an ABORT)
        self.pending_at = now

    def finish(self, t: float, reason: FinishReason) -> None:
        self.done = True
        self.reason = reason
        self.finished_at = t

    def state(self, awaiting_action: bool) -> SenderState:
        if self.done:
            return SenderState.DONE
        return SenderState.AWAITING_ACTION if awaiting_action else SenderState.SENDING

    @property
    def finish_reason(self) -> str:
        """The reason as a plain string ("" while sending; "refused (REASON)")."""
        reason = self.reason
        if reason is None:
            return ""
        if reason is FinishReason.REFUSED:
            return f"refused ({self.refused})"
        return reason.value
