"""A non-standard ProtocolConfig.link_overhead is counted alike by the sender's pacing, the
shared link's capacity, the simulators' channels and their accounting.

On a clean rate-limited link a sender that paces with the bytes the channel's token bucket
counts never queues: every datagram arrives exactly one one-way delay after it left. So
each run below checks, from the loop's trace, that the datagrams leave on the config's
slots and never wait in the channel. The two overheads bracket the standard 42 bytes: with
0 a channel still counting 42 is slower than the pacing (datagrams queue); with 542 a sender
still pacing with 42 is faster than the channel (datagrams queue).
"""

from __future__ import annotations

import numpy as np
import pytest
from kvtransport.netem import make_channel

from kvtransport.core.protocol import STANDARD, ProtocolConfig
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.core.wire import full_send_time, link_bytes
from kvtransport.hosts.link_share import payload_efficiency
from kvtransport.policies.registry import make_policy
from kvtransport.scheduling.allocator import EqualShare
from kvtransport.scheduling.utility_model import SigmoidUtility
from kvtransport.sim.multisim import Handover, MultiSimulation
from kvtransport.sim.simulator import Simulation, make_simulation

RATE_BPS = 50e6
DELAY_S = 0.005  # the clean profile's one-way delay
SYMBOL = STANDARD.symbol_size
SIZE = 1_000_000
OVERHEADS = (0, 542)


def _path(trace, sender: int, receivers: set[int]) -> tuple[np.ndarray, np.ndarray, float]:
    """Send times and sizes of ``sender``'s datagrams (in send order), and the longest
    time one waited in the channel (arrival - send - one-way delay) before a receiver
    got it."""
    sent = {e[3]: e[1] for e in trace if e[0] == "send" and e[2] == sender}
    waits = [e[1] - sent[e[3]] - DELAY_S for e in trace if e[0] == "recv" and e[2] in receivers]
    assert len(waits) > 100
    sizes = np.array([len(d) for d in sent])
    return np.array(list(sent.values())), sizes, max(waits)


@pytest.mark.parametrize("overhead", OVERHEADS)
def test_the_simulator_paces_counts_and_times_with_the_configs_link_overhead(overhead):
    cfg = ProtocolConfig(link_overhead=overhead)
    trace: list = []
    sim = make_simulation(
        channel="clean",
        rate_mbps=RATE_BPS / 1e6,
        policy="none",
        rho=1.3,
        size_bytes=SIZE,
        config=cfg,
        trace=trace,
        record=False,
    )
    sim.run()
    r = sim.result()
    slot = link_bytes(SYMBOL, link_overhead=overhead) * 8 / RATE_BPS
    sends, _, wait = _path(trace, 0, {1})
    # rho's unit counts the config's overhead
    assert r.deadline_s == pytest.approx(
        1.3 * full_send_time(SIZE, RATE_BPS, SYMBOL, link_overhead=overhead), rel=1e-12
    )
    # every datagram leaves on the config's slot and waits nowhere in the channel
    gaps = np.diff(sends)
    assert gaps.min() == pytest.approx(slot, rel=1e-9)
    assert gaps.max() == pytest.approx(slot, rel=1e-9)
    assert wait < 1e-9
    assert r.packets_lost == 0 and r.utility_recovered == pytest.approx(1.0)
    # so the transfer completes one one-way delay after one of the config's slots, the
    # slot of a datagram after every source symbol's
    k = (r.complete_at - DELAY_S) / slot
    assert k == pytest.approx(round(k), abs=1e-6)
    assert sim.sender.n_source - 1 <= round(k) < r.packets_sent


def test_a_simulation_refuses_a_channel_counting_another_overhead():
    tr = synthetic_transfer(100_000, 8, seed=1)
    with pytest.raises(ValueError, match="link overhead"):
        Simulation(
            tr,
            make_policy("none"),
            make_channel("clean", 1),  # counts the standard 42 bytes
            make_channel("clean", 2),
            rate_bps=RATE_BPS,
            deadline=0.1,
            config=ProtocolConfig(link_overhead=0),
        )


@pytest.mark.parametrize("overhead", OVERHEADS)
def test_the_multi_user_simulator_paces_counts_and_plans_with_the_configs_link_overhead(
    overhead,
):
    cfg = ProtocolConfig(link_overhead=overhead)
    curve = SigmoidUtility(a=1.0, b=10.0, c=0.5)
    handovers = [Handover(0, 0.0, 0.4, SIZE, curve), Handover(1, 0.01, 0.4, SIZE, curve)]
    trace: list = []
    ms = MultiSimulation(
        handovers,
        EqualShare(),
        channel="clean",
        rate_mbps=RATE_BPS / 1e6,
        config=cfg,
        trace=trace,
    )
    res = ms.run()
    sends, sizes, wait = _path(trace, 0, {1, 2})
    # the sessions' pacing and the channel count the same bytes: nothing ever queues
    assert wait < 1e-9
    assert res.packets_dropped == 0
    # the link's accounting and the allocator's capacity count the config's overhead
    assert res.wire_bytes == int(sizes.sum()) + sizes.size * overhead
    assert res.payload_capacity_Bps == pytest.approx(
        RATE_BPS / 8 * payload_efficiency(SYMBOL, link_overhead=overhead), rel=1e-12
    )
    # while both share the link it is full at the config's slots: the datagrams sent
    # between the second arrival and the first to finish fill that time at the link rate
    busy = (sends >= 0.01) & (sends < 0.15)
    assert busy.sum() > 100
    wire = int(sizes[busy].sum()) + int(busy.sum()) * overhead
    assert wire * 8 / (0.15 - 0.01) == pytest.approx(RATE_BPS, rel=0.01)
