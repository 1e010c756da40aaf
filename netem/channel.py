"""Userspace model of one direction of a lossy, rate-limited link (the simulator's channel).

A packet handed to the link at ``t_send`` goes through, in order:

1. the loss model (netem semantics; a lost packet never occupies the queue, as in netem
   where the loss decision comes first in ``netem_enqueue``);
2. a token-bucket rate limiter with a FIFO queue limited in bytes (tbf semantics: rate,
   burst, limit; a packet that does not fit in the queue is dropped);
   The rate may change at set times (``rate_steps``: a link whose capacity drops and
   recovers, known in advance as the loss model is): the bucket earns tokens and the queue
   drains at the rate of each moment; the queue and the burst stay in bytes.
3. propagation delay plus jitter (netem's default uniform jitter in
   [delay - jitter, delay + jitter], or a normal one truncated at 4 sigma), or the
   per-packet one-way delay of a trace. Jitter can reorder packets, as in netem.

Sizes: ``transmit(t, nbytes)`` takes the UDP payload size; the limiter counts
``nbytes + overhead_bytes`` (42 = Ethernet 14 + IPv4 20 + UDP 8 by default), which is
exactly what tbf and netem count on the testbed's veth link.

Randomness is pre-drawn in chunks (loss fates and delays for the next CHUNK packets), so
``transmit`` is a handful of float operations (~1 us). ``clone()`` copies everything,
RNG state included: the clone's future is identical to the original's.
"""

from __future__ import annotations

import bisect
import copy
import math
from collections import deque

import numpy as np
from kvtransport.netem.loss import LossSampler

from kvtransport.core.protocol import LINK_OVERHEAD_BYTES

__all__ = ["Channel", "DelaySampler", "UDP_OVERHEAD_BYTES", "CHUNK"]

UDP_OVERHEAD_BYTES = LINK_OVERHEAD_BYTES
"""Ethernet (14) + IPv4 (20) + UDP (8) header bytes the shaper counts per datagram: the
protocol's standard link overhead (kvtransport.core.protocol), one definition."""

CHUNK = 4096
"""Packets whose loss fates and delays are drawn at once."""

NORMAL_CLIP = 4.0
"""netem's normal distribution table spans about +-4 sigma; ours is truncated there too."""


class DelaySampler(LossSampler):
    """Per-packet one-way delay in seconds: ``delay`` plus netem-style jitter."""

    def __init__(
        self, delay_s: float, jitter_s: float, distribution: str, rng: np.random.Generator
    ) -> None:
        if delay_s < 0 or jitter_s < 0:
            raise ValueError("delay and jitter must be >= 0")
        if distribution not in ("uniform", "normal"):
            raise ValueError(f"jitter distribution must be uniform or normal, not {distribution!r}")
        self.delay_s = float(delay_s)
        self.jitter_s = float(jitter_s)
        self.distribution = distribution
        self.rng = rng

    def bounds(self) -> tuple[float, float]:
        """The smallest and largest delay this sampler can return."""
        spread = self.jitter_s * (NORMAL_CLIP if self.distribution == "normal" else 1.0)
        return max(0.0, self.delay_s - spread), self.delay_s + spread

    def draw(self, n: int) -> np.ndarray:
        if self.jitter_s == 0.0:
            return np.full(n, self.delay_s)
        if self.distribution == "uniform":
            x = self.rng.uniform(-1.0, 1.0, n)
        else:
            x = np.clip(self.rng.standard_normal(n), -NORMAL_CLIP, NORMAL_CLIP)
        return np.maximum(self.delay_s + self.jitter_s * x, 0.0)


