"""The protocol's configuration (kvtransport.core.protocol.ProtocolConfig): the hosts build
every session with the config they are given, a non-standard one changes what the sessions
do, and the standard one is the module constants."""

import dataclasses

import pytest

from kvtransport.core import protocol
from kvtransport.core.protocol import STANDARD, ProtocolConfig
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.core.wire import HEADER_SIZE, TAG_SIZE
from kvtransport.hosts.receiver_host import ReceiverHost
from kvtransport.hosts.sender_host import SenderHost
from kvtransport.sim.virtual_clock import VirtualClockLoop

KEY = bytes(range(32))
TID = 7
OTHER = ProtocolConfig(
    symbol_size=1024,
    decoder_window=4096,
    max_pending_equations=256,
    max_repair_span=512,
    feedback_interval=0.016,
    initial_rtt=0.01,
)


class _Path:
    """2 ms one way; every ``lose``-th datagram lost (0: none)."""

    def __init__(self, lose: int) -> None:
        self.n, self.lose = 0, lose

    def transmit(self, t: float, size: int) -> float | None:
        self.n += 1
        return None if self.lose and self.n % self.lose == 0 else t + 0.002


def _transfer(cfg: ProtocolConfig, until: float = 1.0, lose: int = 7):
    """One transfer between a SenderHost and a ReceiverHost built with ``cfg`` (nothing
    else set): the two sessions, the data datagrams' sizes, once run to ``until``."""
    tr = synthetic_transfer(400_000, 20, "zipf", seed=2)
    sender = SenderHost(rate_bps=50e6, key=KEY, burst_s=0.0, config=cfg)
    receiver = ReceiverHost(key=KEY, config=cfg)
    out = sender.submit(tr, "rx", now=0.0, deadline_s=0.5, policy="adaptive", transfer_id=TID)
    trace: list = []
    loop = VirtualClockLoop(trace)
    loop.add(sender, "tx", channel=_Path(lose))
    loop.add(receiver, "rx", channel=_Path(lose))
    loop.run(until)
    sizes = {len(e[3]) for e in trace if e[0] == "send" and e[2] == 0}
    inc = receiver.get(TID)
    assert inc is not None
    return out.session, inc.session, sizes


def test_the_standard_config_is_the_module_constants():
    assert STANDARD == ProtocolConfig()
    assert (STANDARD.symbol_size, STANDARD.decoder_window, STANDARD.max_pending_equations) == (
        protocol.DEFAULT_SYMBOL_SIZE, protocol.DECODER_WINDOW, protocol.MAX_PENDING_EQUATIONS
    )  # fmt: skip
    assert (STANDARD.max_repair_span, STANDARD.feedback_interval, STANDARD.initial_rtt) == (
        protocol.MAX_REPAIR_SPAN, protocol.DEFAULT_FEEDBACK_INTERVAL, protocol.DEFAULT_INITIAL_RTT
    )  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        STANDARD.decoder_window = 1  # type: ignore[misc]


def test_the_hosts_build_every_session_with_their_config():
    tx, rx, sizes = _transfer(OTHER, until=0.02)  # mid-transfer: the decoder is live
    assert tx.config is OTHER and rx.config is OTHER
    assert sizes == {HEADER_SIZE + 1024 + TAG_SIZE}  # the config's symbol size
    assert tx.max_repair_span == 512
    assert rx.decoder is not None
    assert (rx.decoder.max_window, rx.decoder.max_pending) == (4096, 256)
    assert rx.feedback_interval == 0.016


def test_the_sender_starts_from_the_configs_initial_rtt():
    host = SenderHost(rate_bps=50e6, key=KEY, config=OTHER)
    out = host.submit(synthetic_transfer(50_000, 4), "rx", now=0.0, deadline_s=0.5)
    assert out.session.owd == pytest.approx(OTHER.initial_rtt / 2)


