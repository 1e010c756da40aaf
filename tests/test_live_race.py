"""The live race over real UDP on loopback, on the real model.

A real sender (kvtransport.send, in its own process) sends the planned cache of a ~128-token
context to an in-process Receiver whose race builds the cache while it arrives. Over a
clean link the race must load the ranges the plan sends (exactly the bytes the sender
encoded) and compute the rest (exactly a prefill); over a link that delivers nothing (the
sender's key is not the receiver's: every datagram is dropped) it must compute
everything, exactly, in about one prefill. The replay path is pinned by tests/test_race.py.
"""

import dataclasses
import json
import multiprocessing
import threading
import time

import numpy as np
import pytest

import kvtransport
from kvtransport.kvformat import blocks
from kvtransport.model import encoding, hf, tasks
from kvtransport.model.cache_builder import CacheBuilder, ComputeSpeed
from kvtransport.model.plan import LinkEstimate, planned_stream
from kvtransport.policies.registry import default_policy

pytestmark = pytest.mark.model
TOL = 2e-4  # float32 rounding of a chunked against a one-shot prefill (as test_race)
RATE_MBPS = 100.0
PLAN_SPEED = ComputeSpeed(per_call_s=0.02, per_token_s=0.003)
"""What the sender assumes of the receiver (fixed: a measured speed on this shared machine
varies enough to move the plan's split); the race itself uses the measured one."""


@pytest.fixture(scope="module")
def setup(smollm):
    """Context, its prefill, the receiver's speed, one plain prefill's time, the plan."""
    sample = tasks.generate("facts_qa", smollm.tokenizer, target_tokens=128, seed=3)
    ctx, _ = sample.prompt(smollm.tokenizer)
    kv = hf.prefill(smollm.model, smollm.tokenizer, ctx, attention=False)
    # trusted whatever the host's load did to the rounds' spread: these timelines are the
    # trusted speed's (the race's probe of an untrusted speed is test_race.py's)
    speed = dataclasses.replace(ComputeSpeed.measure(smollm.model, ctx), spread=0.0)
    t0 = time.perf_counter()
    CacheBuilder(smollm.model, ctx).compute(len(ctx))
    prefill_s = time.perf_counter() - t0
    plan, stream = _planned(kv, prefill_s, "position")
    return ctx, kv, speed, prefill_s, plan, stream


def _planned(kv, budget_s, order):
    link = LinkEstimate(RATE_MBPS * 1e6, 0.0, 0.0005, 1280)
    return planned_stream(encoding.encode_cache(kv), link=link, budget_s=budget_s,
                          speed=PLAN_SPEED, objective="ttft", order=order)  # fmt: skip


def _send(stream, to, ready, go, kwargs):
    """A sender process: warm up, say so, send when told."""
    from kvtransport.embed.inprocess import as_transfer, warm_kernels

    warm_kernels(kwargs.get("key"), default_policy())
    if kwargs.get("receiver_speed") is not None:  # send() plans first: load its kernels now
        link = LinkEstimate(RATE_MBPS * 1e6, 0.05, 0.0005, 1280)
        as_transfer(stream, (link, 1.0, ("fp16", "int8"), kwargs["receiver_speed"]))
    ready.set()
    go.wait(30)
    opts = kvtransport.SendOptions(**{"precision": "keep", "rate_mbps": RATE_MBPS, **kwargs})
    kvtransport.send(stream, to, options=opts)


class _Sender:
    """kvtransport.send in its own process (as a sending host would be: its pacing loop
    does not share this interpreter with the receiver), started when ``go`` is called."""

    def __init__(self, stream, to, **kwargs):
        mp = multiprocessing.get_context("spawn")
        self.ready, self._go = mp.Event(), mp.Event()
        self.proc = mp.Process(target=_send, args=(stream, to, self.ready, self._go, kwargs))
        self.proc.start()
        assert self.ready.wait(60), "the sender process did not start"

    def go(self):
        self._go.set()

    def join(self):
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()


def _wait_for_first_datagram(rx, timeout_s=20.0):
    """Until the receiver has opened a session for the sender's transfer."""
    t_end = time.monotonic() + timeout_s
    while rx._engine is None or rx._engine.host.adopted is None:
        assert time.monotonic() < t_end, "no datagram from the sender process"
        time.sleep(0.001)


def _when_bound(port, fn, timeout_s=20.0):
    """Call ``fn`` once a UDP socket is bound to ``port`` on this host (/proc/net/udp)."""
    t_end = time.monotonic() + timeout_s
    local = f":{port:04X}"
    while time.monotonic() < t_end:
        with open("/proc/net/udp") as f:
            if any(line.split()[1].endswith(local) for line in list(f)[1:]):
                return fn()
        time.sleep(0.001)