class Channel:
    """One direction of a link: loss model -> token-bucket queue -> delay and jitter.

    ``rate_bps=None`` means no rate limit (and no queue). Counters: ``sent``,
    ``lost`` (by the loss model), ``dropped`` (queue overflow), ``delivered``.
    """

    def __init__(
        self,
        loss: LossSampler,
        delay: LossSampler,
        rate_bps: float | None = None,
        queue_bytes: int | None = None,
        burst_bytes: int | None = None,
        overhead_bytes: int = UDP_OVERHEAD_BYTES,
        rate_steps: tuple[tuple[float, float], ...] = (),
    ) -> None:
        self._loss = loss
        self._delay = delay
        self.overhead_bytes = int(overhead_bytes)
        self.rate_bps = float(rate_bps) if rate_bps else None
        if self.rate_bps is not None:
            if queue_bytes is None or burst_bytes is None:
                raise ValueError("a rate-limited channel needs queue_bytes and burst_bytes")
            if burst_bytes <= 0 or queue_bytes <= 0:
                raise ValueError("queue_bytes and burst_bytes must be positive")
        self.queue_bytes = int(queue_bytes) if queue_bytes is not None else None
        self.burst_bytes = int(burst_bytes) if burst_bytes is not None else None
        self._rate_Bps = self.rate_bps / 8.0 if self.rate_bps else 0.0
        # token bucket: tokens (bytes) as of time _tok_t; bucket starts full, like tbf
        self._tokens = float(self.burst_bytes or 0)
        self._burst = self.burst_bytes or 0  # the two limits, set whenever _rate_Bps is
        self._cap = self.queue_bytes or 0
        if rate_steps and self.rate_bps is None:
            raise ValueError("rate steps need a rate-limited channel")
        # the rate as pieces: from _step_at[k] on, _step_Bps[k] bytes/s (before: the base)
        self._step_at = [float(t) for t, _ in rate_steps]
        self._step_Bps = [float(r) / 8.0 for _, r in rate_steps]
        self._tok_t = 0.0
        self._last_dep = -1e300
        self._queue: deque[tuple[float, int]] = deque()
        self._backlog = 0
        self._last_t = -1e300
        self._fates: list[bool] = []
        self._delays: list[float] = []
        self._i = 0
        self.sent = 0
        self.lost = 0
        self.dropped = 0
        self.delivered = 0

    # -- randomness in chunks ------------------------------------------------

    def _refill(self) -> None:
        self._fates = self._loss.draw(CHUNK).tolist()
        self._delays = self._delay.draw(CHUNK).tolist()
        self._i = 0

    # -- the per-packet path ---------------------------------------------------

    def transmit(self, t_send: float, nbytes: int) -> float | None:
        """Hand a datagram of ``nbytes`` payload to the link at ``t_send`` (seconds).

        Returns its arrival time at the far end, or None if the loss model or a full
        queue dropped it. Calls must come in non-decreasing ``t_send``.
        """
        if t_send < self._last_t:
            raise ValueError(f"transmit times must not decrease ({t_send} < {self._last_t})")
        self._last_t = t_send
        i = self._i
        if i >= len(self._fates):
            self._refill()
            i = 0
        self._i = i + 1
        self.sent += 1
        if self._fates[i]:
            self.lost += 1
            return None
        dep = t_send
        if self._rate_Bps:
            size = nbytes + self.overhead_bytes
            q = self._queue
            while q and q[0][0] <= t_send:
                self._backlog -= q.popleft()[1]
            if size > self._burst or self._backlog + size > self._cap:
                self.dropped += 1
                return None
            start = t_send if t_send > self._last_dep else self._last_dep
            if self._step_at:
                tokens = self._tokens + self._earned(self._tok_t, start)
            else:
                tokens = self._tokens + (start - self._tok_t) * self._rate_Bps
            if tokens > self._burst:
                tokens = self._burst
            if tokens >= size:
                dep = start
                tokens -= size
            elif self._step_at:
                dep = self._served(start, size - tokens)
                tokens = 0.0
            else:
                dep = start + (size - tokens) / self._rate_Bps
                tokens = 0.0
            self._tokens = tokens
            self._tok_t = dep
            self._last_dep = dep
            if dep > t_send:
                q.append((dep, size))
                self._backlog += size
        self.delivered += 1
        return dep + self._delays[i]

    def _piece(self, t: float) -> tuple[float, float]:
        """The rate at ``t`` (bytes/s) and when it next changes."""
        k = bisect.bisect_right(self._step_at, t)
        rate = self._step_Bps[k - 1] if k else self._rate_Bps
        return rate, self._step_at[k] if k < len(self._step_at) else math.inf

    def _earned(self, a: float, b: float) -> float:
        """Bytes the link serves from ``a`` to ``b`` at the rate of each moment."""
        total = 0.0
        while a < b:
            rate, end = self._piece(a)
            end = min(end, b)
            total += (end - a) * rate
            a = end
        return total

    def _served(self, t: float, need: float) -> float:
        """When the link, serving from ``t`` on, has served ``need`` more bytes."""
        while True:
            rate, end = self._piece(t)
            if need <= (end - t) * rate:
                return t + need / rate
            need -= (end - t) * rate
            t = end

    # -- look-ahead ------------------------------------------------------------

    def clone(self) -> Channel:
        """An independent copy whose future is identical to this channel's."""
        twin = copy.copy(self)
        twin._loss = self._loss.clone()
        twin._delay = self._delay.clone()
        twin._queue = deque(self._queue)
        # the pre-drawn chunks are never mutated in place (refill replaces them): share
        return twin

    def lookahead_losses(self, n: int) -> np.ndarray:
        """Loss-model fates (True = lost) of the next n packets, without consuming them.

        Queue drops are not included: they depend on when the packets are sent. For the
        full future, ``clone()`` the channel and transmit on the clone.
        """
        have = self._fates[self._i :]
        if len(have) >= n:
            return np.asarray(have[:n], dtype=np.bool_)
        more = self._loss.clone().draw(max(n - len(have), 0))
        return np.concatenate([np.asarray(have, dtype=np.bool_), more])

    def backlog_bytes(self, now: float) -> int:
        """Bytes waiting in the rate limiter's queue at time ``now``."""
        return sum(size for dep, size in self._queue if dep > now)

    def __repr__(self) -> str:
        rate = f"{self.rate_bps / 1e6:g} Mbit/s" if self.rate_bps else "unlimited"
        return (
            f"Channel({rate}, sent={self.sent}, lost={self.lost}, "
            f"dropped={self.dropped}, delivered={self.delivered})"
        )
