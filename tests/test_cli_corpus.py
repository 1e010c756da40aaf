"""A corpus of bad command lines across the subcommands: every one exits with status 2
(kvtransport.errors.UserError, or argparse's usage error) and one error line, never a
traceback. Run in this process through kvtransport.cli.main (an alarm stops a case that
would wrongly start working), so hundreds of cases take a few seconds."""

import contextlib
import io
import signal

import numpy as np
import pytest

from kvtransport.cli import main

NUMERIC = {
    # command prefix -> {option: (kind, lo, lo_open)} for its bounded numeric options
    ("simulate",): {"--rate-mbps": ("f", 0, True), "--delay-ms": ("f", 0, False),
                    "--rho": ("f", 0, True), "--seed": ("i", 0, False),
                    "--seeds": ("i", 1, False), "--size-mb": ("f", 0, True),
                    "--blocks": ("i", 1, False), "--symbol-size": ("i", 64, False)},
    ("send", "127.0.0.1:9"): {"--size-mb": ("f", 0, True), "--blocks": ("i", 1, False),
                "--seed": ("i", 0, False), "--rate-mbps": ("f", 0, True),
                "--deadline-ms": ("f", 0, True), "--rho": ("f", 0, True),
                "--initial-rtt-ms": ("f", 0, True), "--symbol-size": ("i", 64, False),
                "--burst-us": ("f", 0, False), "--realtime": ("i", 1, False)},
    ("recv",): {"--timeout": ("f", 0, True), "--idle-timeout": ("f", 0, True),
                "--max-mb": ("f", 0, True), "--replay-window": ("f", 0, True)},
    ("sender-daemon",): {"--rate-mbps": ("f", 0, True), "--max-transfers": ("i", 1, False),
                         "--slot-ms": ("f", 0, True), "--symbol-size": ("i", 64, False)},
    ("receiver-daemon",): {"--max-transfers": ("i", 1, False), "--max-mb": ("f", 0, True),
                           "--idle-timeout": ("f", 0, True), "--budget-mb": ("f", 0, True),
                           "--replay-window": ("f", 0, True)},
    ("card", "inspect", "x.card"): {"--blocks": ("i", 0, False)},
    ("answer", "--question", "q"): {"--drop": ("f", 0, False), "--seed": ("i", 0, False),
                                    "--max-new-tokens": ("i", 1, False),
                                    "--threads": ("i", 1, False)},
    ("prefill", "--context", "c.txt", "--out", "o.card"): {
        "--block-tokens": ("i", 1, False), "--window": ("i", 1, False)},
    ("profile",): {"--target-tokens": ("i", 120, False),
                   "--noise": ("f", 0, False), "--draws": ("i", 1, False),
                   "--ratio": ("f", 1, False)},
    ("train",): {"--steps": ("i", 1, False), "--eval-every": ("i", 1, False),
                 "--eval-episodes": ("i", 1, False), "--demo-steps": ("i", 0, False)},
    ("demo",): {"--max-new-tokens": ("i", 1, False)},
    ("netem", "up", "--profile", "clean"): {"--rate-mbps": ("f", 0, True),
                                            "--delay-ms": ("f", 0, False)},
}  # fmt: skip


def _bad_values(kind, lo, lo_open):
    """Values outside what the option allows: not numbers, not finite, huge, below it."""
    out = ["abc", "", "nan", "inf", "-inf", "1e308", "-1e308", str(lo - 1)]
    if lo_open:
        out.append(str(lo))
    if kind == "i":
        out += ["1.5", "1e3", str(2**70)]
    return out


def _numeric_cases():
    for prefix, opts in NUMERIC.items():
        for opt, spec in opts.items():
            for v in _bad_values(*spec):
                yield [*prefix, f"{opt}={v}"]


