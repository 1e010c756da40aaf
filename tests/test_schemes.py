"""The repair-scheme registry: a code is one module plus its wire type.

The repetition code below is defined here and nowhere else: registered at run time with a
wire type the wire format does not list, it is carried end to end by the real
SenderSession and ReceiverSession over a lossy path. Nothing else in the package knows
it, which is the claim that adding a code touches the scheme's module and its wire type
only (kvtransport.core.schemes, docs/architecture.md "How to add a code").
"""

import heapq

import numpy as np
import pytest

from kvtransport.core import schemes, wire
from kvtransport.core.policy_base import Policy
from kvtransport.core.protocol import ProtocolConfig
from kvtransport.core.receiver import ReceiverSession
from kvtransport.core.schemes import rlc
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.errors import UserError
from kvtransport.policies.heuristics import NoFEC
from kvtransport.policies.registry import make_policy
from kvtransport.sim.simulator import simulate

REPEAT_TYPE = 0xE1  # not a DatagramType: the scheme brings it
TID = 0x5EED
KEY = bytes(range(32))


class RepeatSender(schemes.SenderRepair):
    """Every source goes out twice: the copy in the slot after it."""

    sees_sources = True

    def __init__(self, session, policy):
        super().__init__(session, policy)
        self.queue = []

    def on_source(self, esi, sym):
        self.queue.append(esi)

    def before_source(self, t):
        if not self.queue:
            return None
        s = self.session
        esi = self.queue.pop(0)
        s.framer.payload_view(s.symbol_size)[:] = s.source_symbol(esi)
        s.stats["repeat_sent"] += 1
        return s.framer.finish(REPEAT_TYPE, s.seq, s.symbol_size, esi=esi)


class RepeatReceiver(schemes.ReceiverRepair):
    """A copy of a source the receiver misses recovers it."""

    def __init__(self):
        self.held = {}

    def add_repair(self, d, store):
        if store.known_symbol(d.esi) is not None:
            return []
        self.held[d.esi] = bytes(d.payload)
        return [d.esi]

    def read_into(self, esi, out):
        out[:] = self.held.pop(esi)


class Repeat(schemes.RepairScheme):
    name = "repeat-test"
    wire_type = REPEAT_TYPE
    stat = "repeat_sent"

    def sender(self, session, policy):
        return RepeatSender(session, policy)

    def check(self, d):
        if d.key or d.dt_nss:
            raise schemes.BadFEC("a copy has no coding fields")
        return d.esi

    def decoder(self, symbol_size, d):
        return RepeatReceiver()


class RepeatPolicy(Policy):
    name = "repeat"
    scheme = "repeat-test"
    actions = np.array([(0.0, 1.0)], dtype=np.float32)

    def act(self, obs):
        return 0


@pytest.fixture
def repeat():
    scheme = schemes.register(Repeat())
    yield scheme
    schemes.unregister(scheme.name)


def transfer_over(policy, lost, batched=False, size=300_000, delay=0.002):
    """One transfer between real sessions on a virtual clock; data datagram i (counted
    from 0) is lost when ``lost(i)``; feedback always arrives. Returns both sessions."""
    tr = synthetic_transfer(size, 25, "zipf", seed=3)
    s = SenderSession(tr, policy, rate_bps=100e6, deadline=1.0, transfer_id=TID, key=KEY)
    r = ReceiverSession(TID, key=KEY, deadline=1.0)
    heap, n, seq = [], 0, 0  # (arrival, order, to_receiver, datagram)
    t = 0.0
    while not r.finished:
        timers = [x for x in (s.next_timer(), r.next_timer()) if x is not None]
        t = min(timers + [heap[0][0]] if heap else timers)
        if heap and heap[0][0] <= t:
            arrivals = []
            while heap and heap[0][0] <= t:
                arrivals.append(heapq.heappop(heap))
            data = [d for _, _, to_rx, d in arrivals if to_rx]
            for _, _, to_rx, d in arrivals:
                if not to_rx:
                    s.receive_datagram(d, t)
            if batched:
                r.receive_datagrams(data, t)
            else:
                for d in data:
                    r.receive_datagram(d, t)
        else:
            if s.next_timer() is not None and s.next_timer() <= t:
                for d in s.datagrams_to_send(t):
                    if not lost(n):
                        heapq.heappush(heap, (t + delay, seq, True, d))
                        seq += 1
                    n += 1
            if r.next_timer() is not None and r.next_timer() <= t:
                r.handle_timer(t)
        for d in r.datagrams_to_send(t):
            heapq.heappush(heap, (t + delay, seq, False, d))
            seq += 1
    return tr, s, r


def every_fifth(i):
    return i % 5 == 3


@pytest.mark.parametrize("batched", [False, True])
def test_a_code_defined_in_one_place_is_carried_end_to_end(repeat, batched):
    tr, s, r = transfer_over(RepeatPolicy(), every_fifth, batched)
    # no two neighbours are lost, so every lost source's copy arrived and recovered it
    assert r.result.reason == "complete"
    assert bytes(r.result.payload) == bytes(tr.payload)
    assert r.symbols_recovered > 0
    assert s.stats["repeat_sent"] == s.n_source == s.repair_sent
    # the copies reached the receiver as repairs of their own type, none refused
    assert r.repair_received > 0 and not r.drop_reasons


class CountingRLC(rlc.RLC):
    """The RLC scheme, its window decoders counting the repairs the receiver hands them."""

    def __init__(self):
        self.decoders = []

    def window_decoder(self, symbol_size, config):
        dec = CountingRLCReceiver(symbol_size, config)
        self.decoders.append(dec)
        return dec


