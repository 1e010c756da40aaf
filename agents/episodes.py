"""Episodes of the repair-scheduling environment: what a transfer is, and how to draw one.

An :class:`EpisodeSpec` is one transfer, fully determined: the data-path and feedback-path
link profiles (kvtransport.netem), rho, the block table (count, bytes per block, utility
profile) and the seed of every random draw. :func:`build_simulation` turns it into a
:class:`kvtransport.sim.simulator.Simulation` of the real sessions through
:func:`kvtransport.sim.simulator.make_simulation`, the set-up ``simulate`` uses, so an episode
replayed by ``simulate(spec_transfer(spec), channel=spec.channel, ...)`` is the same run.

:class:`EpisodeDistribution` draws specs from the training distribution (seeded by the
caller's generator):

- loss: Gilbert-Elliott (light to heavy bursts), Bernoulli, windows of user trace files
  when given; a handful of loss-free links;
- link rate 50..1000 Mbit/s (log-uniform), one-way delay 1..20 ms, some jitter; and, for
  ``high_rtt_share`` of the episodes, a long link (one-way 20..90 ms: edge backhaul,
  cellular, satellite) whose deadline may be as short as ``high_rtt_min_rtts`` round
  trips: there the last round trip before the deadline is a large share of the transfer
  that feedback cannot cover, and when to stop admitting and how much to protect
  proactively decide the outcome (at short delays reactive repair after feedback is
  nearly as good as the clairvoyant oracle, so there is little to learn);
- feedback path: the same profile drawn independently (the simulator's and testbed's
  default), or loss-free, with its own delay (0.5x..2x the data path's) part of the time
  (``feedback_weights``; a "dead" feedback path that loses everything is available too);
- the sender's loss prior before the first feedback, as a daemon has it
  (``prior_weights``): none (a first transfer to the receiver), the loss an earlier
  transfer over the link ended with (``previous_transfer_loss``), or the link profile's
  stationary loss;
- rho 0.6..1.2; caches of 100..1800 blocks of 3, 6 or 12 KiB (int4, int8, fp16 blocks
  of one SmolLM2 layer x 16 tokens);
  with ``long_link_deadline_rtts``, a long-link episode of a synthetic utility instead has
  as many blocks as make its deadline a drawn number of round trips;
- block utilities: measured from the real model (agents/data/utility_profiles.npz,
  training contexts only) or synthetic (zipf with exponent 0.6..1.4, flat, linear).

Stream modes (``EpisodeSpec.stream``): ``utility`` (the above: equal blocks, highest
utility first) or ``handoff``, the stream kvtransport.model.plan sends: a SmolLM2-135M cache
(``HANDOFF_GEOMETRY``) whose block utilities come from the real utility formula
(kvtransport.model.utility) over synthetic attention drawn from the episode's seed (sparse
needles on a position prior: sinks and recent tokens matter), planned by
``kvtransport.model.plan.plan_handoff`` for the episode's link (the receiver computes a
prefix, which is not sent; the rest goes int4/int8/fp16, so block sizes differ) and sent in
prefix (position) order, so utility does not decrease along the stream. Its rho is drawn
near the plan's own (``handoff_rho_range``). :class:`EpisodeDistribution` draws handoff
episodes for ``handoff_share`` of the episodes (default 0: the training distribution
above, draw for draw).

Held out from training, so evaluation measures generalization: episode seeds at or above
``HELD_OUT_SEED`` (training seeds are drawn below it), the measured profiles of the
evaluation contexts, the netem 4-state loss model (never drawn in training), and a
neighbourhood of every evaluation channel: a Gilbert-Elliott or Bernoulli draw whose
(stationary loss, mean burst length) falls within a factor ``EXCLUDE_FACTOR`` of an
evaluation profile's in both is rejected and redrawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np
from kvtransport.agents.utility_profiles import load_profiles, resample
from kvtransport.netem import (
    Bernoulli,
    GilbertElliott,
    NoLoss,
    Profile,
    load_profile,
    make_channel,
)
from kvtransport.netem.loss import LossSpec
from kvtransport.netem.trace import TraceReplay, read_trace

from kvtransport.core.feedback import LOSS_MEMORY_PACKETS
from kvtransport.core.policy_base import DECISION_PACKETS, Policy
from kvtransport.core.protocol import DEFAULT_SYMBOL_SIZE, STANDARD, ProtocolConfig
from kvtransport.core.transfer import BlockTable, Transfer, utility_profile
from kvtransport.sim.simulator import Simulation, full_send_time, make_simulation

EVAL_CHANNELS = ("bernoulli-5", "ge-light", "ge-heavy", "4state-bursty")
HELD_OUT_SEED = 1 << 40
"""Evaluation episode seeds start here; training draws seeds below it."""
EXCLUDE_FACTOR = 1.3
MIN_DEADLINE_RTTS = 5.0
BLOCK_BYTES = (3072, 6144, 12288)
STREAMS = ("utility", "handoff")
HANDOFF_LAYERS, HANDOFF_KV_HEADS, HANDOFF_HEAD_DIM = 30, 3, 64
"""The handoff episodes' cache geometry: SmolLM2-135M (blocks of 16 tokens, fp16)."""
HANDOFF_MODEL = "SmolLM2-135M-Instruct.Q4_1"
"""Whose packaged layer sensitivity weights the handoff episodes' utilities."""
LONG_LINK_MAX_BLOCKS = 7200
"""The most blocks ``EpisodeDistribution.long_link_deadline_rtts`` gives an episode
(4 x the default draws' largest: 88 MB of 12 KB blocks)."""
HANDOFF_TOKENS = (200, 2000)
"""Context lengths (tokens) of training handoff episodes (log-uniform)."""
HANDOFF_EVAL_TOKENS = (300, 600, 900, 1200)
"""Context lengths of evaluation handoff episodes, in turn."""
HANDOFF_SPEED_PER_TOKEN_S = (1e-3, 8e-3)
"""The receiver's compute time per token (log-uniform; the demo host's is 3.1 ms)."""
HANDOFF_SPEED_PER_CALL_S = 0.07
HANDOFF_BUDGET = (0.5, 1.0)
"""The TTFT budget as a share of the link time of the whole cache at int8 (uniform):
tight enough that the plan mixes precisions and leaves a prefix to the receiver."""
HANDOFF_FIDELITY = {"fp32": 1.0, "fp16": 1.0, "int8": 0.999, "int4": 0.98}
"""The per-precision fidelities the handoff episodes are planned with: the calibration of
when the policies were trained (int4 keys per token; kvtransport.kvformat.blocks.
DEFAULT_FIDELITY is the product's now), so that training and evaluation draw the same
streams as then."""