def _err(a, b, lo=0, hi=None):
    sl = slice(lo, hi)
    return float(max(np.abs(a.keys[:, :, sl] - b.keys[:, :, sl]).max(),
                     np.abs(a.values[:, :, sl] - b.values[:, :, sl]).max()))  # fmt: skip


@pytest.mark.parametrize("order", ["position", "back"])
def test_live_race_loads_what_arrives_and_computes_the_rest(smollm, setup, order):
    """Either stream order (back: the last token range first, ranges arriving ahead of
    the race's frontier until it reaches them)."""
    ctx, kv, speed, prefill_s, plan, stream = setup
    if order != "position":
        plan, stream = _planned(kv, prefill_s, order)
    assert 0 < plan.split < len(ctx)  # the plan leaves the receiver a prefix
    sent = blocks.decode_stream(stream.manifest, stream.payload).cache  # what the link carries
    with kvtransport.Receiver("127.0.0.1:0", insecure=True) as rx:
        # a generous sender deadline: a sender process slowed by another test worker on the
        # same cores must not end the stream early (a CI run's sender sent 378 datagrams,
        # 55 of 180 blocks, by a deadline of one prefill); the race's claim is unchanged
        tx = _Sender(stream, rx.address, deadline_ms=3e3 * prefill_s, insecure=True)
        tx.go()
        # the handoff is announced when its first datagram is in: how soon a freshly
        # spawned sender process starts on a shared machine is not what this test measures
        _wait_for_first_datagram(rx)
        res = rx.race(smollm.model, ctx, speed=speed, rate_mbps=RATE_MBPS, hello_ms=300)
        tx.join()
    # the receiver learnt the split from the manifest (it was not told) and loaded most
    # of what the plan sends
    assert res.loaded >= (len(ctx) - plan.split) // 2
    assert res.computed + res.loaded == len(ctx)
    loads = [s for s in res.steps if s.action == "load"]
    computes = [s for s in res.steps if s.action == "compute"]
    assert all(s.start >= plan.split for s in loads)
    for s in loads:  # exactly the sender's bytes
        assert _err(res.kv, sent, s.start, s.start + s.tokens) == 0.0
    for s in computes:  # exactly a prefill
        assert _err(res.kv, kv, s.start, s.start + s.tokens) < TOL
    # up to the int8 quantization, the whole cache is the prefill's
    assert _err(res.kv, kv) < 0.1 * float(np.abs(kv.keys).max())


def test_the_live_race_answers_while_the_layered_tail_arrives(smollm, setup):
    """A plan with the question's pass in it sends the context's last ranges layer by
    layer; the live race (told the question) builds the cache up to them and runs the
    question while they arrive (its last step answers for the tail's tokens), and its
    first token is the prefill's. The plan and the race assume a receiver about three
    times slower than this one, so that the race gets to the tail before it has crossed
    (on a loaded machine too) and waits for it rather than computing it (on an idle one,
    where computing 48 tokens beats a 20 Mbit/s link)."""
    from kvtransport.model.race import layered_tail

    ctx, kv, _, prefill_s, _, _ = setup
    sample = tasks.generate("facts_qa", smollm.tokenizer, target_tokens=128, seed=3)
    _, question = sample.prompt(smollm.tokenizer)
    full = CacheBuilder(smollm.model, ctx)
    full.compute(len(ctx))
    want = full.answer(question)
    rate = 20.0
    link = LinkEstimate(rate * 1e6, 0.0, 0.0005, 1280)
    slow = ComputeSpeed(per_call_s=0.05, per_token_s=0.01)  # a receiver 3x slower than this
    plan, stream = planned_stream(encoding.encode_cache(kv), link=link, budget_s=prefill_s,
                                  speed=slow, objective="ttft",
                                  answer_s=slow.answer_seconds(len(question),
                                                               len(ctx)))  # fmt: skip
    tail_from = layered_tail(stream.manifest)
    assert plan.tail > 0 and tail_from == (len(ctx) - plan.tail) // 16
    sent = blocks.decode_stream(stream.manifest, stream.payload).cache
    with kvtransport.Receiver("127.0.0.1:0", insecure=True) as rx:
        tx = _Sender(stream, rx.address, deadline_ms=2e3 * plan.send_s, insecure=True,
                     rate_mbps=rate)  # fmt: skip
        tx.go()
        _wait_for_first_datagram(rx)
        res = rx.race(smollm.model, ctx, speed=slow, rate_mbps=rate, hello_ms=300,
                      question_ids=question)  # fmt: skip
        tx.join()
    assert res.first_token == want
    last = res.steps[-1]
    assert (last.action, last.start, last.tokens) == ("answer", len(ctx) - plan.tail, plan.tail)
    assert _err(res.kv, sent, last.start) == 0.0  # the tail: exactly the sender's bytes


