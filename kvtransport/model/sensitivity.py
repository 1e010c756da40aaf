"""Per-layer sensitivity of a model to damage in its KV cache, and layer weights from it.

Measured the RippleKV way: on a small calibration set, perturb one layer's *value* cache
at a time with norm-adaptive Gaussian noise and measure how far the model's output
distribution moves (KL divergence from the clean cache's distribution). Layers whose
damage moves the output most deserve the most protection, so their blocks go first.

Noise (norm-adaptive: the same relative damage for loud and quiet tokens). For layer l,
head h, token t with value vector v (head_dim D):

    v' = v + sigma * (||v|| / sqrt(D)) * z,   z ~ N(0, I_D)

so E||v' - v||^2 = sigma^2 ||v||^2. Only the prefilled context's slots are perturbed.

Score of layer l: KL(p_clean || p_noisy) of the next-token distribution, averaged over
the answer positions (the question's last token and a greedy continuation fed teacher-
forced), then over calibration samples (and noise draws). The profile is saved as JSON.

Layer weights (``layer_weights``): normalize the scores to [0, 1], then map exponentially
with a ratio r >= 1 so the most sensitive layer weighs r times the least sensitive one:

    s_hat_l = (log s_l - min_j log s_j) / (max_j log s_j - min_j log s_j)   (scale="log")
    s_hat_l = (s_l - min_j s_j) / (max_j s_j - min_j s_j)                   (scale="linear")
    w_l     = r ** s_hat_l / sum_j r ** s_hat_j

The weights sum to 1; multiplied by per-layer token importances that each sum to 1, block
utilities over the whole cache then sum to 1 as well. r = 1 gives uniform weights. The log
scale is the default because KL scores span orders of magnitude across layers: on a linear
scale one outlier layer would flatten every other layer to the same weight.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.errors import UserError
from kvtransport.kvformat.kvcache import KVCache

FORMAT = "kvtransport-sensitivity/1"
DEFAULT_NOISE_SCALE = 1.0
DEFAULT_RATIO = 64.0
"""Most- to least-sensitive layer weight ratio; tuned on development prompts (see
kvtransport.model.utility's docstring: top-1 agreement at 25 % kept 0.72 at ratio 4, 0.89 at 64)."""


@dataclass
class SensitivityProfile:
    """Mean KL per layer under value-cache noise (see module docstring), plus provenance.

    ``layer_weights`` are derived from ``kl`` with ``weight_ratio`` and ``weight_scale``
    (filled in when not given) and saved along, so a consumer that only wants weights,
    like ``kvtransport prefill --layer-weights FILE``, reads them directly.
    """

    model_id: str
    kl: list[float]
    kl_std: list[float]
    noise_scale: float
    calibration: dict[str, Any] = field(default_factory=dict)
    command: str | None = None
    created: str | None = None
    seconds: float | None = None
    weight_ratio: float = DEFAULT_RATIO
    weight_scale: str = "log"
    layer_weights: list[float] = field(default_factory=list)
    format: str = FORMAT

    def __post_init__(self) -> None:
        if not self.layer_weights and self.kl:
            w = layer_weights(self.kl, ratio=self.weight_ratio, scale=self.weight_scale)
            self.layer_weights = [float(x) for x in w]

    @property
    def num_layers(self) -> int:
        return len(self.kl)

    def weights(self, ratio: float = DEFAULT_RATIO, scale: str = "log") -> np.ndarray:
        """Layer weights from this profile (``layer_weights``)."""
        return layer_weights(self.kl, ratio=ratio, scale=scale)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON (atomic: temporary file, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        tmp.replace(path)


def load_profile(path: str | Path) -> SensitivityProfile:
    """Read a profile written by ``SensitivityProfile.save``; a bad file is a UserError."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read sensitivity profile {path}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{path} is not a kvtransport sensitivity profile ({FORMAT})")
    kl = np.asarray(data.get("kl"), dtype=object)
    if not (
        kl.ndim == 1
        and kl.size
        and all(isinstance(x, int | float) and math.isfinite(x) and x >= 0 for x in kl)
    ):
        raise UserError(f"{path}: kl must be a non-empty list of finite non-negative numbers")
    try:
        prof = SensitivityProfile(**data)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{path}: malformed sensitivity profile: {exc}") from exc
    if len(prof.layer_weights) != len(prof.kl):
        raise UserError(
            f"{path}: {len(prof.layer_weights)} layer weights for {len(prof.kl)} layers"
        )
    return prof


def packaged_profile_name(model_id: str) -> str:
    """File name of a model's shipped profile in kvtransport/data/."""
    return f"{model_id}-sensitivity.json"


def default_profile(model_id: str) -> SensitivityProfile | None:
    """The profile shipped as package data for ``model_id``, or None if there is none."""
    ref = resources.files("kvtransport") / "data" / packaged_profile_name(model_id)
    if not ref.is_file():
        return None
    with resources.as_file(ref) as p:
        return load_profile(p)


def layer_weights(
    sensitivity: Sequence[float] | np.ndarray, ratio: float = DEFAULT_RATIO, scale: str = "log"
) -> np.ndarray:
    """Map per-layer sensitivity scores to weights that sum to 1 (formula in module doc).

    ratio: weight of the most sensitive layer over the least sensitive one (>= 1).
    scale: "log" (default) or "linear" normalization of the scores before the mapping.
    """
    s = np.asarray(sensitivity, dtype=np.float64)
    if s.ndim != 1 or s.size == 0 or not np.all(np.isfinite(s)) or np.any(s < 0):
        raise ValueError("sensitivity must be a non-empty 1-D array of finite values >= 0")
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1, got {ratio}")
    if scale == "log":
        s = np.log(np.maximum(s, 1e-12))
    elif scale != "linear":
        raise ValueError(f"scale must be 'log' or 'linear', got {scale!r}")
    span = s.max() - s.min()
    s_hat = (s - s.min()) / span if span > 0 else np.zeros_like(s)
    w = ratio**s_hat
    return w / w.sum()


# ----------------------------------------------------------------------------- measurement


def add_value_noise(kv: KVCache, layer: int, scale: float, rng: np.random.Generator) -> KVCache:
    """A copy of ``kv`` with norm-adaptive Gaussian noise on layer ``layer``'s values."""
    values = kv.values.copy()
    v = values[layer].astype(np.float32)
    d = v.shape[-1]
    norms = np.linalg.norm(v, axis=-1, keepdims=True)
    noise = rng.standard_normal(v.shape, dtype=np.float32)
    values[layer] = (v + scale * (norms / np.sqrt(d)) * noise).astype(values.dtype)
    return KVCache(kv.keys, values, kv.token_ids, kv.model_id, kv.attention)


def _log_probs(logits: Any) -> Any:
    import torch

    return torch.log_softmax(logits.double(), dim=-1)


def kl_divergence(clean_logits: Any, noisy_logits: Any) -> float:
    """Mean over positions of KL(softmax(clean) || softmax(noisy)), in nats."""
    import torch

    lp, lq = _log_probs(clean_logits), _log_probs(noisy_logits)
    kl = torch.sum(torch.exp(lp) * (lp - lq), dim=-1)
    return float(kl.clamp_min(0).mean())


@dataclass
class _Calib:
    kv: KVCache
    feed: list[int]
    last: int


def _calibration_item(model: Any, tokenizer: Any, sample: Any, continuation: int) -> _Calib:
    from kvtransport.model import hf

    ctx, question = sample.prompt(tokenizer)
    kv = hf.prefill(model, tokenizer, ctx, attention=False)
    ref = hf.greedy_generate(model, kv, question, max_new_tokens=continuation, stop_ids=()).tokens
    return _Calib(kv=kv, feed=list(question) + ref[:-1], last=len(ref))


def layer_kl(
    model: Any,
    kv: KVCache,
    feed: Sequence[int],
    layer: int,
    *,
    scale: float,
    rng: np.random.Generator,
    last: int = 1,
    clean_logits: Any = None,
) -> float:
    """KL of the output distribution when ``layer``'s value cache gets noise of ``scale``.

    feed: tokens fed after the cache (question + teacher-forced continuation); the KL is
    averaged over the last ``last`` positions.
    """
    from kvtransport.model import hf

    if clean_logits is None:
        clean_logits, _ = hf.cache_forward(model, kv, feed, last=last)
    noisy = add_value_noise(kv, layer, scale, rng)
    noisy_logits, _ = hf.cache_forward(model, noisy, feed, last=last)
    return kl_divergence(clean_logits, noisy_logits)


def profile_model(
    model: Any,
    tokenizer: Any,
    *,
    samples: int = 8,
    target_tokens: int = 400,
    noise_scale: float = DEFAULT_NOISE_SCALE,
    draws: int = 1,
    continuation: int = 8,
    seed: int = 1000,
    progress: bool = True,
    command: str | None = None,
    ratio: float = DEFAULT_RATIO,
) -> SensitivityProfile:
    """Measure the per-layer sensitivity profile on a calibration set of task samples.

    samples: calibration samples, cycling through the quality tasks (seeds from ``seed``,
    kept apart from the evaluation seeds used elsewhere).
    draws: noise draws per (sample, layer).
    ratio: the exponential mapping's ratio for the stored ``layer_weights``.
    """
    from tqdm import tqdm

    from kvtransport.model import hf, tasks
    from kvtransport.model.loader import model_id_of

    if samples < 1 or draws < 1:
        raise UserError("--samples and --draws must be at least 1")
    t0 = time.perf_counter()
    cal = tasks.suite(tokenizer, n=samples, target_tokens=target_tokens, seed=seed)
    num_layers = int(model.config.num_hidden_layers)
    scores = np.zeros((samples * draws, num_layers))
    rng = np.random.default_rng(seed)
    bar = tqdm(
        total=samples * num_layers * draws,
        desc="layer sensitivity",
        unit="forward",
        disable=not progress,
    )
    with bar:
        for i, sample in enumerate(cal):
            item = _calibration_item(model, tokenizer, sample, continuation)
            clean, _ = hf.cache_forward(model, item.kv, item.feed, last=item.last)
            for d in range(draws):
                for layer in range(num_layers):
                    scores[i * draws + d, layer] = layer_kl(
                        model,
                        item.kv,
                        item.feed,
                        layer,
                        scale=noise_scale,
                        rng=rng,
                        last=item.last,
                        clean_logits=clean,
                    )
                    bar.update(1)
    return SensitivityProfile(
        model_id=model_id_of(model),
        kl=[float(x) for x in scores.mean(axis=0)],
        kl_std=[float(x) for x in scores.std(axis=0)],
        noise_scale=float(noise_scale),
        calibration={
            "tasks": sorted({s.task for s in cal}),
            "samples": samples,
            "draws": draws,
            "target_tokens": target_tokens,
            "continuation_tokens": continuation,
            "seed": seed,
        },
        command=command,
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        seconds=round(time.perf_counter() - t0, 1),
        weight_ratio=float(ratio),
    )
