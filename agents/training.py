"""Offline training of the DDQN repair scheduler (behind ``kvtransport train``; imports torch).

The loop, in order:

1. **Demonstrations.** The replay buffer starts with whole episodes played by behaviour
   policies: the best of the clairvoyant oracle, the session's own tail rule alone and
   kvtransport.policies.heuristics' adaptive heuristic (z = 1, 2, 3) on each episode (on average
   over ``expert_realizations`` draws of its channels), the adaptive heuristic with
   margins z in 0..3, the tail rule, and random play, each with a little random noise.
   Double DQN learns off-policy from all of them as from its own transitions; they put
   the states where decisions matter (when to stop admitting sources, how much to protect
   the last RTT) into the buffer from the start.
2. **Double DQN** (kvtransport.agents.ddqn) with a dueling head, n-step returns and
   epsilon-greedy exploration, on the environment's observation mapped to the network's
   features (kvtransport.policies.features) and the reward re-timed by :class:`CreditOnSend`
   (same return, earlier signal). The experts' own transitions (``EXPERTS``: episodes
   played by whichever of the oracle, the session's tail rule alone and the adaptive
   heuristic with a few margins did best on that episode) also get DQfD's large-margin
   loss: in an expert's states its action must look ``expert_margin`` better than the
   others. The per-step value differences between actions are tiny next to the value of a
   state (a few ten-thousandths of the utility against most of it), so the TD signal alone
   takes long to stop the network from wasting slots mid-transfer; the margin anchors it
   near the experts' behaviour, and TD learning decides between them, and where the oracle's
   choices, which rest on its view of the future, do not pay off from observations alone.
3. **Validation** every ``eval_every`` steps: the current network, exported to the numpy
   runtime the daemon uses, plays a fixed set of held-out episodes (seeds outside the
   training range, fresh channel draws), side by side with the adaptive heuristic on the
   same episodes (and, with ``eval_hard_episodes``, :func:`hard_validation_specs`'
   fast long links too). The network with the best :func:`validation_score` so far is
   kept (SB3 zip and exported ``.npz``); every validated network's ``.npz`` stays in
   ``checkpoints/``.
4. Logs: ``progress.csv`` (one row per validation), SB3's own ``sb3/progress.csv``, and
   ``learning_curve.png``.

torch runs on one thread: two threads thrash on these 2-core machines.
"""

from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
from kvtransport.agents.env import RepairSchedulingEnv, observation_space
from kvtransport.agents.episodes import (
    HELD_OUT_SEED,
    EpisodeDistribution,
    EpisodeSpec,
    build_simulation,
)

from kvtransport.core.observation import Obs
from kvtransport.core.policy_base import Policy
from kvtransport.policies.ddqn import DDQNPolicy, load_weights, save_weights
from kvtransport.policies.features import N_FEATURES, feature_bounds, features
from kvtransport.policies.heuristics import Adaptive
from kvtransport.policies.heuristics import ConstantAction as _Constant
from kvtransport.sim.oracle import Oracle
from kvtransport.sim.simulator import Simulation

if TYPE_CHECKING:  # pragma: no cover - typing only (ddqn imports torch: loaded in train)
    from kvtransport.agents.ddqn import DoubleDQN

VALIDATION_SEED = HELD_OUT_SEED + (1 << 30)
"""Validation episodes' seeds start here (the final evaluation's start at HELD_OUT_SEED)."""


