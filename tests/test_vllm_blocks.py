"""The vLLM connector's vLLM-free half (kvtransport.embed.vllm_blocks): paged layout <-> token
ranges, the usable prefix of a received result, and real loopback UDP through
kvtransport.send (Pusher) into a many-transfer Inbox."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvtransport.embed import vllm_blocks as vb
from kvtransport.kvformat.kvcache import KVCache

LAYERS, HEADS, DIM, BS, NBLOCKS = 4, 2, 64, 32, 12
KEY = b"vllm connector test key!"


def _paged(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    shape = (NBLOCKS, HEADS, BS, DIM)
    keys = [rng.standard_normal(shape).astype(np.float32) for _ in range(LAYERS)]
    values = [rng.standard_normal(shape).astype(np.float32) for _ in range(LAYERS)]
    return keys, values


def _zeros() -> tuple[list[np.ndarray], list[np.ndarray]]:
    shape = (NBLOCKS, HEADS, BS, DIM)
    return ([np.zeros(shape, np.float32) for _ in range(LAYERS)],
            [np.zeros(shape, np.float32) for _ in range(LAYERS)])  # fmt: skip


def test_gather_reads_each_token_from_its_block_and_offset():
    keys, values = _paged()
    block_ids = [7, 2, 9]
    tokens = list(range(100, 170))  # 70 tokens: blocks 7, 2 full, 6 tokens of block 9
    cache = vb.gather(keys, values, block_ids, tokens, "toy")
    assert cache.keys.shape == (LAYERS, HEADS, 70, DIM)
    for t in (0, 31, 32, 63, 64, 69):
        b, o = block_ids[t // BS], t % BS
        assert np.array_equal(cache.keys[3, :, t], keys[3][b, :, o])
        assert np.array_equal(cache.values[1, :, t], values[1][b, :, o])
    with pytest.raises(ValueError, match="cannot hold"):
        vb.gather(keys, values, [7, 2], tokens, "toy")


def test_scatter_writes_only_the_token_range_asked_into_other_block_ids():
    keys, values = _paged()
    cache = vb.gather(keys, values, [7, 2, 9], list(range(70)), "toy")
    dk, dv = _zeros()
    dest = [0, 5, 11]
    vb.scatter(cache, dk, dv, dest, 32, 70)
    assert not dk[0][0].any()  # tokens 0-31 (block 0) untouched
    assert np.array_equal(dk[2][5], keys[2][2]) and np.array_equal(dv[2][5], values[2][2])
    assert np.array_equal(dk[2][11][:, :6], keys[2][9][:, :6])
    assert not dk[2][11][:, 6:].any()  # past the request's last token


def _cache(tokens: int = 150, seed: int = 3) -> KVCache:
    keys, values = _paged(seed)
    n_blocks = -(-tokens // BS)
    return vb.gather(keys, values, list(range(n_blocks)), list(range(1, tokens + 1)), "toy")


def test_prefix_stream_is_front_first_every_layer_of_a_range_together():
    m = vb.encode_request(_cache(), "req-1", BS).manifest
    assert m.created[vb.REQUEST_TAG] == "req-1"
    assert list(m.token_block) == sorted(m.token_block)  # ranges front first
    assert list(m.layer[:LAYERS]) == list(range(LAYERS))  # all layers of range 0 first
    assert m.precision.tolist() == [0] * m.num_blocks  # fp32: lossless


def _result_with(stream, complete: np.ndarray):
    """What a receiver holds when exactly ``complete`` blocks arrived (offline)."""
    from kvtransport.daemons.api import DeliveredResult

    payload = np.where(np.repeat(complete, stream.manifest.length), stream.payload, 0)
    return DeliveredResult(1, 0.0, "deadline", None, complete, np.flatnonzero(~complete),
                           payload.astype(np.uint8), stream.manifest_bytes)  # fmt: skip


def test_load_plan_cuts_at_the_first_range_missing_in_any_layer():
    cache = _cache(150)  # 5 blocks of 32 (the last holds 22 tokens)
    stream = vb.encode_request(cache, "r", 16)  # kvtransport ranges of 16 tokens
    m = stream.manifest
    block_ids = [40, 41, 42, 43, 44]
    ids = cache.token_ids
    complete = np.ones(m.num_blocks, bool)
    plan = vb.load_plan(_result_with(stream, complete), block_ids=block_ids, block_size=BS,
                        start=0, stop=150, token_ids=ids)  # fmt: skip
    assert plan.complete and plan.prefix == 150 and plan.why == ""
    assert np.array_equal(plan.cache.keys, cache.keys)
    # range 5 (tokens 80-95, inside vLLM block 2) lost in layer 3 only
    complete[(m.token_block == 5) & (m.layer == 3)] = False
    plan = vb.load_plan(_result_with(stream, complete), block_ids=block_ids, block_size=BS,
                        start=0, stop=150, token_ids=ids)  # fmt: skip
    assert plan.prefix == 64 and plan.failed_block_ids == [42, 43, 44]
    assert "token 64 of 150" in plan.why
    # the same loss, but only the first 96 tokens asked for (the rest computed locally)
    plan = vb.load_plan(_result_with(stream, complete), block_ids=block_ids, block_size=BS,
                        start=0, stop=96, token_ids=ids)  # fmt: skip
    assert plan.failed_block_ids == [42]
    # another prompt: nothing loads
    other = ids.copy()
    other[3] += 1
    plan = vb.load_plan(_result_with(stream, np.ones(m.num_blocks, bool)), block_ids=block_ids,
                        block_size=BS, start=0, stop=150, token_ids=other)  # fmt: skip
    assert plan.prefix == 0 and plan.failed_block_ids == block_ids and plan.cache is None
    plan = vb.load_plan(None, block_ids=block_ids, block_size=BS, start=32, stop=150,
                        token_ids=ids)  # fmt: skip
    assert plan.failed_block_ids == block_ids[1:] and plan.why == "nothing arrived"


def _wait(inbox: vb.Inbox, tag: str, timeout_s: float = 20.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = inbox.take(tag)
        if got is not None:
            return got
        time.sleep(0.01)
    raise AssertionError(f"no result for {tag}")


def test_push_over_udp_loads_the_exact_cache_into_the_consumers_blocks():
    """Producer pages -> gather -> prefix stream -> real UDP -> Inbox -> load_plan ->
    scatter into the consumer's pages: bit-identical, two requests told apart by tag."""
    keys, values = _paged(5)
    caches = {
        "a": vb.gather(keys, values, [3, 1, 4], list(range(10, 90)), "toy"),
        "b": vb.gather(keys, values, [5, 9], list(range(200, 250)), "toy"),
    }
    inbox = vb.Inbox(listen="127.0.0.1:0", key=KEY)
    ended: dict = {}
    pusher = vb.Pusher(key=KEY, rate_mbps=200, on_done=ended.__setitem__)
    try:
        for tag, c in caches.items():
            pusher.push(vb.encode_request(c, tag, BS), tag, inbox.address, deadline_ms=2000)
        got = {tag: _wait(inbox, tag) for tag in ("b", "a")}
        deadline = time.monotonic() + 10
        status: dict = {}
        while len(status) < 2 and time.monotonic() < deadline:
            status.update(pusher.poll())
            time.sleep(0.01)
    finally:
        pusher.close()
        inbox.close()
    assert set(status) == {"a", "b"} and all("error" not in s for s in status.values())
    assert ended == status  # on_done saw each end as poll did
    dk, dv = _zeros()
    dest = {"a": [0, 2, 6], "b": [8, 10]}
    for tag, c in caches.items():
        plan = vb.load_plan(got[tag], block_ids=dest[tag], block_size=BS, start=0,
                            stop=c.num_tokens, token_ids=c.token_ids)  # fmt: skip
        assert plan.complete and plan.prefix == c.num_tokens
        vb.scatter(plan.cache, dk, dv, dest[tag], 0, plan.prefix)
    back = vb.gather(dk, dv, dest["a"], caches["a"].token_ids, "toy")
    assert np.array_equal(back.keys, caches["a"].keys)
    assert np.array_equal(back.values, caches["a"].values)
    back = vb.gather(dk, dv, dest["b"], caches["b"].token_ids, "toy")
    assert np.array_equal(back.values, caches["b"].values)


