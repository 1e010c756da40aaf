"""Wire format: one versioned header for every kvtransport datagram.

Every datagram (data path and feedback path) starts with the same fixed 28-byte header,
network byte order, followed by the payload; with a pre-shared key (the default everywhere
a user runs the transport) the payload is sealed with AES-256-GCM (see "Sealing" below)::

    offset size field         meaning
    ------ ---- ------------- -----------------------------------------------------------
     0     2    magic         0x4B56 ("KV")
     2     1    version       3
     3     1    type          DatagramType (table below)
     4     1    flags         bit 0 SEALED: the payload is AES-GCM ciphertext and a 16-byte
                              tag follows it
                              bit 1 RETRANSMIT: an ARQ retransmission of a source symbol
                              other bits must be 0
     5     1    reserved      must be 0
     6     2    payload_len   bytes of payload after the header (tag not included)
     8     8    transfer_id   random 64-bit id chosen by the sender for one transfer
    16     4    seq           per-direction packet number: every data-path datagram of a
                              transfer (manifest, source, repair, control) takes the next
                              one, so the receiver measures loss and bursts from the gaps;
                              feedback datagrams number their own sequence
    20     2    key           FEC payload id, first half (per type, below)
    22     2    dt_nss        DT (4 high bits) and NSS (12 low bits) per RFC 8681
    24     4    esi           FEC payload id, ESI part (per type, below)
    28     n    payload       plaintext, or with SEALED its AES-GCM ciphertext (same length)
    28+n   16   tag           only with SEALED: the AES-GCM tag over header and payload

Sealing (one mechanism for every type: sources, repairs, manifest, feedback, control).
Each transfer has its own AES-256 key, ``HKDF-SHA256(ikm = secret, salt = transfer_id as
8 bytes, info = "kvtransport/2 datagram AES-256-GCM" + binding)`` (:func:`transfer_key`).
With a pre-shared key alone, the secret is that key and the binding is empty. The 28-byte
header is the associated data: every header bit is authenticated, and a datagram moved to
another transfer, direction, epoch or sequence number fails its tag. Without a key (the
explicit ``--insecure`` mode) datagrams carry plaintext and no tag, and a keyed parser
rejects them (and an unkeyed one rejects sealed ones) as ``bad_tag``.

Peers (static identities, as WireGuard's): a host may hold an X25519 key pair. A sender
that names its receiver's public key, and a receiver that lists the senders' public keys
it allows, seal with :class:`PeerKeys` instead of a bare pre-shared key: per peer, the
secret is ``X25519(own private, peer public)`` followed by the pre-shared key when one is
also given (mixed in, never required), and the binding is ``sender public key | receiver
public key`` (32 bytes each, in that order whatever the direction) (:func:`pairwise`). So
a transfer's key belongs to one sender and one receiver: its datagrams replayed to another
receiver (another identity, the same pre-shared key or not) open under none of that
receiver's secrets and are dropped as ``bad_tag``, and a sender whose public key is not
allowed opens no session. A receiver with several allowed senders tries each pairwise
secret once on a new transfer's first datagram (one key derivation and one open each, at
most ``MAX_PEERS``, counted in ``PeerKeys.tries``) and remembers which one opened it
(``PeerKeys.bind``: only a datagram that opened binds, so forgeries cannot displace a
genuine transfer's peer); its feedback for that transfer is sealed under that peer's
secret. The nonce argument below holds per transfer key as before: the binding only
selects the key, and a transfer id names one key per (sender, receiver) pair.

Nonces are unique by construction: the 96-bit GCM nonce is ``epoch (u64) | seq (u32)``.

- Data path (sender -> receiver, every type but FEEDBACK): epoch 0, so the nonce is the
  header's seq, which a :class:`Framer` numbers 0, 1, 2, ... and refuses to repeat. The
  key is unique to one run of one sender because the transfer id is: a sender draws it at
  random (64 bits) per transfer. A transfer id chosen by a client of the sender daemon is
  only the transfer's *name* there: the daemon draws the wire id at random
  (kvtransport.daemons.daemon_sender), so the same name submitted again after a restart
  gets a new key. Only a sans-I/O shell that passes an explicit wire id (a simulator
  replaying a seed) vouches for its uniqueness itself.
- Feedback (receiver -> sender): each receiving session draws a random 64-bit epoch
  (never 0 with a key) and carries it in its FEEDBACK datagrams' header (key, DT/NSS and
  ESI fields, unused by feedback otherwise); the nonce is that epoch and the feedback's
  own seq. A receiver restarted mid-transfer numbers its feedback from 0 again, but under
  a new epoch, so no (key, nonce) pair repeats; the sender reads the epoch from the header
  (:func:`feedback_epoch`) and orders reports per epoch. A sealed FEEDBACK with epoch 0
  (the data path's nonces) is rejected as ``bad_tag``. Without a key the epoch is
  whatever the receiver writes (no nonce to protect; kept deterministic there).

Per type (the FEC payload id fields are RFC 8681's: a source symbol carries its 32-bit ESI;
a repair symbol carries Repair_Key 16, DT 4, NSS 12 and the ESI of the first source symbol
of its window)::

    type             code key                    dt_nss        esi               payload
    ---------------- ---- ---------------------- ------------- ----------------- -----------
    SOURCE           1    0                      0             ESI               symbol
    REPAIR           2    repair_key             DT, NSS       first ESI         symbol
    BLOCK_REPAIR     3    p << 8 | repair index  NSS = k       first ESI (block) symbol
    FEEDBACK         4    epoch (bits 63-48)     epoch (47-32) epoch (31-0)      FEEDBACK_*
    MANIFEST         5    M (manifest symbols)   0             manifest ESI      symbol
    MANIFEST_REPAIR  6    repair_key             DT, NSS = M   0                 symbol
    CONTROL          7    0                      0             ControlCode       optional

REPAIR is a streaming RLC repair (RFC 8681 sliding window over GF(2^8)); BLOCK_REPAIR is a
Reed-Solomon parity symbol of the block of k source symbols starting at ``esi`` (n = k + p
<= 255, so p and the index fit one byte each); an ARQ retransmission is a SOURCE datagram
with the RETRANSMIT flag. A repair scheme's own type is listed here and in
``SCHEME_TYPES``; one registered at run time (kvtransport.core.schemes.register) may bring a
type this table does not list, which parsers accept while it is registered. The transport
manifest travels in its own ESI space (MANIFEST and MANIFEST_REPAIR) with its own RLC
code; see kvtransport.core.transfer for its content.

Feedback payload (receiver -> sender): ``FEEDBACK_FIXED`` (counters, loss estimates, flags;
field list at its definition), then ``n_ranges`` loss ranges ``(first ESI u32, count u16)``
of recoverable source symbols the receiver still misses and no pending repair equation is
pivoted on (has as its lowest unknown), lowest first (the NACK list): each needs one more
equation, while a pivoted one is decoded once its equation's other unknowns are. Then
``n_segments`` entries ``(segment u32, pending u16)``, pending equations pivoted per aligned
segment of ``REPAIR_SEGMENT`` ESIs, which a sender subtracts from that segment's holes:
receivers of this version send none (their list already leaves those holes out); earlier
ones listed every hole and sent these.

Parsing is defensive: whatever the bytes, :func:`parse` either returns a :class:`Datagram`
or raises a :class:`WireError` subclass whose ``reason`` names a counter; nothing else
escapes. Per-packet cost matters (a few microseconds per datagram in Python), so the header
is one precompiled ``struct.Struct``, datagrams are built in one preallocated buffer by
:class:`Framer`, payloads come back as memoryviews (slices of the caller's buffer when
unsealed, of the decrypted copy when sealed), and each transfer's AES-GCM context is
derived once and kept (a :class:`Parser` keeps the most recent ``MAX_CACHED_KEYS`` whose
datagrams opened; a forged transfer id costs one derivation and is not kept).

Runs of sources (a sender's consecutive source slots, a receiver's in-order sources) are
sealed and opened in one compiled call each where libcrypto is available
(kvtransport.codecs.aesgcm): :meth:`Framer.seal_sources` gives the same datagrams as
:meth:`Framer.seal` one by one, and :meth:`Parser.source_run` opens a run of
:class:`LaidOutDatagrams` (datagrams that lie in one buffer, as a socket read leaves them)
with the same outcome as its per-datagram loop.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Sequence
from enum import IntEnum
from typing import NamedTuple, NoReturn

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtransport.codecs import aesgcm
from kvtransport.core.protocol import LINK_OVERHEAD_BYTES

MAGIC = 0x4B56
VERSION = 3
HEADER = struct.Struct("!HBBBBHQIHHI")
HEADER_SIZE = HEADER.size  # 28
TAG_SIZE = 16
MAX_DATAGRAM = 65507  # largest UDP payload over IPv4
MAX_PAYLOAD = MAX_DATAGRAM - HEADER_SIZE - TAG_SIZE

FLAG_SEALED = 0x01
FLAG_RETRANSMIT = 0x02
_KNOWN_FLAGS = FLAG_SEALED | FLAG_RETRANSMIT

MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 64
MAX_CACHED_KEYS = 256
"""Per-transfer AES-GCM contexts a :class:`Parser` keeps, of transfers whose datagrams
opened (a forged transfer id is never kept; an evicted genuine transfer's context is
derived again)."""
_HKDF_INFO = b"kvtransport/2 datagram AES-256-GCM"
PUBLIC_KEY_BYTES = 32
"""An X25519 public (and private) key's size."""
MAX_PEERS = 64
"""Public keys a :class:`PeerKeys` may hold: the pairwise secrets a receiver tries at most
on a new transfer's first datagram."""
MAX_BOUND_TRANSFERS = 65536
"""Transfers whose peer a :class:`PeerKeys` remembers (the oldest forgotten first; only
datagrams that opened bind one, so only allowed peers fill it). A forgotten transfer's next
uncached datagram binds it again; until then what it would be sent is dropped
(:class:`UnknownPeer`, counted)."""

