"""The Q-network's input: the policy observation plus a few quantities derived from it.

The network sees ``features(obs)``: the raw observation (kvtransport.core.observation.Obs) followed
by what the repair decision hinges on, computed from the observation alone so that the
environment's observation stays exactly the daemon's:

- ``room``: expected surviving slots left minus the repairs still owed, in decision
  intervals (``8 * SLACK``), clipped to -4..8: where admission has to stop;
- ``left``: slots left before the stop time, in intervals (from SLACK, OWED and the loss
  estimate), clipped to 0..64, and the blind horizon (one RTT plus an interval, all of
  what is left once feedback is stale) that feedback can no longer cover, from the
  unclipped ``RTT_LONG`` (long links: one-way 20..90 ms is 10..50 intervals at 100
  Mbit/s, past the 16 intervals ``RTT`` holds);
- ``sigma``: the standard deviation of the losses over that blind horizon, inflated for
  bursts (a Gilbert-like variance ``n p (1-p) (2b - 1)``), in intervals, and
  ``blind_loss``, the expected losses over it (what proactive repair has to cover);
- ``room - z sigma`` for z = 1, 2, 3: the margins a cautious scheduler would keep;
- whether feedback is stale (no report for four RTTs) or has never come.

These are the terms kvtransport.policies.heuristics.Adaptive thresholds by hand; the network learns
its own thresholds and shares from them. One implementation serves training (the
observation wrapper calls it per step) and the runtime (inside the numba kernel).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from kvtransport.core.observation import BURST_UNIT, OBS_CLIP, OBS_SIZE, Obs
from kvtransport.core.policy_base import DECISION_PACKETS

EXTRA_FEATURES = (
    "room",
    "left",
    "blind",
    "sigma",
    "blind_loss",
    "room_1sigma",
    "room_2sigma",
    "room_3sigma",
    "stale",
    "no_feedback",
)
N_FEATURES = OBS_SIZE + len(EXTRA_FEATURES)
FEATURES_VERSION = 2
"""Bumped whenever the feature definition changes: exported weights record it."""

_IV = float(DECISION_PACKETS)
_I_SLACK, _I_OWED, _I_LOSS, _I_BURST = (
    int(Obs.SLACK),
    int(Obs.OWED),
    int(Obs.LOSS_RATE),
    int(Obs.BURST_MEAN),
)
_I_RTT_LONG, _I_AGE = int(Obs.RTT_LONG), int(Obs.FEEDBACK_AGE)


@njit(cache=True, nogil=True, fastmath=False)
def features_into(obs: np.ndarray, out: np.ndarray) -> None:
    """Write the features of one observation (float32[OBS_SIZE]) into ``out``."""
    n = obs.shape[0]
    for i in range(n):
        out[i] = obs[i]
    p = min(max(float(obs[_I_LOSS]), 0.0), 0.95)
    burst = max(1.0, float(obs[_I_BURST]) * BURST_UNIT)
    room = float(obs[_I_SLACK]) * 8.0
    left = (room + float(obs[_I_OWED])) / (1.0 - p)
    if left < 0.0:
        left = 0.0
    no_fb = obs[_I_AGE] >= OBS_CLIP
    stale = obs[_I_AGE] >= 4.0
    blind = min(left, float(obs[_I_RTT_LONG]) * 64.0 + 1.0)
    if stale:
        blind = left
    sigma = math.sqrt(max(blind * _IV, 1.0) * p * (1.0 - p) * (2.0 * burst - 1.0)) / _IV
    out[n] = min(max(room, -4.0), 8.0) / 4.0
    out[n + 1] = min(left, 64.0) / 64.0
    out[n + 2] = min(blind, 64.0) / 64.0
    out[n + 3] = min(sigma, 8.0) / 2.0
    out[n + 4] = min(p * blind, 8.0) / 8.0
    out[n + 5] = min(max(room - sigma, -4.0), 8.0) / 4.0
    out[n + 6] = min(max(room - 2.0 * sigma, -4.0), 8.0) / 4.0
    out[n + 7] = min(max(room - 3.0 * sigma, -4.0), 8.0) / 4.0
    out[n + 8] = 1.0 if stale else 0.0
    out[n + 9] = 1.0 if no_fb else 0.0


def features(obs: np.ndarray) -> np.ndarray:
    """``features_into`` for one observation or a batch (float32[..., N_FEATURES])."""
    o = np.ascontiguousarray(obs, dtype=np.float32)
    if o.ndim == 1:
        out = np.empty(N_FEATURES, dtype=np.float32)
        features_into(o, out)
        return out
    flat = o.reshape(-1, o.shape[-1])
    out = np.empty((flat.shape[0], N_FEATURES), dtype=np.float32)
    for i in range(flat.shape[0]):
        features_into(flat[i], out[i])
    return out.reshape(*o.shape[:-1], N_FEATURES)


def feature_bounds(obs_low: np.ndarray, obs_high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of every feature, for the training wrapper's observation space, from the
    observation's own bounds (kvtransport.agents.env.observation_space)."""
    low = np.concatenate([obs_low, [-1, 0, 0, 0, 0, -1, -1, -1, 0, 0]]).astype(np.float32)
    high = np.concatenate([obs_high, [2, 1, 1, 4, 1, 2, 2, 2, 1, 1]]).astype(np.float32)
    return low, high