@dataclass
class TrainConfig:
    """Everything that defines a training run (recorded next to the weights)."""

    steps: int = 300_000
    seed: int = 0
    hidden: tuple[int, ...] = (64, 64)
    learning_rate: float = 5e-4
    buffer_size: int = 300_000
    batch_size: int = 128
    gamma: float = 0.999
    """Near 1: the objective is the undiscounted utility at the deadline, and what the
    first round trip's repair share buys shows up only at the end (hundreds of steps
    later on long links; at 0.99 it was worth an eighth of its value and the network
    kept admitting sources blindly)."""
    credit_on_send: bool = True
    dueling: bool = True
    expert_margin: float = 0.005
    expert_weight: float = 1.0
    n_steps: int = 4
    train_freq: int = 2
    target_update_interval: int = 2_000
    exploration_fraction: float = 0.2
    exploration_initial_eps: float = 0.2
    exploration_final_eps: float = 0.02
    demo_steps: int = 40_000
    eval_every: int = 25_000
    eval_episodes: int = 40
    trace_files: tuple[str, ...] = ()
    distribution: dict = field(default_factory=dict)
    """EpisodeDistribution fields that differ from its defaults (the rest are its
    defaults *when the run starts*: :func:`effective_config` records them all)."""
    init_from: str | None = None
    """A weights file (kvtransport.policies.ddqn) the Q-network starts from, instead of
    random initial weights (None)."""
    anchor_weight: float = 0.0
    """With ``init_from``: the weight of :meth:`DoubleDQN.set_anchor`'s penalty on moving
    the action preferences away from the starting network's (0: none)."""
    validation: dict = field(default_factory=dict)
    """EpisodeDistribution fields that differ for the validation episodes only, on top of
    ``distribution`` (empty: validate on the training distribution): the checkpoint kept
    is the best on these, so they say which episodes a run must not lose."""
    eval_hard_episodes: int = 0
    """Validation episodes added to ``eval_episodes`` on the links where networks most
    often lose to the adaptive heuristic (:func:`hard_validation_specs`; 0: none)."""
    expert_realizations: int = 1
    """Channel realizations each demonstration episode's candidates are played on before
    the best is chosen as its expert (:func:`best_demonstrator`; 1: the episode's own,
    which picks in hindsight)."""
    shortfall_weight: float = 0.0
    """The checkpoint kept is the one with the best validation score: the mean utility
    minus this weight times the mean shortfall, per episode, below the better of the
    adaptive heuristic and the tail rule on that episode (0: the mean utility alone)."""


def episode_distribution(cfg: TrainConfig) -> EpisodeDistribution:
    """The distribution a run draws its training and validation episodes from."""
    return EpisodeDistribution(trace_files=cfg.trace_files, **cfg.distribution)


def effective_config(cfg: TrainConfig) -> dict:
    """Every knob of a run as it takes effect, in JSON form: ``cfg``'s fields, with
    ``distribution`` resolved to every field of the :class:`EpisodeDistribution` the run
    draws from (defaults included; ``trace_files`` stays at the top level).

    This, not the command line, is what a run records next to its weights (``ddqn.json``,
    the ``.npz`` metadata, ``summary.json``): a default that moves later changes what a
    recorded command trains on, and the two effective configurations then differ.
    ``init_from``, ``validation``, ``anchor_weight``, ``eval_hard_episodes``,
    ``shortfall_weight``, ``expert_realizations`` (other than 1) and the distribution's
    ``exclude_profiles`` and ``long_link_deadline_rtts`` are there only when set (runs
    without them record what they did before the options existed)."""
    dist = episode_distribution(cfg)
    knobs = {f.name: getattr(dist, f.name) for f in fields(dist) if f.name != "trace_files"}
    if not knobs["exclude_profiles"]:
        del knobs["exclude_profiles"]
    if knobs["long_link_deadline_rtts"] is None:
        del knobs["long_link_deadline_rtts"]
    config = {**asdict(cfg), "distribution": knobs}
    if cfg.init_from is None:
        del config["init_from"]
    if not cfg.validation:
        del config["validation"]
    for name in ("anchor_weight", "eval_hard_episodes", "shortfall_weight"):
        if not getattr(cfg, name):
            del config[name]
    if cfg.expert_realizations == 1:
        del config["expert_realizations"]
    return _jsonable(config)


class FeatureObservation(gym.ObservationWrapper):
    """The environment as the network sees it: observation -> features(observation)."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        space = observation_space()
        low, high = feature_bounds(space.low, space.high)
        self.observation_space = gym.spaces.Box(low, high, dtype=np.float32)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return features(observation)


class CreditOnSend(gym.Wrapper):
    """Re-times the reward for learning without changing any episode's return.

    Potential-based shaping (Ng et al., 1999) with potential ``phi`` = utility of the blocks
    sent completely but not yet decoded: each step earns the utility the sender finished
    sending (plus nothing for decoding it later), and the last step pays back whatever was
    sent but never decoded before the deadline. ``phi`` is 0 at the start and at the end, so
    the undiscounted sum of the shaped rewards is, episode by episode, exactly the
    environment's return: the utility recovered before the deadline. What changes is when
    the learner hears about a decision: a slot spent on needless repair shows up at once as
    less utility sent, instead of hundreds of steps later as a block that missed the
    deadline; a tail that cannot be repaired in time shows up as the final pay-back.
    """

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self._phi = 0.0
        self._total = 1.0

    def _potential(self, obs: np.ndarray, decoded: float) -> float:
        sent = self._total - float(obs[Obs.UTILITY_LEFT])
        return max(sent - decoded, 0.0)

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict]:
        obs, info = self.env.reset(**kwargs)
        transfer = _simulation(self.env).sender.transfer
        assert transfer is not None  # a running episode's sender keeps its transfer
        self._total = float(transfer.blocks.utilities.sum())
        self._phi = self._potential(obs, 0.0)
        return obs, info

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        phi = 0.0 if terminated or truncated else self._potential(obs, info["utility"])
        shaped = float(reward) + phi - self._phi
        self._phi = phi
        return obs, shaped, terminated, truncated, info


def _scheduling_env(env: gym.Env) -> RepairSchedulingEnv:
    """The RepairSchedulingEnv under ``env``'s wrappers."""
    core = env.unwrapped
    if not isinstance(core, RepairSchedulingEnv):
        raise TypeError(f"not a RepairSchedulingEnv: {type(core).__name__}")
    return core