def test_ranges_are_decoded_as_they_arrive_before_the_race_loads_them(setup):
    """The receiver's decoding thread checks and decodes each range once it is complete,
    while the race is busy elsewhere (computing): here nothing is ever loaded, yet every
    range the sender sent ends up decoded, exactly the sender's bytes."""
    from kvtransport.embed.live_race import LiveArrivals, adopted_session

    ctx, kv, speed, prefill_s, plan, stream = setup
    sent = blocks.decode_stream(stream.manifest, stream.payload).cache
    with kvtransport.Receiver("127.0.0.1:0", insecure=True) as rx:
        src = LiveArrivals(lambda: adopted_session(rx._engine), ctx)
        try:
            tx = _Sender(stream, rx.address, deadline_ms=4e3 * prefill_s, insecure=True)
            tx.go()
            t_end = time.monotonic() + 20
            while not np.isfinite(src.ready_at()[plan.split // 16 :]).all():
                assert time.monotonic() < t_end, "the transfer did not arrive"
                time.sleep(0.005)
            decoder = src._decoder
            while not np.array_equal(
                decoder.keys[:, :, plan.split :], sent.keys[:, :, plan.split :]
            ):
                assert time.monotonic() < t_end, "the arrived ranges were not decoded"
                time.sleep(0.005)
            assert np.array_equal(
                decoder.values[:, :, plan.split :], sent.values[:, :, plan.split :]
            )
        finally:
            src.close()
        tx.join()


def _receiver_daemon(tmp_path, *args):
    """A receiver daemon process on loopback (insecure), its UDP port once it answers."""
    import subprocess
    import sys

    from kvtransport.daemons.api import ApiError
    from kvtransport.embed.client import ReceiverClient

    ctl = f"ipc://{tmp_path}/rx.ipc"
    pub = f"ipc://{tmp_path}/results.ipc"
    argv = [sys.executable, "-m", "kvtransport", "receiver-daemon", "--listen", "127.0.0.1:0",
            "--control", ctl, "--publish", pub, "--insecure", *args]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_end = time.monotonic() + 120
    while True:
        client = ReceiverClient(ctl, timeout_s=2)
        try:
            return proc, int(client.ping()["udp"].rsplit(":", 1)[1])
        except ApiError:
            if proc.poll() is not None or time.monotonic() > t_end:
                proc.kill()
                raise
        finally:
            client.close()


def test_a_receiver_daemon_on_this_host_is_raced_through_its_race_dir(smollm, setup, tmp_path):
    """A receiver daemon (its own process) run with --race-dir mirrors the transfer into
    a file of that folder while it arrives; the race in this process finds the mirror by
    its context, loads the sender's exact bytes and computes the rest exactly. A race for
    another context never loads that transfer. The daemon removes the file when it stops."""
    ctx, kv, speed, prefill_s, plan, stream = setup
    sent = blocks.decode_stream(stream.manifest, stream.payload).cache
    race_dir = tmp_path / "race"
    race_dir.mkdir(mode=0o700)
    proc, port = _receiver_daemon(tmp_path, "--race-dir", str(race_dir))
    try:
        # generous for a slowed sender process, as in the in-process race above
        tx = _Sender(stream, f"127.0.0.1:{port}", deadline_ms=3e3 * prefill_s, insecure=True)
        tx.go()
        t_end = time.monotonic() + 20
        while not list(race_dir.glob("*.kvrace")):  # the handoff is announced
            assert time.monotonic() < t_end, "the daemon shared no transfer"
            time.sleep(0.001)
        (mirror,) = race_dir.glob("*.kvrace")
        assert mirror.stat().st_mode & 0o777 == 0o600
        res = kvtransport.race_daemon(smollm.model, ctx, race_dir=str(race_dir), speed=speed,
                                      rate_mbps=RATE_MBPS, hello_ms=300)  # fmt: skip
        tx.join()
        other = [ctx[1], *ctx[1:]]
        res_other = kvtransport.race_daemon(smollm.model, other, race_dir=str(race_dir),
                                            speed=speed, hello_ms=50, wait_s=0)  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(20)
    assert res.loaded >= (len(ctx) - plan.split) // 2 and res.computed + res.loaded == len(ctx)
    for s in res.steps:
        if s.action == "load":  # exactly the sender's bytes
            assert s.start >= plan.split and _err(res.kv, sent, s.start, s.start + s.tokens) == 0
        elif s.action == "compute":  # exactly a prefill
            assert _err(res.kv, kv, s.start, s.start + s.tokens) < TOL
    assert res_other.loaded == 0
    assert not list(race_dir.iterdir())  # removed when the daemon stopped


def test_answer_races_a_receiver_daemon_from_the_command_line(smollm, tmp_path):
    """`kvtransport answer --context FILE --race-dir DIR`: the downstream agent's command
    races the local receiver daemon's mirror of the context's cache (here complete by the
    time it looks: it loads every token) and answers as re-prefilling the context does."""
    import subprocess
    import sys

    from kvtransport.model.loader import chat_prompt

    text = ("Mira Vance founded the Quillbrook observatory in 1911. Its first telescope was "
            "built by Oskar Lind, and its library holds the Vance letters.")  # fmt: skip
    question = "Who built the first telescope?"
    ctx, _ = chat_prompt(smollm.tokenizer, text, question)
    kv = hf.prefill(smollm.model, smollm.tokenizer, text, attention=False)
    assert kv.token_ids.tolist() == ctx
    (tmp_path / "context.txt").write_text(text)
    race_dir = tmp_path / "race"
    race_dir.mkdir(mode=0o700)
    proc, port = _receiver_daemon(tmp_path, "--race-dir", str(race_dir))
    answer = [sys.executable, "-m", "kvtransport", "answer", "--context",
              str(tmp_path / "context.txt"), "--question", question, "--json",
              "--max-new-tokens", "12", "--threads", "1"]  # fmt: skip
    try:
        tx = _Sender(
            encoding.encode_cache(kv), f"127.0.0.1:{port}", deadline_ms=2000, insecure=True
        )
        tx.go()
        t_end = time.monotonic() + 20
        while not list(race_dir.glob("*.kvrace")):
            assert time.monotonic() < t_end, "the daemon shared no transfer"
            time.sleep(0.01)
        raced = subprocess.run([*answer, "--race-dir", str(race_dir)], capture_output=True,
                               text=True, timeout=120)  # fmt: skip
        tx.join()
    finally:
        proc.terminate()
        proc.wait(20)
    prefilled = subprocess.run(answer, capture_output=True, text=True, timeout=120)
    got, want = json.loads(raced.stdout), json.loads(prefilled.stdout)
    assert got["source"] == "race" and got["race"]["loaded_tokens"] == len(ctx)
    assert got["answer"] == want["answer"] and got["tokens"] == want["tokens"]


def test_a_link_that_delivers_nothing_costs_one_prefill_after_a_short_silence(smollm, setup):
    """The sender's key is not the receiver's: every datagram is dropped. The race must
    not wait for the sender's deadline (3 s) nor the receiver's timeout: once the link has
    been silent well past the first arrival it expects (hello_ms 50: silent after 150 ms)
    it computes the rest of the context in one call, i.e. one prefill after that short
    silence (timed side by side with re-prefilling in scripts/bench_live_race.py)."""
    ctx, kv, speed, prefill_s, plan, stream = setup
    done: list = []
    with kvtransport.Receiver("127.0.0.1:0", key=bytes(range(32))) as rx:
        tx = _Sender(stream, rx.address, deadline_ms=3000, key=bytes(32), rate_mbps=10.0)
        tx.go()
        racer = threading.Thread(target=lambda: done.append(rx.race(smollm.model, ctx,
                                 speed=speed, rate_mbps=RATE_MBPS)), daemon=True)  # fmt: skip
        racer.start()
        racer.join(20)
        assert done, "the race never returned over a dead link"
        dropped = rx._engine.host.drop_reasons.get("bad_tag", 0)
    tx.join()
    res = done[0]
    assert dropped > 0  # the sender did send: the link delivered nothing genuine
    assert res.loaded == 0 and res.computed == len(ctx)
    assert _err(res.kv, kv) < TOL
    *before, last = res.steps
    assert last.action == "compute" and last.start + last.tokens == len(ctx)
    assert last.t0 < 3 * 0.05 + 0.3  # given up on the link soon after 150 ms (not at 3 s)
    assert all(s.t1 <= last.t0 for s in before)


def test_a_transfer_of_another_context_is_not_loaded(smollm, setup):
    """The race is for the context it is given: the cache of another one (here the same
    text with a different first token, so every K/V differs) is computed, never loaded."""
    ctx, kv, speed, prefill_s, plan, stream = setup
    other = [ctx[1], *ctx[1:]]
    want = CacheBuilder(smollm.model, other)
    want.compute(len(other))
    with kvtransport.Receiver("127.0.0.1:0", insecure=True) as rx:
        tx = _Sender(stream, rx.address, deadline_ms=1e3 * prefill_s, insecure=True)
        tx.go()
        res = rx.race(smollm.model, other, speed=speed, rate_mbps=RATE_MBPS)
        tx.join()
    assert res.loaded == 0 and _err(res.kv, want.kv()) < TOL


def test_send_with_the_receivers_speed_leaves_it_the_front(smollm, setup):
    """The user's flow: ``send(cache, receiver_speed=...)`` plans the split for the racing
    receiver, which learns it from the manifest: it computes the front (never sent) and
    loads the rest."""
    ctx, kv, speed, prefill_s, plan, stream = setup
    with kvtransport.Receiver("127.0.0.1:0", insecure=True) as rx:
        tx = _Sender(kv, rx.address, deadline_ms=1e3 * prefill_s, insecure=True,
                     precision="auto", receiver_speed=PLAN_SPEED)  # fmt: skip
        tx.go()
        _wait_for_first_datagram(rx)  # send() plans before its first datagram
        res = rx.race(smollm.model, ctx, speed=speed, rate_mbps=RATE_MBPS, hello_ms=300)
        got = rx.result(timeout_s=10)  # the transfer goes on to its end
        tx.join()
    sent = blocks.Manifest.from_bytes(got.app_metadata)
    front = int(sent.token_block.min()) * sent.geometry.block_tokens
    assert front > 0  # the plan left the receiver the front and did not send it
    loads = [s for s in res.steps if s.action == "load"]
    first = next(s for s in res.steps if s.action != "wait")  # after the manifest came
    assert first.action == "compute" and first.start == 0
    # what it loads it loads after the front; how much it loads depends on how fast the
    # sender process's datagrams come on a shared host (a late range is computed, correctly):
    # test_live_race_loads_what_arrives_and_computes_the_rest checks the amount
    assert loads and min(s.start for s in loads) >= front and res.loaded > 0
    assert _err(res.kv, kv) < 0.1 * float(np.abs(kv.keys).max())


def test_silence_before_the_plan_is_known_does_not_give_up_on_a_late_transfer(smollm, setup):
    """Before the manifest the live race's view of the link is a guess (settled=False):
    once it is silent the receiver computes from the front in chunks that double, not the
    whole rest in one call, so ranges that arrive late (a sender that starts late) are
    still loaded. Replayed (kvtransport.model.race.run_race) for a deterministic timeline: the
    first range was guessed at 10 ms, the link is silent after 70 ms, ranges 2.. arrive at
    80 ms, while the receiver computes its first chunk."""
    from kvtransport.model.race import LinkView, run_race

    ctx, kv, speed, prefill_s, plan, stream = setup
    bt = 16
    ranges = -(-len(ctx) // bt)
    ready = np.full(ranges, np.inf)
    ready[2:] = 0.08
    guess = LinkView(np.full(ranges, 0.01), np.ones(ranges), np.inf, settled=False)
    res = run_race(smollm.model, ctx, split=0, received=kv, ready_at=ready, link=guess,
                   speed=speed, block_tokens=bt, max_chunk=2 * bt)  # fmt: skip
    assert [s.action for s in res.steps if s.action != "wait"] == ["compute", "load"]
    assert res.computed == 2 * bt and res.loaded == len(ctx) - 2 * bt
    assert _err(res.kv, kv) < TOL


def test_race_receive_binds_races_and_closes(smollm, setup):
    """The one-call form: Receiver options and race options in one call."""
    import socket

    ctx, kv, speed, prefill_s, plan, stream = setup
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the sender's own deadline is not what this test is about: a generous one keeps a
    # sender slowed by another test worker on the same cores from ending the stream early
    # (in a CI run it sent 619 datagrams by a 0.4 s deadline, 16 Mbit/s of a 100 Mbit/s link)
    tx = _Sender(stream, f"127.0.0.1:{port}", deadline_ms=3e3 * prefill_s, insecure=True)
    threading.Thread(target=_when_bound, args=(port, tx.go), daemon=True).start()
    # the sender starts when the port is bound; the race, which starts then too, expects
    # its first datagram within 150 ms
    res = kvtransport.race_receive(smollm.model, ctx, listen=f"127.0.0.1:{port}",
                                   insecure=True, speed=speed, rate_mbps=RATE_MBPS,
                                   hello_ms=150)  # fmt: skip
    tx.join()
    assert res.loaded >= (len(ctx) - plan.split) // 2
    assert _err(res.kv, kv) < 0.1 * float(np.abs(kv.keys).max())
