"""kvtransport as a vLLM KV connector (push mode, prefill engine -> decode engine).

Loaded out of tree; nothing here is imported unless vLLM loads it::

    --kv-transfer-config '{"kv_connector": "KVTransportConnector",
      "kv_connector_module_path": "kvtransport.embed.vllm_connector",
      "kv_role": "kv_producer",                      # the prefill engine
      "kv_connector_extra_config": {"push_to": "DECODE_HOST:9500", "deadline_ms": 300}}'
    --kv-transfer-config '{"kv_connector": "KVTransportConnector",
      "kv_connector_module_path": "kvtransport.embed.vllm_connector",
      "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"listen": "0.0.0.0:9500", "wait_ms": 2000}}'

A request goes to the prefill engine with ``kv_transfer_params`` ``{"do_remote_decode":
true, "kvt_request": TAG}`` (optionally ``"kvt_push_to"``, ``"kvt_deadline_ms"``) and
``max_tokens`` 1; its output's ``kv_transfer_params`` (``{"do_remote_prefill": true,
"kvt_request": TAG}``) go with the same prompt to the decode engine. TAG names the request
on both engines (vLLM's request ids differ).

- Producer: when the request finishes, the scheduler side keeps its blocks
  (``request_finished`` returns True) and passes them to the worker, which copies the
  prompt's KV out of the paged cache in the next step, releases the blocks and sends the
  copy in the background: a lossless stream in prefix order (token ranges front first,
  every layer of a range together) with the deadline (kvtransport.embed.vllm_blocks).
- Consumer: ``get_num_new_matched_tokens`` claims the whole prompt as an asynchronous
  load; the worker waits (without blocking the engine) for the transfer tagged TAG on
  its UDP port, at most ``wait_ms`` from the load's start; then it writes the longest
  prefix of token ranges complete in every layer into the request's blocks and reports
  every block after it through ``get_block_ids_with_load_errors``. With
  ``kv_load_failure_policy`` "recompute", vLLM recomputes from the first failed block.
  ``load_log`` (a file path) appends one JSON line per finished load (request, tag,
  tokens, loaded, failed_blocks, waited_ms, why, and the transfer's ``LINK_STATS``:
  datagrams received and lost, loss rate, repair received, symbols recovered); a
  producer's ``push_log`` one per finished push (tag, finish_reason, decoded_through of
  n_source, source and repair datagrams sent, max_lag_ms, error).

Supported: one KV cache group of full attention, vLLM's CPU backend with float32 or
float16 caches (its "vec" kernels' block layout, see :func:`paged_views`), tensor
parallel size 1.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger

from kvtransport.embed import vllm_blocks as vb

logger = init_logger(__name__)

DEFAULT_LISTEN = "0.0.0.0:9500"
DEFAULT_DEADLINE_MS = 300.0
LINK_STATS = ("datagrams", "datagrams_lost", "loss_rate", "repair_received", "symbols_recovered",
              "elapsed_s")  # fmt: skip
"""A received transfer's receiver statistics that ``load_log`` records."""


@dataclass
class _Load:
    req_id: str
    tag: str
    block_ids: list[int]
    start: int
    stop: int
    token_ids: list[int]


@dataclass
class _Send:
    req_id: str
    tag: str
    block_ids: list[int]
    token_ids: list[int]
    to: str
    deadline_ms: float


@dataclass
class KVTransportMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one step: loads to start and sends to make."""

    loads: list[_Load] = field(default_factory=list)
    sends: list[_Send] = field(default_factory=list)


@dataclass
class KVTransportStats(KVConnectorStats):
    """Counters of one interval: sends, loads, tokens loaded and recomputed, load waits."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVTransportStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = dict(self.data)
        if d.get("loads"):
            d["mean_load_wait_ms"] = round(1e3 * d.get("load_wait_s", 0.0) / d["loads"], 3)
        return d

    def is_empty(self) -> bool:
        return not self.data


def _layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    if not found:
        raise ValueError(f"cannot tell the layer index of KV cache {name!r}")
    return int(found[0])


def cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The kernel family vLLM's CPU attention picks (it decides the block layout)."""
    from vllm.v1.attention.backends import cpu_attn

    return str(cpu_attn._get_attn_isa(dtype, block_size, head_dim))