# cases checked at run time (files, names, addresses, endpoints); {tmp} is a directory
# holding ctx.txt (text), a directory sub/ and nothing else
RUNTIME = [
    ["simulate", "--rho", "1e308"],
    ["simulate", "--rate-mbps", "inf"],
    ["simulate", "--channel", "no-such-profile"],
    ["simulate", "--channel", "gemodel 500% 3%"],
    ["simulate", "--policy", "fixed:9/0"],
    ["simulate", "--policy", "warp"],
    ["simulate", "--profiles", "{tmp}/none.toml"],
    ["simulate", "--profiles", "{tmp}/ctx.txt"],
    ["simulate", "--feedback-channel", "nope"],
    ["simulate", "--size-mb", "0.001", "--blocks", "100000"],
    ["simulate", "--plot", "{tmp}/no/dir/x.png", "--size-mb", "0.01"],
    ["send", "127.0.0.1:9", "--initial-rtt-ms", "-1"],
    ["send", "127.0.0.1:9", "--card", "{tmp}/none.card"],
    ["send", "127.0.0.1:9", "--card", "{tmp}/ctx.txt"],
    ["send", "127.0.0.1:99999"],
    ["send", "127.0.0.1:x"],
    ["send"],
    ["send", "127.0.0.1:9", "--key", "zz"],
    ["send", "127.0.0.1:9", "--policy", "warp"],
    ["send", "127.0.0.1:9", "--bind", "1.2.3.4:-5"],
    ["send", "127.0.0.1:9", "--card", "{tmp}/ctx.txt", "--size-mb", "1"],
    ["recv", "--listen", "127.0.0.1:70000"],
    ["recv", "--out", "{tmp}/none"],
    ["recv", "--out", "{tmp}/ctx.txt"],
    ["recv", "--key", "xyz"],
    ["recv", "--idle-timeout", "inf"],
    ["sender-daemon", "--control", "ipc://{tmp}/ctx.txt/x.ipc"],
    ["sender-daemon", "--control", "ftp://x"],
    ["sender-daemon", "--control", "ipc://{tmp}/sub/"],
    ["sender-daemon", "--policy", "warp"],
    ["sender-daemon", "--utility-table", "{tmp}/none.json"],
    ["sender-daemon", "--bind", "x:y"],
    ["sender-daemon", "--key", "not-hex"],
    ["sender-daemon", "--stats", "{tmp}/no/dir/stats.jsonl"],
    ["receiver-daemon", "--control", "ipc://{tmp}/ctx.txt/x.ipc"],
    ["receiver-daemon", "--publish", "bogus"],
    ["receiver-daemon", "--out-dir", "{tmp}/none"],
    ["receiver-daemon", "--listen", "1.2.3.4.5:1"],
    ["receiver-daemon", "--idle-timeout", "inf"],
    ["receiver-daemon", "--replay-file", "{tmp}/sub"],
    ["receiver-daemon", "--replay-window", "7200"],
    ["receiver-daemon", "--curve-secret", "{tmp}/ctx.txt"],
    ["receiver-daemon", "--publish", "tcp://0.0.0.0:5556"],
    ["sender-daemon", "--curve-secret", "{tmp}/ctx.txt"],
    ["sender-daemon", "--control", "tcp://127.evil.example:5555"],
    ["recv", "--replay-file", "{tmp}/sub"],
    ["card", "inspect", "{tmp}/none.card"],
    ["card", "inspect", "{tmp}/ctx.txt"],
    ["card", "inspect", "{tmp}/sub"],
    ["card", "inspect", "{tmp}/ctx.txt", "--blocks", "-1"],
    ["card", "inspect", "{tmp}/trunc.card"],
    ["card", "inspect", "{tmp}/badmeta.card"],
    ["card"],
    ["card", "shred", "x"],
    ["answer", "--question", "q"],
    ["answer", "--card", "{tmp}/none.card", "--question", "q"],
    ["answer", "--card", "{tmp}/ctx.txt", "--question", "q"],
    ["answer", "--context", "{tmp}/ctx.txt", "--question", "  "],
    ["answer", "--context", "{tmp}/ctx.txt", "--question", "q", "--precision", "fp3"],
    ["answer", "--context", "{tmp}/ctx.txt", "--question", "q", "--order", "sideways"],
    ["prefill", "--context", "{tmp}/none.txt", "--out", "{tmp}/o.card"],
    ["prefill", "--context", "{tmp}/ctx.txt", "--out", "{tmp}/no/dir/o.card"],
    ["prefill", "--context", "{tmp}/ctx.txt", "--out", "o", "--precision", "mixed:-1"],
    ["prefill", "--context", "{tmp}/sub", "--out", "{tmp}/o.card"],
    ["prefill", "--context", "{tmp}/ctx.txt", "--out", "{tmp}/o.card", "--layer-weights",
     "{tmp}/none.json"],
    ["profile", "--out", "{tmp}/no/dir/p.json"],
    ["train", "--hidden", "0,64"],
    ["train", "--hidden", "a,b"],
    ["train", "--trace", "{tmp}/none.csv"],
    ["train", "--rate-range", "400,20"],
    ["train", "--rate-range", "0,400"],
    ["train", "--prior", "guess"],
    ["train", "--prior", "none=-1"],
    ["fit-utility", "--points", "{tmp}/none.csv"],
    ["fit-utility", "--points", "{tmp}/ctx.txt"],
    ["fit-utility", "--measure", "--context-tokens", "abc"],
    ["fit-utility", "--measure", "--fractions", "2,3"],
    ["fit-utility"],
    ["netem"],
    ["netem", "up"],
    ["netem", "up", "--profile", "clean", "--backend", "teleport"],
    ["netem", "trace-from-irtt", "{tmp}/none.json"],
    ["demo", "--task", "chess"],
    ["demo", "--tokens", "5"],
    ["demo", "--rho", "nan"],
    ["demo", "--rho", "inf"],
    ["demo", "--questions", "0"],
    ["profile", "--samples", "0"],
    ["fit-utility", "--measure", "--samples", "0"],
    ["demo", "--link", "pigeon"],
    ["demo", "--objective", "cheapest"],
    ["no-such-command"],
    ["simulate", "--no-such-option"],
    ["send", "127.0.0.1:9", "--rho", "1", "--deadline-ms", "5"],
    # issue 44, row 9: idna's UnicodeError on empty or over-long labels, ports ZeroMQ wraps
    ["send", "a..b:9"],
    ["send", "a" * 70 + ".example:9"],
    ["recv", "--listen", ".:9400"],
    ["receiver-daemon", "--listen", "a..b:1"],
    ["sender-daemon", "--bind", "b" * 64 + ".x:0"],
    ["sender-daemon", "--control", "tcp://127.0.0.1:99999"],
    ["receiver-daemon", "--publish", "tcp://127.0.0.1:0"],
    ["receiver-daemon", "--control", "tcp://127.0.0.1:x"],
]  # fmt: skip


