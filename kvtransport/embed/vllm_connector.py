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
true, "kvt_request": TAG}`` (optionally ``"kvt_push_to"``, ``"kvt_deadline_ms"``,
``"kvt_ttft_ms"``, ``"kvt_precision"``: the extra config's, for this request) and
``max_tokens`` 1; its output's ``kv_transfer_params`` (``{"do_remote_prefill": true,
"kvt_request": TAG}``) go with the same prompt to the decode engine. TAG names the request
on both engines (vLLM's request ids differ).

- Producer: when the request finishes, the scheduler side plans the push with the
  handoff planner (kvtransport.model.plan, through
  :func:`~kvtransport.embed.vllm_blocks.plan_push`): a precision per block (int8/int4
  with their scales, fp16 where it pays; ``precision`` in the extra config, default
  "auto") from the link estimate (``rate_mbps``, ``loss``, ``rtt_ms``), the decode
  engine's prefill speed (``decode_tokens_per_s`` / ``decode_call_ms``, else the
  producer's own steps, measured: same model, same kind of host) and the request's TTFT
  budget (``kvt_ttft_ms`` in its params, ``ttft_budget_ms``, else the decode engine's own
  prefill of the prompt). A push planned to take longer than ``recompute_threshold``
  (default 1) times the decode engine's own prefill is declined, like NixlConnector's
  ``kv_recompute_threshold``: nothing is pushed, the blocks are freed, and the decode
  engine gets ``do_remote_prefill`` false (with ``kvt_declined``, the reason) and
  recomputes at once (counted as ``tokens_declined``). Otherwise it keeps the blocks
  (``request_finished`` returns True) and passes them to the worker, which copies the
  prompt's KV out of the paged cache in the next step (the copy must be taken before the
  blocks are reused) and releases the blocks; encoding and sending run in a pool thread:
  the planned stream in prefix order (token ranges front first, every layer of a range
  together) with the deadline (kvtransport.embed.vllm_blocks). ``precision`` "lossless"
  (or "fp32") pushes every block in the engine's dtype, unplanned and never declined, as
  the connector did before the planner. Every push carries a
  compatibility header (:class:`~kvtransport.embed.vllm_blocks.Compat`: model id,
  layers, KV heads, head_dim, dtype, block size, a digest of the model's config) and the
  prompt's token ids. A push that ends without reaching the decode engine (no feedback:
  a wrong port, a black hole, another key) is logged with the sender's one-line reason.
- Consumer: ``get_num_new_matched_tokens`` claims the whole prompt as an asynchronous
  load; the worker waits (without blocking the engine) for the transfer tagged TAG on
  its UDP port, at most ``wait_ms`` from the load's start; at ``wait_ms`` a transfer
  still arriving is cut and what arrived is used. A planned push hands the decode engine
  ``kvt_planned_ms`` and ``kvt_recompute_ms`` (its own prefill of the prompt, as the
  producer estimates it): then the worker races the push
  (:func:`~kvtransport.embed.vllm_blocks.race_cut` on what has arrived so far,
  :meth:`~kvtransport.embed.vllm_blocks.Inbox.progress`) and cuts it as soon as
  computing the rest is sooner than waiting for it. It writes the longest prefix of token
  ranges complete in every layer into the request's blocks (dequantized into the
  engine's dtype) and reports every block after
  it through ``get_block_ids_with_load_errors``; with ``kv_load_failure_policy``
  "recompute", vLLM recomputes from the first failed block ("fail", vLLM's default,
  fails the request: a warning says so at start-up). A transfer whose header is not this
  engine's, or that is not the cache of the request's prompt, writes nothing: every
  block is a load error. Writes happen only in the step that reports the load finished,
  while vLLM holds the request's blocks; a request aborted while it waits has its load
  dropped before any later write. Results nobody claims expire after ``result_lease_s``
  (default 30) or beyond ``max_held_mb`` (default 512) of held payload, oldest first.