MAX_NSS = 0x0FFF
MAX_DT = 15


def link_bytes(
    symbol_size: int, tagged: bool = False, *, link_overhead: int = LINK_OVERHEAD_BYTES
) -> int:
    """Bytes one data datagram of ``symbol_size`` occupies on the link: header, symbol,
    authentication tag when sealed, and the link's own ``link_overhead`` per datagram (a
    caller holding a ProtocolConfig passes its ``link_overhead``; the default is the
    standard one's)."""
    return HEADER_SIZE + symbol_size + (TAG_SIZE if tagged else 0) + link_overhead


def full_send_time(
    n_bytes: int,
    rate_bps: float,
    symbol_size: int,
    tagged: bool = False,
    *,
    link_overhead: int = LINK_OVERHEAD_BYTES,
) -> float:
    """Seconds to send a payload's source symbols loss-free at the link rate, counting
    ``link_overhead`` bytes per datagram (as :func:`link_bytes`): rho's unit (a deadline
    of ``rho`` is ``rho * full_send_time(...)``)."""
    n_source = -(-n_bytes // symbol_size)
    return n_source * link_bytes(symbol_size, tagged, link_overhead=link_overhead) * 8.0 / rate_bps


class DatagramType(IntEnum):
    """The ``type`` byte of the header."""

    SOURCE = 1
    REPAIR = 2
    BLOCK_REPAIR = 3
    FEEDBACK = 4
    MANIFEST = 5
    MANIFEST_REPAIR = 6
    CONTROL = 7


SCHEME_TYPES = frozenset({int(DatagramType.REPAIR), int(DatagramType.BLOCK_REPAIR)})
"""The types whose datagrams a receiver hands to a repair scheme's decoder
(kvtransport.core.schemes: a scheme names its type as ``wire_type``)."""
_ACCEPTED = bytearray(256)  # per type byte: 1 if parsers accept it
for _t in DatagramType:
    _ACCEPTED[_t] = 1
_SOURCE_TYPE = int(DatagramType.SOURCE)


def is_listed_type(code: int) -> bool:
    """Is ``code`` a ``DatagramType`` of the wire format itself?"""
    return code in DatagramType._value2member_map_


def accept_type(code: int) -> None:
    """Let parsers accept datagrams of type ``code``, a type ``DatagramType`` does not list
    (a repair scheme registered at run time, kvtransport.core.schemes.register)."""
    if not 0 < code < 256:
        raise ValueError(f"datagram type {code} outside 1..255")
    _ACCEPTED[code] = 1


def refuse_type(code: int) -> None:
    """Undo :func:`accept_type` (the wire format's own types stay)."""
    if not is_listed_type(code):
        _ACCEPTED[code] = 0


# The parser's view of the same header: magic, version and type as one u32, flags and
# reserved as one u16 (so a good header passes a few integer tests).
_FAST = struct.Struct("!IHHQIHHI")
_PREFIX = MAGIC << 16 | VERSION << 8
_SEALED_BIT = FLAG_SEALED << 8
_RETRANSMIT_BIT = FLAG_RETRANSMIT << 8
_BAD_BITS = 0xFFFF & ~(_KNOWN_FLAGS << 8)  # unknown flags, or a non-zero reserved byte
_tuple_new = tuple.__new__  # a Datagram without the Python-level NamedTuple constructor
_NONCE = struct.Struct("!IQ")  # the 96-bit GCM nonce of the data path: (0, seq)
_NONCE_PACK = _NONCE.pack
_FB_NONCE_PACK = struct.Struct("!HHII").pack  # a FEEDBACK's: its epoch (key, dt_nss, esi), seq
_HEADER_PACK = HEADER.pack
_FEEDBACK_TYPE = 4  # DatagramType.FEEDBACK: the receiver -> sender direction
_SEQ_AT = struct.calcsize("!HBBBBHQ")  # the header's seq field (u32)
_ESI_AT = struct.calcsize("!HBBBBHQIHH")  # its esi field (u32)
_SOURCE_CHECKED = np.ones(HEADER_SIZE, np.bool_)  # what Parser.source_run compares
_SOURCE_CHECKED[_SEQ_AT + 4 : _ESI_AT] = False  # not the key and DT/NSS fields


class ControlCode(IntEnum):
    """The ``esi`` field of a CONTROL datagram."""

    FIN = 1  # the sender has stopped sending for good (deadline reached or all delivered)
    ABORT = 2  # the sender cancelled the transfer: deliver what you have now


# Feedback: echo_seq, echo_delay_us, received, lost, esi_end, decoded_through, unrecovered,
# pending, source_received, repair_received, loss_rate, burst_mean, flags, n_ranges, n_segments
FEEDBACK_FIXED = struct.Struct("!IIIIIIIIIIffHHH")
FEEDBACK_RANGE = struct.Struct("!IH")
FEEDBACK_SEGMENT = struct.Struct("!IH")
FB_MANIFEST_DONE = 0x01  # the receiver has decoded the transport manifest
FB_ALL_DONE = 0x02  # every source symbol is known: stop sending
FB_FINISHED = 0x04  # the receiver has yielded its result (deadline, abort or all done)
FB_REORDERED = 0x08  # the data path reorders (jitters); earlier senders ignore the bit
# bits 8-15: why the receiver refused the transfer (kvtransport.core.feedback.REFUSALS)
MAX_FEEDBACK_RANGES = 96
MAX_FEEDBACK_SEGMENTS = 96


class WireError(ValueError):
    """A datagram that must be dropped; ``reason`` names the counter to bump."""

    reason = "malformed"


class UnknownPeer(WireError):
    """No peer is known to seal a transfer's datagrams under (:meth:`PeerKeys.sealing`):
    the datagram is not sent (counted in ``PeerKeys.unsealable``)."""

    reason = "unknown_peer"


class Truncated(WireError):
    reason = "truncated"


class Oversized(WireError):
    reason = "oversized"


class BadMagic(WireError):
    reason = "bad_magic"


class BadVersion(WireError):
    reason = "bad_version"


class BadType(WireError):
    reason = "bad_type"


class BadLength(WireError):
    """Lengths or fields that contradict each other (payload_len vs datagram size, ...)."""

    reason = "bad_length"


class BadTag(WireError):
    """Missing, unexpected or wrong authentication tag (a sealed datagram that does not
    open under this transfer's key, or a sealed/unsealed mismatch)."""

    reason = "bad_tag"


class BadPayload(WireError):
    """A header that parses but a payload (feedback, manifest) that does not."""

    reason = "bad_payload"


class Datagram(NamedTuple):
    """One parsed datagram; ``payload`` is a memoryview into the caller's buffer."""

    type: int
    flags: int
    transfer_id: int
    seq: int
    key: int
    dt_nss: int
    esi: int
    payload: memoryview

    @property
    def dt(self) -> int:
        return self.dt_nss >> 12

    @property
    def nss(self) -> int:
        return self.dt_nss & MAX_NSS


def new_epoch() -> int:
    """A random 64-bit feedback epoch, never 0 (module docstring, "Sealing")."""
    while True:
        e = secrets.randbits(64)
        if e:
            return e


def feedback_epoch(d: Datagram) -> int:
    """The feedback epoch a FEEDBACK datagram carries in its header (key, DT/NSS, ESI)."""
    return d.key << 48 | d.dt_nss << 32 | d.esi


def check_key(key: bytes) -> bytes:
    """``key`` as bytes if it is a usable pre-shared key (16..64 bytes), else ValueError."""
    if not isinstance(key, bytes | bytearray) or not (MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES):
        n = len(key) if isinstance(key, bytes | bytearray) else type(key).__name__
        raise ValueError(
            f"the pre-shared key must be {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes (got {n})"
        )
    return bytes(key)


def transfer_key(key: bytes, transfer_id: int, binding: bytes = b"") -> bytes:
    """One transfer's AES-256 key: HKDF-SHA256 of the secret ``key`` (a checked pre-shared
    key, or a :func:`pairwise` secret) salted with the transfer id, with ``binding`` (the
    peers' public keys; empty for a pre-shared key alone) in its info (module docstring)."""
    kdf = HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=transfer_id.to_bytes(8, "big"),
        info=_HKDF_INFO + binding,
    )
    return kdf.derive(key)