def _corpus():
    cases = [*_numeric_cases(), *RUNTIME]
    return cases


class _Stuck(Exception):
    pass


def _run(argv):
    err = io.StringIO()

    def stuck(signum, frame):
        raise _Stuck(" ".join(argv))

    old = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(20)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "ctx.txt").write_text("Some context that is plainly not a card. " * 20)
    (d / "sub").mkdir()
    (d / "trunc.card").write_bytes(b"\xff" * 7)
    head = b'{"__metadata__": {"kvtransport.card": "{not json"}}'
    (d / "badmeta.card").write_bytes(len(head).to_bytes(8, "little") + head)
    return d


def test_the_corpus_is_large():
    assert len(_corpus()) >= 150


def test_bad_command_lines_exit_2_with_one_line_and_no_traceback(tmp, monkeypatch):
    monkeypatch.chdir(tmp)
    failures = []
    for argv in _corpus():
        argv = [a.format(tmp=tmp) for a in argv]
        try:
            code, err = _run(argv)
        except Exception as exc:  # a traceback's worth: the case escaped main()
            failures.append(f"{argv}: raised {type(exc).__name__}: {exc}")
            continue
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if code != 2 or "Traceback" in err or not lines or "error" not in lines[-1]:
            failures.append(f"{argv}: exit {code}, stderr {err[-300:]!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.model
def test_a_card_of_the_wrong_geometry_is_a_one_line_error(tmp_path, smollm):
    """A card whose manifest claims 37 layers passes `card inspect` (it is a valid card)
    but `answer --card` refuses it in one line: the model has another geometry."""
    from kvtransport.kvformat import card
    from kvtransport.kvformat.kvcache import KVCache
    from kvtransport.model import encoding

    rng = np.random.default_rng(0)
    shape = (37, 3, 32, 64)
    cache = KVCache(
        rng.standard_normal(shape, dtype=np.float32),
        rng.standard_normal(shape, dtype=np.float32),
        np.arange(32, dtype=np.int64),
        smollm.model_id,
    )
    path = tmp_path / "l37.card"
    card.write_card(path, encoding.encode_cache(cache, utilities=np.ones((37, 2)), created={}))
    assert _run(["card", "inspect", str(path)])[0] == 0
    code, err = _run(["answer", "--card", str(path), "--question", "q"])
    assert code == 2 and "Traceback" not in err and "37 layers" in err, err
