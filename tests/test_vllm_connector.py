"""kvtransport.embed.vllm_connector against vLLM's own classes (skipped where vLLM is absent).

Run in the vLLM environment (scripts/setup_vllm_env.sh)::

    .venv-vllm/bin/python -m pytest tests/test_vllm_connector.py -q

vLLM's factory loads the connector from ``kv_connector_module_path`` for a real
VllmConfig; the scheduler-side instances see real ``Request`` and ``KVCacheBlocks``
objects; the worker-side instances write into torch tensors laid out as vLLM's CPU
backend lays its paged cache; KV crosses real loopback UDP.
"""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

BS, NBLOCKS = 32, 24
KEY = "00112233445566778899aabbccddeeff"


def _port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir():
    from kvtransport.model.loader import convert_gguf, default_gguf_path

    return str(convert_gguf(default_gguf_path()))


def _config(model_dir: str, role: str, extra: dict) -> VllmConfig:
    tc = KVTransferConfig(kv_connector="KVTransportConnector",
                          kv_connector_module_path="kvtransport.embed.vllm_connector", kv_role=role,
                          kv_load_failure_policy="recompute",
                          kv_connector_extra_config=dict(extra, key=KEY))  # fmt: skip
    return VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float32"),
                      cache_config=CacheConfig(block_size=BS), kv_transfer_config=tc)  # fmt: skip


def _connector(cfg: VllmConfig, role: KVConnectorRole):
    cls = KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
    return cls(cfg, role, None)


def _paged(cfg: VllmConfig, seed: int | None) -> dict[str, torch.Tensor]:
    """Per layer, vLLM's CPU paged KV: [blocks, kv_heads, block_size, 2 * head_dim]."""
    mc = cfg.model_config
    layers = mc.hf_config.num_hidden_layers
    heads, dim = mc.get_total_num_kv_heads(), mc.get_head_size()
    g = torch.Generator().manual_seed(seed or 0)
    shape = (NBLOCKS, heads, BS, 2 * dim)
    make = (lambda: torch.randn(shape, generator=g)) if seed is not None else (
        lambda: torch.zeros(shape))  # fmt: skip
    return {f"model.layers.{i}.self_attn.attn": make() for i in range(layers)}


def _request(rid: str, tokens: list[int], params: dict) -> Request:
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request(rid, tokens, sp, None)


def _blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(blocks=([KVCacheBlock(i) for i in ids],))


def _tokens(paged: dict[str, torch.Tensor], block_ids: list[int], tokens: list[int]):
    """The request's KV as the connector reads vLLM's pages (a KVCache)."""
    from kvtransport.embed import vllm_blocks as vb
    from kvtransport.embed.vllm_connector import paged_views

    return vb.gather(*paged_views(paged, 64), block_ids, tokens, "m")


LOSSLESS = {"precision": "lossless"}
"""The producer's extra config that pushes every block lossless (the connector before the
planner): what the bit-identity tests check."""