@dataclass(frozen=True)
class EpisodeSpec:
    """One transfer (see the module docstring). ``utility`` names the block utilities:
    ``zipf:S``, ``flat``, ``linear`` or ``measured:SPLIT:INDEX``."""

    seed: int
    channel: Profile
    feedback: Profile
    rho: float
    n_blocks: int
    block_bytes: int = 12288
    utility: str = "zipf:1"
    symbol_size: int = DEFAULT_SYMBOL_SIZE
    prior_loss: float | None = None
    """The sender's loss prior before feedback (None: none, a first transfer)."""
    stream: str = "utility"
    """``utility``: ``n_blocks`` equal blocks of ``block_bytes`` with ``utility``'s
    utilities. ``handoff``: the planned handoff stream of a cache of ``n_blocks`` blocks
    (``HANDOFF_LAYERS`` x token ranges; see :func:`handoff_table`); ``block_bytes`` and
    ``utility`` are not used."""

    def __post_init__(self) -> None:
        if self.stream not in STREAMS:
            raise ValueError(f"unknown stream {self.stream!r}; choose from {', '.join(STREAMS)}")
        if self.stream == "handoff" and (self.n_blocks < 1 or self.n_blocks % HANDOFF_LAYERS):
            raise ValueError(
                f"a handoff episode's n_blocks must be a positive multiple of "
                f"{HANDOFF_LAYERS} (layers), not {self.n_blocks}"
            )

    @property
    def size_bytes(self) -> int:
        if self.stream == "handoff":
            return int(handoff_table(self).lengths.sum())
        return self.n_blocks * self.block_bytes

    def describe(self) -> str:
        if self.stream == "handoff":
            t = handoff_table(self)
            blocks = f"handoff of {self.n_blocks} blocks: {len(t)} sent, {self.size_bytes} B"
        else:
            blocks = f"{self.n_blocks} blocks x {self.block_bytes} B; utility {self.utility}"
        return (
            f"{self.channel.describe()}; feedback {self.feedback.name} "
            f"{self.feedback.delay_ms:g} ms; rho {self.rho:.2f}; {blocks}; seed {self.seed}"
            + ("" if self.prior_loss is None else f"; prior loss {self.prior_loss:.4f}")
        )