def paged_views(kv_caches: dict[str, torch.Tensor], head_dim: int) -> tuple[list, list]:
    """Per layer (in layer order), numpy K and V views ``[blocks, heads, block_size, dim]``
    of vLLM's paged KV tensors (shared memory: writes land in vLLM's cache).

    vLLM's CPU backend allocates ``[blocks, heads, block_size, 2 * dim]`` per layer; inside
    a (block, head) its "vec"/"vec16" kernels keep K dim-major (``[dim, block_size]``, for
    the QK product) and then V token-major (``[block_size, dim]``). Other layouts (the AMX
    kernels' bfloat16 tiles, GPU backends) are refused.
    """
    keys, values = [], []
    for name in sorted(kv_caches, key=_layer_index):
        t = kv_caches[name]
        if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"KV cache {name}: {t.dtype} on {t.device}; the connector "
                             "takes float32 or float16 caches on the CPU")  # fmt: skip
        if t.dim() != 4 or t.shape[-1] != 2 * head_dim:
            raise ValueError(f"KV cache {name}: layout {tuple(t.shape)} is not vLLM's CPU one")
        nb, heads, bs, _ = t.shape
        isa = cpu_isa(t.dtype, bs, head_dim)
        if isa not in ("vec", "vec16"):
            raise ValueError(f"KV cache {name}: the CPU attention kernels {isa!r} keep a "
                             "block layout the connector does not read")  # fmt: skip
        kv = t.view(nb, heads, 2, bs * head_dim)
        k = kv[:, :, 0].unflatten(-1, (head_dim, bs)).transpose(2, 3)
        v = kv[:, :, 1].unflatten(-1, (bs, head_dim))
        keys.append(k.numpy())
        values.append(v.numpy())
    return keys, values