def transfer_cipher(key: bytes, transfer_id: int) -> AESGCM:
    """The AES-256-GCM context of one transfer (its key: :func:`transfer_key`)."""
    return AESGCM(transfer_key(key, transfer_id))


class PairSecret(NamedTuple):
    """What this host and one peer seal with (:func:`pairwise`): :func:`transfer_key`'s
    ``key`` and ``binding``, and the peer's public key (to name it)."""

    secret: bytes
    binding: bytes
    peer: bytes


def pairwise(
    own: X25519PrivateKey, peer_public: bytes, *, sending: bool, psk: bytes | None = None
) -> PairSecret:
    """The secret this host (``own``) shares with the peer whose public key is
    ``peer_public``: the static-static X25519 result, then ``psk`` (checked) when given;
    bound to ``sender | receiver`` public keys, this host being the sender when
    ``sending``. ValueError for a key that is not a usable X25519 public key (wrong size,
    or a low-order point whose result is all zeros)."""
    if len(peer_public) != PUBLIC_KEY_BYTES:
        raise ValueError(f"a public key is {PUBLIC_KEY_BYTES} bytes, not {len(peer_public)}")
    try:
        shared = own.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
    except ValueError:
        raise ValueError("not a usable X25519 public key (no shared secret)") from None
    mine = own.public_key().public_bytes_raw()
    binding = mine + peer_public if sending else peer_public + mine
    extra = b"" if psk is None else check_key(psk)
    return PairSecret(shared + extra, bytes(binding), bytes(peer_public))