def block_utilities(label: str, n_blocks: int) -> np.ndarray:
    """Utilities (summing to 1, stream order) of a spec's utility label."""
    kind, _, rest = label.partition(":")
    if kind == "measured":
        split, _, index = rest.partition(":")
        profiles = load_profiles(split).profiles
        return resample(profiles[int(index) % len(profiles)], n_blocks)
    if kind == "zipf":
        return utility_profile("zipf", n_blocks, float(rest or 1.0))
    if kind in ("flat", "linear"):
        return utility_profile(kind, n_blocks)
    raise ValueError(f"unknown utility profile {label!r}")


_PAYLOAD = np.zeros(0, dtype=np.uint8)


def _payload(nbytes: int) -> np.ndarray:
    """A read-only random payload of ``nbytes`` (one shared buffer: the bytes do not
    change what the protocol does, and drawing megabytes per episode would cost more than
    some episodes)."""
    global _PAYLOAD
    if _PAYLOAD.size < nbytes:
        size = max(nbytes, 32 << 20)
        buf = np.frombuffer(np.random.default_rng(20240601).bytes(size), dtype=np.uint8)
        _PAYLOAD = buf
    return _PAYLOAD[:nbytes]


def handoff_utilities(seed: int, token_ranges: int) -> np.ndarray:
    """``[HANDOFF_LAYERS, token_ranges]`` block utilities (summing to 1) of a synthetic
    context of ``token_ranges`` x 16 tokens: kvtransport.model.utility's formula (position
    prior, SnapKV-style attention share, the packaged layer weights) over attention drawn
    from ``seed``: per token, the mean attention of the queries that can see it is a
    gamma draw (shape 0.3: a few heavy "needle" tokens) common to all layers plus a
    per-layer one."""
    from kvtransport.model import utility as mu

    rng = np.random.default_rng([seed, 0x4A_4E_D0])
    tokens = token_ranges * 16
    common = rng.gamma(0.3, size=tokens)
    per_layer = rng.gamma(0.3, size=(HANDOFF_LAYERS, tokens))
    mean_attention = common[None, :] + 0.5 * per_layer  # per query that can see the token
    seen_by = tokens - np.arange(tokens)  # causal: token t is seen by tokens - t queries
    attention = mean_attention * seen_by / tokens  # averaged over all the queries
    imp = mu.token_importance(HANDOFF_LAYERS, tokens, attention, window=None)
    weights = mu.default_layer_weights(HANDOFF_MODEL, HANDOFF_LAYERS)
    return mu.block_utility(imp, 16, weights)


def handoff_table(spec: EpisodeSpec) -> BlockTable:
    """The block table of a handoff episode (:func:`handoff_stream`)."""
    return handoff_stream(spec)[0]


def handoff_ranges(spec: EpisodeSpec) -> np.ndarray:
    """The token range of each block of a handoff episode's table (:func:`handoff_stream`):
    the groups its utility is scored by (``whole_groups`` of
    kvtransport.sim.simulator.Simulation)."""
    return handoff_stream(spec)[1]


