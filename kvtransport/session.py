"""The protocol core: sans-I/O sender and receiver sessions (aioquic style).

Three shells drive the same two classes: the UDP daemons, the discrete-event simulator
(kvtransport.simulator) and the Gymnasium environment. A session never reads a clock or
touches a socket; the shell passes ``now`` (seconds, its own clock) and moves bytes:

    sender.datagrams_to_send(now) -> [bytes]      receiver.receive_datagram(data, now)
    sender.receive_datagram(fb, now)             receiver.datagrams_to_send(now) -> [bytes]
    sender.next_timer() -> float | None          receiver.next_timer() -> float | None
    sender.handle_timer(now)                     receiver.handle_timer(now)
    sender.done                                  receiver.finished, receiver.result

A shell loop is: sleep until the earliest ``next_timer()``; call ``handle_timer`` and
``datagrams_to_send`` on that session and send what comes out; feed every datagram that
arrives to its session and send what that produces. The sender paces itself: its timer is
the next slot at the link rate.

The pieces live in their own modules: kvtransport.sender (SenderSession),
kvtransport.receiver (ReceiverSession), kvtransport.feedback (loss accounting),
kvtransport.manifest_fec (manifest protection), kvtransport.protocol (shared constants),
kvtransport.policy (repair policies), kvtransport.wire (datagram format).
"""

from kvtransport.receiver import ReceiverSession
from kvtransport.sender import SenderSession

__all__ = ["ReceiverSession", "SenderSession"]
