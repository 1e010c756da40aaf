"""The public surface: ``import kvtransport``'s names and the ``kvtransport.protocol``
namespace of the sans-I/O core (docs/architecture.md, "Public API"). A name added or
dropped here is an API change, made on purpose."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

import kvtransport
from kvtransport import protocol

TOP = [
    "__version__",
    "send",
    "send_async",
    "SendOptions",
    "SentResult",
    "receive",
    "receive_async",
    "Receiver",
    "partial_cache",
    "race_receive",
    "race_daemon",
    "DeliveredResult",
]
PROTOCOL = [
    "ACTIONS",
    "DEFAULT_SYMBOL_SIZE",
    "STANDARD",
    "DatagramType",
    "FinishReason",
    "Policy",
    "PolicyContext",
    "ProtocolConfig",
    "ReceiverFinish",
    "ReceiverSession",
    "SenderSession",
    "SenderState",
    "Transfer",
    "TransferResult",
    "TransportManifest",
    "WireError",
    "synthetic_transfer",
]


def test_the_top_level_names_are_pinned_and_resolve():
    assert kvtransport.__all__ == TOP
    for name in TOP:
        assert getattr(kvtransport, name) is not None, name


def test_the_protocol_namespace_is_pinned_and_public():
    assert protocol.__all__ == PROTOCOL
    for name in PROTOCOL:
        obj = getattr(protocol, name)
        assert not getattr(obj, "__name__", name).startswith("_"), name


def test_import_kvtransport_and_its_protocol_stay_torch_free():
    """The package root and the protocol namespace load the data plane only."""
    code = (
        "import sys, kvtransport, kvtransport.protocol\n"
        "print(sorted(m for m in ('torch', 'transformers', 'kvtransport.embed.inprocess')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class _Reactive(protocol.Policy):
    """Repair only on feedback (action 0: no proactive share, admit new sources)."""

    def act(self, obs: np.ndarray) -> int:
        return 0


def test_the_protocol_names_alone_carry_a_transfer():
    """A sender and a receiver wired back to back by the caller, on the caller's clock,
    with nothing but kvtransport.protocol: the payload arrives byte for byte and the
    receiver's all-done stops the sender."""
    tr = protocol.synthetic_transfer(60_000, 6, "zipf", seed=3)
    now, step = 0.0, 1e-4
    sender = protocol.SenderSession(tr, _Reactive(), rate_bps=1e8, deadline=0.5, now=now)
    receiver = protocol.ReceiverSession(deadline=0.5, now=now)
    while not (receiver.finished and sender.done) and now < 1.0:
        for data in sender.datagrams_to_send(now):
            receiver.receive_datagram(data, now)
        for data in receiver.datagrams_to_send(now):
            sender.receive_datagram(data, now)
        now += step
        for session in (sender, receiver):
            due = session.next_timer()
            if due is not None and due <= now:
                session.handle_timer(now)
    res = receiver.result
    assert res is not None and res.reason == protocol.ReceiverFinish.COMPLETE
    assert np.array_equal(res.payload, tr.payload)
    assert sender.finish_reason == protocol.FinishReason.RECEIVER_DONE
