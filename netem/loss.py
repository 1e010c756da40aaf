"""Packet-loss models with exactly the semantics of Linux netem's loss generators.

A *spec* (``Bernoulli``, ``GilbertElliott``, ``FourState``, ``NoLoss``) is an immutable
parameter set: it renders itself in tc-netem notation, knows its analytic stationary loss
rate and mean burst length, and makes *samplers*. A sampler is the stateful part: it owns a
seeded ``numpy.random.Generator`` and the Markov state, and hands out the fates of the next
``n`` packets at once (``draw(n) -> bool array``, True = lost). Drawing in chunks is what
keeps the per-packet cost of a channel at a fraction of a microsecond; the chain itself
runs in a numba kernel.

The same samplers drive the userspace channel of the simulator and the impairment relay of
the testbed, so both see one implementation.

netem semantics reproduced (net/sched/sch_netem.c, ``loss_gilb_ell`` / ``loss_4state``;
tc/q_netem.c for the argument order and defaults):

* ``loss gemodel p r 1-h 1-k``: per packet, first a uniform draw decides the state
  transition (good->bad with p, bad->good with r), then a second draw decides the loss
  with the probability of the state the packet *started* in (1-k in good, 1-h in bad).
  Defaults when omitted: r = 1-p, 1-h = 100%, 1-k = 0%. The chain starts in the good state.
* ``loss state p13 p31 p32 p23 p14``: one draw per packet moves the 4-state chain
  (1 = received in gap, 2 = received in burst, 3 = lost in burst, 4 = isolated loss); the
  packet is lost iff the state it moves *to* is 3 or 4. Defaults: p31 = 1-p13, p32 = 0,
  p23 = 100%, p14 = 0. The chain starts in state 1.
* ``loss random P``: independent loss with probability P (netem's loss correlation is not
  modelled; it is not a proper burst model).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
from numba import njit

__all__ = [
    "LossSpec",
    "LossSampler",
    "NoLoss",
    "Bernoulli",
    "GilbertElliott",
    "FourState",
    "parse_loss",
    "format_percent",
    "markov_loss_stats",
]


# ---------------------------------------------------------------------------
# numba kernels: advance a chain over a chunk of pre-drawn uniforms
# ---------------------------------------------------------------------------

_GOOD, _BAD = 0, 1


@njit(cache=True, nogil=True)
def _ge_kernel(
    u: np.ndarray,
    state: int,
    p: float,
    r: float,
    loss_good: float,
    loss_bad: float,
    out: np.ndarray,
) -> int:
    """netem loss_gilb_ell over len(out) packets; u has shape (n, 2); returns final state."""
    for i in range(out.shape[0]):
        if state == 0:
            if u[i, 0] < p:
                state = 1
            out[i] = u[i, 1] < loss_good
        else:
            if u[i, 0] < r:
                state = 0
            out[i] = u[i, 1] < loss_bad
    return state


@njit(cache=True, nogil=True)
def _four_state_kernel(
    u: np.ndarray,
    state: int,
    p13: float,
    p31: float,
    p32: float,
    p23: float,
    p14: float,
    out: np.ndarray,
) -> int:
    """netem loss_4state over len(out) packets (states 1..4); returns final state."""
    for i in range(out.shape[0]):
        x = u[i]
        lost = False
        if state == 1:
            if x < p14:
                state = 4
                lost = True
            elif x < p13 + p14:
                state = 3
                lost = True
        elif state == 2:
            if x < p23:
                state = 3
                lost = True
        elif state == 3:
            if x < p32:
                state = 2
            elif x < p31 + p32:
                state = 1
            else:
                lost = True
        else:
            state = 1
        out[i] = lost
    return state


# ---------------------------------------------------------------------------
# analytic statistics of a Markov-modulated loss process
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MarkovLossStats:
    """Stationary statistics of a loss process driven by a finite Markov chain."""

    loss_rate: float
    """Long-run fraction of packets lost."""
    mean_burst: float
    """Mean number of consecutive losses in a loss run (inf if everything is lost)."""
    asymptotic_var: float
    """n * Var(empirical loss rate over n packets) as n -> inf (includes correlation)."""


def markov_loss_stats(transition: np.ndarray, loss_prob: np.ndarray) -> MarkovLossStats:
    """Statistics of X_t ~ Bernoulli(loss_prob[S_t]) with S_t a Markov chain (rows = from).

    The mean burst length is P(loss) / P(no loss, then loss). The asymptotic variance
    gamma_0 + 2 sum_k gamma_k comes from the chain's fundamental matrix, so confidence
    intervals for correlated losses are exact to first order, not binomial guesses.
    """
    P = np.asarray(transition, dtype=np.float64)
    ell = np.asarray(loss_prob, dtype=np.float64)
    n = P.shape[0]
    # stationary distribution: left eigenvector for eigenvalue 1
    a = np.vstack([P.T - np.eye(n), np.ones(n)])
    b = np.zeros(n + 1)
    b[-1] = 1.0
    pi = np.linalg.lstsq(a, b, rcond=None)[0]
    pi = np.clip(pi, 0.0, None)
    pi /= pi.sum()
    mu = float(pi @ ell)
    onset = float(((pi * (1.0 - ell)) @ P) @ ell)
    mean_burst = mu / onset if onset > 0 else math.inf
    one_pi = np.outer(np.ones(n), pi)
    z = np.linalg.inv(np.eye(n) - P + one_pi)
    # sum_{k>=1} gamma_k = (pi*l)^T (sum_{k>=1} (P^k - 1 pi)) l = (pi*l)^T (Z - I) l,
    # since sum_{k>=0} (P - 1 pi)^k = Z and P^k - 1 pi = (P - 1 pi)^k for k >= 1.
    gamma_tail = float((pi * ell) @ ((z - np.eye(n)) @ ell))
    var = mu * (1.0 - mu) + 2.0 * gamma_tail
    return MarkovLossStats(mu, mean_burst, max(var, 0.0))


# ---------------------------------------------------------------------------
# specs and samplers
# ---------------------------------------------------------------------------


def format_percent(x: float) -> str:
    """A probability in tc's percent notation: 0.005 -> '0.5%'."""
    return f"{x * 100.0:.10g}%"