- Logs go to vLLM's logger tree (``vllm.kvtransport``; kvtransport's own warnings too);
  stats go through ``KVConnectorStats`` to vLLM's log and through
  :meth:`KVTransportConnector.build_prom_metrics` to its Prometheus endpoint
  (``vllm:kvt_*``: tokens loaded / recomputed / refused, bytes, transfer and wait time).
  ``load_log`` (a file path) appends one JSON line per finished load (request, tag,
  tokens, loaded, failed_blocks, waited_ms, why, and the transfer's ``LINK_STATS``:
  datagrams received and lost, loss rate, repair received, symbols recovered); a
  producer's ``push_log`` one per finished push (tag, finish_reason, decoded_through of
  n_source, source and repair datagrams sent, max_lag_ms, error).

Supported: one KV cache group of full attention, vLLM's CPU backend with float32 or
float16 caches (its "vec" kernels' block layout, see :func:`paged_views`), tensor
parallel size 1. ``model_id`` in the extra config names the model in the header when
the two engines load it from different paths (default: vLLM's served model name).
"""

from __future__ import annotations

import json
import logging
import re
import threading
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
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger

from kvtransport.embed import vllm_blocks as vb

LOGGER_NAME = "vllm.kvtransport"
"""The connector's logger: inside vLLM's tree, so its lines reach vLLM's log."""
logger = init_logger(LOGGER_NAME)

DEFAULT_LISTEN = "0.0.0.0:9500"
DEFAULT_DEADLINE_MS = 300.0
LOSSLESS = ("lossless", "fp32")
"""``precision`` values that push every block lossless in the engine's dtype, unplanned
(the connector before the handoff planner; "fp32" is its name on a float32 engine)."""
CUT_GRACE_S = 1.0
"""After ``wait_ms``, how long a load waits at most for the inbox's loop to cut its
transfer (it answers within one loop iteration; this only bounds a stuck loop)."""
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
    planned_s: float | None = None  # the push's planned time (its producer's kvt_planned_ms)
    recompute_s: float | None = None  # this engine's own prefill of the prompt, estimated


@dataclass
class _Pending:
    load: _Load
    started: float
    cut_at: float | None = None  # when the inbox was asked to cut the transfer
    t_claimed: float = 0.0  # wall clock when the worker took the load (for load_log)
    race_cut: bool = False  # the race cut it before wait_ms


@dataclass
class _Send:
    req_id: str
    tag: str
    block_ids: list[int]
    token_ids: list[int]
    to: str
    deadline_ms: float
    plan: Any = None  # the push's HandoffPlan (None: every block lossless)
    planned: dict[str, Any] = field(default_factory=dict)  # what push_log records of it
    t_finished: float = 0.0  # wall clock when the scheduler handed the push over


@dataclass
class KVTransportMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one step: loads to drop (aborted requests: handled first),
    loads to start and sends to make."""

    loads: list[_Load] = field(default_factory=list)
    sends: list[_Send] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)


COUNTERS = {
    "tokens_loaded": "Prompt tokens whose KV was loaded from a push",
    "tokens_recomputed": "Prompt tokens claimed for a load that vLLM recomputes",
    "tokens_refused": "Prompt tokens of pushes refused whole (incompatible or another prompt)",
    "loads_refused": "Loads whose push was refused whole",
    "loads": "Loads finished (loaded, cut or refused)",
    "bytes_received": "Payload bytes of the pushes a load used or refused",
    "pushes": "Pushes started by the prefill engine",
    "pushes_declined": "Pushes declined because their planned time could not pay off",
    "tokens_declined": "Prompt tokens of declined pushes (the decode engine recomputes them)",
    "push_failures": "Pushes that ended without delivering everything",
    "bytes_pushed": "Payload bytes encoded for pushes",
    "results_expired": "Received pushes dropped unclaimed (lease or memory bound)",
}
"""Stats counters (``KVConnectorStats`` keys) exported as ``vllm:kvt_<name>`` counters."""
HISTOGRAMS = {
    "push_s": ("Seconds from a push's start to its end", "push_times"),
    "load_wait_s": ("Seconds a load waited for its push", "load_waits"),
}
"""Per-event times (lists in the stats) exported as ``vllm:kvt_<name>`` histograms."""


@dataclass
class KVTransportStats(KVConnectorStats):
    """Counters of one interval (:data:`COUNTERS`) and the times of its pushes and
    loads (:data:`HISTOGRAMS`' lists)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVTransportStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, [] if isinstance(v, list) else 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = {k: v for k, v in self.data.items() if not isinstance(v, list)}
        for name, (_, key) in HISTOGRAMS.items():
            times = self.data.get(key) or []
            if times:
                d[f"mean_{name[:-2]}_ms"] = round(1e3 * sum(times) / len(times), 3)
        return d

    def is_empty(self) -> bool:
        return not self.data


class KVTransportPromMetrics(KVConnectorPromMetrics):
    """The connector's stats as Prometheus counters and histograms (``vllm:kvt_*``)."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            k: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvt_{k}", documentation=doc, labelnames=labelnames
                ),  # fmt: skip
                per_engine_labelvalues,
            )
            for k, doc in COUNTERS.items()
        }
        buckets = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
        self.histograms = {
            key: create_metric_per_engine(
                self._histogram_cls(
                    name=f"vllm:kvt_{name}",
                    documentation=doc,
                    buckets=buckets,
                    labelnames=labelnames,
                ),  # fmt: skip
                per_engine_labelvalues,
            )
            for name, (doc, key) in HISTOGRAMS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, per_engine in self.counters.items():
            v = transfer_stats_data.get(k)
            if v:
                per_engine[engine_idx].inc(v)
        for key, per_engine in self.histograms.items():
            for t in transfer_stats_data.get(key) or []:
                per_engine[engine_idx].observe(t)


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


def _route_library_logs() -> None:
    """kvtransport's own warnings (e.g. datagrams failing authentication on the decode
    engine's port) to vLLM's handlers, when the application has not configured them."""
    lib, parent = logging.getLogger("kvtransport"), logging.getLogger("vllm")
    if lib.handlers or not parent.handlers:
        return
    for h in parent.handlers:
        lib.addHandler(h)
    if lib.level == logging.NOTSET:
        lib.setLevel(logging.WARNING)
    lib.propagate = False


def model_id_of(vllm_config: Any, extra: dict[str, Any]) -> str:
    """The model's name in the compatibility header: ``model_id`` in the extra config,
    else vLLM's (first) served model name."""
    if extra.get("model_id"):
        return str(extra["model_id"])
    mc = vllm_config.model_config
    name = getattr(mc, "served_model_name", None) or mc.model
    return str(name[0] if isinstance(name, list | tuple) else name)


def config_hash_of(vllm_config: Any) -> str:
    hf = vllm_config.model_config.hf_config
    return vb.config_digest(hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf)))


@dataclass(frozen=True)
class PushConfig:
    """How the producer plans its pushes, from ``kv_connector_extra_config``.

    levels: the precisions a push may use, best first (``precision``: "auto" = fp16, int8,
    int4, or names such as "int8" or "fp16,int8"; None for "lossless"/"fp32": every block
    in the engine's dtype, unplanned). link: the link estimate (``rate_mbps``, ``loss``,
    ``rtt_ms``). decode_speed: the decode engine's prefill speed (``decode_tokens_per_s``,
    ``decode_call_ms``; None: the producer's own, measured). ttft_budget_ms: the budget a
    push is planned for (``ttft_budget_ms``, or per request ``kvt_ttft_ms``; None: the
    decode engine's own prefill of the prompt). threshold: a push whose planned time
    exceeds this many times the decode engine's own prefill is declined
    (``recompute_threshold``, default 1; 0: never). objective: the planner's
    (``ttft``, default, or ``fidelity``).
    """

    levels: tuple[str, ...] | None
    link: Any
    decode_speed: Any
    ttft_budget_ms: float | None
    threshold: float
    objective: str

    @classmethod
    def of(cls, extra: dict[str, Any], deadline_ms: float) -> PushConfig:
        """UserError (one line) for a bad precision, loss, speed, threshold or objective."""
        from kvtransport.errors import UserError

        try:
            return cls._of(extra, deadline_ms)
        except (TypeError, ValueError) as exc:  # a value that is not a number
            raise UserError(f"kv_connector_extra_config: {exc}") from None

    @classmethod
    def _of(cls, extra: dict[str, Any], deadline_ms: float) -> PushConfig:
        from kvtransport.embed.inprocess import handoff_plan
        from kvtransport.errors import UserError
        from kvtransport.model.cache_builder import ComputeSpeed
        from kvtransport.model.plan import OBJECTIVES

        spec = str(extra.get("precision", "auto")).strip()
        planned = handoff_plan(
            deadline_ms, "auto" if spec in LOSSLESS else spec,
            float(extra.get("rate_mbps", 100.0)), loss_estimate=float(extra.get("loss", 0.0)),
            initial_rtt_ms=float(extra.get("rtt_ms", 1.0)),
        )  # fmt: skip
        assert planned is not None  # a deadline and levels: always a plan
        link, _, levels, _, _ = planned
        tps = extra.get("decode_tokens_per_s")
        speed = None
        if tps is not None:
            if not float(tps) > 0:
                raise UserError(f"decode_tokens_per_s must be positive, not {tps}")
            speed = ComputeSpeed(float(extra.get("decode_call_ms", 0.0)) * 1e-3, 1.0 / float(tps))
        threshold = float(extra.get("recompute_threshold", 1.0))
        if threshold < 0:
            raise UserError(f"recompute_threshold must be >= 0, not {threshold}")
        objective = str(extra.get("objective", "ttft"))
        if objective not in OBJECTIVES:
            raise UserError(f"objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
        budget = extra.get("ttft_budget_ms")
        return cls(None if spec in LOSSLESS else levels, link, speed,
                   None if budget is None else float(budget), threshold, objective)  # fmt: skip


def _positive(value: Any, name: str) -> float | None:
    """A request's positive number (None when absent; a bad one is logged and ignored:
    a request must not fail the engine)."""
    if value is None:
        return None
    try:
        got = float(value)
    except (TypeError, ValueError):
        got = float("nan")
    if got > 0:
        return got
    logger.warning("kvtransport: %s %r is not a positive number; ignored", name, value)
    return None


def _ms_to_s(value: Any) -> float | None:
    """A handed-over time in ms as seconds (None: absent or not a positive number)."""
    try:
        got = float(value)
    except (TypeError, ValueError):
        return None
    return got * 1e-3 if got > 0 else None


def _levels(spec: Any) -> tuple[str, ...] | None:
    """A request's ``kvt_precision`` (as the extra config's ``precision``): None for
    lossless; a bad one is logged and the push goes lossless (a request must not fail
    the engine)."""
    from kvtransport.model.plan import parse_levels

    text = str(spec).strip()
    if text in LOSSLESS:
        return None
    try:
        return parse_levels(text)
    except ValueError as exc:
        logger.warning("kvtransport: kvt_precision: %s; pushing lossless", exc)
        return None


def _cache_shape(vllm_config: Any) -> tuple[int, int, int, str] | None:
    """(layers, KV heads, head_dim, dtype name) of the engine's paged cache as its config
    states it (None when it cannot tell), for the scheduler to plan pushes before the
    worker has the cache."""
    try:
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        dtype = vllm_config.cache_config.cache_dtype
        if dtype in (None, "auto"):
            dtype = str(mc.dtype).removeprefix("torch.")
        return (int(mc.get_num_layers(pc)), int(mc.get_num_kv_heads(pc)), int(mc.get_head_size()),
                str(dtype))  # fmt: skip
    except (AttributeError, TypeError, ValueError):
        return None


class KVTransportConnector(KVConnectorBase_V1):
    """vLLM KV connector over kvtransport (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        tc = self._kv_transfer_config
        extra = dict(tc.kv_connector_extra_config or {})
        self.block_size = int(vllm_config.cache_config.block_size)
        self.model_id = model_id_of(vllm_config, extra)
        self.config_hash = config_hash_of(vllm_config)
        self.head_dim = int(vllm_config.model_config.get_head_size())
        self.is_producer = bool(tc.is_kv_producer)
        self.is_consumer = bool(tc.is_kv_consumer)
        self.deadline_ms = float(extra.get("deadline_ms", DEFAULT_DEADLINE_MS))
        self.wait_s = float(extra.get("wait_ms", self.deadline_ms + 1000.0)) * 1e-3
        self.push_to = extra.get("push_to")
        self.load_log = extra.get("load_log")  # a file: one JSON line per finished load
        self.push_log = extra.get("push_log")  # a file: one JSON line per push
        self.block_tokens = int(extra.get("block_tokens", self.block_size))
        if self.block_tokens < 1 or self.block_size % self.block_tokens:
            raise ValueError(f"block_tokens {self.block_tokens} must divide the block size "
                             f"{self.block_size}")  # fmt: skip
        key = extra.get("key")
        insecure = bool(extra.get("insecure", False))
        self.push_config = PushConfig.of(extra, self.deadline_ms)
        self.geometry = _cache_shape(vllm_config)
        self.step_speed = vb.StepSpeed()  # the producer's own prefill, measured
        self._planned: dict[str, dict[str, Any]] = {}  # worker: tag -> its plan, for push_log
        _route_library_logs()
        # scheduler side
        self._loads: list[_Load] = []
        self._sends: list[_Send] = []
        self._cancels: list[str] = []
        self._claimed: set[str] = set()
        self._loading: set[str] = set()  # claimed, and the worker has not reported done
        # worker side
        self._keys: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self.compat: vb.Compat | None = None
        self._pending: dict[str, _Pending] = {}
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._stats: dict[str, Any] = {}
        self._stats_lock = threading.Lock()  # the push threads count too
        self._expired_seen = 0
        self.inbox: vb.Inbox | None = None
        self.pusher: vb.Pusher | None = None
        if role == KVConnectorRole.SCHEDULER and self.is_consumer:
            if tc.kv_load_failure_policy == "fail":
                logger.warning("kvtransport: kv_load_failure_policy is 'fail': a push that is "
                               "lost, cut or refused fails its request; set "
                               "\"kv_load_failure_policy\": \"recompute\" to recompute "
                               "what did not load")  # fmt: skip
        if role == KVConnectorRole.WORKER:
            if self.is_consumer:
                listen = str(extra.get("listen", DEFAULT_LISTEN))
                lease_s = float(extra.get("result_lease_s", 30.0))
                held_mb = float(extra.get("max_held_mb", 512.0))
                self.inbox = vb.Inbox(listen=listen, key=key, insecure=insecure,
                                      lease_s=lease_s, max_held_mb=held_mb)  # fmt: skip
                logger.info("kvtransport: receiving KV on %s (wait_ms %.0f)",
                            self.inbox.address, self.wait_s * 1e3)  # fmt: skip
            if self.is_producer:
                rate = float(extra.get("rate_mbps", 100.0))
                # pushes in flight at once, each paced at rate_mbps: together they offer
                # parallel x rate_mbps to the link (more than it carries only adds loss)
                parallel = int(extra.get("push_parallel", 1))
                if parallel < 1:
                    raise ValueError(f"push_parallel must be at least 1, not {parallel}")
                self.pusher = vb.Pusher(max_parallel=parallel, rate_mbps=rate,
                                        on_done=self._push_done, key=key,
                                        insecure=insecure)  # fmt: skip
                logger.info("kvtransport: pushing KV to %s at %.0f Mbit/s",
                            self.push_to or "each request's kvt_push_to", rate)  # fmt: skip

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
        self._loading.add(request.request_id)
        params = request.kv_transfer_params
        self._loads.append(_Load(
            request.request_id, str(params["kvt_request"]),
            list(blocks.get_block_ids()[0]), stop - num_external_tokens, stop,
            list(request.prompt_token_ids),
            _ms_to_s(params.get("kvt_planned_ms")), _ms_to_s(params.get("kvt_recompute_ms")),
        ))  # fmt: skip

    def build_connector_meta(self, scheduler_output: Any) -> KVTransportMetadata:
        if self.is_producer:
            tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
            self.step_speed.scheduled(time.perf_counter(), tokens)
        meta = KVTransportMetadata(loads=self._loads, sends=self._sends, cancels=self._cancels)
        self._loads, self._sends, self._cancels = [], [], []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Loads the worker reported finished no longer need cancelling."""
        self._loading -= set(getattr(connector_output, "finished_recving", None) or ())

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        """Producer: keep the blocks of a ``do_remote_decode`` request until the worker
        has copied them out; hand the decode engine its ``kvt_transfer_params``.
        Consumer: a request that ends while its load is pending (aborted) has the load
        dropped in the worker before anything more is written (its blocks go back to
        vLLM now)."""
        self._claimed.discard(request.request_id)
        if request.request_id in self._loading:
            self._loading.discard(request.request_id)
            self._cancels.append(request.request_id)
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
        decision = self._plan_push(n, params)
        if decision is not None and decision.declined:
            self._count("pushes_declined")
            self._count("tokens_declined", n)
            logger.info("kvtransport: request %s (%s) not pushed, the decode engine "
                        "recomputes it: %s", request.request_id, tag, decision.why)  # fmt: skip
            return False, {"do_remote_prefill": False, "kvt_request": tag,
                           "kvt_declined": decision.why}  # fmt: skip
        send = _Send(request.request_id, tag, list(ids), list(request.prompt_token_ids),
                     str(to), deadline, t_finished=time.time())  # fmt: skip
        handed: dict[str, Any] = {"do_remote_prefill": True, "kvt_request": tag}
        if decision is not None:
            send.plan = decision.plan
            send.planned = {"planned_ms": round(decision.plan.link_s * 1e3, 3),
                            "planned_bytes": decision.plan.payload_bytes,
                            "plan": decision.describe()}  # fmt: skip
            handed["kvt_planned_ms"] = send.planned["planned_ms"]  # the consumer's race
            if decision.recompute_s is not None:
                handed["kvt_recompute_ms"] = round(decision.recompute_s * 1e3, 3)
        self._sends.append(send)
        return True, handed

    def _plan_push(self, n: int, params: dict[str, Any]) -> vb.PushPlan | None:
        """The plan of a push of ``n`` prompt tokens (None: lossless, unplanned)."""
        pc = self.push_config
        levels = pc.levels if "kvt_precision" not in params else _levels(params["kvt_precision"])
        if levels is None or self.geometry is None:
            return None
        layers, heads, dim, dtype = self.geometry
        try:
            g = vb.geometry_for(layers, heads, dim, dtype, n, self.block_tokens)
        except (TypeError, ValueError) as exc:  # e.g. bfloat16: the worker refuses it too
            logger.warning("kvtransport: cannot plan a push of this cache (%s)", exc)
            return None
        speed = pc.decode_speed or self.step_speed.speed()
        budget_ms = _positive(params.get("kvt_ttft_ms"), "kvt_ttft_ms") or pc.ttft_budget_ms
        if budget_ms is not None:
            budget_s = budget_ms * 1e-3
        elif speed is not None:  # a push must beat the decode engine's own prefill
            budget_s = float(speed.seconds(n))
        else:
            budget_s = self.deadline_ms * 1e-3
        return vb.plan_push(g, link=pc.link, budget_s=max(budget_s, 1e-3), levels=levels,
                            speed=speed, threshold=pc.threshold,
                            objective=pc.objective)  # fmt: skip

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._keys, self._values = paged_views(kv_caches, self.head_dim)
        k = self._keys[0]
        self.compat = vb.Compat(self.model_id, len(self._keys), int(k.shape[1]),
                                int(k.shape[3]), np.dtype(k.dtype).name, self.block_size,
                                self.config_hash)  # fmt: skip

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Take this step's work: drop aborted loads; copy out finished prefills (their
        encoding and sending run in the pusher's threads); poll the loads."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTransportMetadata)
        for req_id in meta.cancels:  # first: their blocks may be another request's now
            if self._pending.pop(req_id, None) is not None:
                logger.info("kvtransport: request %s aborted while loading", req_id)
        now = time.monotonic()
        for s in meta.sends:
            self._push(s)
        for load in meta.loads:
            self._pending[load.req_id] = _Pending(load, now, t_claimed=time.time())
        for req_id, p in list(self._pending.items()):
            if self._poll_load(p, now):
                del self._pending[req_id]
        if self.pusher is not None:
            self.pusher.poll()  # forget ended pushes (their ends are logged as they end)
        if self.inbox is not None and self.inbox.expired > self._expired_seen:
            self._count("results_expired", self.inbox.expired - self._expired_seen)
            self._expired_seen = self.inbox.expired

    def _poll_load(self, p: _Pending, now: float) -> bool:
        """Finish ``p`` if its push ended, or at ``wait_ms`` with what arrived (the inbox
        cuts the transfer first); True once finished."""
        assert self.inbox is not None
        tag, waited = p.load.tag, now - p.started
        result = self.inbox.take(tag)
        if result is None:
            if not self._cut_now(p, waited):
                return False
            if p.cut_at is None:
                p.cut_at = now
                self.inbox.cut(tag)
                return False
            if not self.inbox.cut_done(tag) and now - p.cut_at < CUT_GRACE_S:
                return False
            result = self.inbox.take(tag)  # what the cut delivered, if it was arriving
        self._finish_load(p.load, result, waited, p.t_claimed, p.race_cut)
        return True

    def _cut_now(self, p: _Pending, waited: float) -> bool:
        """Whether to stop waiting for ``p``'s push: at ``wait_ms``, or sooner where the
        race (:func:`~kvtransport.embed.vllm_blocks.race_cut`, from the producer's plan
        and this engine's own prefill as the producer estimated it) says computing what
        has not arrived is sooner than waiting for it."""
        if p.cut_at is not None or waited >= self.wait_s:
            return True
        load = p.load
        if load.planned_s is None or load.recompute_s is None:
            return False
        assert self.inbox is not None
        got = self.inbox.progress(load.tag)  # None: not begun (or just ended)
        arrived, arriving, received = (
            (min(got[0], load.stop), got[2], got[3]) if got is not None else (0, 0.0, 0.0)
        )
        cut = vb.race_cut(waited_s=waited, arrived=max(arrived - load.start, 0),
                          total=load.stop - load.start, recompute_s=load.recompute_s,
                          planned_s=load.planned_s, wait_s=self.wait_s,
                          arriving_s=arriving, received=received)  # fmt: skip
        if cut:
            p.race_cut = True
            logger.info("kvtransport: request %s (%s): computing the rest is sooner than "
                        "waiting for it (%d of %d tokens in after %.0f ms)", load.req_id,
                        load.tag, arrived, load.stop, waited * 1e3)  # fmt: skip
        return cut

    def _push(self, s: _Send) -> None:
        """Copy the request's KV out now (vLLM frees its blocks after this step); encode
        and send it in the pusher's threads."""
        assert self.pusher is not None and self.compat is not None
        times = {"t_finished": s.t_finished, "t_copy_start": time.time()}
        cache = vb.gather(self._keys, self._values, s.block_ids, s.token_ids, self.model_id)
        times["t_copy_end"] = time.time()
        compat, block_tokens = self.compat, self.block_tokens

        def encode() -> Any:
            times["t_encode_start"] = time.time()
            stream = vb.encode_request(cache, s.tag, block_tokens, compat, s.plan)
            times["t_encode_end"] = time.time()
            return stream

        if self.push_log:  # the plan and the push's timeline (wall clock), for push_log
            self._planned[s.tag] = {**s.planned, "times": times}
        self.pusher.push(encode, s.tag, s.to, s.deadline_ms)
        self._done_sending.add(s.req_id)  # copied out: vLLM may free the blocks
        self._count("pushes")
        self._count("tokens_pushed", len(s.token_ids))

    def _push_done(self, tag: str, status: dict[str, Any]) -> None:
        """A push ended (in its sending thread): count it, log a failure, and append it to
        ``push_log``."""
        self._count("bytes_pushed", status.get("bytes_encoded", 0))
        if "elapsed_s" in status:
            self._count("push_times", [float(status["elapsed_s"])])
        failed = "error" in status or status.get("delivered", "complete") != "complete"
        if failed:
            self._count("push_failures")
            why = status.get("error") or status.get("note") or status.get("finish_reason")
            logger.warning("kvtransport: push %s to %s ended %s: %s", tag, status.get("to", "?"),
                           status.get("delivered", "with an error"), why)  # fmt: skip
        if self.push_log:
            self._planned.get(tag, {}).get("times", {})["t_end"] = time.time()
            keep = ("transfer_id", "finish_reason", "delivered", "note", "decoded_through",
                    "n_source", "source_sent", "repair_sent", "datagrams_sent", "max_lag_ms",
                    "bytes_encoded", "error")  # fmt: skip
            record = {"tag": tag, **{k: status[k] for k in keep if k in status},
                      **self._planned.pop(tag, {})}  # fmt: skip
            with open(self.push_log, "a") as fh:
                fh.write(json.dumps(record) + "\n")

    def _finish_load(self, load: _Load, result: Any, waited_s: float,
                     t_claimed: float = 0.0, race_cut: bool = False) -> None:  # fmt: skip
        """Write what of ``result`` loads into the request's blocks and report the rest as
        load errors. Never raises: anything unexpected fails every block, unwritten."""
        times: dict[str, Any] = {"t_claimed": t_claimed, "t_taken": time.time(),
                                 "race_cut": race_cut}  # fmt: skip
        try:
            plan = vb.load_plan(result, block_ids=load.block_ids, block_size=self.block_size,
                                start=load.start, stop=load.stop, token_ids=load.token_ids,
                                expect=self.compat)  # fmt: skip
            if plan.cache is not None and plan.prefix > load.start:
                vb.scatter(plan.cache, self._keys, self._values, load.block_ids, load.start,
                           plan.prefix)  # fmt: skip
        except Exception as exc:  # a bug or a hostile push must not kill the engine
            logger.exception("kvtransport: request %s: load failed", load.req_id)
            last = -(-load.stop // self.block_size)
            ids = [int(b) for b in load.block_ids[load.start // self.block_size : last]]
            plan = vb.LoadPlan(load.start, ids, None, f"load failed: {exc}", refused=True)
        times["t_loaded"] = time.time()
        self._load_errors.update(plan.failed_block_ids)
        self._done_recving.add(load.req_id)
        loaded = max(plan.prefix - load.start, 0)
        self._count("loads")
        self._count("load_waits", [waited_s])
        self._count("tokens_loaded", loaded)
        self._count("tokens_recomputed", load.stop - load.start - loaded)
        if result is not None:
            self._count("bytes_received", int(result.payload.nbytes))
        if plan.refused:
            self._count("loads_refused")
            self._count("tokens_refused", load.stop - load.start)
            logger.warning("kvtransport: request %s (%s): push refused, nothing loaded: %s",
                           load.req_id, load.tag, plan.why)  # fmt: skip
        elif not plan.complete:
            logger.info("kvtransport: request %s loads %d of %d tokens (%s); recomputing "
                        "%d blocks", load.req_id, plan.prefix, load.stop, plan.why,
                        len(plan.failed_block_ids))  # fmt: skip
        if self.load_log:
            self._log_load(load, plan, result, waited_s, times)

    def _log_load(self, load: _Load, plan: vb.LoadPlan, result: Any, waited_s: float,
                  times: dict[str, Any]) -> None:  # fmt: skip
        record = {"request": load.req_id, "tag": load.tag, "tokens": load.stop,
                  "loaded": plan.prefix, "failed_blocks": len(plan.failed_block_ids),
                  "refused": plan.refused, "waited_ms": round(waited_s * 1e3, 3),
                  "why": plan.why, "times": times}  # fmt: skip
        if result is not None:  # what the link did to this transfer (receiver's view)
            record["reason"] = result.reason
            record.update({k: result.stats[k] for k in LINK_STATS if k in result.stats})
        assert self.load_log is not None
        with open(self.load_log, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def _count(self, name: str, value: Any = 1) -> None:
        with self._stats_lock:
            zero: Any = [] if isinstance(value, list) else 0
            self._stats[name] = self._stats.get(name, zero) + value

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
        """This side's stats of the interval. The scheduler calls its connector's once per
        step, when the step's output is back: the producer's step clock ends the step
        there (:class:`~kvtransport.embed.vllm_blocks.StepSpeed`)."""
        if self.is_producer and self._role == KVConnectorRole.SCHEDULER:
            self.step_speed.finished(time.perf_counter())
        with self._stats_lock:
            if not self._stats:
                return None
            stats, self._stats = KVTransportStats(data=self._stats), {}
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTransportStats:
        return KVTransportStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVTransportPromMetrics:
        return KVTransportPromMetrics(vllm_config, metric_types, labelnames,
                                      per_engine_labelvalues)  # fmt: skip

    def shutdown(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
        if self.inbox is not None:
            self.inbox.close()