class KVTransportConnector(KVConnectorBase_V1):
    """vLLM KV connector over kvtransport (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        tc = self._kv_transfer_config
        extra = dict(tc.kv_connector_extra_config or {})
        self.block_size = int(vllm_config.cache_config.block_size)
        self.model_id = str(vllm_config.model_config.model)
        self.head_dim = int(vllm_config.model_config.get_head_size())
        self.is_producer = bool(tc.is_kv_producer)
        self.is_consumer = bool(tc.is_kv_consumer)
        self.deadline_ms = float(extra.get("deadline_ms", DEFAULT_DEADLINE_MS))
        self.wait_s = float(extra.get("wait_ms", self.deadline_ms + 1000.0)) * 1e-3
        self.push_to = extra.get("push_to")
        self.load_log = extra.get("load_log")  # a file: one JSON line per finished load
        self.block_tokens = int(extra.get("block_tokens", self.block_size))
        if self.block_tokens < 1 or self.block_size % self.block_tokens:
            raise ValueError(f"block_tokens {self.block_tokens} must divide the block size "
                             f"{self.block_size}")  # fmt: skip
        key = extra.get("key")
        insecure = bool(extra.get("insecure", False))
        # scheduler side
        self._loads: list[_Load] = []
        self._sends: list[_Send] = []
        self._claimed: set[str] = set()
        # worker side
        self._keys: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self._pending: dict[str, tuple[_Load, float]] = {}
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._stats: dict[str, float] = {}
        self.inbox: vb.Inbox | None = None
        self.pusher: vb.Pusher | None = None
        if role == KVConnectorRole.WORKER:
            if self.is_consumer:
                listen = str(extra.get("listen", DEFAULT_LISTEN))
                self.inbox = vb.Inbox(listen=listen, key=key, insecure=insecure)
                logger.info("kvtransport: receiving KV on %s", self.inbox.address)
            if self.is_producer:
                rate = float(extra.get("rate_mbps", 100.0))
                # pushes in flight at once, each paced at rate_mbps: together they offer
                # parallel x rate_mbps to the link (more than it carries only adds loss)
                parallel = int(extra.get("push_parallel", 1))
                if parallel < 1:
                    raise ValueError(f"push_parallel must be at least 1, not {parallel}")
                self.push_log = extra.get("push_log")  # a file: one JSON line per push
                on_done = self._log_push if self.push_log else None
                self.pusher = vb.Pusher(max_parallel=parallel, rate_mbps=rate, on_done=on_done,
                                        key=key, insecure=insecure)  # fmt: skip

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """The prompt beyond what is computed, loaded asynchronously, for a request that
        names a pushed transfer (``do_remote_prefill`` and ``kvt_request``); else 0."""
        params = request.kv_transfer_params or {}
        if not self.is_consumer or not params.get("do_remote_prefill"):
            return 0, False
        if "kvt_request" not in params or request.request_id in self._claimed:
            return 0, False
        count = len(request.prompt_token_ids) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or request.request_id in self._claimed:
            return
        stop = len(request.prompt_token_ids)
        self._claimed.add(request.request_id)
        self._loads.append(_Load(
            request.request_id, str(request.kv_transfer_params["kvt_request"]),
            list(blocks.get_block_ids()[0]), stop - num_external_tokens, stop,
            list(request.prompt_token_ids),
        ))  # fmt: skip

    def build_connector_meta(self, scheduler_output: Any) -> KVTransportMetadata:
        meta = KVTransportMetadata(loads=self._loads, sends=self._sends)
        self._loads, self._sends = [], []
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        """Producer: keep the blocks of a ``do_remote_decode`` request until the worker
        has copied them out; hand the decode engine its ``kv_transfer_params``."""
        self._claimed.discard(request.request_id)
        params = request.kv_transfer_params or {}
        if not self.is_producer or not params.get("do_remote_decode"):
            return False, None
        tag = str(params.get("kvt_request", request.request_id))
        to = params.get("kvt_push_to", self.push_to)
        ids = block_ids[0] if block_ids and isinstance(block_ids[0], list | tuple) else block_ids
        n = len(request.prompt_token_ids)
        if not to or len(ids) * self.block_size < n:
            logger.warning("kvtransport: request %s not pushed (%s)", request.request_id,
                           "no push_to" if not to else "its prompt's blocks are gone")  # fmt: skip
            return False, None
        deadline = float(params.get("kvt_deadline_ms", self.deadline_ms))
        self._sends.append(_Send(request.request_id, tag, list(ids),
                                 list(request.prompt_token_ids), str(to), deadline))  # fmt: skip
        return True, {"do_remote_prefill": True, "kvt_request": tag}

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._keys, self._values = paged_views(kv_caches, self.head_dim)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Take this step's work: copy out and push finished prefills; poll the loads."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTransportMetadata)
        now = time.monotonic()
        for s in meta.sends:
            self._push(s)
        for load in meta.loads:
            self._pending[load.req_id] = (load, now)
        for req_id, (load, started) in list(self._pending.items()):
            assert self.inbox is not None
            result = self.inbox.take(load.tag)
            if result is None and now - started < self.wait_s:
                continue
            self._finish_load(load, result, now - started)
            del self._pending[req_id]
        if self.pusher is not None:
            for tag, status in self.pusher.poll().items():
                if "error" in status:
                    logger.warning("kvtransport: push of %s failed: %s", tag, status["error"])
                    self._count("push_errors")

    def _push(self, s: _Send) -> None:
        assert self.pusher is not None
        cache = vb.gather(self._keys, self._values, s.block_ids, s.token_ids, self.model_id)
        self.pusher.push(vb.encode_request(cache, s.tag, self.block_tokens), s.tag, s.to,
                         s.deadline_ms)  # fmt: skip
        self._done_sending.add(s.req_id)  # copied out: vLLM may free the blocks
        self._count("pushes")
        self._count("tokens_pushed", len(s.token_ids))

    def _log_push(self, tag: str, status: dict[str, Any]) -> None:
        keep = ("transfer_id", "finish_reason", "decoded_through", "n_source", "source_sent",
                "repair_sent", "datagrams_sent", "max_lag_ms", "error")  # fmt: skip
        record = {"tag": tag, **{k: status[k] for k in keep if k in status}}
        assert self.push_log is not None  # set whenever this callback is
        with open(self.push_log, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def _finish_load(self, load: _Load, result: Any, waited_s: float) -> None:
        plan = vb.load_plan(result, block_ids=load.block_ids, block_size=self.block_size,
                            start=load.start, stop=load.stop, token_ids=load.token_ids)  # fmt: skip
        if plan.cache is not None and plan.prefix > load.start:
            vb.scatter(plan.cache, self._keys, self._values, load.block_ids, load.start,
                       plan.prefix)  # fmt: skip
        self._load_errors.update(plan.failed_block_ids)
        self._done_recving.add(load.req_id)
        self._count("loads")
        self._count("load_wait_s", waited_s)
        self._count("tokens_loaded", max(plan.prefix - load.start, 0))
        self._count("tokens_failed", load.stop - max(plan.prefix, load.start))
        if self.load_log:
            record = {"request": load.req_id, "tag": load.tag, "tokens": load.stop,
                      "loaded": plan.prefix, "failed_blocks": len(plan.failed_block_ids),
                      "waited_ms": round(waited_s * 1e3, 3), "why": plan.why}  # fmt: skip
            if result is not None:  # what the link did to this transfer (receiver's view)
                record.update({k: result.stats[k] for k in LINK_STATS if k in result.stats})
            with open(self.load_log, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        if not plan.complete:
            self._count("partial_loads")
            logger.info("kvtransport: request %s loads %d of %d tokens (%s); recomputing "
                        "%d blocks", load.req_id, plan.prefix, load.stop, plan.why,
                        len(plan.failed_block_ids))  # fmt: skip

    def _count(self, name: str, value: float = 1) -> None:
        self._stats[name] = self._stats.get(name, 0) + value

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request's whole load lands before vLLM schedules it."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        """Nothing per layer: a finished request's blocks are copied out at once."""

    def wait_for_save(self) -> None:
        """Nothing to wait for: the copy-out in start_load_kv is synchronous."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._done_sending, self._done_recving
        self._done_sending, self._done_recving = set(), set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVTransportStats | None:
        if not self._stats:
            return None
        stats, self._stats = KVTransportStats(data=self._stats), {}
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTransportStats:
        return KVTransportStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
        if self.inbox is not None:
            self.inbox.close()