class PeerKeys:
    """The keys of a host with a static identity (module docstring, "Peers"): one
    :class:`PairSecret` per peer (a sender: its receiver's; a receiver: one per allowed
    sender), and the peer each transfer belongs to once one of its datagrams opened.
    :class:`Framer` and :class:`Parser` take it wherever they take a pre-shared key; a
    framer needs the transfer's peer known (bound, or the only one): one of a transfer whose
    binding was forgotten (more than ``MAX_BOUND_TRANSFERS`` bound since) raises
    :class:`UnknownPeer`, which callers drop and ``unsealable`` counts."""

    __slots__ = ("pairs", "tries", "unsealable", "_bound")

    def __init__(self, pairs: Sequence[PairSecret]) -> None:
        if not 1 <= len(pairs) <= MAX_PEERS:
            raise ValueError(f"a host holds 1..{MAX_PEERS} peers' public keys, not {len(pairs)}")
        self.pairs = tuple(pairs)
        self.tries = 0  # pairwise secrets tried on transfers whose peer was not known
        self.unsealable = 0  # seals asked for transfers of no known peer (UnknownPeer)
        self._bound: dict[int, PairSecret] = {}

    def candidates(self, transfer_id: int) -> tuple[PairSecret, ...]:
        """The secrets a datagram of ``transfer_id`` may be sealed under: its bound peer's,
        else every peer's."""
        pair = self._bound.get(transfer_id)
        return self.pairs if pair is None else (pair,)

    def bind(self, transfer_id: int, pair: PairSecret) -> None:
        """Remember ``pair`` as the peer of ``transfer_id`` (a datagram of it opened)."""
        bound = self._bound
        if transfer_id not in bound and len(bound) >= MAX_BOUND_TRANSFERS:
            del bound[next(iter(bound))]
        bound[transfer_id] = pair

    def sealing(self, transfer_id: int) -> PairSecret:
        """The secret datagrams of ``transfer_id`` are sealed under; :class:`UnknownPeer`
        (counted) while several peers are possible."""
        pairs = self.candidates(transfer_id)
        if len(pairs) != 1:
            self.unsealable += 1
            raise UnknownPeer(f"no peer known for transfer {transfer_id:016x}")
        return pairs[0]

    def peer_of(self, transfer_id: int) -> bytes | None:
        """The public key of the peer ``transfer_id`` belongs to, if known."""
        pair = self._bound.get(transfer_id)
        if pair is None and len(self.pairs) == 1:
            pair = self.pairs[0]
        return None if pair is None else pair.peer


SealKey = bytes | PeerKeys
"""What seals datagrams: a pre-shared key, or peers' pairwise secrets."""


def _checked(key: SealKey | None) -> SealKey | None:
    """``key`` ready for a framer or parser: a pre-shared key checked (:func:`check_key`)."""
    return key if key is None or isinstance(key, PeerKeys) else check_key(key)


def _sealing_key(key: SealKey, transfer_id: int) -> bytes:
    """The AES-256 key a framer seals ``transfer_id``'s datagrams with."""
    if isinstance(key, PeerKeys):
        pair = key.sealing(transfer_id)
        return transfer_key(pair.secret, transfer_id, pair.binding)
    return transfer_key(key, transfer_id)


def _opening_keys(key: SealKey, transfer_id: int) -> list[tuple[bytes, PairSecret | None]]:
    """The AES-256 keys a datagram of a transfer not cached may open under, each with the
    peer it would bind (None for a pre-shared key): one derivation per candidate."""
    if not isinstance(key, PeerKeys):
        return [(transfer_key(key, transfer_id), None)]
    pairs = key.candidates(transfer_id)
    key.tries += len(pairs)
    return [(transfer_key(p.secret, transfer_id, p.binding), p) for p in pairs]


def kernel_stand_in(key: SealKey | None) -> bytes | None:
    """A pre-shared key that makes the same kernels run as ``key`` does (warming them in a
    process: never sealed with on a link), or None for None."""
    return None if key is None else bytes(range(32)) if isinstance(key, PeerKeys) else key


if (aesgcm.HEADER_BYTES, aesgcm.TAG_BYTES) != (HEADER_SIZE, TAG_SIZE):
    raise ImportError("kvtransport.codecs.aesgcm's header and tag sizes are not the wire's")


def _source_template(flags: int, size: int, transfer_id: int) -> np.ndarray:
    """The header of a SOURCE of ``transfer_id`` with ``size``-byte symbols and ``flags``,
    its seq and FEC payload id zero: what the run kernels set seq and ESI into."""
    header = _HEADER_PACK(MAGIC, VERSION, _SOURCE_TYPE, flags, 0, size, transfer_id, 0, 0, 0, 0)
    return np.frombuffer(header, np.uint8)


def _run_key(cipher_key: bytes) -> aesgcm.GcmKey | None:
    """The run kernels' contexts for one transfer key (None where they are unavailable)."""
    return aesgcm.GcmKey(cipher_key) if aesgcm.AVAILABLE else None