def _handoff(model_dir, tokens: list[int], deadline_ms: float, rate_mbps: float = 100,
             load_log: str | None = None, wait_ms: float = 5000,
             producer: dict | None = None, late: dict | None = None):  # fmt: skip
    """Producer and consumer connectors, both roles each, one request pushed and loaded.
    producer: more of the producer's extra config (default: LOSSLESS); late: what the
    decode engine is told instead of the producer's handed-over plan (a push late
    against it). Returns (src pages, dst pages, producer block ids, consumer block ids,
    load errors, consumer stats)."""
    port = _port()
    p_extra = {"push_to": f"127.0.0.1:{port}", "rate_mbps": rate_mbps}
    p_cfg = _config(model_dir, "kv_producer", {**p_extra, **(producer or LOSSLESS)})
    c_extra = {"listen": f"127.0.0.1:{port}", "wait_ms": wait_ms}
    c_cfg = _config(
        model_dir, "kv_consumer", dict(c_extra, load_log=load_log) if load_log else c_extra
    )
    p_sched, p_work = _connector(p_cfg, KVConnectorRole.SCHEDULER), None
    c_sched, c_work = _connector(c_cfg, KVConnectorRole.SCHEDULER), None
    try:
        p_work = _connector(p_cfg, KVConnectorRole.WORKER)
        c_work = _connector(c_cfg, KVConnectorRole.WORKER)
        src, dst = _paged(p_cfg, seed=1), _paged(c_cfg, seed=None)
        p_work.register_kv_caches(src)
        c_work.register_kv_caches(dst)
        n_blocks = -(-len(tokens) // BS)
        p_ids = list(range(3, 3 + n_blocks))
        c_ids = list(range(NBLOCKS - n_blocks, NBLOCKS))[::-1]  # other ids, other order
        # prefill engine: the request finishes; its blocks are held and pushed
        params = {"do_remote_decode": True, "kvt_request": "t1", "kvt_deadline_ms": deadline_ms}
        req = _request("p-1", tokens, params)
        assert p_sched.get_num_new_matched_tokens(req, 0) == (0, False)  # a producer loads nothing
        delay, handed = p_sched.request_finished(req, p_ids)
        assert delay is True
        assert {k: handed[k] for k in ("do_remote_prefill", "kvt_request")} == {
            "do_remote_prefill": True, "kvt_request": "t1"}  # fmt: skip
        # a planned push tells the decode engine its plan (for its race); lossless none
        assert ("kvt_planned_ms" in handed) == ((producer or LOSSLESS) != LOSSLESS)
        handed = {**handed, **(late or {})}
        p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
        p_work.start_load_kv(None)
        assert p_work.get_finished({"p-1"}) == ({"p-1"}, None)  # copied out: blocks freed
        # decode engine: the same prompt, with what the prefill engine handed back
        creq = _request("d-7", tokens, handed)
        assert c_sched.get_num_new_matched_tokens(creq, 0) == (len(tokens), True)
        c_sched.update_state_after_alloc(creq, _blocks(c_ids), len(tokens))
        assert c_sched.get_num_new_matched_tokens(creq, 0) == (0, False)  # claimed once
        c_work.bind_connector_metadata(c_sched.build_connector_meta(None))
        recving, errors = None, set()
        end = time.monotonic() + 20
        while recving is None and time.monotonic() < end:
            c_work.start_load_kv(None)
            errors |= c_work.get_block_ids_with_load_errors()
            _, recving = c_work.get_finished(set())
            c_work.bind_connector_metadata(c_sched.build_connector_meta(None))
            time.sleep(0.005)
        assert recving == {"d-7"}
        stats = c_work.get_kv_connector_stats()
        return src, dst, p_ids, c_ids, errors, stats
    finally:
        for c in (p_work, c_work):
            if c is not None:
                c.shutdown()


def test_vllm_loads_the_connector_from_its_module_path(model_dir):
    cfg = _config(model_dir, "kv_consumer", {})
    cls = KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
    from kvtransport.embed.vllm_connector import KVTransportConnector

    assert cls is KVTransportConnector
    stats = cls.build_kv_connector_stats({"loads": 2, "load_waits": [0.1, 0.4]})
    stats.aggregate(cls.build_kv_connector_stats({"loads": 2, "load_waits": [0.1, 0.2]}))
    assert stats.reduce()["mean_load_wait_ms"] == pytest.approx(200.0)
    assert stats.reduce()["loads"] == 4
    plain = _request("x", [1, 2, 3], {})
    assert _connector(cfg, KVConnectorRole.SCHEDULER).get_num_new_matched_tokens(plain, 0) == (
        0, False)  # fmt: skip


def test_vllm_cpu_kernels_write_the_layout_the_connector_reads():
    """vLLM's own cache-write op (the one its CPU attention runs) puts each token's K and V
    where paged_views reads them, the partial last block included."""
    from vllm import _custom_ops as ops

    from kvtransport.embed.vllm_connector import cpu_isa, paged_views

    heads, dim, n = 3, 64, 45
    kv = torch.zeros(4, heads, BS, 2 * dim)
    key_cache, value_cache = kv.view(4, heads, 2 * BS, dim).chunk(2, dim=2)
    g = torch.Generator().manual_seed(7)
    key, value = torch.randn(n, heads, dim, generator=g), torch.randn(n, heads, dim, generator=g)
    block_ids = [3, 1]
    slots = torch.tensor([block_ids[t // BS] * BS + t % BS for t in range(n)])
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots,
                                   cpu_isa(torch.float32, BS, dim))  # fmt: skip
    from kvtransport.embed import vllm_blocks as vb

    got = vb.gather(*paged_views({"model.layers.0.attn": kv}, dim), block_ids, range(n), "m")
    assert torch.equal(torch.from_numpy(got.keys[0]), key.transpose(0, 1))
    assert torch.equal(torch.from_numpy(got.values[0]), value.transpose(0, 1))


def test_complete_push_lands_bit_identical_in_the_decode_engines_blocks(model_dir, tmp_path):
    tokens = list(range(1000, 1150))  # 150 tokens: 5 blocks, the last one partial
    log = tmp_path / "loads.jsonl"
    src, dst, p_ids, c_ids, errors, stats = _handoff(model_dir, tokens, deadline_ms=3000,
                                                     load_log=str(log))  # fmt: skip
    assert errors == set()
    want, got = _tokens(src, p_ids, tokens), _tokens(dst, c_ids, tokens)
    assert np.array_equal(got.keys, want.keys) and np.array_equal(got.values, want.values)
    from kvtransport.embed.vllm_connector import paged_views

    k, v = paged_views(dst, 64)
    assert not k[3][c_ids[4], :, 22:].any() and not v[3][c_ids[4], :, 22:].any()
    assert stats.data["tokens_loaded"] == 150 and stats.data["tokens_recomputed"] == 0
    # the load log: what loaded, and what the link did to the transfer (the receiver's
    # counters: 6.9 MB of KV in 1280-byte symbols; loopback loses next to nothing)
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["tag"] == "t1" and record["loaded"] == 150 and record["failed_blocks"] == 0
    assert record["datagrams"] >= 150 * 46080 // 1280
    assert 0 <= record["datagrams_lost"] <= record["datagrams"] // 100
    assert 0 <= record["loss_rate"] < 0.05


def test_a_planned_push_lands_int8_dequantized_in_the_decode_engines_blocks(model_dir):
    """The default push is planned (kvtransport.model.plan): int8 blocks, a quarter of
    fp32's bytes on the wire, dequantized into the decode engine's float32 pages: close
    to the prefill engine's KV, not equal to it, and nothing past the prompt written."""
    tokens = list(range(1000, 1150))
    slow = {"decode_tokens_per_s": 50}  # the decode engine's own prefill: 3 s, a push pays
    src, dst, p_ids, c_ids, errors, stats = _handoff(model_dir, tokens, deadline_ms=3000,
                                                     producer=slow)  # fmt: skip
    assert errors == set() and stats.data["tokens_loaded"] == 150
    assert stats.data["bytes_received"] < 0.3 * 150 * 46080  # fp32: 46080 bytes a token
    want, got = _tokens(src, p_ids, tokens), _tokens(dst, c_ids, tokens)
    err = np.abs(got.keys - want.keys).max()
    assert 0 < err < 0.05 * np.abs(want.keys).max()
    assert np.abs(got.values - want.values).max() < 0.05 * np.abs(want.values).max()
    from kvtransport.embed.vllm_connector import paged_views

    k, _ = paged_views(dst, 64)
    assert not k[3][c_ids[4], :, 22:].any()


def test_a_push_late_against_its_plan_is_cut_when_computing_the_rest_is_sooner(
    model_dir, tmp_path
):  # fmt: skip
    """The decode engine's race: a push told to take 50 ms (its plan) runs seconds at
    2 Mbit/s; computing the prompt takes the decode engine 0.8 s (so said). Long before
    wait_ms it stops waiting, loads the prefix that arrived and reports the rest as load
    errors."""
    tokens = list(range(4000, 4000 + 20 * BS))  # int8: ~1.9 MB, ~8 s at 2 Mbit/s
    log = tmp_path / "loads.jsonl"
    plan = {"precision": "int8", "decode_tokens_per_s": 5}  # a push pays: it is made
    late = {"kvt_planned_ms": 50, "kvt_recompute_ms": 800}
    src, dst, p_ids, c_ids, errors, stats = _handoff(
        model_dir, tokens, deadline_ms=60000, rate_mbps=2, wait_ms=30000, producer=plan,
        late=late, load_log=str(log),
    )  # fmt: skip
    rec = json.loads(log.read_text().splitlines()[0])
    assert rec["times"]["race_cut"] is True and rec["waited_ms"] < 30000
    loaded = stats.data["tokens_loaded"]
    assert loaded < len(tokens) and loaded % BS == 0
    assert errors == set(c_ids[loaded // BS :])


def _producer(model_dir, extra: dict):
    cfg = _config(model_dir, "kv_producer", {"push_to": "127.0.0.1:9", **extra})
    return _connector(cfg, KVConnectorRole.SCHEDULER)


def _finish(sched, rid: str, tokens: list[int]):
    req = _request(rid, tokens, {"do_remote_decode": True, "kvt_request": rid})
    return sched.request_finished(req, list(range(-(-len(tokens) // BS))))


def test_a_push_that_cannot_pay_off_is_declined_and_the_decode_engine_recomputes(model_dir):
    """A decode engine that prefills faster than the push would cross the link gets no
    push: the prefill engine frees the blocks at once, hands ``do_remote_prefill`` false,
    and counts the declined tokens; the decode engine then claims nothing."""
    from types import SimpleNamespace

    tokens = list(range(100, 164))
    fast = _producer(model_dir, {"decode_tokens_per_s": 1e6, "rate_mbps": 100})
    delay, handed = _finish(fast, "r1", tokens)
    assert delay is False and handed["do_remote_prefill"] is False
    assert "own prefill" in handed["kvt_declined"]
    assert fast.build_connector_meta(SimpleNamespace()).sends == []
    stats = fast.get_kv_connector_stats().data
    assert stats["tokens_declined"] == 64 and stats["pushes_declined"] == 1
    consumer = _connector(_config(model_dir, "kv_consumer", {}), KVConnectorRole.SCHEDULER)
    assert consumer.get_num_new_matched_tokens(_request("d", tokens, handed), 0) == (0, False)
    # the same push to a slow decode engine, and with the threshold off, goes ahead
    for extra in ({"decode_tokens_per_s": 20}, {"decode_tokens_per_s": 1e6,
                                                "recompute_threshold": 0}):  # fmt: skip
        delay, handed = _finish(_producer(model_dir, extra), "r2", tokens)
        assert delay is True and handed["do_remote_prefill"] is True
    # unconfigured, the producer's own steps give the speed: unknown at first (pushed),
    # then measured fast (1000 tokens in ~10 ms): declined
    own = _producer(model_dir, {"rate_mbps": 100})
    assert _finish(own, "r3", tokens)[0] is True
    own.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1000))
    time.sleep(0.01)
    own.get_kv_connector_stats()  # the scheduler's call once the step's output is back
    delay, handed = _finish(own, "r4", tokens)
    assert delay is False and handed["do_remote_prefill"] is False


def test_a_bad_push_config_is_one_line(model_dir):
    from kvtransport.errors import UserError

    for bad, what in (({"precision": "int3"}, "precision"), ({"loss": 2}, "loss"),
                      ({"decode_tokens_per_s": 0}, "decode_tokens_per_s"),
                      ({"recompute_threshold": -1}, "recompute_threshold"),
                      ({"rate_mbps": "fast"}, "kv_connector_extra_config")):  # fmt: skip
        with pytest.raises(UserError, match=what):
            _producer(model_dir, bad)
    # a request's own bad values are ignored (logged), never fatal to the engine
    sched = _producer(model_dir, {"decode_tokens_per_s": 20})
    for params in ({"kvt_ttft_ms": "soon"}, {"kvt_ttft_ms": -5}, {"kvt_precision": "int3"}):
        req = _request("r", list(range(64)), {"do_remote_decode": True, "kvt_request": "r",
                                              **params})  # fmt: skip
        assert sched.request_finished(req, [0, 1])[0] is True
    (lossless,) = sched.build_connector_meta(None).sends[2:]
    assert lossless.plan is None  # int3 is no precision: that push goes lossless


def test_a_deadline_cut_loads_a_prefix_and_reports_the_tail_as_load_errors(model_dir):
    tokens = list(range(2000, 2000 + 20 * BS))  # 20 blocks, 27.6 MB of fp32 KV
    src, dst, p_ids, c_ids, errors, stats = _handoff(
        model_dir, tokens, deadline_ms=1500, rate_mbps=40
    )
    loaded = stats.data["tokens_loaded"]
    assert 0 < loaded < len(tokens) and loaded % BS == 0
    k = loaded // BS
    assert errors == set(c_ids[k:])  # every block from the first incomplete one
    want, got = _tokens(src, p_ids, tokens), _tokens(dst, c_ids, tokens)
    assert np.array_equal(got.keys[:, :, :loaded], want.keys[:, :, :loaded])
    assert not got.keys[:, :, loaded:].any()  # nothing of the failed blocks written
    assert not any(t[c_ids[k]].any() for t in dst.values())
    assert np.isclose(stats.data["tokens_recomputed"], len(tokens) - loaded)


def test_at_wait_ms_the_prefix_that_arrived_loads(model_dir):
    """A push far longer than the consumer's wait (the deadline later still): at wait_ms
    the transfer is cut and the ranges that arrived load, not nothing."""
    tokens = list(range(3000, 3000 + 20 * BS))  # 27.6 MB of fp32 KV, ~11 s at 20 Mbit/s
    src, dst, p_ids, c_ids, errors, stats = _handoff(
        model_dir, tokens, deadline_ms=60000, rate_mbps=20, wait_ms=3000
    )
    loaded = stats.data["tokens_loaded"]
    assert 0 < loaded < len(tokens) and loaded % BS == 0
    assert errors == set(c_ids[loaded // BS :])
    want, got = _tokens(src, p_ids, tokens), _tokens(dst, c_ids, tokens)
    assert np.array_equal(got.keys[:, :, :loaded], want.keys[:, :, :loaded])


def _consumer(model_dir, port: int, wait_ms: float = 8000):
    cfg = _config(model_dir, "kv_consumer", {"listen": f"127.0.0.1:{port}", "wait_ms": wait_ms})
    sched, work = (
        _connector(cfg, KVConnectorRole.SCHEDULER),
        _connector(cfg, KVConnectorRole.WORKER),
    )
    dst = _paged(cfg, seed=None)
    work.register_kv_caches(dst)
    return sched, work, dst


def _claim(sched, work, rid: str, tag: str, tokens: list[int], c_ids: list[int]):
    req = _request(rid, tokens, {"do_remote_prefill": True, "kvt_request": tag})
    assert sched.get_num_new_matched_tokens(req, 0) == (len(tokens), True)
    sched.update_state_after_alloc(req, _blocks(c_ids), len(tokens))
    work.bind_connector_metadata(sched.build_connector_meta(None))
    work.start_load_kv(None)
    return req


def _steps_until_done(sched, work, rid: str, timeout_s: float = 30.0) -> set[int]:
    errors: set[int] = set()
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        work.bind_connector_metadata(sched.build_connector_meta(None))
        work.start_load_kv(None)
        errors |= work.get_block_ids_with_load_errors()
        _, recving = work.get_finished(set())
        if recving and rid in recving:
            return errors
        time.sleep(0.005)
    raise AssertionError(f"load of {rid} did not finish")


def test_foreign_wrong_shape_and_headerless_pushes_are_load_errors_and_write_nothing(model_dir):
    """What crashed the decode engine (KV of 2 layers instead of 30) or served garbage
    (random KV of the right shape): each is a load error for its request, every block of
    it, and not one value written into the paged cache."""
    from kvtransport.embed import vllm_blocks as vb

    port = _port()
    sched, work, dst = _consumer(model_dir, port)
    pusher = vb.Pusher(key=KEY, rate_mbps=200)
    try:
        mine = work.compat
        tokens = list(range(500, 600))  # 4 blocks
        rng = np.random.default_rng(3)
        heads, dim, n = mine.num_kv_heads, mine.head_dim, len(tokens)

        def kv(layers: int):
            k = rng.standard_normal((layers, heads, n, dim)).astype(np.float32)
            return vb.KVCache(k, k.copy(), np.asarray(tokens), "x")

        cases = {
            # 2 layers, its header forged to claim this engine's geometry
            "shape": vb.encode_request(kv(2), "shape", BS, mine),
            "random": vb.encode_request(kv(mine.num_layers), "random", BS),  # no header
            "foreign": vb.encode_request(kv(mine.num_layers), "foreign", BS,
                                         vb.Compat(**{**mine.to_dict(), "model_id": "other"})),
        }  # fmt: skip
        for i, (tag, stream) in enumerate(cases.items()):
            c_ids = [4 * i + j for j in range(4)]
            _claim(sched, work, f"d-{tag}", tag, tokens, c_ids)
            pusher.push(stream, tag, f"127.0.0.1:{port}", deadline_ms=5000)
            errors = _steps_until_done(sched, work, f"d-{tag}")
            assert errors == set(c_ids), tag
        assert not any(t.any() for t in dst.values())  # nothing written anywhere
        stats = work.get_kv_connector_stats().data
        assert stats["loads_refused"] == 3 and stats["tokens_loaded"] == 0
        assert stats["tokens_refused"] == 3 * n
    finally:
        pusher.close()
        work.shutdown()


def test_a_request_aborted_while_it_waits_gets_nothing_written_later(model_dir):
    """vLLM frees an aborted request's blocks at once: its push, arriving after, must not
    be written into them (they may be another request's)."""
    from kvtransport.embed import vllm_blocks as vb

    port = _port()
    sched, work, dst = _consumer(model_dir, port)
    pusher = vb.Pusher(key=KEY, rate_mbps=200)
    try:
        tokens, c_ids = list(range(700, 764)), [5, 6]
        req = _claim(sched, work, "d-a", "abort-me", tokens, c_ids)
        assert sched.request_finished(req, [c_ids]) == (False, None)  # aborted: freed
        stream = vb.encode_request(_tokens(_paged(_config(model_dir, "kv_producer", {}), 2),
                                           c_ids, tokens), "abort-me", BS, work.compat)  # fmt: skip
        work.bind_connector_metadata(sched.build_connector_meta(None))
        work.start_load_kv(None)  # the cancel lands first
        pusher.push(stream, "abort-me", f"127.0.0.1:{port}", deadline_ms=5000)
        end = time.monotonic() + 10
        while not pusher.poll() and time.monotonic() < end:
            work.bind_connector_metadata(sched.build_connector_meta(None))
            work.start_load_kv(None)
            time.sleep(0.01)
        for _ in range(20):
            work.bind_connector_metadata(sched.build_connector_meta(None))
            work.start_load_kv(None)
            time.sleep(0.01)
        assert work.get_finished(set()) == (None, None)
        assert not any(t.any() for t in dst.values())
    finally:
        pusher.close()
        work.shutdown()


def test_stats_reach_a_prometheus_scrape_and_fail_policy_warns(model_dir, caplog):
    import logging

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()

    def bind(cls):  # the metric classes, registered in a private registry
        return lambda *a, **k: cls(*a, registry=registry, **k)

    cfg = _config(model_dir, "kv_consumer", {})
    cls = KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
    types = {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}
    prom = cls.build_prom_metrics(cfg, types, ["engine"], {0: ["0"]})
    stats = cls.build_kv_connector_stats({"tokens_loaded": 96, "tokens_recomputed": 54,
                                          "load_waits": [0.2], "bytes_received": 4096,
                                          "tokens_declined": 640})  # fmt: skip
    prom.observe(stats.data, 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvt_tokens_loaded_total{engine="0"} 96.0' in text
    assert 'vllm:kvt_tokens_recomputed_total{engine="0"} 54.0' in text
    assert 'vllm:kvt_load_wait_s_count{engine="0"} 1.0' in text
    assert 'vllm:kvt_tokens_declined_total{engine="0"} 640.0' in text
    tc = KVTransferConfig(kv_connector="KVTransportConnector",
                          kv_connector_module_path="kvtransport.embed.vllm_connector",
                          kv_role="kv_consumer")  # fmt: skip
    fail = VllmConfig(model_config=cfg.model_config, cache_config=CacheConfig(block_size=BS),
                      kv_transfer_config=tc)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="vllm.kvtransport"):
        _connector(fail, KVConnectorRole.SCHEDULER)
    assert any(r.name == "vllm.kvtransport" and "'fail'" in r.getMessage() for r in caplog.records)