class LossSampler:
    """Stateful loss generator: ``draw(n)`` returns the next n fates (True = lost).

    ``clone()`` returns an independent copy with the identical future (RNG state and chain
    state are copied), which is how a clairvoyant oracle looks ahead.
    """

    rng: np.random.Generator  # set by the samplers that draw at random (clone copies it)

    def draw(self, n: int) -> np.ndarray:
        raise NotImplementedError

    def clone(self) -> LossSampler:
        # Parameters are immutable and shared; the RNG and plain state are copied.
        twin = copy.copy(self)
        rng = getattr(self, "rng", None)
        if rng is not None:
            twin.rng = copy_rng(rng)
        return twin


def copy_rng(rng: np.random.Generator) -> np.random.Generator:
    """An independent Generator in exactly the same state (3x cheaper than deepcopy)."""
    bit_gen = type(rng.bit_generator)(0)
    bit_gen.state = rng.bit_generator.state
    return np.random.Generator(bit_gen)


class LossSpec:
    """Immutable loss-model parameters (base class)."""

    kind: str = "?"

    def sampler(self, rng: np.random.Generator) -> LossSampler:
        raise NotImplementedError

    def netem_args(self) -> list[str]:
        """The ``loss ...`` arguments of tc-netem (empty for no loss)."""
        raise NotImplementedError

    def stats(self) -> MarkovLossStats:
        raise NotImplementedError

    def stationary_loss(self) -> float:
        """Long-run fraction of packets this model drops."""
        return self.stats().loss_rate

    def mean_burst_length(self) -> float:
        """Mean length of a run of consecutive losses."""
        return self.stats().mean_burst

    def describe(self) -> str:
        """Human-readable netem notation."""
        args = self.netem_args()
        return " ".join(args) if args else "no loss"


class _NoLossSampler(LossSampler):
    def draw(self, n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.bool_)