@lru_cache(maxsize=256)
def handoff_stream(spec: EpisodeSpec) -> tuple[BlockTable, np.ndarray]:
    """The block table of a handoff episode (see the module docstring), from its seed and
    link: the plan of ``kvtransport.model.plan.plan_handoff`` (objective ``fidelity``,
    default levels and fidelity floor, no hedge) for a receiver whose compute speed and TTFT budget
    are drawn from the seed (``HANDOFF_SPEED_PER_TOKEN_S``, ``HANDOFF_BUDGET``) and for the
    link estimate of ``spec.channel`` (rate, stationary loss, one-way delay). The sent
    blocks (the plan's prefix is not) in position order, each at its planned precision's
    size; utilities are the sent blocks' shares of the sent utility (summing to 1). With
    it, each sent block's token range (the plan sends or computes whole ranges, every
    layer of a range at once)."""
    from kvtransport.kvformat.blocks import PRECISIONS, Geometry
    from kvtransport.model.cache_builder import ComputeSpeed
    from kvtransport.model.plan import DEFAULT_LEVELS, LinkEstimate, plan_handoff
    from kvtransport.model.utility import stream_order

    if spec.stream != "handoff":
        raise ValueError(f"not a handoff episode (stream {spec.stream!r})")
    ranges = spec.n_blocks // HANDOFF_LAYERS
    u = handoff_utilities(spec.seed, ranges)
    # int8 in 32-value groups (int8_group_size 0) and int4 with keys per token, planned
    # with int4's fidelity of then (HANDOFF_FIDELITY), as when the handoff cells in
    # docs/results.md were measured and the policies trained; the product's streams now
    # quantize int8 in one group per head vector (blocks 6 % smaller) and int4's keys per
    # channel (5 % larger, and planned at a higher fidelity: Geometry.of, DEFAULT_FIDELITY)
    g = Geometry(HANDOFF_LAYERS, HANDOFF_KV_HEADS, ranges * 16, HANDOFF_HEAD_DIM, "float16")
    rng = np.random.default_rng([spec.seed, 0x91_A7])
    speed = ComputeSpeed(HANDOFF_SPEED_PER_CALL_S, _log_uniform(rng, *HANDOFF_SPEED_PER_TOKEN_S))
    ch = spec.channel.reverse_profile("delay") if spec.channel.is_trace else spec.channel
    loss = 0.0 if spec.channel.is_trace else float(ch.stationary_loss())
    link = LinkEstimate(ch.rate_mbps * 1e6, loss, ch.delay_ms * 1e-3, spec.symbol_size)
    int8 = int(g.cost_table(("int8",)).sum())
    budget = float(rng.uniform(*HANDOFF_BUDGET)) * link.seconds(int8)
    # the planned part only: the hedge the product's plans append after it is not modelled
    plan = plan_handoff(
        g, u, link=link, speed=speed, budget_s=budget, hedge_share=0.0, fidelity=HANDOFF_FIDELITY
    )
    order = stream_order(u, g.block_tokens, "position")
    level = plan.precision.reshape(-1)[order]
    sent = order[level >= 0]
    codes = [PRECISIONS.index(p) for p in DEFAULT_LEVELS]
    cost = g.cost_table(DEFAULT_LEVELS)
    lengths = cost[sent, [codes.index(int(c)) for c in level[level >= 0]]].astype(np.uint64)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)
    util = u.reshape(-1)[sent]
    return BlockTable(offsets, lengths, util / util.sum()), sent % ranges


def spec_transfer(spec: EpisodeSpec) -> Transfer:
    """The transfer of an episode: equal blocks with the spec's utilities, or the planned
    handoff stream (:func:`handoff_table`)."""
    if spec.stream == "handoff":
        table = handoff_table(spec)
        return Transfer(_payload(int(table.lengths.sum())), table)
    n, b = spec.n_blocks, spec.block_bytes
    offsets = np.arange(n, dtype=np.uint64) * np.uint64(b)
    lengths = np.full(n, b, dtype=np.uint64)
    table = BlockTable(offsets, lengths, block_utilities(spec.utility, n))
    return Transfer(_payload(n * b), table)


