"""SenderSession's source runs (``_source_run``: consecutive plain source slots sent in one
go) against the slot-by-slot path (``source_runs = False``: every slot through ``_emit``).

A real sender and receiver run on a virtual clock over a lossy link (deterministic
losses, feedback as the receiver emits it); the sender's inputs (the times it was asked
for datagrams, the feedback it got) are recorded. Two fresh senders then get exactly those
inputs with the send calls grouped into random runs (so several slots are due per call and
the runs engage): one with source runs, one slot by slot. Every datagram, in order, and the
sessions' counters, log and scheme state must be identical, with and without a key, for
the repair schemes and policies a user picks; a tight deadline makes the tail rule refuse
sources inside runs.
"""

import numpy as np
import pytest

from kvtransport.core.receiver import ReceiverSession
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.policies.registry import make_policy

KEY = bytes(range(32))
RATE = 1e9
OWD = 200e-6


def _sender(policy: str, key: bytes | None, size: int, deadline: float) -> SenderSession:
    tr = synthetic_transfer(size, max(1, size // 12_288), seed=3)
    return SenderSession(tr, make_policy(policy), rate_bps=RATE, deadline=deadline, key=key,
                         transfer_id=7, initial_rtt=1e-3)  # fmt: skip


def _record(
    policy: str, key: bytes | None, size: int, deadline: float, loss: float, rate_every: int = 0
) -> list:
    """The sender's inputs in a lossy run: ("send", t), ("fb", t, datagram) and, with
    ``rate_every``, ("rate", t, bps) before every rate_every-th send: the rate cut to a
    quarter and raised back in turn, as a shared link's allocator does (a raise past
    RATE_REDECIDE makes the sender decide again at once)."""
    snd = _sender(policy, key, size, deadline)
    rcv = ReceiverSession(7, key=key, deadline=deadline)
    lost = np.random.default_rng(5).random(1 << 16) < loss
    inputs: list[tuple] = []
    data: list[tuple[float, bytes]] = []
    back: list[tuple[float, bytes]] = []
    sent = 0
    while not snd.done:
        cands = [x for x in (snd.next_timer(), rcv.next_timer()) if x is not None]
        cands += [data[0][0]] if data else []
        cands += [back[0][0]] if back else []
        if not cands:
            break
        now = min(cands)
        if back and back[0][0] <= now:
            f = back.pop(0)[1]
            inputs.append(("fb", now, f))
            snd.receive_datagram(f, now)
            continue
        if data and data[0][0] <= now:
            rcv.receive_datagram(data.pop(0)[1], now)
        elif (t := snd.next_timer()) is not None and t <= now:
            if rate_every and len(inputs) % rate_every == rate_every - 1:
                bps = RATE / 4 if snd.rate_bps == RATE else RATE
                inputs.append(("rate", now, bps))
                snd.set_rate(bps, now)
            inputs.append(("send", now))
            for d in snd.datagrams_to_send(now):
                if not lost[sent % lost.size]:
                    data.append((now + OWD, d))
                sent += 1
        else:
            rcv.handle_timer(now)
        back.extend((now + OWD, f) for f in rcv.datagrams_to_send(now))
    return inputs


def _grouped(inputs: list, seed: int) -> list:
    """Consecutive send calls merged into one at the last one's time (1-12 at a time)."""
    rng = np.random.default_rng(seed)
    out: list[tuple] = []
    left = 0
    for ev in inputs:
        if ev[0] == "send" and out and out[-1][0] == "send" and left > 0:
            out[-1] = ev
            left -= 1
        else:
            out.append(ev)
            left = int(rng.integers(0, 12))
    return out


def _replay(snd: SenderSession, inputs: list) -> list[bytes]:
    out: list[bytes] = []
    for ev in inputs:
        if ev[0] == "send":
            out += snd.datagrams_to_send(ev[1])
        elif ev[0] == "rate":
            snd.set_rate(ev[2], ev[1])
        else:
            snd.receive_datagram(ev[2], ev[1])
    return out


def _state(snd: SenderSession) -> tuple:
    rep, log = snd._repair, snd.progress.log
    return (
        snd.next_esi, snd.seq, snd.slot, snd.source_sent, snd.repair_sent,
        snd.reactive_sent, dict(snd.stats), snd.pacer.next_send, snd.done, snd.finish_reason,
        log.t, log.src, log.rep, log.rea, log.newest,
        getattr(rep, "credit", None), getattr(rep, "key", None), rep.needed,
    )  # fmt: skip


@pytest.mark.parametrize(
    "policy,key,size,deadline,loss",
    [
        ("fixed:1/16", KEY, 3_000_000, 1.0, 0.05),
        ("fixed:1/16", None, 3_000_000, 1.0, 0.05),
        ("adaptive", KEY, 3_000_000, 1.0, 0.10),
        ("ddqn", KEY, 3_000_000, 1.0, 0.05),
        ("none", KEY, 2_000_000, 1.0, 0.0),
        ("arq", KEY, 2_000_000, 1.0, 0.05),
        ("block-rs:4/32", KEY, 2_000_000, 1.0, 0.05),
        ("fixed:1/16", KEY, 3_000_000, 0.022, 0.05),  # tight: the tail rule refuses
    ],
    ids=["fixed-key", "fixed-nokey", "adaptive", "ddqn", "none", "arq", "block-rs", "tight"],
)
def test_source_runs_send_what_slot_by_slot_sends(
    policy: str, key: bytes | None, size: int, deadline: float, loss: float, monkeypatch
) -> None:
    inputs = _grouped(_record(policy, key, size, deadline, loss), seed=11)
    slotwise = _sender(policy, key, size, deadline)
    monkeypatch.setattr(slotwise, "source_runs", False)
    runs = _sender(policy, key, size, deadline)
    ran: list[int] = []
    source_run = runs._source_run

    def counted(t: float, now: float, burst: int, out: list[bytes]) -> tuple[float, int]:
        n = len(out)
        res = source_run(t, now, burst, out)
        ran.append(len(out) - n)
        return res

    monkeypatch.setattr(runs, "_source_run", counted)
    a, b = _replay(slotwise, inputs), _replay(runs, inputs)
    assert len(a) > 1000
    assert a == b
    assert _state(slotwise) == _state(runs)
    if policy in ("arq", "block-rs:4/32"):
        assert sum(ran) == 0  # before_source slot by slot: no runs
    else:
        assert sum(ran) > runs.source_sent // 2  # most sources went out in runs
        assert max(ran) > 4
    if deadline < 0.1:
        assert runs.source_sent < runs.n_source  # the tail rule cut the stream


@pytest.mark.parametrize("deadline", [0.01, 0.013, 0.016, 0.019, 0.022, 0.025, 0.028])
@pytest.mark.parametrize("policy", ["fixed:1/16", "adaptive"])
def test_source_runs_stop_where_the_tail_rule_does(policy: str, deadline: float) -> None:
    """Deadlines that cut the stream at different points, feedback with loss: the runs
    test the tail rule once per run (``TailRule.clear``) and per source past its reach, and
    send exactly the sources slot by slot sends."""
    inputs = _grouped(_record(policy, KEY, 3_000_000, deadline, 0.08), seed=int(deadline * 1e3))
    slotwise = _sender(policy, KEY, 3_000_000, deadline)
    slotwise.source_runs = False
    runs = _sender(policy, KEY, 3_000_000, deadline)
    assert _replay(slotwise, inputs) == _replay(runs, inputs)
    assert _state(slotwise) == _state(runs)
    assert 0 < runs.source_sent < runs.n_source


@pytest.mark.parametrize("policy", ["fixed:1/16", "adaptive"])
def test_tail_clear_vouches_only_for_what_the_tail_rule_allows(policy: str) -> None:
    """``TailRule.clear`` (one test for a whole run) is sufficient: wherever it passes for
    sources esi..esi+k-1 up to a slot time, the per-source rule (``TailRule.ok``) passes for
    each of them at its slot with the state after the ones before it. Checked on a sender
    with a tight deadline, at states along a lossy run, over the slot times before its stop
    time and runs of 1-32; both outcomes occur, some within a few slots of a refusal."""
    deadline = 0.02
    inputs = _record(policy, KEY, 3_000_000, deadline, 0.08)
    snd = _sender(policy, KEY, 3_000_000, deadline)
    outcomes = {True: 0, False: 0}
    tight = 0
    for n, ev in enumerate(inputs):
        if ev[0] == "send":
            snd.datagrams_to_send(ev[1])
        else:
            snd.receive_datagram(ev[2], ev[1])
        if n % 50 or snd.done or snd.next_esi >= snd.n_source - 32:
            continue
        esi0, sent0, slot_s = snd.next_esi, snd.source_sent, snd.slot_s
        # the last 600 slots before the stop time, where the rule's boundary lies
        for t0 in snd.stop_time - slot_s * np.arange(1.0, 600.0, 4.0):
            for k in (1, 2, 5, 9, 17, 32):
                t_end = t0 + k * slot_s
                clear = snd.tail.clear(t_end, esi0, k)
                outcomes[clear] += 1
                if not clear:
                    continue
                try:
                    for j in range(k):
                        snd.next_esi, snd.source_sent = esi0 + j, sent0 + j
                        t = t0 + j * slot_s
                        assert snd.tail.ok(t, esi0 + j)
                        need = snd.source.finish_esi[esi0 + j] - (esi0 + j) + 1
                        tight += not snd.tail_fits(snd.slots_left(t) - 3, need)
                finally:
                    snd.next_esi, snd.source_sent = esi0, sent0
    assert outcomes[True] > 50 and outcomes[False] > 50
    assert tight > 0  # some vouched-for sources were within a few slots of refusal


@pytest.mark.parametrize("deadline", [0.016, 0.022, 0.028, 1.0])
@pytest.mark.parametrize("policy", ["fixed:1/16", "adaptive", "ddqn"])
def test_source_runs_decide_where_slot_by_slot_does_when_the_rate_moves(
    policy: str, deadline: float
) -> None:
    """A shared link cuts and raises the sender's rate (4x, past RATE_REDECIDE): the policy
    decides again at the next slot after a raise, also where that slot would have gone
    in a run and where the sender had just decided and then sat idle, so both paths send
    the same datagrams, decide at the same slots and end in the same state."""
    inputs = _grouped(_record(policy, KEY, 3_000_000, deadline, 0.08, rate_every=23), seed=7)
    assert sum(ev[0] == "rate" for ev in inputs) > 20
    slotwise = _sender(policy, KEY, 3_000_000, deadline)
    slotwise.source_runs = False
    slotwise.record = True
    runs = _sender(policy, KEY, 3_000_000, deadline)
    runs.record = True
    assert _replay(slotwise, inputs) == _replay(runs, inputs)
    assert _state(slotwise) == _state(runs)
    assert [h[:2] for h in slotwise.history] == [h[:2] for h in runs.history]
    # decisions off the 32-slot grid: the raises were decided on at once
    assert len(runs.history) >= runs.slot // 32 + 5


def test_a_raise_on_a_slot_already_decided_is_decided_again_by_both_paths() -> None:
    """The sender decided on this slot and sent nothing (here the Gymnasium shell's
    deferred decision: the slot stays decided while the shell answers), then its rate is
    raised past RATE_REDECIDE: both paths decide again before anything is sent, the source
    runs too (they must not send the slot's sources on the old decision)."""
    from kvtransport.policies.heuristics import ExternalPolicy

    senders = []
    for runs in (False, True):
        tr = synthetic_transfer(3_000_000, 3_000_000 // 12_288, seed=3)
        s = SenderSession(tr, ExternalPolicy(), rate_bps=RATE / 4, deadline=1.0, key=KEY,
                          transfer_id=7, initial_rtt=1e-3)  # fmt: skip
        s.source_runs = runs
        out = s.datagrams_to_send(0.0)
        assert out == [] and s.awaiting_action and s.driver.decision_slot == 0  # slot 0 decided
        s.apply_action(0)
        s.set_rate(RATE, 0.0)  # 4x
        out = s.datagrams_to_send(1e-3)  # a dozen slots due: a run, were one allowed
        assert out == [] and s.awaiting_action  # decided again first, nothing sent
        assert s.stats["decisions"] == 2
        s.apply_action(0)
        senders.append((s.datagrams_to_send(2e-3), _state(s)))
    assert senders[0] == senders[1] and len(senders[0][0]) > 4
