"""`kvtransport answer --race-dir` in the orders users start things, against a real receiver
daemon (its own process, --race-dir) fed by a real `kvtransport send` over UDP loopback.

The racer claims its context's transfer in the race folder before it looks; the daemon
keeps a claimed mirror until the racer is done with it and an unclaimed one for
--race-keep-s (kvtransport.daemons.race_share). `answer` waits --wait-s for a transfer that
has not started, finds one that has started or even ended, and says on stderr whether it
raced (tokens loaded / computed) or found nothing and re-prefilled.
"""

import json
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from test_live_race import _receiver_daemon

from kvtransport.daemons.race_share import SUFFIX, SharedTransfers
from kvtransport.kvformat import card
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model import encoding, hf

RACED = re.compile(r"raced transfer [0-9a-f]{16}: (\d+) of (\d+) context tokens loaded")
KVT = [sys.executable, "-m", "kvtransport"]


def _send(card_path, port):
    """`kvtransport send` the card (as it is) to the daemon, until it is complete or the
    deadline (a slowed host may deliver part of it: exit 3); returns its summary."""
    out = subprocess.run([*KVT, "send", f"127.0.0.1:{port}", "--card", str(card_path),
                          "--insecure", "--precision", "keep", "--rate-mbps", "100",
                          "--deadline-ms", "20000", "--json"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode in (0, 3), out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _until(cond, what, timeout_s=60.0):
    t_end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < t_end, what
        time.sleep(0.02)


def _mirrors(race_dir):
    return sorted(race_dir.glob(f"*{SUFFIX}"))


def _synthetic_card(path, seed):
    """A small cache card of 32 random tokens' made-up K/V (no model needed)."""
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((2, 2, 1, 32, 8)).astype(np.float16)
    cache = KVCache(kv[0], kv[1], rng.integers(0, 1000, 32).astype(np.int64), "synthetic")
    card.write_card(path, encoding.encode_cache(cache, utilities=np.ones((2, 2))))
    return cache.token_ids


def test_a_claimed_mirror_stays_until_its_racer_is_done_an_unclaimed_one_goes(tmp_path):
    """The daemon (--race-keep-s 1) keeps the finished transfer of a claimed context past
    that second while the claim is held, and removes it once the claim is released (the
    racer used it); the mirror of a transfer no racer claimed goes after the second."""
    race_dir = tmp_path / "race"
    race_dir.mkdir(mode=0o700)
    ids_a = _synthetic_card(tmp_path / "a.card", 1)
    ids_b = _synthetic_card(tmp_path / "b.card", 2)
    proc, port = _receiver_daemon(tmp_path, "--race-dir", str(race_dir), "--race-keep-s", "1")
    try:
        claim = SharedTransfers(str(race_dir), ids_a).claim()
        _send(tmp_path / "a.card", port)
        _send(tmp_path / "b.card", port)  # ends after a's
        _until(lambda: SharedTransfers(str(race_dir), ids_b)() is None,
               "the unclaimed mirror was never removed")  # fmt: skip
        kept = SharedTransfers(str(race_dir), ids_a)()
        assert kept is not None and kept.complete.all(), "the claimed mirror was removed"
        claim.release()
        _until(lambda: not _mirrors(race_dir), "the used mirror was never removed")
    finally:
        proc.terminate()
        proc.wait(20)
    assert not list(race_dir.iterdir())


TEXT = ("Mira Vance founded the Quillbrook observatory in 1911. Its first telescope was "
        "built by Oskar Lind, and its library holds the Vance letters.")  # fmt: skip
QUESTION = "Who built the first telescope?"
MAX_NEW = 12


def _answer_argv(tmp_path, race_dir):
    (tmp_path / "context.txt").write_text(TEXT)
    return [*KVT, "answer", "--context", str(tmp_path / "context.txt"), "--question",
            QUESTION, "--max-new-tokens", str(MAX_NEW), "--threads", "1", "--race-dir",
            str(race_dir)]  # fmt: skip


def _reprefilled(smollm):
    """The answer re-prefilling the context gives (`answer --context`'s own computation)."""
    from kvtransport.model.loader import chat_prompt

    _, question_ids = chat_prompt(smollm.tokenizer, TEXT, QUESTION)
    kv = hf.prefill(smollm.model, smollm.tokenizer, TEXT, attention=False)
    gen = hf.greedy_generate(smollm.model, kv, question_ids, max_new_tokens=MAX_NEW)
    return kv, smollm.tokenizer.decode(gen.tokens, skip_special_tokens=True).strip()


@pytest.mark.model
def test_answer_says_when_no_transfer_came_and_re_prefills(smollm, tmp_path):
    """Nothing in the race folder within --wait-s: one line on stderr says so, and the
    answer is the re-prefilled one."""
    race_dir = tmp_path / "race"
    race_dir.mkdir(mode=0o700)
    alone = subprocess.run([*_answer_argv(tmp_path, race_dir), "--wait-s", "0.5"],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    assert (f"no transfer for this context in {race_dir} within 0.5 s: answered by "
            "re-prefilling") in alone.stderr, alone.stderr  # fmt: skip
    assert alone.stdout.strip() == _reprefilled(smollm)[1]
    assert not list(race_dir.iterdir())  # its claim released


@pytest.mark.model
@pytest.mark.timeout(1200)  # two model loads in subprocesses, a daemon, two sends
def test_answer_races_a_transfer_it_waited_for_and_one_that_ended_before_it(smollm, tmp_path):
    """`answer --race-dir` (plain output) against one daemon, in two orders:

    1. started before the transfer (the transfer is sent once `answer` has claimed its
       context, i.e. has its model): it waits for it, races it and says so (how many
       tokens it loaded: the race loads what arrives before computing it would be done);
       the daemon removes the mirror once that racer is done with it;
    2. started after the transfer ended: it loads the mirror and says so.
    Both answers are the re-prefilled one, word for word."""
    kv, want = _reprefilled(smollm)
    card.write_card(tmp_path / "ctx.card", encoding.encode_cache(kv))
    race_dir = tmp_path / "race"
    race_dir.mkdir(mode=0o700)
    answer = _answer_argv(tmp_path, race_dir)
    proc, port = _receiver_daemon(tmp_path, "--race-dir", str(race_dir))
    try:
        early = subprocess.Popen([*answer, "--wait-s", "600"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert early.stderr is not None
        said = []  # until it is ready (context claimed, speed measured) and waits
        while not said or (said[-1] and "waiting up to" not in said[-1]):
            said.append(early.stderr.readline())
        assert str(race_dir) in said[-1], said
        assert list(race_dir.glob("*.claim")), "answer waits without claiming its context"
        _send(tmp_path / "ctx.card", port)
        out, err = early.communicate(timeout=600)
        err = "".join(said) + err
        assert early.returncode == 0, err
        raced_early = RACED.search(err)
        assert raced_early, err
        assert int(raced_early[2]) == kv.num_tokens  # loaded or computed: the race's call
        assert out.strip() == want
        _until(lambda: not _mirrors(race_dir), "the used mirror was never removed")
        assert not list(race_dir.glob("*.claim"))  # released

        _send(tmp_path / "ctx.card", port)  # it has ended (complete, or its deadline)
        late = subprocess.run(answer, capture_output=True, text=True, timeout=600)
        assert late.returncode == 0, late.stderr
    finally:
        proc.terminate()
        proc.wait(20)
    raced_late = RACED.search(late.stderr)
    assert raced_late, late.stderr
    assert int(raced_late[1]) > 0 and int(raced_late[2]) == kv.num_tokens
    assert late.stdout.strip() == want
