"""The trained Q-network as plain arrays, evaluated by a numba kernel: the ``ddqn`` policy.

Nothing here imports torch: the daemons' data plane loads the shipped weights file
(``agents/data/ddqn.npz``) and calls :meth:`DDQNPolicy.act` once per decision interval.
One call computes the features of the observation (kvtransport.agents.features), runs the
MLP (ReLU hidden layers, float64 accumulation) and returns the arg-max action, in one
compiled function over the observation and one packed array holding the whole network.

Weights file (``.npz``, written by :func:`save_weights` from a trained SB3 model):
``W0, b0, W1, b1, ...`` (float32, ``W`` shaped (out, in) as in torch) and ``meta``, a JSON
string: ``features_version``, ``n_features``, ``actions`` (the action table the network's
outputs index), ``obs_fields`` and free-form provenance. A file whose feature version or
observation layout differs from this code is refused with a one-line error.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
from kvtransport.agents.features import FEATURES_VERSION, N_FEATURES, features_into
from numba import njit

from kvtransport.errors import UserError
from kvtransport.policy import OBS_FIELDS, Policy, RepairMode

SHIPPED_WEIGHTS = Path(__file__).with_name("data") / "ddqn.npz"
SHIPPED_SIDECAR = SHIPPED_WEIGHTS.with_suffix(".json")


@njit(cache=True, nogil=True)
def mlp_qvalues(x: np.ndarray, blob: np.ndarray) -> np.ndarray:
    """Q-values (float64) of input ``x`` through the MLP packed in ``blob``.

    ``blob`` (float32) is ``[L, d0, d1, .., dL]`` (layer count and sizes) followed, per
    layer, by the transposed weights (in, out) and the bias: the inner loop is an axpy over
    contiguous memory (vectorizes without reassociating sums; float64 accumulation) and
    inputs a ReLU zeroed are skipped. One array keeps the compiled call's argument
    checking, a fixed cost per array, small."""
    n_layers = int(blob[0])
    width = 0
    for k in range(n_layers + 1):
        width = max(width, int(blob[1 + k]))
    a = np.empty(width, dtype=np.float64)
    b = np.empty(width, dtype=np.float64)
    for i in range(int(blob[1])):
        a[i] = x[i]
    off = 2 + n_layers
    for layer in range(n_layers):
        nin, nout = int(blob[1 + layer]), int(blob[2 + layer])
        b_off = off + nin * nout
        for j in range(nout):
            b[j] = blob[b_off + j]
        for i in range(nin):
            ai = a[i]
            if ai != 0.0:
                row = off + i * nout
                for j in range(nout):
                    b[j] += blob[row + j] * ai
        if layer < n_layers - 1:
            for j in range(nout):
                if b[j] < 0.0:
                    b[j] = 0.0
        off = b_off + nout
        a, b = b, a
    return a[: int(blob[1 + n_layers])]


@njit(cache=True, nogil=True)
def act_kernel(obs: np.ndarray, blob: np.ndarray) -> int:
    """Features, Q-values and arg-max (first of equals) for one observation."""
    feat = np.empty(int(blob[1]), dtype=np.float32)
    features_into(obs, feat)
    q = mlp_qvalues(feat, blob)
    best = 0
    for j in range(1, q.shape[0]):
        if q[j] > q[best]:
            best = j
    return best


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
        head = np.array([len(self.layers), *dims], dtype=np.float32)
        params = [np.concatenate([w.T.ravel(), b]) for w, b in self.layers]
        self.blob = np.concatenate([head, *params]).astype(np.float32)

    @property
    def n_params(self) -> int:
        return int(self.blob.size - 2 - len(self.layers))

    def qvalues(self, obs: np.ndarray) -> np.ndarray:
        """Q-values (float64[n_actions]) for one observation."""
        feat = np.empty(N_FEATURES, dtype=np.float32)
        features_into(np.ascontiguousarray(obs, dtype=np.float32), feat)
        return mlp_qvalues(feat, self.blob)


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
        np.savez_compressed(f, meta=np.array(json.dumps(meta)), **arrays)
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
    if meta.get("features_version") != FEATURES_VERSION or meta.get("obs_fields") != list(
        OBS_FIELDS
    ):
        raise UserError(
            f"{path}: trained for another observation or feature layout "
            f"(features v{meta.get('features_version')}, this code v{FEATURES_VERSION}); "
            "retrain with `kvtransport train`"
        )
    try:
        return QWeights(layers, np.array(meta["actions"], dtype=np.float32), meta)
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None


@lru_cache(maxsize=1)
def _shipped() -> QWeights:
    """The shipped weights, read once per process (a daemon builds a policy per transfer)."""
    return load_weights(SHIPPED_WEIGHTS)


def shipped_policy_available() -> bool:
    """True when the package ships trained DDQN weights."""
    return SHIPPED_WEIGHTS.is_file()


class DDQNPolicy(Policy):
    """The learned repair scheduler: RLC repair, reactive hole repair as in the adaptive
    heuristic, and the proactive share and admission chosen by the exported Q-network.

    weights: a :class:`QWeights`, a path to a weights file, or None for the shipped one.
    """

    name = "ddqn"
    mode = RepairMode.RLC
    reactive = True

    def __init__(self, weights: QWeights | str | Path | None = None) -> None:
        if weights is None:
            if not shipped_policy_available():
                raise UserError(
                    "no trained DDQN policy is installed (agents/data/ddqn.npz); "
                    "train one with `kvtransport train`"
                )
            weights = _shipped()
        if not isinstance(weights, QWeights):
            weights = load_weights(weights)
        self.weights = weights
        self.actions = weights.actions
        self._blob = weights.blob

    def act(self, obs: np.ndarray) -> int:
        return act_kernel(obs, self._blob)
