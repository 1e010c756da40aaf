"""The sender's tail rule, tested on the mechanism itself (sans-I/O sender, no sockets).

The rule (kvtransport.core.sender, module docstring item 3): the next source goes out only
if the expected surviving slots before the stop time, ``left * (1 - p)`` at the loss
estimate ``p``, cover the repairs still owed plus the symbols that finish the source's
block. Here nothing is reported lost and no proactive repair is sent before the cut (the
``tail-rule`` policy: repair share 0), so what is owed is the expected loss among the
sources in flight, ``p`` times those sent since the last report. The tests model that rule
slot by slot from the session's pacing and deadline and check that the sender stops
admitting sources exactly where the model does, and earlier with a loss estimate than
without. The slot-by-slot and batched sender paths share the rule, so the comparison tests
(tests/test_sender_runs.py) cannot see a rule that drops the loss estimate.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtransport.core import protocol, wire
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import BlockTable, Transfer
from kvtransport.core.wire import DatagramType as T
from kvtransport.policies.registry import make_policy

TID = 0x7A11_0000_0000_0043
RATE = 100e6
S = protocol.DEFAULT_SYMBOL_SIZE
B = 10  # symbols per block
N_BLOCKS = 40
# the stop time falls half a slot after slot BUDGET: ``left`` at slot k is BUDGET - k + 1
# (whole slots, clear of rounding)
BUDGET = 300
INITIAL_RTT = 0.1  # the sender counts as open loop only after 2 RTTs: far beyond the stop
SLOT_S = (wire.HEADER_SIZE + S + protocol.LINK_OVERHEAD_BYTES) * 8 / RATE
MANIFEST = (T.MANIFEST, T.MANIFEST_REPAIR)


def _transfer() -> Transfer:
    lengths = np.full(N_BLOCKS, B * S, dtype=np.uint64)
    offsets = (np.arange(N_BLOCKS) * B * S).astype(np.uint64)
    table = BlockTable(offsets, lengths, np.full(N_BLOCKS, 1.0 / N_BLOCKS))
    payload = np.random.default_rng(43).integers(0, 256, N_BLOCKS * B * S, dtype=np.uint8)
    return Transfer(payload, table)


def _sender(prior: float | None) -> SenderSession:
    # stop time = deadline - one-way delay (half the initial RTT) - one slot
    deadline = INITIAL_RTT / 2 + (BUDGET + 1.5) * SLOT_S
    s = SenderSession(_transfer(), make_policy("tail-rule"), rate_bps=RATE, deadline=deadline,
                      transfer_id=TID, initial_rtt=INITIAL_RTT, symbol_size=S,
                      prior_loss=prior)  # fmt: skip
    assert s.slot_s == pytest.approx(SLOT_S, rel=1e-12)
    assert s.stop_time == pytest.approx((BUDGET + 0.5) * SLOT_S, rel=1e-9)
    return s


def _run(s: SenderSession, slots: int, step_slots: int) -> list:
    """The types and ESIs of the next ``slots`` datagrams, one per slot from t = 0
    (``step_slots`` due per call: 1 slot by slot, more in runs; never past ``slots``)."""
    out = []
    while len(out) < slots:
        t = s.next_timer()
        assert t is not None and not s.done
        assert t == pytest.approx(s.slot * SLOT_S, abs=1e-9)  # back to back: no idle slot
        now = t + (min(step_slots, slots - len(out)) - 1) * SLOT_S
        for raw in s.datagrams_to_send(now):
            d = wire.parse(raw)
            out.append((d.type, d.esi))
    assert len(out) == slots and not s.open_loop
    return out


def _need(esi: int) -> int:
    """The symbols that finish the block holding source ``esi``, ``esi`` included."""
    return (esi // B + 1) * B - esi


def _model(kinds: list, p_at) -> int:
    """Sources the tail rule admits, slot by slot from slot 0: ``kinds[k]`` says whether
    slot k went to the manifest (which takes precedence over sources); ``p_at(k)`` is the
    loss estimate at slot k and the ESI the last report described sources up to. Returns
    how many sources go before the first refusal (after it, each repair that fills a slot
    is expected to deliver as much as the slot it takes, so the rule keeps refusing)."""
    esi = 0
    for k, manifest in enumerate(kinds):
        if manifest:
            continue
        if esi == N_BLOCKS * B:
            break
        p, reported = p_at(k)
        left = BUDGET - k + 1
        owed = p * (esi - reported)  # expected losses among the sources in flight
        if left * (1.0 - p) >= owed + _need(esi):
            esi += 1
        else:
            break
    return esi


def _check_cut(trace: list, expected: int) -> None:
    sources = [esi for kind, esi in trace if kind == T.SOURCE]
    assert sources == list(range(len(sources)))  # stream order
    assert len(sources) == expected
    last = max(i for i, (kind, _) in enumerate(trace) if kind == T.SOURCE)
    after = [kind for kind, _ in trace[last + 1 :] if kind not in MANIFEST]
    assert after and all(kind == T.REPAIR for kind in after)  # the slots left protect them


@pytest.mark.parametrize("step_slots", [1, 8], ids=["slot-by-slot", "runs"])
def test_a_loss_prior_stops_admission_where_the_expected_surviving_slots_run_out(step_slots):
    """With a loss prior p (no report yet), source e goes at slot k only if
    (BUDGET - k + 1) (1 - p) >= p e + (rest of e's block); with no prior, only if
    BUDGET - k + 1 >= rest of e's block. The sender cuts the stream exactly there, and the
    prior cuts it blocks earlier."""
    cuts = {}
    for prior in (None, 0.3):
        s = _sender(prior)
        trace = _run(s, BUDGET + 1, step_slots)
        kinds = [kind in MANIFEST for kind, _ in trace]
        p = prior or 0.0
        expected = _model(kinds, lambda k, p=p: (p, 0))
        _check_cut(trace, expected)
        cuts[prior] = expected
    assert cuts[0.3] % B == 0 and cuts[None] % B == 0  # whole blocks only
    assert cuts[0.3] <= cuts[None] - 2 * B  # the loss estimate moves the cut
    assert cuts[None] < N_BLOCKS * B  # the deadline cuts the stream even without loss


@pytest.mark.parametrize("step_slots", [1, 8], ids=["slot-by-slot", "runs"])
def test_reported_loss_stops_admission_earlier_from_the_report_on(step_slots):
    """No prior; at slot 60 a report arrives that describes every source sent so far (no
    holes, manifest decoded) and gives a smoothed loss rate of 1/4. From then on the rule
    counts the surviving slots at that rate and a quarter of the sources sent after the
    report as owed: the sender cuts the stream where that says, blocks before where a
    lossless report would have it cut."""
    report_at = 60
    cuts = {}
    for loss in (0.0, 0.25):  # exact in the report's float32
        s = _sender(None)
        trace = _run(s, report_at, step_slots)  # slots 0..59; the report comes before 60
        esi_at_report = s.next_esi
        fb = wire.Feedback(
            echo_seq=s.seq - 1, echo_delay_us=10**6,  # no RTT sample: the estimate holds
            received=s.seq, lost=0, esi_end=esi_at_report, decoded_through=esi_at_report,
            unrecovered=0, pending=0, source_received=esi_at_report, repair_received=0,
            loss_rate=loss, burst_mean=1.0, flags=wire.FB_MANIFEST_DONE, ranges=(),
        )  # fmt: skip
        buf = bytearray(wire.feedback_size(0))
        n = wire.encode_feedback(fb, memoryview(buf))
        s.receive_datagram(wire.Framer(TID).build(T.FEEDBACK, 1, bytes(buf[:n])), s.next_timer())
        assert s.stats["feedback_received"] == 1 and s.loss_estimate() == loss
        assert s.stop_time == pytest.approx((BUDGET + 0.5) * SLOT_S, rel=1e-9)
        trace += _run(s, BUDGET + 1 - report_at, step_slots)
        kinds = [kind in MANIFEST for kind, _ in trace]
        expected = _model(
            kinds, lambda k, loss=loss, e=esi_at_report: (loss, e) if k >= report_at else (0.0, 0)
        )
        _check_cut(trace, expected)
        cuts[loss] = expected
    assert cuts[0.25] <= cuts[0.0] - 2 * B