class LaidOutDatagrams(list):
    """Datagrams (a list of memoryviews, as any other) that all lie in one buffer: item j is
    ``buf[starts[j]:ends[j]]`` (``buf`` a uint8 array, ``starts`` and ``ends`` int64
    arrays of the list's length). What a socket read leaves (kvtransport.daemons.udp), so
    :meth:`Parser.source_run` can open a run of them in one compiled call."""

    __slots__ = ("buf", "starts", "ends")

    def __init__(
        self, datagrams: Sequence[memoryview], buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
    ) -> None:
        super().__init__(datagrams)
        self.buf, self.starts, self.ends = buf, starts, ends

    @classmethod
    def join(cls, datagrams: Sequence[bytes | bytearray | memoryview]) -> LaidOutDatagrams:
        """The same datagrams copied back to back into one new buffer (tests, replays)."""
        sizes = np.fromiter((len(d) for d in datagrams), np.int64, len(datagrams))
        ends = np.cumsum(sizes)
        starts = ends - sizes
        buf = np.frombuffer(bytearray(b"".join(datagrams)), np.uint8)  # writable, as a socket's
        mv = memoryview(buf)
        views = [mv[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        return cls(views, buf, starts, ends)


class ReceivedBatch(list):
    """``(datagram, address)`` pairs of one socket read, whose datagrams lie in one buffer
    as in :class:`LaidOutDatagrams` (pair j's is ``buf[starts[j]:ends[j]]``): a list like
    any other, and :meth:`run` gives a stretch of its datagrams laid out."""

    __slots__ = ("buf", "starts", "ends")

    def __init__(
        self, pairs: Sequence[tuple], buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
    ) -> None:
        super().__init__(pairs)
        self.buf, self.starts, self.ends = buf, starts, ends

    def run(self, a: int, datagrams: list) -> LaidOutDatagrams:
        """``datagrams``, the datagrams of pairs ``a, a + 1, ...``, laid out."""
        b = a + len(datagrams)
        return LaidOutDatagrams(datagrams, self.buf, self.starts[a:b], self.ends[a:b])


class Parser:
    """Parses and opens datagrams under one pre-shared key or one :class:`PeerKeys` (or
    none: insecure mode).

    With a key, unsealed datagrams and ones that do not open under their transfer's key
    raise :class:`BadTag`; without a key, sealed datagrams raise :class:`BadTag` too (they
    cannot be opened, and accepting them would hide a misconfigured peer). Per-transfer
    contexts are cached once a datagram of the transfer opened (at most
    ``MAX_CACHED_KEYS``, oldest evicted first); a forged transfer id costs one key
    derivation and one open per candidate secret (one; with :class:`PeerKeys`, one per
    allowed peer), and is not kept.
    """

    __slots__ = ("_key", "_ciphers", "_keys", "_run_keys", "_run_cache")

    def __init__(self, key: SealKey | None = None) -> None:
        self._key = _checked(key)
        # transfers whose datagrams opened: their AES-GCM contexts and keys (for the run
        # kernels' contexts, made when a run of sources first needs them)
        self._ciphers: dict[int, AESGCM] = {}
        self._keys: dict[int, bytes] = {}
        self._run_keys: dict[int, aesgcm.GcmKey | None] = {}
        # the last compiled run's output buffer, transfer and symbol size, and for them: the
        # expected header, the output as an array, room for a plaintext before its tag
        self._run_cache: tuple = (None, -1, -1, None, None, None)

    def _remember(self, tid: int, cipher: AESGCM, key: bytes) -> None:
        """Cache a transfer's context once a datagram of it opened: a forged transfer id
        (one whose datagram does not open) is derived, tried and forgotten, so forgeries
        cannot evict genuine transfers' contexts."""
        ciphers = self._ciphers
        if len(ciphers) >= MAX_CACHED_KEYS:
            oldest = next(iter(ciphers))
            del ciphers[oldest], self._keys[oldest]
            self._run_keys.pop(oldest, None)
        ciphers[tid] = cipher
        self._keys[tid] = key

    def _run_key_of(self, tid: int) -> aesgcm.GcmKey | None:
        """The run kernels' contexts of a cached transfer, made on first use."""
        run_key = self._run_keys.get(tid)
        if run_key is None:
            run_key = self._run_keys[tid] = _run_key(self._keys[tid])
        return run_key

    def _open_new(self, tid: int, nonce: bytes, sealed: memoryview, header: memoryview) -> bytes:
        """Open a datagram of a transfer not cached: one key derivation and one AES-GCM
        open per candidate secret (one with a pre-shared key; with :class:`PeerKeys`, the
        bound peer's or each peer's in turn, the one that opens bound), no run-kernel
        context until the transfer is known genuine. InvalidTag when none opens: nothing
        is kept."""
        assert self._key is not None  # parse() opens only with a key
        for k, pair in _opening_keys(self._key, tid):
            c = AESGCM(k)
            try:
                plain = c.decrypt(nonce, sealed, header)
            except InvalidTag:
                continue
            if pair is not None:
                assert isinstance(self._key, PeerKeys)
                self._key.bind(tid, pair)
            self._remember(tid, c, k)
            return plain
        raise InvalidTag

    def parse(self, data: bytes | bytearray | memoryview) -> Datagram:
        """Return the datagram in ``data`` or raise a :class:`WireError`.

        The hot path of every receiver: a well-formed datagram passes one combined test of
        the header (magic, version, type, flags and lengths in a few integer comparisons)
        and, with a key, one AES-GCM open with its transfer's cached context; anything
        that fails the header test goes through :meth:`_reject`, which names the first
        problem in the documented order.
        """
        n = len(data)
        if n < HEADER_SIZE:
            self._reject(data)
        mvt, fr, plen, tid, seq, key, dt_nss, esi = _FAST.unpack_from(data, 0)
        dtype = mvt & 0xFF
        end = HEADER_SIZE + plen
        sealed = self._key is not None
        if (
            mvt & 0xFFFFFF00 != _PREFIX
            or fr & _BAD_BITS
            or not _ACCEPTED[dtype]
            or n != (end + TAG_SIZE if sealed else end)
            or n > MAX_DATAGRAM
            or (fr & _SEALED_BIT) != (_SEALED_BIT if sealed else 0)
        ):
            self._reject(data)
        mv = memoryview(data)
        if fr & _RETRANSMIT_BIT and dtype != _SOURCE_TYPE:
            raise BadType("RETRANSMIT flag on a non-source datagram")
        if sealed:
            if dtype == _FEEDBACK_TYPE:
                if not (key or dt_nss or esi):
                    raise BadTag("sealed feedback with epoch 0 (the data path's nonces)")
                nonce = _FB_NONCE_PACK(key, dt_nss, esi, seq)
            else:
                nonce = _NONCE_PACK(0, seq)
            c = self._ciphers.get(tid)
            try:
                if c is None:
                    plain = self._open_new(tid, nonce, mv[HEADER_SIZE:n], mv[:HEADER_SIZE])
                else:
                    plain = c.decrypt(nonce, mv[HEADER_SIZE:n], mv[:HEADER_SIZE])
                payload = memoryview(plain)
            except InvalidTag:
                raise BadTag("datagram does not open under its transfer's key") from None
        else:
            payload = mv[HEADER_SIZE:end]
        return _tuple_new(Datagram, (dtype, fr >> 8, tid, seq, key, dt_nss, esi, payload))

    def source_run(
        self,
        datagrams: Sequence[bytes | bytearray | memoryview],
        i: int,
        stop: int,
        transfer_id: int,
        seq: int,
        esi: int,
        size: int,
        out: memoryview,
    ) -> int:
        """Open a run of in-order sources: from ``datagrams[i]`` on (before index
        ``stop``), the plain SOURCE datagrams of ``transfer_id`` numbered ``seq, seq + 1,
        ...`` that carry ESIs ``esi, esi + 1, ...`` with ``size``-byte payloads; each one's
        payload is written to ``out[e * size : (e + 1) * size]`` (e its ESI) once it
        opened. Returns the index of the first datagram not taken.

        A receiver's hot path (``ReceiverSession.receive_datagrams``): one header unpack,
        one combined test and, with a key, one AES-GCM open per datagram, no parsed
        :class:`Datagram` made. It takes only datagrams :meth:`parse` returns as exactly
        that SOURCE (flags SEALED as the key requires, no RETRANSMIT) and stops at the first
        other one, a datagram whose tag does not verify included (nothing of it is written;
        the caller parses it as usual, and drops it). With a key, it takes nothing until
        :meth:`parse` has seen the transfer (its cipher is derived there).

        :class:`LaidOutDatagrams` are opened in one compiled call
        (kvtransport.codecs.aesgcm.open_run) where it is available, with the same outcome."""
        sealed = self._key is not None
        c = None
        if sealed:
            c = self._ciphers.get(transfer_id)
            if c is None:
                return i
        if isinstance(datagrams, LaidOutDatagrams) and aesgcm.AVAILABLE and stop > i:
            # one compiled call: the expected header of each datagram is what Framer.seal
            # writes for it, compared on every byte the loop below tests (all but the FEC
            # payload id's key and DT/NSS, which a SOURCE ignores)
            run_key = self._run_key_of(transfer_id) if sealed else None
            cached = self._run_cache
            if cached[0] is not out or cached[1] != transfer_id or cached[2] != size:
                cached = self._run_cache = (
                    out, transfer_id, size,
                    _source_template(FLAG_SEALED if sealed else 0, size, transfer_id),
                    np.frombuffer(out, np.uint8), np.zeros(size, np.uint8),
                )  # fmt: skip
            _, _, _, want, out_array, scratch = cached
            return int(
                aesgcm.open_run(
                    0 if run_key is None else run_key.open_ctx, datagrams.buf, datagrams.starts,
                    datagrams.ends, i, stop, want, _SOURCE_CHECKED, _SEQ_AT, _ESI_AT, 0, seq,
                    esi, size, out_array, scratch,
                )
            )  # fmt: skip
        whole = HEADER_SIZE + size + (TAG_SIZE if sealed else 0)
        head, flags = _PREFIX | _SOURCE_TYPE, _SEALED_BIT if sealed else 0
        unpack = _FAST.unpack_from
        j = i
        while j < stop:
            data = datagrams[j]
            if len(data) != whole:
                break
            mvt, fr, plen, tid, sq, _, _, e = unpack(data, 0)
            if mvt != head or fr != flags or plen != size or tid != transfer_id:
                break
            if sq != seq or e != esi:
                break
            mv = memoryview(data)
            o = esi * size
            if c is None:
                out[o : o + size] = mv[HEADER_SIZE:whole]
            else:
                try:
                    out[o : o + size] = c.decrypt(
                        _NONCE_PACK(0, sq), mv[HEADER_SIZE:], mv[:HEADER_SIZE]
                    )
                except InvalidTag:
                    break
            j += 1
            seq += 1
            esi += 1
        return j

    def _reject(self, data: bytes | bytearray | memoryview) -> NoReturn:
        """Raise the :class:`WireError` that names what is wrong with ``data`` (checked in
        the order the module docstring's header lists the fields)."""
        n = len(data)
        if n < HEADER_SIZE:
            raise Truncated(f"{n} bytes < {HEADER_SIZE}-byte header")
        if n > MAX_DATAGRAM:
            raise Oversized(f"{n} bytes > {MAX_DATAGRAM}")
        magic, version, dtype, flags, reserved, plen, *_ = HEADER.unpack_from(data, 0)
        if magic != MAGIC:
            raise BadMagic(f"magic {magic:#06x}")
        if version != VERSION:
            raise BadVersion(f"version {version}")
        if not _ACCEPTED[dtype]:
            raise BadType(f"type {dtype}")
        if flags & ~_KNOWN_FLAGS or reserved:
            raise BadType(f"unknown flags {flags:#x}/{reserved:#x}")
        end = HEADER_SIZE + plen
        sealed = flags & FLAG_SEALED
        expect = end + TAG_SIZE if sealed else end
        if n < expect:
            raise Truncated(f"{n} bytes < {expect} announced")
        if n > expect:
            raise BadLength(f"{n} bytes > {expect} announced")
        if self._key is not None and not sealed:
            raise BadTag("unsealed datagram but a key is configured")
        if self._key is None and sealed:
            raise BadTag("sealed datagram but no key configured (insecure mode)")
        raise WireError("malformed")  # pragma: no cover (parse lets only good ones through)


def parse(data: bytes | bytearray | memoryview, key: SealKey | None = None) -> Datagram:
    """One-off parse (tests, tools); hot paths keep a :class:`Parser`."""
    return Parser(key).parse(data)


class Framer:
    """Builds datagrams of one transfer in one preallocated buffer.

    Hot path: write the payload into :meth:`payload_view` (or let a codec write it
    there with ``repair_into``), then :meth:`finish` packs the header, seals the payload
    (with a key) and returns the datagram as ``bytes``. Sequence numbers must increase
    per direction (FEEDBACK, everything else): the nonce is made of them, so a repeat
    raises ValueError instead of reusing a nonce.

    ``epoch``: the feedback epoch a FEEDBACK datagram of this framer carries in its header
    and nonce (module docstring). None draws a random one (never 0) with a key, and is 0
    without one; a keyed framer refuses epoch 0 (the data path's nonces).
    """

    __slots__ = (
        "transfer_id", "epoch", "_epoch_fields", "_cipher", "_run_key", "_flags", "_tag_len",
        "_next_seq", "buf", "_mv", "_pv", "_source_header",
    )  # fmt: skip

    def __init__(
        self,
        transfer_id: int,
        key: SealKey | None = None,
        max_payload: int = 2048,
        epoch: int | None = None,
    ) -> None:
        if not 0 <= transfer_id < 1 << 64:
            raise ValueError("transfer_id must fit 64 bits")
        if not 0 < max_payload <= MAX_PAYLOAD:
            raise ValueError(f"max_payload must be 1..{MAX_PAYLOAD}")
        if epoch is None:
            epoch = new_epoch() if key is not None else 0
        if not 0 <= epoch < 1 << 64 or (epoch == 0 and key is not None):
            raise ValueError("a keyed framer's feedback epoch must be 1..2^64-1")
        self.epoch = epoch
        self._epoch_fields = (epoch >> 48, (epoch >> 32) & 0xFFFF, epoch & 0xFFFFFFFF)
        self.transfer_id = transfer_id
        key = _checked(key)
        cipher_key = None if key is None else _sealing_key(key, transfer_id)
        self._cipher = None if cipher_key is None else AESGCM(cipher_key)
        self._run_key = None if cipher_key is None else _run_key(cipher_key)
        # seal_sources' symbol size and header (seq and ESI 0)
        self._source_header: tuple[int, np.ndarray] = (-1, np.zeros(0, np.uint8))
        self._flags = FLAG_SEALED if key is not None else 0
        self._tag_len = TAG_SIZE if key is not None else 0
        self._next_seq = [0, 0]  # per direction: the lowest seq not yet used
        self.buf = bytearray(HEADER_SIZE + max_payload + TAG_SIZE)
        self._mv = memoryview(self.buf)
        self._pv = self._mv[HEADER_SIZE:HEADER_SIZE]  # the last payload view finish used

    @property
    def overhead(self) -> int:
        """Bytes a datagram carries beyond its payload (header and tag)."""
        return HEADER_SIZE + self._tag_len

    def payload_view(self, n: int) -> memoryview:
        """The buffer region where the next datagram's ``n``-byte payload goes."""
        return self._mv[HEADER_SIZE : HEADER_SIZE + n]

    def finish(
        self,
        dtype: int,
        seq: int,
        n: int,
        esi: int = 0,
        key: int = 0,
        dt_nss: int = 0,
        flags: int = 0,
    ) -> bytes:
        """Pack the header for an ``n``-byte payload already in place, seal it; return the
        datagram."""
        pv = self._pv
        if len(pv) != n:
            pv = self._pv = self._mv[HEADER_SIZE : HEADER_SIZE + n]
        return self.seal(dtype, seq, pv, esi, key, dt_nss, flags)

    def seal(
        self,
        dtype: int,
        seq: int,
        payload: bytes | bytearray | memoryview,
        esi: int = 0,
        key: int = 0,
        dt_nss: int = 0,
        flags: int = 0,
    ) -> bytes:
        """:meth:`finish` for a payload held elsewhere (e.g. a slice of the transfer's
        buffer): the same datagram, without copying the payload into the framer's buffer
        first. The header is packed straight into ``bytes`` (it is the AEAD's associated
        data as is), and the datagram is header + sealed payload (+ tag)."""
        direction = dtype == _FEEDBACK_TYPE
        nxt = self._next_seq
        if seq < nxt[direction]:
            raise ValueError(f"seq {seq} already used in this direction (nonce reuse)")
        n = len(payload)
        if n > MAX_PAYLOAD:
            raise ValueError(f"payload of {n} bytes > {MAX_PAYLOAD}")
        if direction:  # the feedback epoch rides in the FEC payload id fields
            key, dt_nss, esi = self._epoch_fields
        header = _HEADER_PACK(
            MAGIC,
            VERSION,
            dtype,
            flags | self._flags,
            0,
            n,
            self.transfer_id,
            seq,
            key,
            dt_nss,
            esi,
        )
        nxt[direction] = seq + 1
        c = self._cipher
        if c is None:
            return header + payload
        nonce = _FB_NONCE_PACK(key, dt_nss, esi, seq) if direction else _NONCE_PACK(0, seq)
        return header + c.encrypt(nonce, payload, header)

    def seal_sources(
        self,
        seq: int,
        esi: int,
        count: int,
        payload: np.ndarray,
        size: int,
        last_esi: int,
        last_symbol: np.ndarray,
    ) -> list[bytes]:
        """The SOURCE datagrams ``seal(SOURCE, seq + k, symbol(esi + k), esi + k)`` for k in
        ``0 .. count - 1``, byte for byte: symbol e is ``payload[e * size : (e + 1) * size]``
        except ``last_esi``'s, which is ``last_symbol`` (zero-padded). Sealed in one
        compiled call (kvtransport.codecs.aesgcm.seal_run) where it is available, else one
        :meth:`seal` each."""
        if count <= 0:
            return []
        if seq < self._next_seq[0]:
            raise ValueError(f"seq {seq} already used in this direction (nonce reuse)")
        if size > MAX_PAYLOAD or not 0 <= esi <= esi + count - 1 <= last_esi:
            raise ValueError(f"sources {esi}..{esi + count - 1} of size {size} do not fit")
        if not aesgcm.AVAILABLE:
            out = []
            for k in range(count):
                e = esi + k
                sym = last_symbol if e == last_esi else payload[e * size : e * size + size]
                out.append(self.seal(_SOURCE_TYPE, seq + k, memoryview(sym), e))
            return out
        run_key = self._run_key
        if self._source_header[0] != size:
            self._source_header = (size, _source_template(self._flags, size, self.transfer_id))
        header = self._source_header[1]
        whole = HEADER_SIZE + size + self._tag_len
        blob = bytearray(count * whole)
        written = aesgcm.seal_run(
            0 if run_key is None else run_key.seal_ctx, header, _SEQ_AT, _ESI_AT, 0, seq, esi,
            count, payload, size, last_esi, last_symbol, np.frombuffer(blob, np.uint8),
        )  # fmt: skip
        if written != len(blob):
            raise RuntimeError("libcrypto failed to seal a run of sources")
        self._next_seq[0] = seq + count
        mv = memoryview(blob)
        return [bytes(mv[a : a + whole]) for a in range(0, len(blob), whole)]

    def build(
        self,
        dtype: int,
        seq: int,
        payload: bytes | bytearray | memoryview = b"",
        esi: int = 0,
        key: int = 0,
        dt_nss: int = 0,
        flags: int = 0,
    ) -> bytes:
        """Copy ``payload`` in and :meth:`finish` (convenience for non-hot datagrams)."""
        n = len(payload)
        if n > len(self.buf) - HEADER_SIZE - TAG_SIZE:
            raise ValueError(f"payload of {n} bytes exceeds the framer's buffer")
        self._mv[HEADER_SIZE : HEADER_SIZE + n] = payload
        return self.finish(dtype, seq, n, esi, key, dt_nss, flags)


def pack_dt_nss(dt: int, nss: int) -> int:
    """RFC 8681 DT (4 bits) and NSS (12 bits) in one 16-bit field."""
    if not 0 <= dt <= MAX_DT or not 1 <= nss <= MAX_NSS:
        raise ValueError(f"dt {dt} or nss {nss} out of range (0..15, 1..4095)")
    return dt << 12 | nss


def block_repair_key(p: int, index: int) -> int:
    """The ``key`` field of a BLOCK_REPAIR: parity count p and this parity's index."""
    if not 1 <= p <= 255 or not 0 <= index < p:
        raise ValueError(f"block repair p={p} index={index} out of range")
    return p << 8 | index


class Feedback(NamedTuple):
    """The receiver's report (feedback payload), see the module docstring."""

    echo_seq: int  # highest data-path seq received one reordering window ago (LossMonitor)
    echo_delay_us: int  # time between receiving echo_seq and sending this report
    received: int  # data-path datagrams received (unique)
    lost: int  # data-path datagrams missing from the seq space so far
    esi_end: int  # highest source ESI known + 1 (0: none)
    decoded_through: int  # every source ESI below this is known
    unrecovered: int  # source ESIs below esi_end still unknown and still recoverable
    pending: int  # independent repair equations held that involve unknown sources
    source_received: int  # source datagrams received (unique ESIs)
    repair_received: int  # repair datagrams received
    loss_rate: float  # receiver's smoothed packet loss rate
    burst_mean: float  # receiver's smoothed loss-burst length (packets)
    flags: int  # FB_* bits
    ranges: tuple[tuple[int, int], ...]  # missing source ESIs: (first, count), lowest first
    segments: tuple[tuple[int, int], ...] = ()  # (segment index, pending equations pivoted there)


def encode_feedback(fb: Feedback, out: memoryview) -> int:
    """Write ``fb`` into ``out``; return the number of bytes written."""
    ranges = fb.ranges[:MAX_FEEDBACK_RANGES]
    segments = fb.segments[:MAX_FEEDBACK_SEGMENTS]
    FEEDBACK_FIXED.pack_into(out, 0, *fb[:13], len(ranges), len(segments))
    off = FEEDBACK_FIXED.size
    for first, count in ranges:
        FEEDBACK_RANGE.pack_into(out, off, first, count)
        off += FEEDBACK_RANGE.size
    for seg, pending in segments:
        FEEDBACK_SEGMENT.pack_into(out, off, seg, pending)
        off += FEEDBACK_SEGMENT.size
    return off


def feedback_size(n_ranges: int, n_segments: int = 0) -> int:
    """Payload bytes of a feedback with that many loss ranges and segment entries."""
    return (
        FEEDBACK_FIXED.size
        + min(n_ranges, MAX_FEEDBACK_RANGES) * FEEDBACK_RANGE.size
        + min(n_segments, MAX_FEEDBACK_SEGMENTS) * FEEDBACK_SEGMENT.size
    )


def decode_feedback(payload: bytes | memoryview) -> Feedback:
    """Parse a feedback payload; raises :class:`BadPayload` when it is inconsistent."""
    n = len(payload)
    if n < FEEDBACK_FIXED.size:
        raise BadPayload(f"feedback of {n} bytes")
    fields = FEEDBACK_FIXED.unpack_from(payload, 0)
    n_ranges, n_segments = fields[13], fields[14]
    if (
        n_ranges > MAX_FEEDBACK_RANGES
        or n_segments > MAX_FEEDBACK_SEGMENTS
        or n != feedback_size(n_ranges, n_segments)
    ):
        raise BadPayload(f"feedback announces {n_ranges}+{n_segments} entries in {n} bytes")
    loss_rate, burst_mean = fields[10], fields[11]
    if not (0.0 <= loss_rate <= 1.0) or not (0.0 <= burst_mean < 1e9):  # also rejects NaN
        raise BadPayload("feedback loss estimates out of range")
    esi_end, through, unrecovered = fields[4], fields[5], fields[6]
    if through > esi_end or unrecovered > esi_end - through:
        raise BadPayload("feedback ESI counters contradict each other")
    off = FEEDBACK_FIXED.size
    step = FEEDBACK_RANGE.size
    ranges = tuple(FEEDBACK_RANGE.unpack_from(payload, off + i * step) for i in range(n_ranges))
    for first, count in ranges:
        if count == 0 or first < through or first + count > esi_end:
            raise BadPayload("feedback loss range outside the reported window")
    off += n_ranges * step
    step = FEEDBACK_SEGMENT.size
    segments = tuple(
        FEEDBACK_SEGMENT.unpack_from(payload, off + i * step) for i in range(n_segments)
    )
    return Feedback._make((*fields[:13], ranges, segments))