def build_simulation(
    spec: EpisodeSpec,
    policy: Policy,
    record: bool = False,
    config: ProtocolConfig = STANDARD,
    queue_guard: bool = True,
) -> Simulation:
    """The real sender and receiver for ``spec`` over its channels: exactly the run
    ``kvtransport.sim.simulator.make_simulation`` sets up for the same transfer, profiles, rho,
    seed, protocol ``config`` and ``queue_guard`` (``simulate`` with those arguments gives
    the same result). A handoff episode's utility counts whole token ranges only
    (:func:`handoff_ranges`): the race loads a range once every layer of it arrived and
    recomputes a partial one, so a partial range is worth nothing."""
    return make_simulation(
        spec_transfer(spec),
        channel=spec.channel,
        feedback_channel=spec.feedback,
        rho=spec.rho,
        policy=policy,
        seed=spec.seed,
        symbol_size=spec.symbol_size,
        record=record,
        prior_loss=spec.prior_loss,
        config=config,
        whole_groups=handoff_ranges(spec) if spec.stream == "handoff" else None,
        queue_guard=queue_guard,
    )


PRIOR_WINDOW_PACKETS = 1024
"""Packets of an earlier transfer the prior estimate runs over (four loss memories)."""
PRIOR_KINDS = ("none", "previous", "profile")


def previous_transfer_loss(profile: Profile, seed: int) -> float:
    """The loss a daemon remembers for a receiver: the receiver's smoothed loss rate at
    the end of an earlier transfer over the same link (kvtransport.core.feedback.LossMonitor:
    one sample per feedback interval, weighted over ``LOSS_MEMORY_PACKETS``), on an
    independent stretch of the channel (its own seed, none of the episode's draws)."""
    ch = make_channel(profile, np.random.SeedSequence([seed, 0x9_0_1_0_5]))
    fates = ch.lookahead_losses(PRIOR_WINDOW_PACKETS).reshape(-1, DECISION_PACKETS)
    rates = fates.mean(axis=1)
    w = DECISION_PACKETS / LOSS_MEMORY_PACKETS
    est = float(rates[0])
    for r in rates[1:]:
        est += w * (float(r) - est)
    return est


def episode_prior(kind: str, profile: Profile, seed: int) -> float | None:
    """The prior of ``PRIOR_KINDS``: none, an earlier transfer's end loss, or the link
    profile's stationary loss (a trace: an earlier window of it)."""
    if kind == "none":
        return None
    if kind == "profile" and not profile.is_trace:
        return float(profile.stationary_loss())
    if kind in ("previous", "profile"):
        return previous_transfer_loss(profile, seed)
    raise ValueError(f"unknown loss prior {kind!r}; choose from {', '.join(PRIOR_KINDS)}")


def spec_deadline(spec: EpisodeSpec) -> float:
    """The episode's deadline in seconds (rho times the loss-free send time)."""
    rate_bps = spec.channel.rate_mbps * 1e6
    return spec.rho * full_send_time(spec.size_bytes, rate_bps, spec.symbol_size)


def round_trip(spec: EpisodeSpec) -> float:
    """Nominal round-trip time of the episode's link (trace: its median one-way delay)."""
    fwd = spec.channel
    if fwd.is_trace:
        fwd = fwd.reverse_profile("delay")
    back = spec.feedback.reverse_profile("delay") if spec.feedback.is_trace else spec.feedback
    return (fwd.delay_ms + back.delay_ms) * 1e-3


def _loss_point(loss: LossSpec) -> tuple[float, float]:
    return loss.stationary_loss(), loss.mean_burst_length()


_EVAL_POINTS: list[tuple[float, float]] | None = None


def near_eval_channel(
    loss: LossSpec,
    factor: float = EXCLUDE_FACTOR,
    more: tuple[tuple[float, float], ...] = (),
) -> bool:
    """True if ``loss`` is within ``factor`` of an evaluation channel (or of a point of
    ``more``: (stationary loss, mean burst length)) in both stationary loss and mean burst
    length (such draws are kept out of training)."""
    global _EVAL_POINTS
    if _EVAL_POINTS is None:
        _EVAL_POINTS = [_loss_point(load_profile(n).loss) for n in EVAL_CHANNELS]
    p, b = _loss_point(loss)
    lf = math.log(factor)
    for pe, be in (*_EVAL_POINTS, *more):
        if abs(math.log(max(p, 1e-9) / pe)) < lf and abs(math.log(b / be)) < lf:
            return True
    return False


