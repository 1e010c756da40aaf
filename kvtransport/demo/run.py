"""The demo: one KV-cache handoff across a burst-loss link, five repair schemes side by side.

What :func:`run_demo` (``kvtransport demo``) does:

1. The real model (kvtransport.model.loader; SmolLM2-135M-Instruct by default) prefills the
   context of a seeded task (kvtransport.model.tasks: invented facts by default) once. The
   cache becomes a cache card (kvtransport.kvformat.card: blocks in utility order), kept in
   ``$KVT_CACHE/demo`` so that the next run with the same task skips this prefill.
2. A sender and a receiver start once, in processes of their own, and the card crosses
   between them once per scheme: no FEC, block Reed-Solomon, fixed-rate RLC, the adaptive
   heuristic and the shipped Double-DQN policy (kvtransport.policies.registry names ``none``,
   ``block-rs:4/32``, ``fixed:4/32``, ``adaptive``, ``ddqn``). The deadline is rho times
   the loss-free send time; the link is the ``ge-heavy`` profile (100 Mbit/s, 5 ms,
   Gilbert-Elliott bursts, about 12 % loss) in both directions. Two links:

   - ``netns`` (root): the real ``kvtransport sender-daemon`` and ``receiver-daemon`` in
     the two network namespaces of the testbed (kvtransport.netem.testbed: kernel netem,
     or rate limiting plus the userspace relay where the kernel has no sch_netem), at
     real-time priority, driven through the ZeroMQ client API (kvtransport.embed.client).
   - ``emulated`` (any user, and the fallback when not root): the sender and receiver
     sessions (kvtransport.core.sender and .receiver, inside the daemons) in two processes, joined
     by the userspace channel of the same profile (kvtransport.netem.Channel: the loss
     models the simulator and the relay use) on the link's own clock.
3. For each scheme the receiver rebuilds the partial cache once, injects it with the
   missing blocks masked per layer (kvtransport.model.hf) and answers ``questions`` questions
   about the context (kvtransport.model.tasks.question_set: the task's own first, then other
   facts the same context states, drawn by the seed). Each answer is scored with token F1
   against the full cache's answer to the same question (kvtransport.model.metrics); the row
   shows the mean F1 and how many answers equal the full cache's. Why several: a 135M
   model's answer to one question can flip on a small difference in the cache, so one
   answer is a knife edge, while the share of questions answered as with the full cache
   follows what arrived. Only the answering repeats (one transfer per scheme). TTFT is
   measured both ways on the first question: the handoff's (transfer until the receiver's
   result, rebuild, injection, first token) and re-prefilling the context (prefill, first
   token).

The pieces: kvtransport.demo.demo_report (schemes, configuration, results, the table and the
JSON), kvtransport.demo.demo_model (card, rebuild, answer), kvtransport.demo.demo_links (the link
interface, choosing and opening one), kvtransport.demo.demo_netns and
kvtransport.demo.demo_emulated (the two links; the latter explains why the emulated link keeps
its own clock, so that the same ``--seed`` gives the same table). This module runs them
in order.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.demo.demo_emulated import EmulatedLink, PeerError
from kvtransport.demo.demo_links import LINKS, PROFILE, Link, LinkOutcome, NoTimeToSend
from kvtransport.demo.demo_model import (
    answer,
    default_card_dir,
    link_profile,
    plan_stream,
    prepare_card,
    rebuild,
)
from kvtransport.demo.demo_netns import NetnsLink
from kvtransport.demo.demo_report import (
    DEMO_CACHE_COPIES,
    MAX_QUESTIONS,
    MAX_REPEATS,
    MAX_TOKENS,
    SCHEMES,
    DemoConfig,
    DemoReport,
    SchemeResult,
    determinism_text,
    render_table,
    report_json,
)
from kvtransport.demo.host_load import LoadWatch, load_text
from kvtransport.errors import UserError

__all__ = [
    "SCHEMES",
    "DemoConfig",
    "DemoReport",
    "EmulatedLink",
    "LinkOutcome",
    "NetnsLink",
    "SchemeResult",
    "choose_link",
    "default_card_dir",
    "open_link",
    "prepare",
    "prepare_card",
    "render_table",
    "report_json",
    "run_demo",
    "transfer_id_for",
]


def choose_link(requested: str) -> tuple[str, str]:
    """(link, note): "netns" or "emulated", and why when "auto" did not pick netns.

    ``auto`` takes the namespaces when the process is root and ``ip``/``tc`` exist, else
    the emulated link (a note, not an error). Asking for ``netns`` without root is a
    UserError.
    """
    if requested not in LINKS:
        raise UserError(f"--link must be one of {', '.join(LINKS)}, not {requested!r}")
    if requested == "emulated":
        return "emulated", ""
    from kvtransport.netem.testbed import check_environment

    try:
        check_environment()
    except UserError as exc:
        if requested == "netns":
            raise
        return "emulated", f"network namespaces unavailable ({exc}); using the emulated link"
    return "netns", ""


@contextlib.contextmanager
def open_link(
    link: str,
    seed: int,
    policies: tuple[str, ...] = (),
    *,
    fallback: bool = False,
    profile: Any = PROFILE,
) -> Iterator[tuple[Link, str]]:
    """(link object, note) for "netns" or "emulated" carrying ``profile`` (a name or a
    kvtransport.netem Profile), closed on exit; both start loading ``policies`` at once.
    With ``fallback``, a testbed that cannot come up gives the emulated link and a note
    saying why."""
    note = ""
    if link == "netns":
        try:
            obj: Link = NetnsLink(seed, profile=profile, policies=policies)
        except UserError as exc:
            if not fallback:
                raise
            note = f"the netns testbed did not come up ({exc}); using the emulated link"
            obj = EmulatedLink(profile=profile, policies=policies)
    else:
        obj = EmulatedLink(profile=profile, policies=policies)
    try:
        yield obj, note
    finally:
        obj.close()


_TID_BASE = 0x6B76_7464_0000_0000  # "kvtd": transfer ids are derived from the seed


class _Progress:
    """tqdm bars on stderr (only on a terminal, and only when asked for)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()

    def bar(self, total: float, desc: str, unit: str = "it", fmt: str | None = None) -> Any:
        """A bar (a silent one when disabled or when there is nothing to count)."""
        from tqdm import tqdm

        return tqdm(
            total=total,
            desc=desc,
            unit=unit,
            bar_format=fmt,
            disable=not self.enabled or not total,
            leave=False,
            file=sys.stderr,
            dynamic_ncols=True,
        )

    def note(self, text: str) -> None:
        if self.enabled:
            from tqdm import tqdm

            tqdm.write(text, file=sys.stderr)