@dataclass(frozen=True)
class NoLoss(LossSpec):
    """A loss-free link."""

    kind = "none"

    def sampler(self, rng: np.random.Generator) -> LossSampler:
        return _NoLossSampler()

    def netem_args(self) -> list[str]:
        return []

    def stats(self) -> MarkovLossStats:
        return MarkovLossStats(0.0, 0.0, 0.0)


class _BernoulliSampler(LossSampler):
    def __init__(self, p: float, rng: np.random.Generator) -> None:
        self.p = p
        self.rng = rng

    def draw(self, n: int) -> np.ndarray:
        return self.rng.random(n) < self.p


@dataclass(frozen=True)
class Bernoulli(LossSpec):
    """Independent loss with probability ``p`` (netem ``loss random P``)."""

    p: float
    kind = "random"

    def __post_init__(self) -> None:
        _check_prob("loss random", self.p)

    def sampler(self, rng: np.random.Generator) -> LossSampler:
        return _BernoulliSampler(self.p, rng)

    def netem_args(self) -> list[str]:
        return ["loss", "random", format_percent(self.p)]

    def stats(self) -> MarkovLossStats:
        p = self.p
        burst = 1.0 / (1.0 - p) if p < 1.0 else math.inf
        return MarkovLossStats(p, burst if p > 0 else 0.0, p * (1.0 - p))


class _GESampler(LossSampler):
    def __init__(self, spec: GilbertElliott, rng: np.random.Generator) -> None:
        self.spec = spec
        self.rng = rng
        self.state = _GOOD

    def draw(self, n: int) -> np.ndarray:
        s = self.spec
        out = np.empty(n, dtype=np.bool_)
        u = self.rng.random((n, 2))
        self.state = int(_ge_kernel(u, self.state, s.p, s.r, s.loss_good, s.loss_bad, out))
        return out


@dataclass(frozen=True)
class GilbertElliott(LossSpec):
    """netem ``loss gemodel p r 1-h 1-k``.

    p: P(good -> bad); r: P(bad -> good); loss_bad = 1-h: loss probability in the bad
    state; loss_good = 1-k: loss probability in the good state.
    """

    p: float
    r: float
    loss_bad: float = 1.0
    loss_good: float = 0.0
    kind = "gemodel"

    def __post_init__(self) -> None:
        for name, v in (
            ("p", self.p),
            ("r", self.r),
            ("1-h", self.loss_bad),
            ("1-k", self.loss_good),
        ):
            _check_prob(f"gemodel {name}", v)

    def sampler(self, rng: np.random.Generator) -> LossSampler:
        return _GESampler(self, rng)

    def netem_args(self) -> list[str]:
        return ["loss", "gemodel"] + [
            format_percent(x) for x in (self.p, self.r, self.loss_bad, self.loss_good)
        ]

    def stats(self) -> MarkovLossStats:
        P = np.array([[1.0 - self.p, self.p], [self.r, 1.0 - self.r]])
        return markov_loss_stats(P, np.array([self.loss_good, self.loss_bad]))


class _FourStateSampler(LossSampler):
    def __init__(self, spec: FourState, rng: np.random.Generator) -> None:
        self.spec = spec
        self.rng = rng
        self.state = 1

    def draw(self, n: int) -> np.ndarray:
        s = self.spec
        out = np.empty(n, dtype=np.bool_)
        u = self.rng.random(n)
        self.state = int(_four_state_kernel(u, self.state, s.p13, s.p31, s.p32, s.p23, s.p14, out))
        return out


