"""The trained Q-network as plain arrays, evaluated by a numba kernel: the ``ddqn`` policy.

Nothing here imports torch: the daemons' data plane loads the shipped weights file
(``kvtransport/policies/data/ddqn.npz``) and the sender calls :meth:`DDQNPolicy.decide` once per
decision interval. One compiled call builds the observation from the sender's state
(kvtransport.core.observation), computes its features (kvtransport.policies.features), runs the
MLP (ReLU hidden layers, float64 accumulation) and returns the arg-max action: the
sender state, the observation to fill and a tuple of per-layer weight arrays in, an action
index out.

Weights file (``.npz``, written by :func:`save_weights` from a trained SB3 model):
``W0, b0, W1, b1, ...`` (float32, ``W`` shaped (out, in) as in torch) and ``meta``, a JSON
string: ``features_version``, ``n_features``, ``actions`` (the action table the network's
outputs index), ``obs_fields`` and free-form provenance. A file whose feature version or
observation layout differs from this code is refused with a one-line error, except a
file trained on fewer observation fields of the same feature version (fields added since,
such as the loss prior): its network gets zero input weights for the new fields, so it
computes exactly what it computed before they existed. Likewise a network whose training
drew no loss prior (``meta["config"]["distribution"]["prior_weights"]`` gives weight to
none but "none", or the file does not say) held ``PRIOR_FIELDS`` at 0 throughout: their
input weights are still the random initial ones, so they are zeroed when it is loaded,
and the prior reaches such a network only as the loss estimate it already learned to
read (kvtransport.core.observation).
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from kvtransport.core.observation import BURST_UNIT, OBS_FIELDS, Obs, observe_into
from kvtransport.core.policy_base import Policy
from kvtransport.errors import UserError
from kvtransport.policies.features import FEATURES_VERSION, N_FEATURES, features_into

SHIPPED_WEIGHTS = Path(__file__).with_name("data") / "ddqn.npz"
SHIPPED_SIDECAR = SHIPPED_WEIGHTS.with_suffix(".json")
PRIOR_FIELDS = ("prior_loss", "prior_known")
"""The observation fields only a loss prior moves (0 in every episode without one)."""
_BURST = Obs.BURST_MEAN.value


@njit(cache=True, nogil=True)
def mlp_qvalues(x: np.ndarray, layers: tuple) -> np.ndarray:
    """Q-values (float64) of input ``x`` through the MLP ``layers``.

    ``layers`` is a tuple of float32 arrays, one per layer, shaped (in + 1, out): the
    transposed weights with the bias as the last row. The inner loop is an axpy over a
    contiguous row (vectorizes without reassociating sums; float64 accumulation, bias
    first, inputs in order) and inputs a ReLU zeroes are skipped (ReLU applied as the next
    layer reads them). Per-layer 2-D arrays rather than one flat array: the compiler then
    knows each row is contiguous, and the loop runs about 3x faster."""
    n_layers = len(layers)
    width = x.shape[0]
    for k in range(n_layers):
        width = max(width, layers[k].shape[1])
    h = np.empty((n_layers + 1, width), dtype=np.float64)
    for i in range(x.shape[0]):
        h[0, i] = x[i]
    for k in range(n_layers):
        w = layers[k]
        nin, nout = w.shape[0] - 1, w.shape[1]
        h_in, h_out = h[k], h[k + 1]
        for j in range(nout):
            h_out[j] = w[nin, j]
        for i in range(nin):
            xi = h_in[i]
            if xi > 0.0 or (k == 0 and xi != 0.0):
                for j in range(nout):
                    h_out[j] += w[i, j] * xi
    return h[n_layers, : layers[n_layers - 1].shape[1]]


@njit(cache=True, nogil=True)
def act_kernel(obs: np.ndarray, layers: tuple, burst_max: float, base: int) -> int:
    """Features, Q-values and arg-max (first of equals) for one observation; ``base``
    where the observed loss-burst length exceeds ``burst_max`` (observation units: see
    :class:`DDQNPolicy`)."""
    if obs[_BURST] > burst_max:
        return base
    feat = np.empty(layers[0].shape[0] - 1, dtype=np.float32)
    features_into(obs, feat)
    q = mlp_qvalues(feat, layers)
    best = 0
    for j in range(1, q.shape[0]):
        if q[j] > q[best]:
            best = j
    return best


@njit(cache=True, nogil=True)
def decide_kernel(
    raw: np.ndarray, obs: np.ndarray, layers: tuple, burst_max: float, base: int
) -> int:
    """The whole decision in one compiled call: the observation of sender state ``raw``
    (written to ``obs``, which the sender keeps), then :func:`act_kernel`."""
    observe_into(raw, obs)
    return act_kernel(obs, layers, burst_max, base)


class QWeights:
    """An exported Q-network: per-layer (W, b), the action table and metadata."""

    def __init__(
        self,
        layers: list[tuple[np.ndarray, np.ndarray]],
        actions: np.ndarray,
        meta: dict | None = None,
    ) -> None:
        self.layers = [
            (np.ascontiguousarray(w, np.float32), np.ascontiguousarray(b, np.float32))
            for w, b in layers
        ]
        self.actions = np.ascontiguousarray(actions, dtype=np.float32)
        self.meta = dict(meta or {})
        dims = [self.layers[0][0].shape[1]] + [w.shape[0] for w, _ in self.layers]
        for (w, b), nin, nout in zip(self.layers, dims[:-1], dims[1:], strict=True):
            if w.shape != (nout, nin) or b.shape != (nout,):
                raise ValueError("layer shapes do not chain")
        if dims[0] != N_FEATURES:
            raise ValueError(f"network input {dims[0]} != {N_FEATURES} features")
        if dims[-1] != len(self.actions):
            raise ValueError(f"network output {dims[-1]} != {len(self.actions)} actions")
        self.dims = np.array(dims, dtype=np.int64)
        self.kernel_layers = tuple(
            np.ascontiguousarray(np.vstack([w.T, b])) for w, b in self.layers
        )
        """What the kernels take (see :func:`mlp_qvalues`)."""

    @property
    def n_params(self) -> int:
        return int(sum(w.size + b.size for w, b in self.layers))

    def qvalues(self, obs: np.ndarray) -> np.ndarray:
        """Q-values (float64[n_actions]) for one observation."""
        feat = np.empty(N_FEATURES, dtype=np.float32)
        features_into(np.ascontiguousarray(obs, dtype=np.float32), feat)
        return mlp_qvalues(feat, self.kernel_layers)


def save_weights(path: str | Path, weights: QWeights, provenance: dict | None = None) -> Path:
    """Write a weights file (see the module docstring)."""
    meta = {
        "features_version": FEATURES_VERSION,
        "n_features": N_FEATURES,
        "obs_fields": list(OBS_FIELDS),
        "actions": weights.actions.tolist(),
        "hidden": [int(d) for d in weights.dims[1:-1]],
        **weights.meta,
        **(provenance or {}),
    }
    arrays = {}
    for i, (w, b) in enumerate(weights.layers):
        arrays[f"W{i}"], arrays[f"b{i}"] = w, b
    path = Path(path)
    with open(path, "wb") as f:
        # numpy's stub reads **arrays as possibly naming allow_pickle (a bool)
        np.savez_compressed(f, meta=np.array(json.dumps(meta)), **arrays)  # type: ignore[arg-type]
    return path


def load_weights(path: str | Path) -> QWeights:
    """Read a weights file; a wrong or incompatible file is a one-line UserError."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            n = sum(1 for k in z.files if k.startswith("W"))
            layers = [(z[f"W{i}"], z[f"b{i}"]) for i in range(n)]
    except FileNotFoundError:
        raise UserError(f"{path}: no such DDQN weights file") from None
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{path}: not a DDQN weights file ({exc})") from None
    fields = meta.get("obs_fields")
    if meta.get("features_version") == FEATURES_VERSION and isinstance(fields, list):
        if fields != list(OBS_FIELDS) and set(fields) < set(OBS_FIELDS) and layers:
            layers[0] = (_widen_input(layers[0][0], fields), layers[0][1])
            meta = {**meta, "obs_fields": list(OBS_FIELDS), "trained_obs_fields": fields}
    if meta.get("features_version") != FEATURES_VERSION or meta.get("obs_fields") != list(
        OBS_FIELDS
    ):
        raise UserError(
            f"{path}: trained for another observation or feature layout "
            f"(features v{meta.get('features_version')}, this code v{FEATURES_VERSION}); "
            "retrain with `kvtransport train`"
        )
    if layers and not trained_priors(recorded_distribution(meta)):
        w0 = layers[0][0].copy()
        w0[:, [OBS_FIELDS.index(name) for name in PRIOR_FIELDS]] = 0.0
        layers[0] = (w0, layers[0][1])
    try:
        return QWeights(layers, np.array(meta["actions"], dtype=np.float32), meta)
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None