@lru_cache(maxsize=8)
def profile_loss_points(path: str) -> tuple[tuple[float, float], ...]:
    """(stationary loss, mean burst length) of every lossy channel of a profiles file."""
    from kvtransport.netem.profiles import load_profiles_file

    points = []
    for prof in load_profiles_file(path).values():
        loss = prof.loss
        if loss.stationary_loss() > 0:
            points.append(_loss_point(loss))
    return tuple(points)


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


@dataclass
class EpisodeDistribution:
    """The training distribution of episodes (see the module docstring).

    ``trace_files``: loss/delay traces (kvtransport.netem trace CSV) whose random windows
    make up ``trace_share`` of the episodes. The ``*_range`` fields bound the draws.
    """

    trace_files: tuple[str, ...] = ()
    rho_range: tuple[float, float] = (0.6, 1.2)
    rate_range_mbps: tuple[float, float] = (50.0, 1000.0)
    delay_range_ms: tuple[float, float] = (1.0, 20.0)
    high_rtt_share: float = 0.5
    high_delay_range_ms: tuple[float, float] = (20.0, 90.0)
    high_rtt_min_rtts: float = 2.0
    blocks_range: tuple[int, int] = (100, 1800)
    block_bytes: tuple[int, ...] = BLOCK_BYTES
    ge_p_range: tuple[float, float] = (0.002, 0.08)
    ge_r_range: tuple[float, float] = (0.15, 0.7)
    ge_bad_range: tuple[float, float] = (0.3, 1.0)
    ge_good_range: tuple[float, float] = (0.0, 0.01)
    bernoulli_range: tuple[float, float] = (0.003, 0.2)
    loss_weights: dict[str, float] = field(
        default_factory=lambda: {"ge": 0.6, "bernoulli": 0.3, "clean": 0.05, "trace": 0.15}
    )
    feedback_weights: dict[str, float] = field(
        default_factory=lambda: {"same": 0.6, "lossless": 0.2, "lossless_delay": 0.2, "dead": 0.0}
    )
    utility_weights: dict[str, float] = field(
        default_factory=lambda: {"measured": 0.5, "zipf": 0.3, "flat": 0.1, "linear": 0.1}
    )
    prior_weights: dict[str, float] = field(
        default_factory=lambda: {"none": 0.3, "previous": 0.5, "profile": 0.2}
    )
    held_out: bool = True
    measured_split: str = "train"
    handoff_share: float = 0.0
    """Share of the episodes that are handoff streams (0: none, and no extra draws)."""
    exclude_profiles: tuple[str, ...] = ()
    """Profiles files (netem/data/held-out.toml) whose channels' neighbourhoods are kept
    out of the loss draws too, as the evaluation channels' are (with ``held_out``): a
    range widened towards a held-out channel's family still leaves its cells unseen. A run
    records the files' paths, not their contents."""
    long_link_deadline_rtts: tuple[float, float] | None = None
    """Long-link episodes of a synthetic utility (not a measured profile, not a handoff)
    get as many blocks as make their deadline a draw of this many round trips (uniform;
    within ``blocks_range``'s low end and ``LONG_LINK_MAX_BLOCKS``), so that fast long links
    see deadlines of one or two round trips as often as slow ones. None: the blocks are
    drawn as on short links, and a fast long link's deadline is rarely short."""
    handoff_rho_range: tuple[float, float] = (0.95, 1.1)
    handoff_tokens: tuple[int, int] = HANDOFF_TOKENS

    def __post_init__(self) -> None:
        self.trace_files = tuple(str(t) for t in self.trace_files)
        self.exclude_profiles = tuple(str(f) for f in self.exclude_profiles)
        if self.exclude_profiles and not self.held_out:
            raise ValueError("exclude_profiles keeps channels out only with held_out")
        self._excluded = tuple(
            pt for f in self.exclude_profiles for pt in profile_loss_points(f)
        )  # a bad file fails here, with the profile reader's one-line error
        for t in self.trace_files:
            read_trace(t)  # a bad file fails here, with the trace reader's one-line error
        self._n_measured = len(load_profiles(self.measured_split))

    # ------------------------------------------------------------------ pieces

    def _pick(self, rng: np.random.Generator, weights: dict[str, float]) -> str:
        keys = [k for k, w in weights.items() if w > 0 and (k != "trace" or self.trace_files)]
        w = np.array([weights[k] for k in keys], dtype=np.float64)
        return keys[int(rng.choice(len(keys), p=w / w.sum()))]

    def _loss(self, rng: np.random.Generator, kind: str) -> LossSpec:
        for _ in range(1000):
            loss: LossSpec
            if kind == "ge":
                loss = GilbertElliott(
                    _log_uniform(rng, *self.ge_p_range),
                    float(rng.uniform(*self.ge_r_range)),
                    float(rng.uniform(*self.ge_bad_range)),
                    float(rng.uniform(*self.ge_good_range)),
                )
            else:
                loss = Bernoulli(_log_uniform(rng, *self.bernoulli_range))
            if not (self.held_out and near_eval_channel(loss, more=self._excluded)):
                return loss
        raise RuntimeError("could not draw a loss model outside the held-out neighbourhoods")

    def _channel(self, rng: np.random.Generator) -> Profile:
        kind = self._pick(rng, self.loss_weights)
        rate = _log_uniform(rng, *self.rate_range_mbps)
        if kind == "trace":
            path = self.trace_files[int(rng.integers(len(self.trace_files)))]
            return Profile(
                name=f"trace:{path}", loss=TraceReplay(path), rate_mbps=rate, delay_ms=0.0
            )
        high = self.high_rtt_share > 0 and rng.random() < self.high_rtt_share
        delay = float(rng.uniform(*(self.high_delay_range_ms if high else self.delay_range_ms)))
        jitter = float(rng.uniform(0.0, 0.2 * delay)) if rng.random() < 0.2 else 0.0
        loss = NoLoss() if kind == "clean" else self._loss(rng, kind)
        return Profile(name=kind, loss=loss, rate_mbps=rate, delay_ms=delay, jitter_ms=jitter)

    def _feedback(self, rng: np.random.Generator, data: Profile) -> Profile:
        w = self.feedback_weights
        keys = ("same", "lossless", "lossless_delay", "dead")
        cum = np.cumsum([w.get(k, 0.0) for k in keys])
        kind = keys[min(int(np.searchsorted(cum / cum[-1], rng.random(), side="right")), 3)]
        if kind == "same":
            return data
        fb = data.reverse_profile("delay")
        if kind == "lossless_delay" and not data.is_trace:
            fb = replace(fb, delay_ms=data.delay_ms * _log_uniform(rng, 0.5, 2.0))
        elif kind == "dead":
            fb = replace(fb, name="dead", loss=Bernoulli(1.0))
        return fb

    def _utility(self, rng: np.random.Generator) -> tuple[str, int | None]:
        kind = self._pick(rng, self.utility_weights)
        if kind == "measured" and self._n_measured:
            i = int(rng.integers(self._n_measured))
            n = len(load_profiles(self.measured_split).profiles[i])
            return f"measured:{self.measured_split}:{i}", n
        if kind == "zipf" or kind == "measured":
            return f"zipf:{rng.uniform(0.6, 1.4):.3f}", None
        return kind, None

    # ------------------------------------------------------------------ draw

    def sample(self, rng: np.random.Generator) -> EpisodeSpec:
        """One episode, drawn from ``rng`` (training seeds stay below HELD_OUT_SEED).

        Draws whose deadline is shorter than ``MIN_DEADLINE_RTTS`` round trips
        (``high_rtt_min_rtts`` on long links) are redrawn: there the sender cannot hear
        from the receiver at all, nothing to learn."""
        while True:
            spec = self._draw(rng)
            if self.handoff_share > 0 and rng.random() < self.handoff_share:
                spec = self._handoff(rng, spec)
            long_link = spec.channel.delay_ms >= self.delay_range_ms[1]
            least = self.high_rtt_min_rtts if long_link else MIN_DEADLINE_RTTS
            if spec_deadline(spec) >= least * round_trip(spec):
                return spec

    def _draw(self, rng: np.random.Generator) -> EpisodeSpec:
        channel = self._channel(rng)
        feedback = self._feedback(rng, channel)
        label, n_blocks = self._utility(rng)
        sized = n_blocks is None  # a synthetic utility: any number of blocks will do
        if n_blocks is None:
            n_blocks = int(round(_log_uniform(rng, *self.blocks_range)))
        block_bytes = int(self.block_bytes[int(rng.integers(len(self.block_bytes)))])
        seed = int(rng.integers(0, HELD_OUT_SEED))
        prior = episode_prior(self._pick(rng, self.prior_weights), channel, seed)
        spec = EpisodeSpec(
            seed=seed,
            channel=channel,
            feedback=feedback,
            rho=float(rng.uniform(*self.rho_range)),
            n_blocks=n_blocks,
            block_bytes=block_bytes,
            utility=label,
            prior_loss=prior,
        )
        rtts = self.long_link_deadline_rtts
        if rtts is not None and sized and channel.delay_ms >= self.delay_range_ms[1]:
            spec = self._sized_to_round_trips(rng, spec, rtts)
        return spec

    def _sized_to_round_trips(
        self, rng: np.random.Generator, spec: EpisodeSpec, rtts: tuple[float, float]
    ) -> EpisodeSpec:
        """``spec`` with as many blocks as make its deadline ``U(*rtts)`` round trips."""
        target = float(rng.uniform(*rtts)) * round_trip(spec)
        per_block = spec_deadline(spec) / spec.n_blocks
        n = int(round(target / per_block))
        return replace(spec, n_blocks=min(max(n, self.blocks_range[0]), LONG_LINK_MAX_BLOCKS))

    def _handoff(self, rng: np.random.Generator, spec: EpisodeSpec) -> EpisodeSpec:
        """``spec``'s links, seed and prior with a handoff stream instead of its blocks."""
        tokens = _log_uniform(rng, *self.handoff_tokens)
        return replace(
            spec,
            stream="handoff",
            n_blocks=HANDOFF_LAYERS * max(1, math.ceil(tokens / 16)),
            rho=float(rng.uniform(*self.handoff_rho_range)),
            utility="position",
        )


