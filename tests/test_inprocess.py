"""The embeddable API (kvtransport.send / Receiver / receive, partial_cache) over real
loopback UDP, and the README's example run as written."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

import kvtransport
from kvtransport.core.protocol import DEFAULT_SYMBOL_SIZE
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.daemons.api import write_result_file
from kvtransport.errors import UserError
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model import encoding

README = Path(__file__).resolve().parents[1] / "README.md"


def _toy_cache(seed: int = 4, tokens: int = 96) -> KVCache:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((4, 2, tokens, 64)).astype(np.float16)
    v = rng.standard_normal((4, 2, tokens, 64)).astype(np.float16)
    att = rng.random((4, tokens)).astype("f4")
    return KVCache(k, v, rng.integers(0, 1000, tokens), "toy", att)


def test_send_and_receive_in_process_are_byte_exact_with_a_key():
    t = synthetic_transfer(600_000, 48, seed=11)
    key = bytes(range(16))
    with kvtransport.Receiver(listen="127.0.0.1:0", key=key, timeout_s=20) as rx:
        opts = kvtransport.SendOptions(deadline_ms=1500, rate_mbps=100, key=key)
        sent = kvtransport.send(t, to=rx.address, options=opts)
        got = rx.result(timeout_s=20)
    assert sent.finish_reason in ("receiver done", "receiver finished")
    assert got.reason == "complete" and got.is_complete
    assert got.transfer_id == sent.transfer_id
    assert got.blocks.equals(t.blocks)
    assert np.array_equal(got.payload[: t.nbytes], t.payload)


def test_a_wrong_key_delivers_nothing_and_says_so():
    t = synthetic_transfer(100_000, 8, seed=1)
    with kvtransport.Receiver(
        listen="127.0.0.1:0", key=b"the right key, 16+ bytes", timeout_s=1.5
    ) as rx:
        wrong = kvtransport.SendOptions(deadline_ms=300, key=b"the wrong key, 16+ bytes")
        sent = kvtransport.send(t, to=rx.address, options=wrong)
        with pytest.raises(UserError, match="no transfer arrived"):
            rx.result(timeout_s=20)
    # the sender heard nothing back, and its result says so
    assert sent.delivered == "nothing" and sent.note and not sent.is_complete
    assert sent.decoded_through == 0 and sent.delivered_bytes == 0 and sent.datagrams_sent > 0


def test_the_sent_result_carries_the_transfers_outcome():
    """send's SentResult is what happened on the wire: a complete transfer is complete on
    both sides, with the receiver's transfer id, every byte in order, the sender's
    counters; to_dict() is its JSON status (the id in hex, as the CLI prints it)."""
    t = synthetic_transfer(200_000, 16, seed=5)
    with kvtransport.Receiver(listen="127.0.0.1:0", insecure=True, timeout_s=20) as rx:
        opts = kvtransport.SendOptions(deadline_ms=2000, rate_mbps=100, insecure=True)
        to = rx.address
        sent = kvtransport.send(t, to=to, options=opts)
        got = rx.result(timeout_s=20)
    assert got.is_complete
    assert isinstance(sent, kvtransport.SentResult)
    assert sent.delivered == "complete" and sent.is_complete and not sent.note
    assert sent.transfer_id == got.transfer_id and sent.to == to
    assert sent.bytes == sent.delivered_bytes == t.nbytes
    assert sent.n_source == sent.decoded_through == -(-t.nbytes // DEFAULT_SYMBOL_SIZE)
    assert sent.source_sent >= sent.n_source
    assert sent.datagrams_sent >= sent.source_sent + sent.repair_sent
    assert sent.deadline_s == pytest.approx(2.0, abs=0.01)
    assert sent.stats["socket"]["datagrams_sent"] > 0
    as_json = json.loads(json.dumps(sent.to_dict()))
    assert as_json["transfer_id"] == f"{got.transfer_id:016x}"
    assert as_json["delivered"] == "complete" and as_json["bytes"] == t.nbytes
    assert "srtt_ms" in as_json and "socket" in as_json


def test_send_options_are_checked_and_keep_the_key_out_of_sight():
    secret = kvtransport.SendOptions(key=b"a key of sixteen+ bytes")
    assert "sixteen" not in repr(secret)
    with pytest.raises(UserError, match="options must be a kvtransport.SendOptions"):
        kvtransport.send(synthetic_transfer(1000, 2), to="127.0.0.1:9", options={"rate_mbps": 1})


def test_async_partial_transfer_gives_the_cache_of_what_arrived(tmp_path):
    """A deadline far below the send time: the result is partial, and partial_cache puts
    exactly the complete blocks back (from the result and from its result file). The link
    is slower than a datagram per allocation slot (1 Mbit/s): the lone transfer still goes."""
    cache = _toy_cache()

    async def handoff():
        with kvtransport.Receiver(listen="127.0.0.1:0", timeout_s=20) as rx:
            sent, got = await asyncio.gather(
                kvtransport.send_async(
                    cache,
                    to=rx.address,
                    options=kvtransport.SendOptions(deadline_ms=600, rate_mbps=1, precision="keep"),
                ),
                rx,
            )
        return sent, got

    sent, got = asyncio.run(handoff())
    assert 0 < int(got.complete.sum()) < got.complete.size and not got.is_complete
    assert sent.delivered == "partial" and sent.transfer_id == got.transfer_id
    partial = kvtransport.partial_cache(got)
    assert partial.mask is not None and 0 < partial.present.mean() < 1
    m = partial.manifest
    for i in range(m.num_blocks):
        layer, t0 = int(m.layer[i]), int(m.token_start[i])
        t1 = t0 + int(m.token_count[i])
        assert bool(partial.present[layer, t0:t1].all()) == bool(got.complete[i])
        want = cache.keys[layer, :, t0:t1] if got.complete[i] else 0
        assert np.array_equal(partial.cache.keys[layer, :, t0:t1], np.zeros_like(
            cache.keys[layer, :, t0:t1]) + want)  # fmt: skip
    # the same from the result file a receiver daemon or `recv --out` writes
    path = write_result_file(tmp_path, _as_transfer_result(got), got.stats)
    again = kvtransport.partial_cache(path)
    assert np.array_equal(again.present, partial.present)
    assert np.array_equal(again.cache.keys, partial.cache.keys)


def test_send_with_a_deadline_sends_the_plan():
    """With a deadline the API plans the cache (fp16/int8 by utility, prefix order); the
    receiver gets those blocks, within quantization error of the cache."""
    from kvtransport.kvformat import blocks

    cache = _toy_cache()

    async def handoff():
        opts = kvtransport.SendOptions(deadline_ms=150, rate_mbps=20)
        with kvtransport.Receiver(listen="127.0.0.1:0", timeout_s=20) as rx:
            return await asyncio.gather(kvtransport.send_async(cache, rx.address, options=opts), rx)

    _, got = asyncio.run(handoff())
    partial = kvtransport.partial_cache(got)
    m = partial.manifest
    assert {blocks.PRECISIONS[p] for p in m.precision.tolist()} <= {"fp16", "int8"}
    assert np.all(np.diff(m.token_block.astype(int)) >= 0)
    ok = partial.present
    assert ok.any()
    err = np.abs(partial.cache.keys - cache.keys).max(axis=(1, 3))  # [layers, tokens]
    assert err[ok].max() < 0.05


def test_send_picks_the_policy_for_the_stream_and_the_link():
    """Told no policy, send uses the shipped DDQN, except for a planned (whole-range)
    stream over a link whose assumed RTT is long (kvtransport.hosts.policy_choice.
    default_policy_for); a named policy is always the one used."""
    from kvtransport.hosts.policy_choice import LONG_LINK_HANDOFF_POLICY, LONG_LINK_ONE_WAY_S
    from kvtransport.policies.registry import default_policy

    cache = _toy_cache()
    long_rtt_ms = 2e3 * LONG_LINK_ONE_WAY_S

    def policy_used(**kw) -> str:
        with kvtransport.Receiver(listen="127.0.0.1:0", timeout_s=5) as rx:
            opts = kvtransport.SendOptions(rate_mbps=20, **kw)
            sent = kvtransport.send(cache, to=rx.address, options=opts)
            rx.result(timeout_s=5)
        return sent.policy

    planned = dict(deadline_ms=400, initial_rtt_ms=long_rtt_ms)
    assert policy_used(**planned) == LONG_LINK_HANDOFF_POLICY
    assert policy_used(**planned, policy="fixed:4/32") == "fixed:4/32"
    assert policy_used(deadline_ms=400, initial_rtt_ms=20) == default_policy()
    # kept as the card is (utility order): not whole ranges, the default on any link
    assert policy_used(**planned, precision="keep") == default_policy()


def _as_transfer_result(got):
    from kvtransport.core.transfer import TransferResult, TransportManifest

    manifest = TransportManifest(1280, int(got.payload.size), got.blocks, got.app_metadata)
    return TransferResult(
        got.transfer_id, manifest, got.payload, got.complete, got.missing,
        got.utility_recovered, got.reason,
    )  # fmt: skip


def test_partial_cache_without_a_manifest_needs_the_expected_one():
    from kvtransport.daemons.api import DeliveredResult

    cache = _toy_cache(tokens=32)
    stream = encoding.encode_cache(cache)
    nothing = DeliveredResult(1, 0.0, "idle", None, np.zeros(0, bool), np.zeros(0, np.int64),
                              np.zeros(0, np.uint8), None)  # fmt: skip
    with pytest.raises(UserError, match="manifest never arrived"):
        kvtransport.partial_cache(nothing)
    got = kvtransport.partial_cache(nothing, expected=stream.manifest)
    assert got.cache.keys.shape == cache.keys.shape and not got.present.any()
    assert got.missing.size == stream.manifest.num_blocks


def test_send_refuses_what_it_cannot_send_in_one_line():
    with pytest.raises(UserError, match="cannot send a dict"):
        kvtransport.send({}, to="127.0.0.1:9")
    with pytest.raises(UserError, match="not HOST:PORT"):
        kvtransport.send(synthetic_transfer(1000, 2), to="nowhere")


def _readme_example() -> str:
    text = README.read_text()
    section = text.split("## From your own Python code", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]  # the handoff example


@pytest.mark.model
def test_readme_example_runs_and_answers_as_the_local_cache_does():
    code = _readme_example()
    assert len([ln for ln in code.splitlines() if ln.strip()]) <= 16  # an example
    ns: dict = {"__name__": "readme_example"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), ns)
    got, partial, cache, lm = ns["got"], ns["partial"], ns["cache"], ns["lm"]
    assert got.reason == "complete" and got.is_complete
    # with its deadline the cache crossed as the plan encoded it (fp16 here: it fits)
    scale = np.abs(cache.keys).max()
    assert np.abs(partial.cache.keys - cache.keys).max() <= scale * 2**-10
    assert not np.array_equal(partial.cache.keys, cache.keys)  # it was re-encoded
    from kvtransport.model import hf

    local = hf.greedy_generate(lm.model, cache, ns["question"])
    assert ns["gen"].tokens == local.tokens and local.tokens
    assert out.getvalue().startswith("complete 1.000 ")
