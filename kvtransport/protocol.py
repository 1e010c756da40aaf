"""The sans-I/O protocol core as one namespace (h11's ``Connection``, aioquic's
``QuicConnection``): bytes and ``now`` in, bytes and timers out, no sockets, no threads,
no clock of its own.

One transfer is a :class:`SenderSession` on one side and a :class:`ReceiverSession` on the
other; the caller owns the I/O and the time::

    sender = SenderSession(transfer, policy, rate_bps=1e8, deadline=0.5, now=now)
    receiver = ReceiverSession(deadline=0.5, now=now)
    for data in sender.datagrams_to_send(now):      # due at ``now``: put them on the wire
        receiver.receive_datagram(data, now)         # what came off the wire
    for data in receiver.datagrams_to_send(now):    # feedback, back to the sender
        sender.receive_datagram(data, now)
    receiver.result                                  # a TransferResult once finished

Call ``handle_timer(now)`` when ``next_timer()`` is due. A :class:`Transfer` is the payload
with its blocks and their utilities (:func:`synthetic_transfer` makes one); a
:class:`Policy` decides how much repair and when (``act(obs)`` returns an index into
:data:`ACTIONS`; kvtransport.policies has the built-in ones); :class:`ProtocolConfig`
(:data:`STANDARD` by default) holds the receiver's bounds. The lifecycles are
:class:`SenderState` / :class:`FinishReason` and :class:`ReceiverFinish`; a malformed
datagram is dropped and counted (:class:`WireError` is what the parser raises inside).

The daemons (kvtransport.daemons), the in-process API (``kvtransport.send`` /
``receive``) and the simulators (kvtransport.sim) are shells around these classes.
"""

from kvtransport.core.lifecycle import FinishReason, ReceiverFinish, SenderState
from kvtransport.core.policy_base import ACTIONS, Policy, PolicyContext
from kvtransport.core.protocol import DEFAULT_SYMBOL_SIZE, STANDARD, ProtocolConfig
from kvtransport.core.receiver import ReceiverSession
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import (
    Transfer,
    TransferResult,
    TransportManifest,
    synthetic_transfer,
)
from kvtransport.core.wire import DatagramType, WireError

__all__ = [
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