def transfer_id_for(seed: int, index: int) -> int:
    """The transfer id of scheme ``index`` for ``seed`` (ids are part of the datagrams, so
    a repeatable run needs repeatable ids)."""
    return (_TID_BASE + (int(seed) & 0xFFFF) * 256 + index) & (2**64 - 1)


def run_demo(cfg: DemoConfig, loaded: Any = None) -> DemoReport:
    """Run the demo (see the module docstring); ``loaded`` reuses a loaded model.

    The link opens first, so a link that cannot work fails before the slow model load and
    its processes load their code while the model prefills.
    """
    _check_config(cfg)
    t_all = time.perf_counter()
    load = LoadWatch(cfg.threads)
    load.sample(own=0.0)  # before the demo computes anything: other work only
    link, note = choose_link(cfg.link)
    ui = _Progress(cfg.progress)
    timings: dict[str, float] = {}
    rows = _scheme_rows(cfg.schemes)
    policies = tuple(r.policy for r in rows if not r.error)
    profile = link_profile(cfg.link_rate_mbps or cfg.rate_mbps)
    with open_link(link, cfg.seed, policies, fallback=cfg.link == "auto", profile=profile) as (
        lk,
        fell_back,
    ):
        if fell_back:
            link, note = lk.name, fell_back
        if note:
            ui.note(f"note: {note}")
        link_text = lk.describe()
        measured = _measure(cfg, loaded, ui, timings)
        t = time.perf_counter()
        lk.ready()  # warm daemons, and the link's round trip measured with them
        timings["link_ready"] = time.perf_counter() - t
        prep = _plan(cfg, measured, ui, timings, lk.rtt_s)
        t = time.perf_counter()
        lk.load(prep.transfer)
        outcomes = _run_transfers(lk, rows, prep.deadline_s, cfg.seed, ui)
        if link == "netns":  # the same bytes over TCP through the same link
            rows += _tcp_rows(lk, prep.deadline_s, outcomes, len(rows), ui)
        timings["transfers"] = time.perf_counter() - t
    load.sample(own=cfg.threads)
    t = time.perf_counter()
    baseline = _answer_all(cfg, prep, rows, outcomes, ui)
    timings["answers"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t_all
    load.sample(own=cfg.threads)
    rep = _report(cfg, link, note, link_text, prep, baseline, rows, timings)
    rep.host = load.summary()
    if rep.host["loaded"]:
        ui.note(f"note: {load_text(rep.host, cfg.repeats)}")
    return rep


def _scheme_rows(labels: tuple[str, ...] | None = None) -> list[SchemeResult]:
    """One row per scheme; a policy that cannot be made here (no shipped DDQN weights, say)
    keeps its row with the reason instead of stopping the demo."""
    from kvtransport.policies.registry import make_policy

    rows = [
        SchemeResult(label, spec) for label, spec in SCHEMES if labels is None or label in labels
    ]
    for row in rows:
        try:
            make_policy(row.policy)
        except UserError as exc:
            row.error = f"unavailable: {exc}"
    return rows


@dataclass
class _Measured:
    """The model, the task's two halves, the full cache's stream and the receiver's speed:
    everything the plan needs but the link."""

    loaded: Any
    sample: Any
    context_ids: list[int]
    question_ids: list[int]
    probes: tuple[Any, ...]  # the questions asked (TaskSamples; probes[0] is sample)
    probe_ids: list[list[int]]  # their question ids (probe_ids[0] is question_ids)
    stream: Any  # the full cache's stream (fp32, utility order): the card
    cached: bool
    speed: Any  # the receiver's measured compute speed (kvtransport.model.cache_builder)


@dataclass
class _Prepared(_Measured):
    """:class:`_Measured`, the plan and the block stream that crosses."""

    budget_s: float  # the TTFT budget
    plan: Any  # kvtransport.model.plan.HandoffPlan
    planned: Any  # the stream the plan sends (kvtransport.kvformat.blocks.EncodedStream)
    transfer: Any
    send_time_s: float  # the planned stream's loss-free time at the link rate
    deadline_s: float  # the transport's deadline (from the transfer's start)
    rtt_s: float | None = None  # the round trip the link measured (None: the profile's)


def _prepare(
    cfg: DemoConfig,
    loaded: Any,
    ui: _Progress,
    timings: dict[str, float],
    rtt_s: float | None = None,
) -> _Prepared:
    """The model loaded, the card, the receiver's speed and the plan for a link whose
    round trip is ``rtt_s`` (None: the profile's)."""
    return _plan(cfg, _measure(cfg, loaded, ui, timings), ui, timings, rtt_s)


def prepare(cfg: DemoConfig, loaded: Any, rtt_s: float | None = None) -> _Prepared:
    """:func:`_prepare` without progress bars or timings: what :func:`race_ttft_once` and
    :func:`reprefill_ttft_once` take (scripts/eval_handoff.py)."""
    return _prepare(cfg, loaded, _Progress(False), {}, rtt_s)


def _measure(cfg: DemoConfig, loaded: Any, ui: _Progress, timings: dict[str, float]) -> _Measured:
    from kvtransport.model import tasks
    from kvtransport.model.cache_builder import ComputeSpeed
    from kvtransport.model.loader import load_model, set_threads

    t = time.perf_counter()
    if loaded is None:
        ui.note("loading the model ...")
        loaded = load_model(threads=cfg.threads)
    else:
        set_threads(cfg.threads)
    timings["load_model"] = time.perf_counter() - t
    tok = loaded.tokenizer
    try:
        sample = tasks.generate(cfg.task, tok, target_tokens=cfg.tokens, seed=cfg.seed)
    except ValueError as exc:  # the task cannot fill --tokens
        raise UserError(f"--tokens {cfg.tokens}: {exc}") from None
    context_ids, question_ids = sample.prompt(tok)
    probes = tasks.question_set(sample, cfg.questions)
    probe_ids = [question_ids] + [p.prompt(tok)[1] for p in probes[1:]]
    _check_context(cfg, loaded, len(context_ids), max(len(q) for q in probe_ids))
    ui.note(f"prefilling {len(context_ids)} context tokens ({cfg.task}, seed {cfg.seed}) ...")
    stream, cached, timings["card_prefill"] = prepare_card(
        loaded, sample, context_ids, cfg.card_dir
    )
    t = time.perf_counter()
    if cfg.compute_speed is not None:
        speed = ComputeSpeed(*cfg.compute_speed)
    else:
        speed = ComputeSpeed.measure(loaded.model, context_ids)
    timings["measure_speed"] = time.perf_counter() - t
    if not speed.trusted:
        ui.note(f"the compute speed's timed rounds disagree (spread {speed.spread:.2f}): "
                "planning on the slowest, the last tokens sent first, the race learns its "
                "real speed from its first chunk")  # fmt: skip
    return _Measured(loaded, sample, context_ids, question_ids, probes, probe_ids, stream,
                     cached, speed)  # fmt: skip


def _plan(
    cfg: DemoConfig,
    m: _Measured,
    ui: _Progress,
    timings: dict[str, float],
    rtt_s: float | None = None,
) -> _Prepared:
    """The plan for the TTFT budget over a link whose round trip is ``rtt_s`` (None: the
    profile's), and the transfer it sends."""
    from kvtransport.core.protocol import DEFAULT_SYMBOL_SIZE
    from kvtransport.core.wire import full_send_time

    t = time.perf_counter()
    speed, context_ids, question_ids = m.speed, m.context_ids, m.question_ids
    profile = link_profile(cfg.rate_mbps)
    # the receiver's own estimate of re-prefilling (context, then the question): the
    # budget is a share of it, as a user would set a TTFT target
    budget_s = cfg.budget * (speed.seconds(len(context_ids)) + speed.seconds(len(question_ids)))
    answer_s = speed.answer_seconds(len(question_ids), len(context_ids)) if cfg.tail else 0.0
    one_way_s = None if rtt_s is None else rtt_s / 2
    plan, planned, link_budget = plan_stream(m.stream, context_ids, profile, speed, budget_s,
                                             len(question_ids), cfg.precision,
                                             cfg.objective, cfg.order, hedge=cfg.hedge,
                                             answer_s=answer_s,
                                             one_way_s=one_way_s)  # fmt: skip
    transfer = planned.to_transfer()
    # both links seal every datagram (a per-run key): a 16-byte tag each
    send_time = full_send_time(transfer.nbytes, profile.rate_bps, DEFAULT_SYMBOL_SIZE, True)
    timings["plan"] = time.perf_counter() - t
    ui.note(f"plan: {plan.describe()}")
    deadline = max(link_budget, plan.finish_s, plan.send_s)  # the hedge too
    return _Prepared(
        m.loaded, m.sample, m.context_ids, m.question_ids, m.probes, m.probe_ids, m.stream,
        m.cached, speed, budget_s, plan, planned, transfer, send_time, deadline, rtt_s,
    )  # fmt: skip


def _run_transfers(
    lk: Any, rows: list[SchemeResult], deadline_s: float, seed: int, ui: _Progress
) -> dict[int, LinkOutcome]:
    """Each runnable scheme's transfer over the open link, with a progress bar each."""
    outcomes: dict[int, LinkOutcome] = {}
    total_ms = deadline_s * 1e3
    fmt = "{desc:<13} {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} ms to the deadline"
    for i, row in enumerate(rows):
        if row.error:
            continue
        with ui.bar(total_ms, row.label, fmt=fmt) as bar:

            def step(frac: float, bar: Any = bar, total_ms: float = total_ms) -> None:
                bar.n = round(total_ms * frac)
                bar.refresh()

            try:
                outcomes[i] = lk.transfer(
                    row.policy,
                    deadline_s=deadline_s,
                    transfer_id=transfer_id_for(seed, i),
                    seed=seed,
                    on_progress=step,
                )
            except NoTimeToSend as exc:  # a slow host's plan: the receiver computes it all
                outcomes[i] = nothing_crossed(NOTHING_CROSSED)
                why = _refusal_words(str(exc))
                row.note = f"{why}: nothing crossed, the receiver computed every token"
            except PeerError as exc:
                row.error = str(exc)
    return outcomes


NOTHING_CROSSED = "no time to send"
"""The reason of a transfer the sender refused for want of time (nothing crossed)."""


def nothing_crossed(reason: str = "") -> LinkOutcome:
    """The outcome of a transfer of which nothing arrived (the receiver computes it all)."""
    return LinkOutcome(0.0, reason, np.zeros(0, bool), np.zeros(0, np.uint8), None, 0.0)


def _refusal_words(message: str) -> str:
    """A sender's no-time refusal shortened for a table note: what it found, not its advice
    (the demo follows the advice itself: its transfers assume the measured round trip)."""
    text = message.removeprefix("submit: ")
    return text.split("; ")[0]


TCP_CONGESTION = ("cubic", "bbr")
"""TCP congestion controls of the TCP rows (where the kernel has them): cubic is Linux's
default; bbr does not back off on random loss."""


def _tcp_rows(
    lk: Any, deadline_s: float, outcomes: dict[int, LinkOutcome], first: int, ui: _Progress
) -> list[SchemeResult]:
    """What users of a KV store over TCP get: the planned stream over one TCP connection
    (kvtransport.demo.tcp_baseline) through the same link, cut at the same deadline."""
    available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
    try:
        have = set(available.read_text().split())
    except OSError:
        have = set()
    rows: list[SchemeResult] = []
    for cc in TCP_CONGESTION:
        row = SchemeResult(f"TCP {cc}", f"tcp:{cc}")
        if cc not in have:
            row.error = f"unavailable: this kernel has no {cc}"
        else:
            ui.note(f"TCP ({cc}) across the same link ...")
            try:
                outcomes[first + len(rows)] = lk.tcp_transfer(deadline_s, congestion=cc)
            except UserError as exc:
                row.error = str(exc)
        rows.append(row)
    return rows


def _answer_all(
    cfg: DemoConfig,
    prep: _Prepared,
    rows: list[SchemeResult],
    outcomes: dict[int, LinkOutcome],
    ui: _Progress,
) -> dict[str, Any]:
    """Re-prefill (the TTFT baseline), the full cache's answers (the F1 references), the
    answers with no cache at all (the floor: what the model answers from the question
    alone), a dead link (the receiver's race computes everything: the fallback), then
    each scheme's answers from the cache its race built (kvtransport.model.race: the planned
    prefix computed, the rest loaded as it arrived or recomputed); fills the rows,
    returns the baselines."""

    from kvtransport.kvformat import blocks

    lm, qs, n_new = prep.loaded, prep.probe_ids, cfg.max_new_tokens
    with ui.bar(len(qs) * (4 + len(outcomes)), "answering", unit="answer") as bar:

        def ask(kv: Any, present: Any) -> tuple[list[str], float]:
            """Every question's answer from one cache; seconds to Q1's first token."""
            texts, first = [], 0.0
            for j, q in enumerate(qs):
                text, t_first = answer(lm, kv, present, q, n_new)
                texts.append(text)
                first = t_first if j == 0 else first
                bar.update(1)
            return texts, first

        plain, prefill_s = reprefilled(prep)
        re_answers, re_first = ask(plain, None)
        del plain
        stream = prep.stream
        full = blocks.decode_stream(stream.manifest, stream.payload, token_ids=prep.context_ids)
        full_answers, _ = ask(full.cache, None)
        del full
        reprefill_ttft = prefill_s + re_first
        # the floor: nothing of the context (every block masked), the question alone
        nothing = nothing_crossed()
        floor_answers, _ = ask(*rebuild(stream, nothing, prep.context_ids))
        floor = _scores(floor_answers, full_answers)
        dead = _race_row(prep, nothing, ask, full_answers, reprefill_ttft,
                         SchemeResult("link down", "-"))  # fmt: skip
        for i, out in outcomes.items():
            _race_row(prep, out, ask, full_answers, reprefill_ttft, rows[i])
    timed = [(dead, nothing)] + [(rows[i], out) for i, out in outcomes.items()]
    reprefill_rounds = _repeat_timings(cfg, prep, timed, reprefill_ttft, ui)
    return {
        "full_answers": full_answers,
        "reprefill_answers": re_answers,
        "no_cache": floor,
        "link_down": dead,
        "reprefill": {
            "answer": re_answers[0],
            "prefill_s": prefill_s,
            "ttft_s": statistics.median(reprefill_rounds),
            "ttft_rounds": reprefill_rounds,
        },  # fmt: skip
    }


def _repeat_timings(
    cfg: DemoConfig,
    prep: _Prepared,
    timed: list[tuple[SchemeResult, LinkOutcome]],
    reprefill_ttft: float,
    ui: _Progress,
) -> list[float]:
    """Rounds 2..``cfg.repeats`` of the TTFT measurements (re-prefill, then each row's
    race and first token), the first round being the answering one: sets each row's
    ``ttft_rounds``, its ``ttft_s`` to their median and its ``speedup`` to the median of
    the rounds' ratios; returns re-prefill's TTFT per round."""
    re_t = [reprefill_ttft]
    row_t: list[list[float]] = []
    for row, _ in timed:
        assert row.ttft_s is not None  # every timed row has raced once
        row_t.append([row.ttft_s])
    rounds = cfg.repeats - 1
    with ui.bar(rounds * (1 + len(timed)), "timing again", unit="TTFT") as bar:
        for _ in range(rounds):  # (no bar shows for a single round: nothing is timed again)
            re_t.append(reprefill_ttft_once(prep))
            bar.update(1)
            for times, (_, out) in zip(row_t, timed, strict=True):
                times.append(race_ttft_once(prep, out))
                bar.update(1)
    for times, (row, _) in zip(row_t, timed, strict=True):
        row.ttft_rounds = times
        row.ttft_s = statistics.median(times)
        row.speedup = statistics.median(r / t for r, t in zip(re_t, times, strict=True))
    return re_t


def _race_row(
    prep: _Prepared,
    out: LinkOutcome,
    ask: Any,
    full_answers: list[str],
    reprefill_ttft: float,
    row: SchemeResult,
) -> SchemeResult:
    """One transfer's outcome -> the receiver's race -> answers and TTFT into ``row``."""
    n_blocks = prep.planned.manifest.num_blocks
    plan = prep.plan
    race, row.rebuild_s = _race(prep, out)
    assert race.answer_s is not None  # the race answered the first question
    row.answers, _ = ask(race.model_cache, None)
    row.first_token_s = race.answer_s - race.seconds
    row.answer = row.answers[0]
    sc = _scores(row.answers, full_answers)
    row.f1s, row.f1, row.matches = sc["f1s"], sc["f1"], sc["matches"]
    row.utility = min(out.utility + plan.prefix_utility, 1.0)
    row.blocks_total = n_blocks
    missing = int((~out.complete).sum()) if out.app_metadata is not None else n_blocks
    row.blocks_missing = missing
    row.reason = out.reason
    row.transfer_s = out.transfer_s
    row.race_s = race.seconds
    row.computed_tokens = race.computed
    row.recomputed_tokens = race.recomputed
    row.loaded_tokens = race.loaded
    row.waited_s = race.waited_s
    row.ttft_s = race.answer_s + row.rebuild_s
    row.speedup = reprefill_ttft / row.ttft_s
    row.counters = out.counters
    row.note = row.note or late_note(row, out, plan.link_s)
    return row


LATE_SHARE = 0.1
"""A row's last block is late when it completes more than this share after the plan's time."""


def late_note(row: SchemeResult, out: LinkOutcome, planned_s: float) -> str:
    """The note of a row whose link lost no block yet did not give the receiver every
    block when its race wanted it: the row shows full utility (everything was in place
    by the transport's deadline) with a speed-up that says otherwise. Either the receiver
    computed tokens beyond its planned prefix itself (the race computes a range when
    waiting for it is not expected to be sooner), or the last block completed more than
    ``LATE_SHARE`` after the plan's ``planned_s`` (the link's part in place) and the race
    waited for blocks (a race also waits for blocks due on plan: that alone is no note).
    Says which, and when the last block completed. Empty when neither is the case."""
    if out.app_metadata is None or row.blocks_missing != 0:
        return ""
    arrival = out.arrival_s
    done = arrival[np.isfinite(arrival)] if arrival is not None else np.zeros(0)
    last = float(done.max()) if done.size else None
    late = last is not None and last > planned_s * (1 + LATE_SHARE)
    waited = late and (row.waited_s or 0.0) > 0
    if not row.recomputed_tokens and not waited:
        return ""
    when = ""
    if last is not None:
        than = "after" if last > planned_s else "within"
        when = f" (the last at {last * 1e3:.0f} ms, {than} the plan's {planned_s * 1e3:.0f} ms)"
    what = []
    if row.recomputed_tokens:
        what.append(
            f"the receiver computed {row.recomputed_tokens} tokens itself: when its race "
            "reached them they were not in place or computing was sooner than waiting"
        )
    if waited:
        what.append(f"the receiver waited {(row.waited_s or 0.0) * 1e3:.0f} ms for late blocks")
    return f"no block lost{when}, but " + "; ".join(what)


def reprefilled(prep: _Prepared) -> tuple[Any, float]:
    """Re-prefilling: the context's model cache computed from scratch in one call, by the
    same builder the receiver's race computes with (kvtransport.model.cache_builder), and
    its seconds."""
    from kvtransport.model.cache_builder import CacheBuilder

    builder = CacheBuilder(prep.loaded.model, prep.context_ids)
    t0 = time.perf_counter()
    builder.compute(builder.num_tokens)
    return builder.model_cache, time.perf_counter() - t0


def reprefill_ttft_once(prep: _Prepared) -> float:
    """One measurement of re-prefilling's TTFT: the context's cache from scratch, then the
    first question's first token."""
    cache, prefill_s = reprefilled(prep)
    return prefill_s + answer(prep.loaded, cache, None, prep.probe_ids[0], 1)[1]


def race_ttft_once(prep: _Prepared, out: LinkOutcome) -> float:
    """One measurement of the handoff's TTFT for a transfer's outcome: the receiver's
    race (reading the manifest included), which ends with the first question's first
    token (during the stream's tail, when the plan has one)."""
    race, rebuild_s = _race(prep, out)
    assert race.answer_s is not None  # the race answered the first question
    return race.answer_s + rebuild_s


def _race(prep: _Prepared, out: LinkOutcome) -> tuple[Any, float]:
    """The receiver's race (kvtransport.model.race.RaceResult) over one transfer's outcome, and
    the seconds it took to read the received manifest before it. The received blocks are
    checked and decoded range by range as the race loads them (kvtransport.kvformat.blocks.
    RangeDecoder), on the race's clock, as a live receiver does. The race ends with the
    first question's first token (:attr:`kvtransport.model.race.RaceResult.answer_s`)."""
    from kvtransport.kvformat import blocks
    from kvtransport.model.race import (
        LinkView,
        Received,
        layer_ready_at,
        layered_tail,
        range_ready_at,
        run_race,
        stream_rank,
    )

    t0 = time.perf_counter()
    received: Received | None = None
    ready_at = layers = None
    if out.app_metadata is not None:
        m = blocks.Manifest.from_bytes(out.app_metadata)
        if m.geometry == prep.planned.manifest.geometry and blocks.is_cache_of(m, prep.context_ids):
            received = (blocks.RangeDecoder(m), out.payload)
            arrival = out.arrival_s if out.arrival_s is not None else np.zeros(m.num_blocks)
            ready_at = range_ready_at(m, np.where(out.complete, arrival, np.inf))
            layers = layer_ready_at(m, np.where(out.complete, arrival, np.inf))
    rebuild_s = time.perf_counter() - t0
    plan = prep.plan
    if ready_at is None:
        ready_at = np.full_like(plan.expect_at, np.inf)
    race = run_race(
        prep.loaded.model, prep.context_ids, split=plan.first_call, received=received,
        ready_at=ready_at,
        link=LinkView(plan.expect_at, plan.range_bytes, prep.deadline_s,
                      rank=stream_rank(prep.planned.manifest),
                      layered_from=layered_tail(prep.planned.manifest)),
        speed=prep.speed,
        block_tokens=prep.planned.manifest.geometry.block_tokens,
        layer_ready=layers,
        question_ids=prep.probe_ids[0],
    )  # fmt: skip
    return race, rebuild_s


def _scores(answers: list[str], full_answers: list[str]) -> dict[str, Any]:
    """Per-question token F1 against the full cache's answers, their mean, and how many
    answers equal the full cache's (SQuAD-normalized exact match)."""
    from kvtransport.model import metrics

    pairs = list(zip(answers, full_answers, strict=True))
    f1s = [metrics.token_f1(a, f) for a, f in pairs]
    return {
        "answers": list(answers),
        "f1s": f1s,
        "f1": sum(f1s) / len(f1s),
        "matches": sum(int(metrics.exact_match(a, f)) for a, f in pairs),
    }


def _report(
    cfg: DemoConfig,
    link: str,
    note: str,
    link_text: str,
    prep: _Prepared,
    baseline: dict[str, Any],
    rows: list[SchemeResult],
    timings: dict[str, float],
) -> DemoReport:
    from kvtransport.model import metrics

    g = prep.stream.manifest.geometry
    sample = prep.sample
    full_answers = baseline["full_answers"]
    full_answer = full_answers[0]
    return DemoReport(
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        link={
            "mode": link,
            "note": note,
            "description": link_text,
            "deterministic": determinism_text(link, cfg.seed),
            "rtt_s": prep.rtt_s,  # measured by the link's warm-up (None: the profile's)
        },
        task={
            "name": sample.task,
            "seed": sample.seed,
            "question": sample.question,
            "gold": list(sample.answers),
            "gold_f1_full": metrics.token_f1(full_answer, sample.answers),
        },
        cache={
            "model_id": prep.loaded.model_id,
            "context_tokens": len(prep.context_ids),
            "question_tokens": len(prep.question_ids),
            "layers": g.num_layers,
            "blocks": prep.stream.manifest.num_blocks,
            "block_tokens": g.block_tokens,
            "dtype": g.dtype,
            "bytes": prep.stream.payload.size,
            "card_cached": prep.cached,
        },
        deadline_s=prep.deadline_s,
        send_time_s=prep.send_time_s,
        budget_s=prep.budget_s,
        plan=_plan_dict(prep, cfg.objective),
        link_down=baseline["link_down"],
        full_answer=full_answer,
        reprefill=baseline["reprefill"],
        no_cache=baseline["no_cache"],
        answers_agree=baseline["reprefill_answers"] == full_answers,
        schemes=rows,
        timings=timings,
        questions=[
            {
                "question": p.question,
                "gold": list(p.answers),
                "full_answer": f,
                "reprefill_answer": r,
                "gold_f1_full": metrics.token_f1(f, p.answers),
            }
            for p, f, r in zip(prep.probes, full_answers, baseline["reprefill_answers"],
                               strict=True)
        ],
    )  # fmt: skip


def _plan_dict(prep: _Prepared, objective: str) -> dict[str, Any]:
    from kvtransport.kvformat.blocks import PRECISIONS

    p = prep.plan
    codes, counts = np.unique(p.precision[p.precision >= 0], return_counts=True)
    return {
        "text": p.describe(),
        "objective": objective,
        "order": p.order,
        "split_tokens": p.split,
        "hedge_tokens": p.hedge,
        "tail_tokens": p.tail,
        "planned_answer_s": p.answer_at_s,
        "hedge_bytes": p.hedge_bytes,
        "planned_send_s": p.send_s,
        "blocks": {PRECISIONS[int(c)]: int(n) for c, n in zip(codes, counts, strict=True)},
        "payload_bytes": p.payload_bytes,
        "planned_compute_s": p.compute_s,
        "planned_link_s": p.link_s,
        "fits": p.fits,
        "compute_speed": {"per_call_s": prep.speed.per_call_s,
                          "per_token_s": prep.speed.per_token_s,
                          "per_pair_s": prep.speed.per_pair_s},
    }  # fmt: skip


def _check_context(cfg: DemoConfig, loaded: Any, context: int, question: int) -> None:
    """A one-line UserError when the context, a question and its answer exceed the model's
    positions, or the receiver's memory and the demo's copies of the cache
    (:data:`DEMO_CACHE_COPIES`) the memory available
    (kvtransport.model.model_cache.check_context)."""
    from kvtransport.model.model_cache import cache_bytes, check_context

    try:
        check_context(
            loaded.model,
            context + question + cfg.max_new_tokens,
            extra_bytes=DEMO_CACHE_COPIES * cache_bytes(loaded.model.config, context),
        )
    except UserError as exc:
        raise UserError(f"--tokens {cfg.tokens}: {exc}") from None


def _check_config(cfg: DemoConfig) -> None:
    from kvtransport.model.tasks import TASK_NAMES

    if cfg.task not in TASK_NAMES:
        raise UserError(f"--task must be one of {', '.join(TASK_NAMES)}, not {cfg.task!r}")
    if not 32 <= cfg.tokens <= MAX_TOKENS:
        raise UserError(f"--tokens must be 32..{MAX_TOKENS}, not {cfg.tokens}")
    if not (cfg.budget > 0 and math.isfinite(cfg.budget)) or cfg.budget > 1:
        raise UserError(f"--budget must be in (0, 1], not {cfg.budget:g}")
    for name, rate in (("rate-mbps", cfg.rate_mbps), ("link-rate-mbps", cfg.link_rate_mbps)):
        if rate is not None and not (1 <= rate <= 10_000):
            raise UserError(f"--{name} must be in [1, 10000], not {rate:g}")
    from kvtransport.model.plan import ORDERS

    if cfg.order not in ORDERS:
        raise UserError(f"--order must be one of {', '.join(ORDERS)}, not {cfg.order!r}")
    if not 0 <= cfg.hedge <= 1:
        raise UserError(f"--hedge must be in [0, 1], not {cfg.hedge:g}")
    from kvtransport.kvformat.blocks import PRECISIONS

    if not cfg.precision or any(p not in PRECISIONS for p in cfg.precision):
        raise UserError(
            f"--precision must list names from {', '.join(PRECISIONS)}, best first, "
            f"not {','.join(cfg.precision)!r}"
        )
    from kvtransport.model.plan import OBJECTIVES

    if cfg.objective not in OBJECTIVES:
        raise UserError(f"--objective must be one of {', '.join(OBJECTIVES)}, not {cfg.objective}")
    if cfg.compute_speed is not None and not (
        len(cfg.compute_speed) in (2, 3, 4)
        and all(math.isfinite(x) and 0 <= x < 10 for x in cfg.compute_speed)
        and cfg.compute_speed[1] > 0
    ):
        raise UserError("--compute-speed must be CALL_MS,TOKEN_MS[,PAIR_US] with TOKEN_MS > 0")
    known = [label for label, _ in SCHEMES]
    if cfg.schemes is not None and (not cfg.schemes or set(cfg.schemes) - set(known)):
        raise UserError(f"schemes must be labels among {', '.join(known)}")
    if cfg.threads < 1:
        raise UserError(f"--threads must be at least 1, not {cfg.threads}")
    if cfg.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if not 1 <= cfg.questions <= MAX_QUESTIONS:
        raise UserError(f"--questions must be 1..{MAX_QUESTIONS}, not {cfg.questions}")
    if not 1 <= cfg.repeats <= MAX_REPEATS:
        raise UserError(f"--rounds must be 1..{MAX_REPEATS}, not {cfg.repeats}")
    if cfg.link not in LINKS:
        raise UserError(f"--link must be one of {', '.join(LINKS)}, not {cfg.link!r}")