def test_a_longer_feedback_interval_sends_less_feedback():
    """No loss: feedback is periodic only, every ``feedback_interval``."""
    longer = dataclasses.replace(STANDARD, feedback_interval=4 * STANDARD.feedback_interval)
    _, rx_std, _ = _transfer(STANDARD, lose=0)
    _, rx_longer, _ = _transfer(longer, lose=0)
    assert rx_std.result is not None and rx_longer.result is not None
    assert rx_longer.feedback_sent < rx_std.feedback_sent / 2


def test_a_config_out_of_range_is_refused_in_one_line():
    span = rf"^max_repair_span must be 64..{STANDARD.decoder_window} \(the decoder window\), not "
    with pytest.raises(ValueError, match=span + "9000$"):
        ProtocolConfig(max_repair_span=9000)
    # below one reactive segment the sender could not use it: refused here, not later
    with pytest.raises(ValueError, match=span + "63$"):
        ProtocolConfig(max_repair_span=63)
    with pytest.raises(ValueError, match="max_pending_equations"):
        ProtocolConfig(decoder_window=1024, max_pending_equations=2048)


# ---------------------------------------------------------------- the shells pass it on

SHELL = dataclasses.replace(OTHER, link_overhead=0)


def test_the_simulators_build_their_hosts_with_their_config():
    from kvtransport.scheduling.allocator import EqualShare
    from kvtransport.scheduling.utility_model import SigmoidUtility
    from kvtransport.sim.multisim import Handover, MultiSimulation
    from kvtransport.sim.simulator import make_simulation

    sim = make_simulation(channel="clean", size_bytes=200_000, config=SHELL, record=False)
    assert sim.sender_host.config is SHELL and sim.receiver_host.config is SHELL
    assert sim.sender.config is SHELL and sim.receiver.config is SHELL
    assert sim.sender.symbol_size == 1024 and sim.sender.owd == pytest.approx(0.0055)
    sim.restart_receiver()  # a restarted receiver is built with it too
    assert sim.receiver_host.config is SHELL

    curve = SigmoidUtility(a=1.0, b=10.0, c=0.5)
    ms = MultiSimulation([Handover(0, 0.0, 0.2, 100_000, curve)], EqualShare(), config=SHELL)
    assert ms.sender.config is SHELL and ms.sender.symbol_size == 1024
    assert all(u.host.config is SHELL for u in ms.users)
    assert ms.data_channel.overhead_bytes == ms.feedback_channel.overhead_bytes == 0


def test_the_daemons_build_their_hosts_with_their_config(tmp_path):
    from kvtransport.core.wire import full_send_time
    from kvtransport.daemons.api import transfer_frames
    from kvtransport.daemons.daemon_receiver import ReceiverDaemon
    from kvtransport.daemons.daemon_sender import SenderDaemon

    tx = SenderDaemon(
        bind=("127.0.0.1", 0), control=f"ipc://{tmp_path}/s.ipc", rate_bps=50e6, key=KEY,
        config=SHELL,
    )  # fmt: skip
    try:
        host = tx.engine.host
        assert host.config is SHELL and host.symbol_size == 1024
        assert host.link.link_overhead == 0
        tr = synthetic_transfer(300_000, 8, seed=4)
        got = tx._submit({"to": "127.0.0.1:9", "rho": 1.0}, transfer_frames(tr))
        # rho counts the config's link overhead; no initial_rtt_ms: the config's
        assert got["deadline_s"] == pytest.approx(
            full_send_time(300_000, 50e6, 1024, True, link_overhead=0)
        )
        out = host.get(int(got["transfer_id"], 16))
        assert out is not None and out.session.config is SHELL
        assert out.session.owd == pytest.approx(SHELL.initial_rtt / 2)
    finally:
        tx.close()
    rx = ReceiverDaemon(
        bind=("127.0.0.1", 0), control=f"ipc://{tmp_path}/r.ipc",
        publish=f"ipc://{tmp_path}/p.ipc", key=KEY, config=SHELL,
    )  # fmt: skip
    try:
        assert rx.engine.host.config is SHELL
    finally:
        rx.close()