def _simulation(env: gym.Env) -> Simulation:
    """The running episode's simulation (after ``reset``)."""
    sim = _scheduling_env(env).sim
    if sim is None:
        raise RuntimeError("call reset() first")
    return sim


def make_env(cfg: TrainConfig) -> gym.Env:
    env: gym.Env = RepairSchedulingEnv(episode_distribution(cfg))
    if cfg.credit_on_send:
        env = CreditOnSend(env)
    return FeatureObservation(env)


def _validation_distribution(cfg: TrainConfig) -> EpisodeDistribution:
    """The training distribution with ``cfg.validation``'s fields changed."""
    fields_ = {**cfg.distribution, **cfg.validation}
    return EpisodeDistribution(trace_files=cfg.trace_files, **fields_)


def validation_specs(cfg: TrainConfig, n: int) -> list[EpisodeSpec]:
    """``n`` fixed episodes with held-out seeds from the training distribution, with
    ``cfg.validation``'s fields changed."""
    dist = _validation_distribution(cfg)
    rng = np.random.default_rng(12345)
    return [replace(dist.sample(rng), seed=VALIDATION_SEED + i) for i in range(n)]


HARD_VALIDATION_RTTS = (1.0, 2.0)
"""Deadlines of the hard validation episodes, in round trips of their link."""
HARD_VALIDATION_SEED = VALIDATION_SEED + (1 << 29)
"""Hard validation episodes' seeds start here (after any count of ordinary ones)."""


def hard_validation_specs(
    cfg: TrainConfig,
    n: int,
    rtts: tuple[float, float] = HARD_VALIDATION_RTTS,
    draw_seed: int = 54321,
    first_seed: int = HARD_VALIDATION_SEED,
) -> list[EpisodeSpec]:
    """``n`` fixed validation episodes where a network most often loses to the adaptive
    heuristic: long links only (one way 20 ms and more), at rates in the upper half
    (log scale) of the run's, synthetic utilities sized so that the deadline is ``rtts``
    round trips (uniform), Gilbert-Elliott or Bernoulli loss; everything else (prior, rho,
    feedback path, held-out neighbourhoods) as ``validation_specs``'. ``draw_seed`` seeds
    the draws, episode i gets seed ``first_seed + i`` (scripts/eval_short_deadlines.py
    draws other episodes with other values).

    At one or two round trips feedback can repair at most one loss, so the episode turns on
    when to stop admitting sources and how much proactive repair to send; at high rates
    such a deadline is a long stream, and the default distribution draws few of them."""
    if n <= 0:
        return []
    base = _validation_distribution(cfg)
    lo, hi = base.rate_range_mbps
    dist = replace(
        base,
        high_rtt_share=1.0,
        rate_range_mbps=(math.sqrt(lo * hi), hi),
        long_link_deadline_rtts=rtts,
        high_rtt_min_rtts=min(base.high_rtt_min_rtts, rtts[0]),
        utility_weights={"zipf": 1.0},
        loss_weights={"ge": 0.6, "bernoulli": 0.4},
        handoff_share=0.0,
    )
    rng = np.random.default_rng(draw_seed)
    return [replace(dist.sample(rng), seed=first_seed + i) for i in range(n)]


def validation_score(
    utility: np.ndarray, best_heuristic: np.ndarray, shortfall_weight: float
) -> tuple[float, float]:
    """The validation score of one checkpoint and its mean shortfall: ``utility`` (per
    episode) averaged, minus ``shortfall_weight`` times the mean of how far each episode
    falls below ``best_heuristic`` (the better heuristic's utility on that episode)."""
    shortfall = float(np.maximum(best_heuristic - utility, 0.0).mean())
    return float(utility.mean()) - shortfall_weight * shortfall, shortfall