def recorded_distribution(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The training distribution (EpisodeDistribution's settings) a weights file's meta
    records (``meta["config"]["distribution"]``); None where it records none."""
    config = meta.get("config")
    dist = config.get("distribution") if isinstance(config, dict) else None
    return dist if isinstance(dist, dict) else None


def _widen_input(w0: np.ndarray, fields: list[str]) -> np.ndarray:
    """First-layer weights (out, in) of a network trained on observation ``fields`` (a
    subset of ``OBS_FIELDS``), remapped to today's feature layout by name: the extra
    features keep their columns, fields it never saw get zero weights."""
    n_extra = N_FEATURES - len(OBS_FIELDS)
    if w0.ndim != 2 or w0.shape[1] != len(fields) + n_extra:
        return w0  # QWeights reports the mismatch
    out = np.zeros((w0.shape[0], N_FEATURES), dtype=w0.dtype)
    for i, name in enumerate(fields):
        out[:, OBS_FIELDS.index(name)] = w0[:, i]
    out[:, len(OBS_FIELDS) :] = w0[:, len(fields) :]
    return out


@lru_cache(maxsize=1)
def _shipped() -> QWeights:
    """The shipped weights, read once per process (a daemon builds a policy per transfer)."""
    return load_weights(SHIPPED_WEIGHTS)


def shipped_policy_available() -> bool:
    """True when the package ships trained DDQN weights."""
    return SHIPPED_WEIGHTS.is_file()


def shipped_distribution() -> dict[str, Any] | None:
    """The training distribution (EpisodeDistribution's settings) the shipped weights'
    sidecar records, read afresh (the caller may keep or change it); None where the
    sidecar is missing or unreadable."""
    try:
        sidecar = json.loads(SHIPPED_SIDECAR.read_text())
    except (OSError, ValueError):
        return None
    return recorded_distribution(sidecar) if isinstance(sidecar, dict) else None


@lru_cache(maxsize=1)
def shipped_trained_bdp_bits() -> float:
    """The largest bandwidth-delay product (bits: link rate x round trip) the shipped
    weights were trained on, from the training distribution their sidecar records: the
    top of its rate range times twice the longest one-way delay it drew. ``math.inf``
    where the sidecar is missing or does not say. Beyond it the network meets spans in
    flight it never saw (kvtransport.hosts.policy_choice.default_policy_for)."""
    dist = shipped_distribution()
    if dist is None:
        return math.inf
    try:
        rate_bps = float(dist["rate_range_mbps"][1]) * 1e6
        one_way_ms = float(dist["delay_range_ms"][1])
        if float(dist.get("high_rtt_share", 0.0)) > 0:
            one_way_ms = max(one_way_ms, float(dist["high_delay_range_ms"][1]))
    except (ValueError, KeyError, TypeError, IndexError):
        return math.inf
    return rate_bps * 2.0 * one_way_ms * 1e-3


def trained_priors(distribution: dict[str, Any] | None) -> bool:
    """Whether a network trained on ``distribution`` (EpisodeDistribution's settings, as
    a sidecar or a weights file's meta records them) drew loss priors: weight on a prior
    other than none. False where it does not say."""
    weights = distribution.get("prior_weights") if distribution is not None else None
    if not isinstance(weights, dict):
        return False
    return any(kind != "none" and float(w) > 0 for kind, w in weights.items())


def trained_burst_packets(distribution: dict[str, Any] | None) -> float:
    """The longest mean loss burst (packets) of the channels a network trained on
    ``distribution`` (EpisodeDistribution's settings) could draw: its Gilbert-Elliott
    draws' extreme (the most loss in the bad state, none in the good one, the least
    recovery probability r: a run of losses goes on with probability (1 - r) x bad-state
    loss per packet) or its heaviest Bernoulli draw (1 / (1 - p)). These are the loss
    models' ``mean_burst_length`` (kvtransport.netem.loss) in closed form: the data plane
    does not load the channel models. ``math.inf`` where it does not say, drew no lossy
    channel, or drew trace windows (whose bursts are the traces')."""
    if distribution is None:
        return math.inf
    try:
        weights = {kind: float(w) for kind, w in distribution["loss_weights"].items()}
        if weights.get("trace", 0.0) > 0 and distribution.get("trace_files"):
            return math.inf
        go_on = 0.0  # the largest probability that a run of losses goes on
        if weights.get("ge", 0.0) > 0:
            r, bad = float(distribution["ge_r_range"][0]), float(distribution["ge_bad_range"][1])
            go_on = (1.0 - r) * bad
        if weights.get("bernoulli", 0.0) > 0:
            go_on = max(go_on, float(distribution["bernoulli_range"][1]))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return math.inf
    if not 0.0 < go_on < 1.0:
        return math.inf
    return 1.0 / (1.0 - go_on)


@lru_cache(maxsize=1)
def shipped_trained_priors() -> bool:
    """Whether the shipped weights trained with loss priors (:func:`trained_priors` of
    their sidecar's distribution). A network trained without them never saw a loss before
    the first feedback (kvtransport.hosts.policy_choice.default_policy_for)."""
    return trained_priors(shipped_distribution())


class DDQNPolicy(Policy):
    """The learned repair scheduler: RLC repair, reactive hole repair as in the adaptive
    heuristic, and the proactive share and admission chosen by the exported Q-network.

    Where the receiver's smoothed loss-burst length exceeds the longest mean burst of the
    channels the network trained on (:func:`trained_burst_packets` of its weights'
    recorded distribution), the network is not asked: the policy plays its base action
    (no proactive repair, keep admitting: the tail rule, with reactive repair), since the
    network's proactive bets were learned on shorter bursts (docs/results.md, "A network
    does not bet beyond the bursts it trained on").

    weights: a :class:`QWeights`, a path to a weights file, or None for the shipped one.
    """

    name = "ddqn"
    scheme = "rlc"
    reactive = True

    def __init__(self, weights: QWeights | str | Path | None = None) -> None:
        if weights is None:
            if not shipped_policy_available():
                raise UserError(
                    "no trained DDQN policy is installed (kvtransport/policies/data/ddqn.npz); "
                    "train one with `kvtransport train`"
                )
            weights = _shipped()
        if not isinstance(weights, QWeights):
            weights = load_weights(weights)
        self.weights = weights
        self.actions = weights.actions
        self._layers = weights.kernel_layers
        base = np.flatnonzero((weights.actions[:, 0] == 0) & (weights.actions[:, 1] > 0.5))
        self.base_action = int(base[0]) if len(base) else -1
        self.burst_limit = (
            trained_burst_packets(recorded_distribution(weights.meta))
            if self.base_action >= 0
            else math.inf
        )
        """Packets of smoothed loss burst beyond which the policy plays ``base_action``."""
        self._burst_max = self.burst_limit / BURST_UNIT

    def act(self, obs: np.ndarray) -> int:
        return act_kernel(obs, self._layers, self._burst_max, self.base_action)

    def decide(self, raw: np.ndarray, obs: np.ndarray) -> int:
        return decide_kernel(raw, obs, self._layers, self._burst_max, self.base_action)

    def __init_subclass__(cls, **kwargs: object) -> None:
        """A subclass that overrides ``act`` (to count or log actions) gets the two-step
        ``Policy.decide``, so its ``act`` sees every decision the fused kernel would
        otherwise make without it."""
        super().__init_subclass__(**kwargs)
        if "act" in cls.__dict__ and "decide" not in cls.__dict__:
            cls.decide = Policy.decide  # type: ignore[method-assign]  # on purpose