def test_a_deadline_cut_over_udp_loads_a_prefix_and_fails_the_tail():
    """A deadline far below the send time: what arrived is a prefix of whole ranges (the
    prefix order), the plan loads exactly it and fails every block after it."""
    rng = np.random.default_rng(9)
    n, nb = 640, 20
    shape = (nb, 3, BS, DIM)
    keys = [rng.standard_normal(shape).astype(np.float32) for _ in range(8)]
    values = [rng.standard_normal(shape).astype(np.float32) for _ in range(8)]
    cache = vb.gather(keys, values, list(range(nb)), list(range(n)), "toy")  # 7.9 MB
    inbox = vb.Inbox(listen="127.0.0.1:0", key=KEY)
    pusher = vb.Pusher(key=KEY, rate_mbps=20)  # ~3.2 s of wire time, a quarter in time
    try:
        pusher.push(vb.encode_request(cache, "r", BS), "r", inbox.address, deadline_ms=800)
        got = _wait(inbox, "r")
    finally:
        pusher.close()
        inbox.close()
    block_ids = list(range(100, 100 + nb))
    plan = vb.load_plan(got, block_ids=block_ids, block_size=BS, start=0, stop=n,
                        token_ids=cache.token_ids)  # fmt: skip
    assert 0 < plan.prefix < n and plan.prefix % BS == 0
    assert plan.failed_block_ids == block_ids[plan.prefix // BS :]
    assert np.array_equal(plan.cache.keys[:, :, : plan.prefix], cache.keys[:, :, : plan.prefix])
    # the stream's front arrived: completion is (nearly) a prefix of the stream order
    first_gap = int(np.flatnonzero(~got.complete)[0])
    assert plan.prefix == (first_gap // 8) * BS


def test_the_inbox_keeps_at_most_max_results_untaken():
    keys, values = _paged(2)
    inbox = vb.Inbox(listen="127.0.0.1:0", key=KEY, max_results=1)
    pusher = vb.Pusher(max_parallel=1, key=KEY, rate_mbps=200)
    try:
        for tag in ("old", "new"):
            c = vb.gather(keys, values, [0], list(range(20)), "toy")
            pusher.push(vb.encode_request(c, tag, BS), tag, inbox.address, deadline_ms=1000)
        got = _wait(inbox, "new")
    finally:
        pusher.close()
        inbox.close()
    assert got is not None and inbox.take("old") is None and inbox.expired == 1


COMPAT = vb.Compat("toy", LAYERS, HEADS, DIM, "float32", BS, vb.config_digest({"n": 1}))


def _complete(stream):
    return _result_with(stream, np.ones(stream.manifest.num_blocks, bool))


def test_load_plan_refuses_a_push_whose_header_or_prompt_is_not_the_consumers():
    cache = _cache(150)
    ids, block_ids = cache.token_ids, [40, 41, 42, 43, 44]

    def plan(stream, expect=COMPAT, token_ids=ids):
        return vb.load_plan(_complete(stream), block_ids=block_ids, block_size=BS, start=0,
                            stop=150, token_ids=token_ids, expect=expect)  # fmt: skip

    good = plan(vb.encode_request(cache, "r", BS, COMPAT))
    assert good.complete and not good.refused and good.prefix == 150
    # right shape, no header (random KV a stranger pushed): nothing loads
    rng = np.random.default_rng(1)
    shape = cache.keys.shape
    noise = KVCache(rng.standard_normal(shape).astype(np.float32),
                    rng.standard_normal(shape).astype(np.float32), ids, "toy")  # fmt: skip
    headless = plan(vb.encode_request(noise, "r", BS))
    assert headless.refused and headless.cache is None and headless.prefix == 0
    assert headless.failed_block_ids == block_ids and "no compatibility header" in headless.why
    # another model, another config, another block size: refused, naming the field
    for field_, value in (("model_id", "other"), ("config_hash", "0" * 64), ("block_size", 16)):
        theirs = vb.Compat(**{**COMPAT.to_dict(), field_: value})
        p = plan(vb.encode_request(cache, "r", BS, theirs))
        assert p.refused and p.cache is None and field_ in p.why
    # a header that lies about the payload's shape (2 layers sent, 4 claimed)
    two = KVCache(cache.keys[:2], cache.values[:2], ids, "toy")
    p = plan(vb.encode_request(two, "r", BS, COMPAT))
    assert p.refused and "geometry" in p.why
    # a valid header on the cache of another prompt
    other = ids.copy()
    other[7] += 1
    p = plan(vb.encode_request(cache, "r", BS, COMPAT), token_ids=other)
    assert p.refused and "another prompt" in p.why


def test_compat_header_reads_back_and_rejects_malformed_ones():
    m = vb.encode_request(_cache(40), "r", BS, COMPAT).manifest
    assert vb.Compat.from_created(m.created) == COMPAT
    assert vb.Compat.from_created({"vllm": {"model_id": "x"}}) is None
    assert vb.Compat.from_created({"vllm": {**COMPAT.to_dict(), "num_layers": "many"}}) is None
    assert COMPAT.mismatch(COMPAT) == ""
    # the digest ignores where the config was read from, not what it says
    assert vb.config_digest({"n": 1, "_name_or_path": "/a"}) == vb.config_digest({"n": 1})
    assert vb.config_digest({"n": 2}) != vb.config_digest({"n": 1})


def test_the_pusher_encodes_in_its_own_thread():
    import threading

    inbox = vb.Inbox(listen="127.0.0.1:0", key=KEY)
    pusher = vb.Pusher(key=KEY, rate_mbps=200)
    where: list[str] = []
    cache = _cache(40)

    def encode():
        where.append(threading.current_thread().name)
        return vb.encode_request(cache, "t", BS, COMPAT)

    try:
        pusher.push(encode, "t", inbox.address, deadline_ms=2000)
        got = _wait(inbox, "t")
    finally:
        pusher.close()
        inbox.close()
    assert where and where[0] != threading.current_thread().name
    assert got.is_complete


def test_a_cut_delivers_what_arrived_of_a_transfer_still_receiving():
    """At the consumer's wait: the inbox ends the transfer and its prefix is usable."""
    rng = np.random.default_rng(4)
    n, nb = 640, 20
    shape = (nb, 3, BS, DIM)
    keys = [rng.standard_normal(shape).astype(np.float32) for _ in range(8)]
    cache = vb.gather(keys, keys, list(range(nb)), list(range(n)), "toy")  # 7.9 MB
    inbox = vb.Inbox(listen="127.0.0.1:0", key=KEY)
    pusher = vb.Pusher(key=KEY, rate_mbps=10)  # ~6 s of wire time; the deadline far off
    try:
        pusher.push(vb.encode_request(cache, "r", BS), "r", inbox.address, deadline_ms=60000)
        end = time.monotonic() + 30
        while time.monotonic() < end and not any(  # a few ranges in
            inc.session.blocks_complete >= 24 for inc in list(inbox.engine.host.active.values())
        ):
            time.sleep(0.05)
        inbox.cut("r")
        while not inbox.cut_done("r") and time.monotonic() < end:
            time.sleep(0.01)
        got = inbox.take("r")
        status = {}
        while not status and time.monotonic() < end:  # the sender hears the end
            status = pusher.poll()
            time.sleep(0.05)
    finally:
        pusher.close()
        inbox.close()
    assert got is not None and got.reason == "cut" and not got.is_complete
    plan = vb.load_plan(got, block_ids=list(range(nb)), block_size=BS, start=0, stop=n,
                        token_ids=cache.token_ids)  # fmt: skip
    assert BS <= plan.prefix < n and not plan.refused
    assert np.array_equal(plan.cache.keys[:, :, : plan.prefix], cache.keys[:, :, : plan.prefix])
    assert status["r"].get("delivered") != "complete"


def test_unclaimed_results_expire_by_lease_and_by_bytes():
    keys, values = _paged(6)
    c = vb.gather(keys, values, [0, 1], list(range(50)), "toy")  # 205 KB of payload
    inbox = vb.Inbox(listen="127.0.0.1:0", key=KEY, lease_s=0.5, max_held_mb=0.3)
    pusher = vb.Pusher(max_parallel=1, key=KEY, rate_mbps=200)
    try:
        pusher.push(vb.encode_request(c, "a", BS), "a", inbox.address, deadline_ms=2000)
        end = time.monotonic() + 20
        while inbox.held_bytes == 0 and time.monotonic() < end:
            time.sleep(0.01)
        held = inbox.held_bytes
        assert held == 204_800
        pusher.push(vb.encode_request(c, "b", BS), "b", inbox.address, deadline_ms=2000)
        while inbox.expired == 0 and time.monotonic() < end:
            time.sleep(0.01)
        assert inbox.expired == 1 and inbox.expired_bytes == held  # the older went first
        assert inbox.take("a") is None
        while inbox.held_bytes and time.monotonic() < end:  # "b" outlives its lease
            time.sleep(0.05)
        assert inbox.expired == 2 and inbox.take("b") is None
    finally:
        pusher.close()
        inbox.close()


def _link(rate_mbps: float = 100.0, loss: float = 0.0):
    from kvtransport.model.plan import LinkEstimate

    return LinkEstimate(rate_mbps * 1e6, loss, 5e-4, 1280)


def test_a_planned_push_is_int8_front_first_and_loads_its_dequantized_prefix():
    """The producer's planner (kvtransport.model.plan) sets each block's precision: on a
    prefix-only consumer every token counts alike, so the fidelity floor keeps the blocks
    at int8, a quarter of fp32's bytes; the stream stays front first, and a cut loads the
    dequantized prefix into the consumer's float32 pages."""
    from kvtransport.kvformat.blocks import PRECISIONS, Geometry, decode_stream

    cache = _cache(150)
    g = vb.geometry_for(LAYERS, HEADS, DIM, "float32", 150, BS)
    assert g == Geometry.of(cache, BS)  # planned before the cache is copied out: same geometry
    push = vb.plan_push(g, link=_link(), budget_s=1.0, levels=("fp16", "int8", "int4"))
    assert not push.declined and push.plan.split == 0 and push.plan.hedge == 0
    stream = vb.encode_request(cache, "r", BS, plan=push.plan)
    m = stream.manifest
    names = {PRECISIONS[p] for p in m.precision}
    assert names <= {"int8", "int4"} and "int8" in names
    lossless = vb.encode_request(cache, "r", BS)
    assert stream.payload.nbytes < 0.3 * lossless.payload.nbytes
    assert list(m.token_block) == sorted(m.token_block)  # still front first
    complete = m.token_block < 2  # the first two ranges (64 tokens) arrived
    plan = vb.load_plan(_result_with(stream, complete), block_ids=[5, 6, 7, 8, 9],
                        block_size=BS, start=0, stop=150, token_ids=cache.token_ids)  # fmt: skip
    assert plan.prefix == 64 and plan.failed_block_ids == [7, 8, 9]
    dk, dv = _zeros()
    vb.scatter(plan.cache, dk, dv, [5, 6, 7, 8, 9], 0, plan.prefix)
    want = decode_stream(m, stream.payload, token_ids=cache.token_ids).cache
    assert np.array_equal(dk[1][6], want.keys[1, :, 32:64])  # [heads, tokens, dim]
    err = np.abs(dk[1][6] - cache.keys[1, :, 32:64]).max()
    assert 0 < err < 0.05  # quantized, not garbage
    assert not dk[1][7].any()
    with pytest.raises(ValueError, match="not a push plan"):
        vb.encode_request(_cache(100), "r", BS, plan=push.plan)


def test_a_push_slower_than_the_consumers_own_prefill_is_declined():
    from kvtransport.model.cache_builder import ComputeSpeed

    g = vb.geometry_for(LAYERS, HEADS, DIM, "float32", 150, BS)
    levels = ("fp16", "int8", "int4")
    slow = ComputeSpeed(0.0, 1e-2)  # 1.5 s to recompute 150 tokens
    fast = ComputeSpeed(0.0, 1e-6)  # 0.15 ms
    kept = vb.plan_push(g, link=_link(), budget_s=1.0, levels=levels, speed=slow)
    assert not kept.declined and kept.recompute_s == pytest.approx(1.5)
    gone = vb.plan_push(g, link=_link(), budget_s=1.0, levels=levels, speed=fast)
    assert gone.declined and "own prefill" in gone.why
    assert gone.plan.link_s > gone.recompute_s
    # threshold 0 never declines; an unknown speed never declines
    assert not vb.plan_push(g, link=_link(), budget_s=1.0, levels=levels, speed=fast,
                            threshold=0).declined  # fmt: skip
    assert not vb.plan_push(g, link=_link(), budget_s=1.0, levels=levels).declined
    # loss raises the planned time: a push that pays on a clean link may not on a lossy one
    t = kept.plan.link_s
    lossy = vb.plan_push(g, link=_link(loss=0.3), budget_s=1.0, levels=levels, speed=slow)
    assert lossy.plan.link_s > t


def test_step_speed_times_big_steps_from_when_they_could_start():
    s = vb.StepSpeed(min_tokens=100, window=3)
    assert s.speed() is None
    s.scheduled(0.0, 50)  # too small to tell
    s.finished(1.0)
    assert s.speed() is None
    s.scheduled(1.0, 1000)
    s.scheduled(1.1, 1000)  # scheduled ahead: it runs once the one before finished
    s.finished(2.0)
    s.finished(3.0)
    assert s.speed().per_token_s == pytest.approx(1e-3)  # both 1 s / 1000 tokens
    s.scheduled(3.0, 1000)
    s.finished(13.0)  # one step ten times slower (a busy host) does not move it
    assert s.speed().per_token_s == pytest.approx(1e-3)
    for end in (15.0, 17.0):  # lasting slower steps take the window over
        s.scheduled(end - 2.0, 1000)
        s.finished(end)
    assert s.speed().per_token_s == pytest.approx(2e-3)


def test_the_race_waits_while_the_push_keeps_pace_and_cuts_once_computing_is_sooner():
    """The consumer's race (vb.race_cut): 1,000 tokens it computes in 10 s, a push
    planned at 1 s on the link."""
    race = dict(total=1000, recompute_s=10.0, planned_s=1.0, wait_s=30.0)
    # nothing in yet: expected in the planned time, then in as long again as waited
    assert not vb.race_cut(waited_s=0.5, arrived=0, **race)
    assert not vb.race_cut(waited_s=9.0, arrived=0, **race)  # the producer is slow
    assert vb.race_cut(waited_s=10.5, arrived=0, **race)  # computing it all is sooner
    # the pace counts from the first arrival, not from the wait's start: a tenth in
    # 50 ms after 5 s of the producer's copy-out and encoding -> 0.45 s more: wait
    assert not vb.race_cut(waited_s=5.0, arrived=100, arriving_s=0.05, received=0.1, **race)
    # a thousandth in 20 ms (a burst of loss at the start, repaired later): too early to
    # tell a pace (PACE_AFTER of the planned time); 20 s at that pace, but wait
    assert not vb.race_cut(waited_s=1.0, arrived=0, arriving_s=0.02, received=0.001, **race)
    # a tenth in 5 s -> 45 s more against 9 s of computing: cut
    assert vb.race_cut(waited_s=6.0, arrived=100, arriving_s=5.0, received=0.1, **race)
    # the pace is the bytes', not the prefix's: a hole in range 1 holds the prefix at 32
    # tokens while 60 % arrived in 0.6 s -> 0.4 s more: wait (the prefix alone said 18 s)
    assert not vb.race_cut(waited_s=1.0, arrived=32, arriving_s=0.6, received=0.6, **race)
    # half in 2.5 s -> 2.5 s more against 5 s: wait; everything in: never
    assert not vb.race_cut(waited_s=3.0, arrived=500, arriving_s=2.5, received=0.5, **race)
    assert not vb.race_cut(waited_s=29.0, arrived=1000, arriving_s=1.0, received=1.0, **race)
    # at wait_s: always
    assert vb.race_cut(waited_s=30.0, arrived=900, arriving_s=0.1, received=0.9, **race)
    # no plan or no compute speed: only wait_s cuts
    for unknown in ({"planned_s": None}, {"recompute_s": None}):
        kw = {**race, **unknown}
        assert not vb.race_cut(waited_s=20.0, arrived=0, **kw)
        assert vb.race_cut(waited_s=30.0, arrived=0, **kw)


def test_arrived_prefix_counts_ranges_complete_in_every_layer():
    keys, values = _paged(5)
    n = 150  # 5 ranges of 32, the last short
    cache = vb.gather(keys, values, [0, 1, 2, 3, 4], list(range(n)), "toy")
    m = vb.encode_request(cache, "r", BS).manifest
    tb, layer = m.token_block.astype(int), m.layer.astype(int)
    complete = np.zeros(len(tb), bool)
    assert vb.arrived_prefix(m, complete) == 0
    complete[tb <= 1] = True  # ranges 0 and 1 whole
    complete[(tb == 2) & (layer != 3)] = True  # range 2 less one layer
    assert vb.arrived_prefix(m, complete) == 2 * BS
    complete[:] = True
    assert vb.arrived_prefix(m, complete) == n  # not 5 * 32


def test_progress_reports_what_would_load_of_a_transfer_still_receiving():
    """Inbox.progress while a push arrives over UDP: whole ranges, never more than a cut
    then loads, growing; None for a tag nobody sends and once the transfer ended."""
    rng = np.random.default_rng(6)
    n, nb = 640, 20
    shape = (nb, 3, BS, DIM)
    keys = [rng.standard_normal(shape).astype(np.float32) for _ in range(8)]
    cache = vb.gather(keys, keys, list(range(nb)), list(range(n)), "toy")  # 7.9 MB
    inbox = vb.Inbox(listen="127.0.0.1:0", key=KEY)
    pusher = vb.Pusher(key=KEY, rate_mbps=10)  # ~6 s of wire time
    seen: list[int] = []
    shares: list[float] = []
    try:
        pusher.push(vb.encode_request(cache, "r", BS), "r", inbox.address, deadline_ms=60000)
        end = time.monotonic() + 30
        while time.monotonic() < end and (not seen or seen[-1] < 3 * BS):
            got = inbox.progress("r")
            if got is not None:
                assert got[1] == n and got[2] >= 0 and 0 <= got[3] <= 1
                assert got[0] == 0 or (got[2] > 0 and got[3] >= got[0] / n)
                seen.append(got[0])
                shares.append(got[3])
            time.sleep(0.02)
        assert inbox.progress("another") is None
        inbox.cut("r")
        while not inbox.cut_done("r") and time.monotonic() < end:
            time.sleep(0.01)
        last = seen[-1]
        result = inbox.take("r")
        assert inbox.progress("r") is None  # ended
    finally:
        pusher.close()
        inbox.close()
    assert seen == sorted(seen) and all(s % BS == 0 for s in seen)
    assert shares == sorted(shares) and 0 < shares[-1] < 1
    assert 3 * BS <= last < n
    plan = vb.load_plan(result, block_ids=list(range(nb)), block_size=BS, start=0, stop=n,
                        token_ids=cache.token_ids)  # fmt: skip
    assert plan.prefix >= last