def play(spec: EpisodeSpec, policy: Policy) -> float:
    """Utility recovered before the deadline by ``policy`` on one episode."""
    sim = build_simulation(spec, policy)
    sim.run()
    assert sim.receiver.result is not None  # run() goes on until the receiver's result
    return sim.utility_recovered


# ---------------------------------------------------------------------------- demonstrations


DEMONSTRATORS = ("tail", "adaptive:2", "adaptive:1", "adaptive:3", "oracle")
"""Candidates for an episode's expert (first of equals wins): the session's tail rule
with reactive repair alone (action 0 throughout), the adaptive heuristic with margins z =
2, 1, 3, and the clairvoyant oracle. None dominates: at short delays the tail rule and
the oracle are within a thousandth of each other and the adaptive margin costs a little;
on long links (one-way 40 ms and more) the tail rule's margin-free admission and the
oracle's plan without it lose whole windows in the last round trips, and adaptive wins by
up to a tenth of the utility."""

EXPERTS = ("best",)
"""Episodes whose behaviour transitions get the large-margin loss: those played by the
best of ``DEMONSTRATORS`` on that episode (each candidate is played on it first, on
``TrainConfig.expert_realizations`` draws of its channels).
Where the candidates disagree across episodes, the margin lifts whichever did best there
and TD learning generalizes between them from the observation."""


def demonstrator(name: str) -> Policy:
    """A fresh policy for a name in ``DEMONSTRATORS``."""
    if name == "tail":
        return _Constant(0)
    if name == "oracle":
        return Oracle()
    return Adaptive(z=float(name.split(":", 1)[1]))


REALIZATION_STRIDE = 1 << 36
"""Seed distance between the channel draws :func:`best_demonstrator` averages over."""


def best_demonstrator(spec: EpisodeSpec, realizations: int = 1) -> str:
    """The candidate of ``DEMONSTRATORS`` that recovers the most utility on ``spec``, on
    average over ``realizations`` draws of its channels: the episode's own seed, then
    seeds :data:`REALIZATION_STRIDE` apart (still training seeds). One draw picks in
    hindsight: on a long lossy link the tail rule wins the draws whose last round trips
    happen to lose little, where a margin wins on average."""
    scores = np.zeros(len(DEMONSTRATORS))
    for j in range(realizations):
        draw = replace(spec, seed=(spec.seed + j * REALIZATION_STRIDE) % HELD_OUT_SEED)
        scores += [play(draw, demonstrator(n)) for n in DEMONSTRATORS]
    return DEMONSTRATORS[int(np.argmax(scores))]


def _behaviour(
    kind: str, rng: np.random.Generator, spec: EpisodeSpec, realizations: int
) -> tuple[Policy, float]:
    if kind == "best":
        return demonstrator(best_demonstrator(spec, realizations)), 0.05
    if kind == "adaptive":
        return Adaptive(z=float(rng.uniform(0.0, 3.0))), 0.05
    if kind == "tail":
        return _Constant(0), 0.05
    return _Constant(0), 1.0  # random


def collect_demonstrations(
    model: DoubleDQN,
    env: gym.Env,
    n_steps: int,
    seed: int,
    progress: Any = None,
    realizations: int = 1,
) -> np.ndarray:
    """Add whole episodes of behaviour policies to ``model``'s replay buffer; returns the
    buffer indices of the experts' own (not noise) transitions (see ``EXPERTS``; an
    expert is chosen over ``realizations`` channel draws, :func:`best_demonstrator`)."""
    rng = np.random.default_rng(seed)
    n_actions = len(_scheduling_env(env).actions)
    buf = model.replay_buffer
    assert buf is not None  # made with the model
    kinds = ("best", "adaptive", "best", "tail", "best", "random")
    added = 0
    episode = 0
    expert: list[int] = []
    while added < n_steps:
        obs, info = env.reset(seed=int(rng.integers(1 << 31)))
        kind = kinds[episode % len(kinds)]
        episode += 1
        pol, eps = _behaviour(kind, rng, info["spec"], realizations)
        sim = _simulation(env)
        pol.reset(sim.sender.policy.ctx)
        if isinstance(pol, Oracle):
            pol.bind_channel(sim.data_channel)
            pol.bind_sender(sim.sender)
        done = False
        while not done:
            raw = sim.sender.obs
            noise = rng.random() < eps
            a = int(rng.integers(n_actions)) if noise else pol.act(raw)
            if kind in EXPERTS and not noise:
                expert.append(buf.pos)
            nxt, r, term, trunc, _ = env.step(a)
            done = term or trunc
            buf.add(obs[None], nxt[None], np.array([[a]]), np.array([r]), np.array([done]), [{}])
            obs = nxt
            added += 1
            if progress is not None:
                progress.update(1)
    return np.array(expert, dtype=np.int64)