@dataclass(frozen=True)
class FourState(LossSpec):
    """netem ``loss state p13 p31 p32 p23 p14`` (the GI 4-state Markov model).

    States: 1 received in a gap, 2 received in a burst, 3 lost in a burst, 4 isolated
    loss in a gap. A packet is lost when the chain moves into state 3 or 4.
    """

    p13: float
    p31: float
    p32: float = 0.0
    p23: float = 1.0
    p14: float = 0.0
    kind = "state"

    def __post_init__(self) -> None:
        for name in ("p13", "p31", "p32", "p23", "p14"):
            _check_prob(f"state {name}", getattr(self, name))
        if self.p13 + self.p14 > 1.0 + 1e-12:
            raise ValueError("loss state: p13 + p14 must not exceed 100%")
        if self.p31 + self.p32 > 1.0 + 1e-12:
            raise ValueError("loss state: p31 + p32 must not exceed 100%")

    def sampler(self, rng: np.random.Generator) -> LossSampler:
        return _FourStateSampler(self, rng)

    def netem_args(self) -> list[str]:
        return ["loss", "state"] + [
            format_percent(x) for x in (self.p13, self.p31, self.p32, self.p23, self.p14)
        ]

    def transition_matrix(self) -> np.ndarray:
        """Rows/columns are states 1..4 (index 0..3)."""
        p13, p31, p32, p23, p14 = self.p13, self.p31, self.p32, self.p23, self.p14
        return np.array(
            [
                [1.0 - p13 - p14, 0.0, p13, p14],
                [0.0, 1.0 - p23, p23, 0.0],
                [p31, p32, 1.0 - p31 - p32, 0.0],
                [1.0, 0.0, 0.0, 0.0],
            ]
        )

    def stats(self) -> MarkovLossStats:
        return markov_loss_stats(self.transition_matrix(), np.array([0.0, 0.0, 1.0, 1.0]))


# ---------------------------------------------------------------------------
# parsing netem notation
# ---------------------------------------------------------------------------


def _check_prob(what: str, v: float) -> None:
    if not (isinstance(v, int | float) and 0.0 <= v <= 1.0) or math.isnan(v):
        raise ValueError(f"{what} must be a probability between 0% and 100%, got {v!r}")


def _parse_percent(token: str, what: str) -> float:
    """tc's get_percent: '5%' or '5' both mean five percent."""
    text = token[:-1] if token.endswith("%") else token
    try:
        v = float(text) / 100.0
    except ValueError:
        raise ValueError(f"{what}: {token!r} is not a percentage like '5%'") from None
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{what}: {token!r} is outside 0%..100%")
    return v


def parse_loss(text: str) -> LossSpec:
    """Parse tc-netem loss notation, with tc's defaults for omitted parameters.

    Accepts ``none``, ``P%``, ``random P%``, ``gemodel p [r [1-h [1-k]]]`` and
    ``state p13 [p31 [p32 [p23 [p14]]]]``, optionally preceded by ``loss``.
    Raises ValueError with a one-line explanation on anything else.
    """
    tokens = str(text).split()
    if tokens and tokens[0] == "loss":
        tokens = tokens[1:]
    if not tokens or tokens == ["none"]:
        return NoLoss()
    head, rest = tokens[0], tokens[1:]
    if head == "random" or head[0].isdigit() or head[0] == ".":
        args = rest if head == "random" else tokens
        if len(args) != 1:
            raise ValueError(
                f"loss {text!r}: random loss takes one percentage "
                "(netem's loss correlation is not supported; use gemodel for bursts)"
            )
        return Bernoulli(_parse_percent(args[0], "loss random"))
    if head == "gemodel":
        if not 1 <= len(rest) <= 4:
            raise ValueError(f"loss {text!r}: gemodel takes 1 to 4 percentages: p [r [1-h [1-k]]]")
        names = ["gemodel p", "gemodel r", "gemodel 1-h", "gemodel 1-k"]
        vals = [_parse_percent(t, n) for t, n in zip(rest, names, strict=False)]
        p = vals[0]
        defaults = [p, 1.0 - p, 1.0, 0.0]
        vals += defaults[len(vals) :]
        return GilbertElliott(*vals)
    if head == "state":
        if not 1 <= len(rest) <= 5:
            raise ValueError(
                f"loss {text!r}: state takes 1 to 5 percentages: p13 [p31 [p32 [p23 [p14]]]]"
            )
        names = ["state p13", "state p31", "state p32", "state p23", "state p14"]
        vals = [_parse_percent(t, n) for t, n in zip(rest, names, strict=False)]
        p13 = vals[0]
        defaults = [p13, 1.0 - p13, 0.0, 1.0, 0.0]
        vals += defaults[len(vals) :]
        return FourState(*vals)
    raise ValueError(
        f"loss {text!r}: expected 'none', 'random P%', 'gemodel p r 1-h 1-k' "
        "or 'state p13 p31 p32 p23 p14'"
    )