def eval_spec(
    channel: str | Profile,
    rho: float,
    index: int,
    utility: str = "measured",
    delay_ms: float | None = None,
    prior: str = "none",
    stream: str = "utility",
) -> EpisodeSpec:
    """Held-out evaluation episode ``index`` on a named channel (at the profile's own rate
    and delay, or one-way ``delay_ms`` both ways; feedback over the same profile, as
    ``kvtransport simulate`` does).

    ``utility="measured"`` takes the held-out contexts' measured profiles in turn, at
    their own size (12 KiB fp16 blocks); a synthetic name (``zipf:1``) uses 10 MB.
    ``prior``: the sender's loss prior, one of ``PRIOR_KINDS`` (see ``episode_prior``).
    ``stream="handoff"``: the planned handoff stream of a context of
    ``HANDOFF_EVAL_TOKENS[index % 4]`` tokens instead (``utility`` is not used)."""
    if stream not in STREAMS:
        raise ValueError(f"unknown stream {stream!r}; choose from {', '.join(STREAMS)}")
    prof = load_profile(channel).with_overrides(delay_ms=delay_ms)  # a trace keeps its own
    if stream == "handoff":
        tokens = HANDOFF_EVAL_TOKENS[index % len(HANDOFF_EVAL_TOKENS)]
        label, n_blocks = "position", HANDOFF_LAYERS * math.ceil(tokens / 16)
    elif utility == "measured":
        profiles = load_profiles("eval").profiles
        i = index % len(profiles)
        label, n_blocks = f"measured:eval:{i}", len(profiles[i])
    else:
        label, n_blocks = utility, 10_000_000 // 12288
    return EpisodeSpec(
        seed=HELD_OUT_SEED + index,
        channel=prof,
        feedback=prof,
        rho=float(rho),
        n_blocks=n_blocks,
        block_bytes=12288,
        utility=label,
        prior_loss=episode_prior(prior, prof, HELD_OUT_SEED + index),
        stream=stream,
    )