class CountingRLCReceiver(rlc.RLCReceiver):
    taken = 0

    def add_repair_datagram(self, d):  # one at a time
        self.taken += 1
        return super().add_repair_datagram(d)

    def repair_row(self, d):  # into a batched run
        self.taken += 1
        return super().repair_row(d)


@pytest.fixture
def counting_rlc():
    schemes.unregister("rlc")
    scheme = schemes.register(CountingRLC())
    yield scheme
    schemes.unregister("rlc")
    schemes.register(rlc.SCHEME)


@pytest.mark.parametrize("batched", [False, True])
def test_the_receiver_decodes_with_the_registered_window_schemes_decoder(counting_rlc, batched):
    """The receiver core knows no code: its window decoder is the registered window
    scheme's, made once, and every REPAIR datagram it takes goes to it."""
    tr, s, r = transfer_over(make_policy("adaptive"), every_fifth, batched)
    assert len(counting_rlc.decoders) == 1
    assert counting_rlc.decoders[0].taken == r.repair_received > 0
    assert r.symbols_recovered > 0 and not r.drop_reasons


def test_there_is_one_window_scheme():
    assert schemes.window() is rlc.SCHEME
    assert schemes.by_wire_type(int(wire.DatagramType.REPAIR)) is rlc.SCHEME
    other = CountingRLC()
    other.name = "rlc-2"
    with pytest.raises(ValueError, match="already the window scheme"):
        schemes.register(other)


def test_without_the_code_the_same_losses_stay_lost():
    tr, s, r = transfer_over(NoFEC(), every_fifth)
    assert r.result.reason != "complete" and r.symbols_recovered == 0


def test_the_wire_type_is_accepted_only_while_its_scheme_is_registered():
    framer = wire.Framer(TID, KEY)
    copy = framer.build(REPEAT_TYPE, 0, b"x" * 64, esi=0)
    with pytest.raises(wire.BadType):
        wire.parse(copy, KEY)
    schemes.register(Repeat())
    try:
        assert wire.parse(copy, KEY).type == REPEAT_TYPE
        assert schemes.by_wire_type(REPEAT_TYPE).name == "repeat-test"
    finally:
        schemes.unregister("repeat-test")
    with pytest.raises(wire.BadType):
        wire.parse(copy, KEY)


def test_the_built_in_codes_are_registered_by_their_modules():
    assert {"none", "rlc", "block-rs", "arq"} <= set(schemes.names().split(", "))
    assert schemes.by_wire_type(int(wire.DatagramType.BLOCK_REPAIR)).name == "block-rs"


def test_names_and_types_cannot_be_taken_twice_or_from_the_transport(repeat):
    with pytest.raises(ValueError, match="taken"):
        schemes.register(Repeat())
    other = Repeat()
    other.name = "repeat-2"
    with pytest.raises(ValueError, match="already"):
        schemes.register(other)
    other.wire_type = int(wire.DatagramType.SOURCE)
    with pytest.raises(ValueError, match="transport's own"):
        schemes.register(other)


def test_a_policy_naming_an_unknown_scheme_fails_in_one_line():
    policy = RepeatPolicy()  # its scheme is not registered here
    tr = synthetic_transfer(10_000, 2, "zipf", seed=1)
    with pytest.raises(UserError, match="unknown repair scheme 'repeat-test'"):
        SenderSession(tr, policy, rate_bps=1e6, deadline=1.0)


SMALL_WINDOW = ProtocolConfig(
    decoder_window=512, max_decoder_window=512, max_pending_equations=128,
    max_repair_span=256, release_lag=64, release_chunk=32,
)  # fmt: skip


def test_a_hole_below_every_repairs_reach_is_sent_again_and_the_transfer_completes():
    """A path whose round trips outlast the decoder window (512 ESIs here; 100 Mbit/s, 40 ms
    one way: about 730 datagrams per round trip): a hole reported, or repaired in vain, late
    lies below the floor of ``highest ESI sent - decoder_window + 1`` that every RLC repair
    stays above. The adaptive sender sends such a hole's source again (RETRANSMIT), and only
    such holes: the transfer completes where it used to end at the deadline with those
    holes given up, after thousands of repairs no one could use."""
    for seed in (1, 2):
        trace: list = []
        r = simulate(
            channel="loss 2%", rate_mbps=100, delay_ms=40, rho=3, size_bytes=2_000_000,
            policy="adaptive", seed=seed, config=SMALL_WINDOW, trace=trace, record=False,
        )  # fmt: skip
        assert r.receiver_finish == "complete" and r.utility_recovered == 1.0
        parser = wire.Parser()
        highest, resent = -1, 0
        for ev in trace:
            if ev[0] != "send" or ev[2] != 0:
                continue  # the sender is the loop's first endpoint
            d = parser.parse(ev[3])
            if d.type != wire.DatagramType.SOURCE:
                continue
            if d.flags & wire.FLAG_RETRANSMIT:
                resent += 1
                assert d.esi < highest - SMALL_WINDOW.decoder_window + 2  # below the floor
            else:
                highest = max(highest, d.esi)
        assert resent == r.retransmit_sent > 0  # counted as they leave


def test_with_a_window_the_path_fits_the_adaptive_sender_never_resends():
    r = simulate(
        channel="loss 2%", rate_mbps=100, delay_ms=40, rho=3, size_bytes=2_000_000,
        policy="adaptive", seed=1, record=False,
    )  # fmt: skip
    assert r.receiver_finish == "complete" and r.repair_sent > 0 and r.retransmit_sent == 0
