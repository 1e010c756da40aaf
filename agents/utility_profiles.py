"""Block-utility profiles measured once from the real model, shipped as a small data file.

The environment samples a block-utility profile per episode. Synthetic shapes (zipf, flat,
linear) come from kvtransport.core.transfer; the *measured* ones come from here: for a set of
generated contexts (kvtransport.model.tasks: needle-in-a-haystack and facts QA), the default
model (SmolLM2-135M-Instruct) prefills the context and kvtransport.model.utility scores every
block (one layer x 16 tokens) exactly as ``kvtransport prefill`` does; the utilities in
stream order are one profile. Extraction needs torch and the model, so it runs once,
offline::

    .venv/bin/python -m kvtransport.agents.utility_profiles

and writes ``agents/data/utility_profiles.npz``: ``train_values``/``train_offsets`` and
``eval_values``/``eval_offsets`` (ragged float32 arrays, one profile per context; the two
sets come from disjoint task seeds, so evaluation never sees a training context) plus a
``meta`` JSON string (model, seeds, token counts). Loading is numpy only.

A profile is resampled to an episode's block count through its cumulative utility curve
(:func:`resample`): the share of the total utility carried by the first x % of the stream
is kept, whatever the number of blocks, so one measured context serves every cache size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

PROFILES_FILE = Path(__file__).with_name("data") / "utility_profiles.npz"
TRAIN_SEED = 30_000
EVAL_SEED = 31_000
"""Task seeds of the measured contexts (disjoint from the calibration's and the
retention evaluation's seeds, and from each other)."""
TARGET_TOKENS = (200, 300, 450, 650, 900)


@dataclass(frozen=True)
class MeasuredProfiles:
    """Measured profiles of one split: a list of float64 utility vectors in stream order."""

    profiles: tuple[np.ndarray, ...]
    meta: dict

    def __len__(self) -> int:
        return len(self.profiles)


@lru_cache(maxsize=4)
def load_profiles(split: str = "train", path: str | None = None) -> MeasuredProfiles:
    """The shipped profiles of a split ("train" or "eval")."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, not {split!r}")
    with np.load(path or PROFILES_FILE) as z:
        values = z[f"{split}_values"].astype(np.float64)
        offsets = z[f"{split}_offsets"].astype(np.int64)
        meta = json.loads(str(z["meta"]))
    profiles = tuple(
        values[a:b] / values[a:b].sum() for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    )
    return MeasuredProfiles(profiles, meta)


def resample(profile: np.ndarray, n_blocks: int) -> np.ndarray:
    """The profile's utilities for ``n_blocks`` blocks: the same cumulative utility curve
    (utility carried by the first x % of the stream), differenced. Sums to 1."""
    if n_blocks < 1:
        raise ValueError("need at least one block")
    p = np.asarray(profile, dtype=np.float64)
    cum = np.concatenate(([0.0], np.cumsum(p) / p.sum()))
    x_src = np.linspace(0.0, 1.0, p.size + 1)
    x_dst = np.linspace(0.0, 1.0, n_blocks + 1)
    u = np.diff(np.interp(x_dst, x_src, cum))
    u = np.maximum(u, 0.0)
    return u / u.sum()


def measure(n_contexts: int, seed: int, block_tokens: int = 16) -> tuple[list[np.ndarray], list]:
    """Prefill ``n_contexts`` generated contexts with the default model and return their
    block utilities in stream order, plus a description of each context."""
    import torch
    from tqdm import tqdm

    from kvtransport.model import hf, tasks, utility
    from kvtransport.model.loader import load_model

    torch.set_num_threads(1)
    lm = load_model(threads=1)
    model, tok = lm
    weights = utility.default_layer_weights(lm.model_id, lm.num_layers)
    out, info = [], []
    for i in tqdm(range(n_contexts), desc=f"prefill (seed {seed})"):
        task = tasks.TASK_NAMES[i % len(tasks.TASK_NAMES)]
        target = TARGET_TOKENS[i % len(TARGET_TOKENS)]
        sample = tasks.generate(task, tok, target_tokens=target, seed=seed + i)
        ctx, _ = sample.prompt(tok)
        kv = hf.prefill(model, tok, ctx, window=utility.OBSERVATION_WINDOW)
        u = utility.cache_utility(kv, block_tokens, weights)
        order = utility.stream_order(u, block_tokens)
        out.append(u.reshape(-1)[order].astype(np.float32))
        info.append({"task": task, "seed": seed + i, "tokens": int(kv.num_tokens)})
    return out, info


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", type=int, default=20, help="training contexts (default 20)")
    p.add_argument("--eval", type=int, default=12, help="held-out contexts (default 12)")
    p.add_argument("--out", default=str(PROFILES_FILE), help="npz to write")
    args = p.parse_args(argv)
    arrays: dict[str, np.ndarray] = {}
    meta: dict = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF)", "block_tokens": 16}
    for split, n, seed in (("train", args.train, TRAIN_SEED), ("eval", args.eval, EVAL_SEED)):
        profiles, info = measure(n, seed)
        arrays[f"{split}_values"] = np.concatenate(profiles)
        arrays[f"{split}_offsets"] = np.cumsum([0] + [len(x) for x in profiles]).astype(np.int64)
        meta[split] = info
    meta["command"] = "python -m kvtransport.agents.utility_profiles " + " ".join(
        f"--{k} {v}" for k, v in (("train", args.train), ("eval", args.eval))
    )
    # numpy's stub reads **arrays as possibly naming allow_pickle (a bool)
    np.savez_compressed(args.out, meta=np.array(json.dumps(meta)), **arrays)  # type: ignore[arg-type]
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
