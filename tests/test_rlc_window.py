"""The RLC proactive repair's window, tested on the mechanism itself (sans-I/O sessions).

A proactive repair covers the symbols feedback has not described, up to and including the
newest source sent (kvtransport.core.schemes.rlc, ``RLCSender._window``): its window must end
at ``next_esi``, so that a receiver missing only the newest source can decode it from the
very next repair. The slot-by-slot and batched sender paths share that window, so the
comparison tests (tests/test_sender_runs.py) cannot see a window that stops one short; these
tests read the windows off the wire and decode with a real receiver.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtransport.core import wire
from kvtransport.core.receiver import ReceiverSession
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.core.wire import DatagramType as T
from kvtransport.policies.registry import make_policy

TID = 0x0BAD_CAFE_F00D_0001
RATE = 100e6
# long: the sources and the first tail repairs go out well before the sender could count as
# open loop (2 initial RTTs without a report), so every repair here is a closed-loop
# proactive one
INITIAL_RTT = 0.2
SIZE = 200_000  # 157 sources of 1280 bytes


def _sender(policy: str = "fixed:1/4") -> SenderSession:
    tr = synthetic_transfer(SIZE, 10, "zipf", seed=11)
    return SenderSession(tr, make_policy(policy), rate_bps=RATE, deadline=1.0,
                         transfer_id=TID, initial_rtt=INITIAL_RTT)  # fmt: skip


def _drive(s: SenderSession, n_datagrams: int, step_slots: int = 1):
    """``n_datagrams`` datagrams as the sender emits them with no feedback at all, each as
    (raw bytes, parsed, newest source ESI sent before it (-1: none), sender open loop)."""
    out = []
    newest = -1
    while len(out) < n_datagrams:
        t = s.next_timer()
        assert t is not None and not s.done
        for raw in s.datagrams_to_send(t + (step_slots - 1) * s.slot_s):
            d = wire.parse(raw)
            out.append((raw, d, newest, s.open_loop))
            if d.type == T.SOURCE:
                assert d.esi == newest + 1  # stream order, never skipped
                newest = d.esi
    return out


@pytest.mark.parametrize("step_slots", [1, 8], ids=["slot-by-slot", "runs"])
def test_every_proactive_repair_ends_at_the_newest_source_sent(step_slots):
    """With no feedback (nothing described yet), each proactive repair's window [esi,
    esi + nss) ends exactly at the newest source sent so far: it covers that source, and
    nothing not yet sent. This holds mid-stream (repairs between sources) and in the tail
    (once every source is out, the fill repairs cover the stream's last source)."""
    s = _sender()
    trace = _drive(s, 260, step_slots)
    repairs = [(d, newest, ol) for _, d, newest, ol in trace if d.type == T.REPAIR]
    mid = [r for r in repairs if r[1] < s.n_source - 1]
    tail = [r for r in repairs if r[1] == s.n_source - 1]
    assert len(mid) >= 20 and len(tail) >= 10  # the case is exercised both ways
    for d, newest, open_loop in repairs:
        assert not open_loop
        assert d.nss >= 1
        assert d.esi <= newest < d.esi + d.nss, (d.esi, d.nss, newest)  # covers the newest
        assert d.esi + d.nss == newest + 1, (d.esi, d.nss, newest)  # and nothing unsent


def _recovers_from(trace, i, newest) -> tuple[ReceiverSession, bool, bool]:
    """A receiver gets every datagram before trace[i] except source ``newest``, then
    trace[i]: did it know ``newest`` before, and after?"""
    r = ReceiverSession(TID, deadline=1.0)
    for k, (raw, d, _, _) in enumerate(trace[:i]):
        if not (d.type == T.SOURCE and d.esi == newest):
            r.receive_datagram(raw, k * 1e-4)
    before = r.known_symbol(newest) is not None
    r.receive_datagram(trace[i][0], i * 1e-4)
    return r, before, r.known_symbol(newest) is not None


def test_a_receiver_missing_only_the_newest_source_decodes_it_from_the_next_repair():
    """Lose exactly the newest source before a proactive repair, deliver everything else
    and then that repair: the receiver decodes the lost source from it, byte for byte. For
    repairs mid-stream, and for the first repair once the whole stream is out (the
    stream's last source, which no later source's repairs would ever cover)."""
    s = _sender()
    trace = _drive(s, 260)
    repairs = [(i, newest) for i, (_, d, newest, _) in enumerate(trace) if d.type == T.REPAIR]
    last = s.n_source - 1
    picks = [
        next((i, e) for i, e in repairs if e >= 1),  # the first with a source before it
        next((i, e) for i, e in repairs if e >= last // 2),  # one mid-stream
        next((i, e) for i, e in repairs if e == last),  # the first once the stream is out
    ]
    assert picks[0][1] < picks[1][1] < picks[2][1]
    for i, newest in picks:
        r, before, after = _recovers_from(trace, i, newest)
        assert not before, newest  # the repair is what delivers it
        assert after, newest
        assert bytes(r.known_symbol(newest)) == bytes(s.source_symbol(newest))


def test_the_stream_end_is_recovered_with_the_feedback_path_dead():
    """End to end, the case a window one short would lose for good: the stream's last
    source is lost and the receiver's reports never reach the sender (no reactive repair
    can ask for it). Only the proactive (fill, then open-loop) repairs can deliver it, and
    they do: the transfer completes."""
    s = _sender("adaptive")
    r = ReceiverSession(TID, deadline=1.0)
    last = s.n_source - 1
    t = s.next_timer()
    while t is not None and not s.done and t < 1.0:
        for raw in s.datagrams_to_send(t):
            d = wire.parse(raw)
            if not (d.type == T.SOURCE and d.esi == last):
                r.receive_datagram(raw, t + 0.005)
        r.datagrams_to_send(t)  # its feedback is lost
        if r.finished:
            break
        t = s.next_timer()
    assert r.known_symbol(last) is not None
    tr = synthetic_transfer(SIZE, 10, "zipf", seed=11)
    assert r.finished and r.result.reason == "complete"
    assert np.array_equal(r.result.payload, tr.payload)
