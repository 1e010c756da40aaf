"""The sessions' parts (kvtransport.core.sender, .receiver and what they are made of):
the lifecycle's explicit states and finish reasons, and the repair scheme's read-only view.

Real sessions, real datagrams (sealed with a key), no mocks: a sender's datagrams go to a
receiver and its feedback comes back by hand.
"""

from __future__ import annotations

import json

import pytest

from kvtransport.core import schemes
from kvtransport.core.lifecycle import FinishReason, ReceiverFinish, SenderState
from kvtransport.core.receiver import ReceiverSession
from kvtransport.core.schemes.rlc import RLCSender
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.policies.heuristics import ExternalPolicy
from kvtransport.policies.registry import make_policy

KEY = bytes(range(32))
TID = 0x0123_4567_89AB_CDEF
RATE = 100e6


def _sender(policy: object, deadline: float = 1.0, size: int = 100_000) -> SenderSession:
    tr = synthetic_transfer(size, 10, "zipf", seed=3)
    pol = make_policy(policy) if isinstance(policy, str) else policy
    return SenderSession(
        tr, pol, rate_bps=RATE, deadline=deadline, transfer_id=TID, key=KEY, initial_rtt=0.01
    )


def _exchange(s: SenderSession, r: ReceiverSession, until: float, step: float = 1e-4) -> None:
    """Move both sessions to ``until``: every datagram arrives at once, feedback too."""
    now = 0.0
    while now <= until and not s.done:
        for d in s.datagrams_to_send(now):
            r.receive_datagram(d, now)
        r.handle_timer(now) if (t := r.next_timer()) is not None and t <= now else None
        for fb in r.datagrams_to_send(now):
            s.receive_datagram(fb, now)
        now += step


def test_the_sender_state_moves_sending_awaiting_done_with_string_reasons() -> None:
    s = _sender(ExternalPolicy())
    assert s.state is SenderState.SENDING and s.finish_reason == ""
    assert s.datagrams_to_send(0.0) == []  # slot 0 decides: the policy defers
    assert s.state is SenderState.AWAITING_ACTION and s.next_timer() is None
    s.apply_action(0)
    assert s.state is SenderState.SENDING and s.datagrams_to_send(0.0)
    s.cancel(0.001)
    assert s.state is SenderState.DONE and s.life.reason is FinishReason.CANCELLED
    # the public reason is the plain string logs and JSON always carried
    assert type(s.finish_reason) is str and s.finish_reason == "cancelled"
    assert json.dumps({"reason": s.finish_reason}) == '{"reason": "cancelled"}'
    with pytest.raises(RuntimeError):
        s.apply_action(0)


def test_a_sender_past_its_stop_time_finishes_with_the_deadline_reason() -> None:
    s = _sender("fixed:4/32", deadline=0.002, size=2_000_000)
    out = s.datagrams_to_send(0.01)
    assert s.done and s.finish_reason == FinishReason.DEADLINE == "deadline"
    assert out and s.finished_at is not None and s.finished_at <= 0.002


def test_a_receivers_result_reason_is_a_plain_string() -> None:
    s = _sender("adaptive")
    r = ReceiverSession(TID, key=KEY, deadline=1.0)
    _exchange(s, r, 0.5)
    assert r.finished and r.result is not None
    assert type(r.result.reason) is str and r.result.reason == ReceiverFinish.COMPLETE
    assert s.finish_reason == FinishReason.RECEIVER_DONE.value


def test_a_repair_scheme_gets_a_read_only_view_not_the_session() -> None:
    s = _sender("adaptive")
    rep = s._repair
    assert isinstance(rep, RLCSender)
    view = rep.view
    assert view is not s and not isinstance(view, SenderSession)
    assert view.next_esi == s.next_esi and view.seq == s.seq and view.share == s.share
    for name in ("next_esi", "seq", "share", "fb_through", "stop_time", "open_loop"):
        with pytest.raises(AttributeError):
            setattr(view, name, 1)
    with pytest.raises(AttributeError):
        view.fb_deficit = 1  # type: ignore[attr-defined]  # no such member to write


class _Counting(schemes.SenderRepair):
    """No repairs; each report's deficit is counted as this scheme says: 1000 + reports."""

    def __init__(self, view: schemes.base.SenderView, policy: object) -> None:
        super().__init__(view, policy)  # type: ignore[arg-type]
        self.reports = 0

    def on_feedback(self, fb: object, now: float) -> int | None:
        self.reports += 1
        return 1000 + self.reports


class _CountingScheme(schemes.RepairScheme):
    name = "counting-test"

    def sender(self, view: schemes.base.SenderView, policy: object) -> schemes.SenderRepair:
        return _Counting(view, policy)


def test_what_a_scheme_returns_from_on_feedback_becomes_the_senders_deficit() -> None:
    schemes.register(_CountingScheme())
    try:
        pol = make_policy("fixed:0/32")
        pol.scheme = "counting-test"
        s = _sender(pol)
        r = ReceiverSession(TID, key=KEY, deadline=1.0)
        _exchange(s, r, 0.02)
        reports = s._repair.reports  # type: ignore[attr-defined]
        assert reports >= 2 and s.fb_deficit == 1000 + reports
    finally:
        schemes.unregister("counting-test")
