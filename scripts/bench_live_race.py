#!/usr/bin/env python3
"""The live race against re-prefilling, side by side, over real UDP on loopback.

One process holds the model (SmolLM2-135M-Instruct, ``--threads`` torch threads) and
builds a context of about ``--tokens`` tokens (a facts_qa sample). Per round, interleaved:

    reprefill  the receiver computes the whole context itself (one CacheBuilder call: what
               a receiver without this product does), then runs the question;
    link down  the same race with nobody sending (the fallback);
    race       a sender process (kvtransport.send, paced at ``--rate-mbps``, the plan's
               stream: ttft objective, budget = the measured prefill, the context's last
               ranges layer by layer unless ``--no-tail``) sends to an in-process
               kvtransport.Receiver whose ``race`` builds the same cache while the KV
               streams in and ends with the question's first token, run through the model
               while the tail arrives (kvtransport.embed.live_race); with ``--via daemon`` to a
               receiver daemon process (``--race-dir``) that this process races through
               its mirror of the transfer (kvtransport.race_daemon).

The sender runs in its own process (its pacing loop would otherwise share this process's
interpreter with the receiver's loop and the model); it warms up first and starts sending
when the race starts. Figures: seconds until the whole cache is in place and until the
question's first token (TTFT; medians of ``--rounds``), the ratios, tokens computed /
loaded, and whether the first token and the greedy answer to the sample's question from
the race's cache equal those from the prefill's. Writes results/bench_live_race.json.

    .venv/bin/python scripts/bench_live_race.py --tokens 512 --rate-mbps 100
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import platform
import statistics
import time
from pathlib import Path
from typing import Any


def _sender(stream: Any, to: str, deadline_ms: float, rate_mbps: float, ready: Any,
            go: Any) -> None:  # fmt: skip
    import kvtransport
    from kvtransport.embed.inprocess import warm_kernels
    from kvtransport.policies.registry import default_policy

    warm_kernels(None, default_policy())
    ready.set()
    go.wait(60)
    opts = kvtransport.SendOptions(deadline_ms=deadline_ms, precision="keep",
                                   rate_mbps=rate_mbps, insecure=True)  # fmt: skip
    kvtransport.send(stream, to, options=opts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rate-mbps", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--no-tail",
        action="store_true",
        help="plan no layer-by-layer tail (the question runs after the cache)",
    )
    ap.add_argument("--via", choices=("inprocess", "daemon"), default="inprocess",
                    help="race an in-process Receiver or a local receiver daemon")  # fmt: skip
    ap.add_argument("--out", default="results/bench_live_race.json")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        daemon = _receiver_daemon(stack) if args.via == "daemon" else None
        _bench(args, daemon)


def _receiver_daemon(stack: contextlib.ExitStack) -> tuple[int, Path]:
    """A receiver daemon process mirroring its transfers into a fresh folder (under
    /dev/shm where there is one): its UDP port and that folder. Stopped by ``stack``."""
    import subprocess
    import sys
    import tempfile

    from kvtransport.daemons.api import ApiError
    from kvtransport.embed.client import ReceiverClient

    shm = Path("/dev/shm")
    base = Path(stack.enter_context(tempfile.TemporaryDirectory(
        dir=shm if shm.is_dir() else None)))  # fmt: skip
    race_dir = base / "race"
    race_dir.mkdir(mode=0o700)
    ctl = f"ipc://{base}/rx.ipc"
    argv = [sys.executable, "-m", "kvtransport", "receiver-daemon", "--listen", "127.0.0.1:0",
            "--control", ctl, "--publish", f"ipc://{base}/results.ipc", "--insecure",
            "--race-dir", str(race_dir)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(proc.wait, 20)
    stack.callback(proc.terminate)
    t_end = time.monotonic() + 120
    while True:
        client = ReceiverClient(ctl, timeout_s=2)
        try:
            return int(client.ping()["udp"].rsplit(":", 1)[1]), race_dir
        except ApiError:
            if proc.poll() is not None or time.monotonic() > t_end:
                raise SystemExit("the receiver daemon did not start") from None
        finally:
            client.close()


def _bench(args: argparse.Namespace, daemon: tuple[int, Path] | None) -> None:

    import kvtransport
    from kvtransport.model import encoding, hf, tasks
    from kvtransport.model.cache_builder import CacheBuilder, ComputeSpeed
    from kvtransport.model.loader import load_model
    from kvtransport.model.plan import LinkEstimate, planned_stream

    lm = load_model(threads=args.threads)
    sample = tasks.generate("facts_qa", lm.tokenizer, target_tokens=args.tokens, seed=1)
    ctx, question = sample.prompt(lm.tokenizer)
    kv = hf.prefill(lm.model, lm.tokenizer, ctx, attention=False)
    speed = ComputeSpeed.measure(lm.model, ctx)
    q = list(question)
    answer_s = 0.0 if args.no_tail else speed.answer_seconds(len(q), len(ctx))
    rows: dict[str, list[float]] = {
        "reprefill_s": [],
        "race_s": [],
        "dead_s": [],
        "reprefill_ttft_s": [],
        "ttft_s": [],
        "dead_ttft_s": [],
    }
    first_tokens: list[tuple[int, int | None]] = []  # (re-prefill's, the race's)
    races = []
    steps: list[list[tuple[str, int, int, float, float]]] = []
    ctxp = mp.get_context("spawn")
    prefill_kv = None
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        b = CacheBuilder(lm.model, ctx)
        b.compute(len(ctx))
        rows["reprefill_s"].append(time.perf_counter() - t0)
        want = b.answer(q)
        rows["reprefill_ttft_s"].append(time.perf_counter() - t0)
        prefill_kv = b.kv()
        budget = rows["reprefill_s"][-1]
        link = LinkEstimate(args.rate_mbps * 1e6, 0.0, 0.0005, 1280)
        plan, stream = planned_stream(encoding.encode_cache(kv), link=link, budget_s=budget,
                                      speed=speed, objective="ttft",
                                      answer_s=answer_s)  # fmt: skip
        with contextlib.ExitStack() as stack:
            if daemon is None:
                rx = stack.enter_context(kvtransport.Receiver("127.0.0.1:0", insecure=True))
                to = rx.address
            else:
                to = f"127.0.0.1:{daemon[0]}"
                for old in daemon[1].glob("*.kvrace"):  # the last round's: not this one
                    old.unlink()
            ready, go = ctxp.Event(), ctxp.Event()
            proc = ctxp.Process(target=_sender, args=(stream, to, 1e3 * budget,
                                                      args.rate_mbps, ready, go))  # fmt: skip
            proc.start()
            ready.wait(60)
            go.set()
            if daemon is None:
                res = rx.race(lm.model, ctx, speed=speed, rate_mbps=args.rate_mbps,
                              question_ids=q)  # fmt: skip
            else:
                res = kvtransport.race_daemon(lm.model, ctx, race_dir=str(daemon[1]),
                                              speed=speed, rate_mbps=args.rate_mbps,
                                              question_ids=q)  # fmt: skip
            proc.join(30)
        rows["race_s"].append(res.seconds)
        rows["ttft_s"].append(res.answer_s)
        first_tokens.append((want, res.first_token))
        with kvtransport.Receiver("127.0.0.1:0", insecure=True) as rx:  # nobody sends
            dead = rx.race(lm.model, ctx, speed=speed, rate_mbps=args.rate_mbps,
                           question_ids=q)  # fmt: skip
        assert dead.computed == len(ctx)
        rows["dead_s"].append(dead.seconds)
        rows["dead_ttft_s"].append(dead.answer_s)
        races.append((plan.split, res.computed, res.loaded, res.waited_s, res.kv))
        steps.append([(x.action, x.start, x.tokens, round(x.t0, 4), round(x.t1, 4))
                      for x in res.steps if x.action != "wait"])  # fmt: skip
    assert prefill_kv is not None
    ref = lm.tokenizer.decode(hf.greedy_generate(lm.model, prefill_kv, q).tokens)
    got = lm.tokenizer.decode(hf.greedy_generate(lm.model, races[-1][4], q).tokens)
    re_s, race_s = statistics.median(rows["reprefill_s"]), statistics.median(rows["race_s"])
    re_t, race_t = (statistics.median(rows[k]) for k in ("reprefill_ttft_s", "ttft_s"))
    out = {
        "tokens": len(ctx),
        "rate_mbps": args.rate_mbps,
        "threads": args.threads,
        "via": args.via,
        "tail_tokens": plan.tail,
        "speed": {
            "per_call_s": speed.per_call_s,
            "per_token_s": speed.per_token_s,
            "per_pair_s": speed.per_pair_s,
        },
        "reprefill_s": rows["reprefill_s"],
        "race_s": rows["race_s"],
        "median_reprefill_s": re_s,
        "median_race_s": race_s,
        "speedup": re_s / race_s,
        "reprefill_ttft_s": rows["reprefill_ttft_s"],
        "ttft_s": rows["ttft_s"],
        "ttft_speedup": re_t / race_t,
        "dead_ttft_s": rows["dead_ttft_s"],
        "median_dead_ttft_over_reprefill": statistics.median(rows["dead_ttft_s"]) / re_t,
        "first_token_equal": all(a == b for a, b in first_tokens),
        "dead_s": rows["dead_s"],
        "median_dead_over_reprefill": statistics.median(rows["dead_s"]) / re_s,
        "split_computed_loaded_waited": [r[:4] for r in races],
        "race_steps": steps,
        "answer_equal": ref == got,
        "answers": {"reprefill": ref, "race": got},
        "machine": platform.platform(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{len(ctx)} tokens at {args.rate_mbps:g} Mbit/s: re-prefill {re_s:.3f} s, live race "
          f"{race_s:.3f} s ({re_s / race_s:.2f}x); answers equal: {ref == got}")  # fmt: skip
    print(f"  TTFT: re-prefill {re_t:.3f} s, handoff {race_t:.3f} s ({re_t / race_t:.2f}x; tail "
          f"{plan.tail} tokens); first tokens equal: {out['first_token_equal']}")  # fmt: skip
    print(
        f"  link down (nobody sends): {statistics.median(rows['dead_s']):.3f} s "
        f"({statistics.median(rows['dead_s']) / re_s:.2f}x re-prefill)"
    )
    for (split, computed, loaded, waited, _), st in zip(races, steps, strict=True):
        print(f"  split {split}: computed {computed}, loaded {loaded}, waited {waited:.3f} s; {st}")


if __name__ == "__main__":
    main()