# ---------------------------------------------------------------------------- the run


@dataclass
class TrainResult:
    out: Path
    best_step: int
    best_utility: float
    adaptive_utility: float
    wall_s: float
    steps: int


def _plot(rows: list[dict], path: Path) -> None:
    """Validation utility per scheme, and (lower panel, where the differences show) the
    paired margin of the DDQN and of the tail rule over the adaptive heuristic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    x = [r["step"] for r in rows]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 2]})  # fmt: skip
    ax.plot(x, [r["val_ddqn"] for r in rows], "o-", label="DDQN (validation)")
    ax.plot(x, [r["val_adaptive"] for r in rows], "--", label="adaptive heuristic")
    ax.plot(x, [r["val_oracle"] for r in rows], ":", label="oracle")
    ax.plot(x, [r["val_tail_rule"] for r in rows], "-.", label="tail rule alone (action 0)")
    tr = [(r["step"], r["train_return"]) for r in rows if not math.isnan(r["train_return"])]
    if tr:
        ax.plot(*zip(*tr, strict=True), alpha=0.5, label="training return (last 100 episodes)")
    ax.set_ylabel("utility before the deadline")
    ax.set_title("kvtransport train: learning curve")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    base = np.array([r["val_adaptive"] for r in rows])
    ax2.plot(x, 1e3 * (np.array([r["val_ddqn"] for r in rows]) - base), "o-", label="DDQN")
    ax2.plot(x, 1e3 * (np.array([r["val_tail_rule"] for r in rows]) - base), "-.",
             label="tail rule")  # fmt: skip
    ax2.plot(x, 1e3 * (np.array([r["val_oracle"] for r in rows]) - base), ":", label="oracle")
    ax2.axhline(0.0, color="k", lw=0.8)
    lo = min(-2.0, 1e3 * min(r["val_ddqn"] - r["val_adaptive"] for r in rows[1:] or rows))
    ax2.set_ylim(max(lo, -10.0), 6.0)
    ax2.set_ylabel("minus adaptive (x 1e-3)")
    ax2.set_xlabel("environment steps")
    ax2.legend(loc="lower right", fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train(cfg: TrainConfig, out: str | Path, command: str = "", quiet: bool = False) -> TrainResult:
    """Run one training (see the module docstring); everything lands in ``out``.

    ``command`` is the command line that asked for the run (recorded as given). Next to
    the weights go ``ddqn.json`` (the command, :func:`effective_config` and the validation
    figures; what to copy into kvtransport/policies/data/ with ``ddqn.npz`` to ship a
    policy), and the same command and configuration in the ``.npz`` metadata and
    ``summary.json``."""
    import torch
    from kvtransport.agents.ddqn import (
        DoubleDQN,
        DuelingDQNPolicy,
        export_q_network,
        load_q_network,
    )
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.logger import configure
    from tqdm import tqdm

    if cfg.anchor_weight and cfg.init_from is None:
        raise ValueError("anchor_weight needs init_from (the network to anchor to)")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = make_env(cfg)
    actions = _scheduling_env(env).actions
    model = DoubleDQN(
        DuelingDQNPolicy if cfg.dueling else "MlpPolicy",
        env,
        learning_rate=cfg.learning_rate,
        buffer_size=cfg.buffer_size,
        learning_starts=1_000,
        batch_size=cfg.batch_size,
        gamma=cfg.gamma,
        n_steps=cfg.n_steps,
        train_freq=cfg.train_freq,
        target_update_interval=cfg.target_update_interval,
        exploration_fraction=cfg.exploration_fraction,
        exploration_initial_eps=cfg.exploration_initial_eps,
        exploration_final_eps=cfg.exploration_final_eps,
        policy_kwargs={"net_arch": list(cfg.hidden)},
        seed=cfg.seed,
        device="cpu",
    )
    if cfg.init_from is not None:
        load_q_network(model, load_weights(cfg.init_from))
        model.set_anchor(cfg.anchor_weight)
    model.set_logger(configure(str(out / "sb3"), ["csv"]))
    val = validation_specs(cfg, cfg.eval_episodes) + hard_validation_specs(
        cfg, cfg.eval_hard_episodes
    )
    bar = tqdm(
        total=cfg.demo_steps + cfg.steps,
        desc="train ddqn",
        unit="step",
        disable=quiet,
        smoothing=0.05,
    )
    bar.set_postfix_str("baselines on validation episodes")
    base_adaptive = np.array([play(s, Adaptive()) for s in val])
    base_oracle = np.array([play(s, Oracle()) for s in val])
    base_tail = np.array([play(s, _Constant(0)) for s in val])
    best_heuristic = np.maximum(base_adaptive, base_tail)
    bar.set_postfix_str("demonstrations")
    experts = collect_demonstrations(
        model, env, cfg.demo_steps, cfg.seed, bar, cfg.expert_realizations
    )
    if cfg.expert_margin > 0 and cfg.expert_weight > 0:
        model.set_expert_transitions(experts, cfg.expert_margin, cfg.expert_weight)

    config = effective_config(cfg)
    provenance = {"command": command, "config": config}
    rows: list[dict] = []
    best = {"score": -math.inf, "utility": -1.0, "step": 0}
    log_path = out / "progress.csv"
    checkpoints = out / "checkpoints"
    checkpoints.mkdir(exist_ok=True)

    def validate(step: int) -> None:
        weights = export_q_network(model, actions, {"step": step})
        u = np.array([play(s, DDQNPolicy(weights)) for s in val])
        score, shortfall = validation_score(u, best_heuristic, cfg.shortfall_weight)
        returns = [e["r"] for e in model.ep_info_buffer] if model.ep_info_buffer else []
        row = {
            "step": step,
            "wall_s": round(time.perf_counter() - t0, 1),
            "epsilon": round(float(model.exploration_rate), 4),
            "train_return": float(np.mean(returns)) if returns else float("nan"),
            "val_ddqn": float(u.mean()),
            "val_adaptive": float(base_adaptive.mean()),
            "val_oracle": float(base_oracle.mean()),
            "val_tail_rule": float(base_tail.mean()),
            "val_gap_vs_adaptive": float((u - base_adaptive).mean()),
            "val_shortfall": shortfall,
            "val_score": score,
            "best": False,
        }
        meta = {**provenance, "step": step, "validation_utility": row["val_ddqn"],
                "validation_score": score}  # fmt: skip
        save_weights(checkpoints / f"step_{step}.npz", weights, meta)
        if score > best["score"]:
            best.update(score=score, utility=row["val_ddqn"], step=step)
            row["best"] = True
            model.save(out / "best_model.zip")
            save_weights(out / "ddqn.npz", weights, meta)
        rows.append(row)
        with open(log_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(row))
            w.writeheader()
            w.writerows(rows)
        _plot(rows, out / "learning_curve.png")
        bar.set_postfix_str(
            f"val {row['val_ddqn']:.4f} (adaptive {row['val_adaptive']:.4f}, "
            f"best {best['score']:.4f} @ {best['step']})"
        )

    class _Hook(BaseCallback):
        def _on_step(self) -> bool:
            bar.update(1)
            if self.num_timesteps % cfg.eval_every == 0:
                validate(self.num_timesteps)
            return True

    validate(0)
    model.learn(total_timesteps=cfg.steps, callback=_Hook(), log_interval=10)
    if cfg.steps % cfg.eval_every:
        validate(cfg.steps)
    bar.close()
    model.save(out / "last_model.zip")
    wall = time.perf_counter() - t0
    summary = {
        "command": command,
        "config": config,
        "best_step": best["step"],
        "best_validation_utility": best["utility"],
        "best_validation_score": best["score"],
        "adaptive_validation_utility": float(base_adaptive.mean()),
        "oracle_validation_utility": float(base_oracle.mean()),
        "wall_s": wall,
        "n_features": N_FEATURES,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    sidecar = {
        "weights": "ddqn.npz",
        "command": command,
        "config": config,
        "best_step": best["step"],
        "validation_utility": best["utility"],
        "validation_score": best["score"],
        "adaptive_validation_utility": float(base_adaptive.mean()),
        "wall_s": round(wall, 1),
    }
    (out / "ddqn.json").write_text(json.dumps(sidecar, indent=2) + "\n")
    return TrainResult(
        out, int(best["step"]), best["utility"], float(base_adaptive.mean()), wall, cfg.steps
    )


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=list))
