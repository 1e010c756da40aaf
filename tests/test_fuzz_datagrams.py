"""50,000 fuzzed datagrams against a live receiver daemon during a transfer (issue 12):
0 crashes, 0 accepted, the transfer byte-identical, RSS within the configured budget.
scripts/eval_fuzz.py runs the same harness with 1M (the figures are in docs/results.md)."""

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "eval_fuzz", Path(__file__).resolve().parents[1] / "scripts" / "eval_fuzz.py"
)
fuzz = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fuzz)


def test_fuzzed_datagrams_during_a_transfer_are_all_dropped():
    r = fuzz.run(50_000, size_mb=2.0, rate_mbps=8.0, seed=3, timeout_s=120)
    assert r["fuzz_sent"] == 50_000 and r["fuzz_finished_before_result"], r
    assert all(n > 5000 for n in r["fuzz_by_kind"].values()), r["fuzz_by_kind"]
    # nothing opens under the key, no other transfer got a session or a result
    assert r["accepted_by_parser"] == 0
    assert r["other_transfer_sessions"] == 0 and not r["other_results"], r
    # every datagram the receiver did not drop was the sender's
    rx = r["receiver"]
    assert rx["datagrams"] - rx["dropped"] <= rx["genuine_sent"], rx
    assert rx["dropped"] >= 45_000 and rx["results"] == 1, rx
    assert r["crashes"] == 0 and r["tracebacks"] == 0 and r["receiver_exit_status"] == 0, r
    assert r["result_reason"] == "complete" and r["byte_identical"], r
    assert r["rss_within_budget"], r
