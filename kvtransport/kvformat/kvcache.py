"""The in-memory KV cache as plain numpy arrays: the contract between model code and transport.

Model code (kvtransport.model.hf, torch) produces and consumes it; blocks, quantization, cards
and the transport only ever see numpy, so the data plane never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class KVCache:
    """A prefill's key/value cache for one sequence.

    keys, values: ``[layers, kv_heads, tokens, head_dim]``, float32 or float16, as the
        model's attention layers hold them (keys already rotated by RoPE).
    token_ids: ``[tokens]`` int64, the prefilled tokens (chat template applied).
    model_id: the model the cache belongs to (a cache is useless to another model).
    attention: optional ``[layers, tokens]`` float32, the attention mass each cached token
        received from the observation window (the prefill's last queries, SnapKV style),
        averaged over heads; the raw material of token importance.
    """

    keys: np.ndarray
    values: np.ndarray
    token_ids: np.ndarray
    model_id: str
    attention: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.ndim != 4:
            raise ValueError(
                f"keys {self.keys.shape} and values {self.values.shape} must share one "
                "[layers, kv_heads, tokens, head_dim] shape"
            )
        if self.token_ids.shape != (self.num_tokens,):
            raise ValueError(f"token_ids {self.token_ids.shape} != ({self.num_tokens},)")
        if self.attention is not None and self.attention.shape != (
            self.num_layers,
            self.num_tokens,
        ):
            raise ValueError(
                f"attention {self.attention.shape} != ({self.num_layers}, {self.num_tokens})"
            )

    @property
    def num_layers(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys.shape[1])

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.keys.shape[3])

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)
