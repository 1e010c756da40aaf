"""A small run of scripts/eval_repair_span.py: the proactive repair span cap it passes in
(a ProtocolConfig) reaches the real sender, and only where a round trip holds more slots
than the cap."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_repair_span.py"


def test_span_cap_binds_only_when_a_round_trip_exceeds_it(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--cells", "ge-heavy+40ms@0.85,ge-heavy+80ms@0.85",
         "--schemes", "fixed:4/32", "--spans", "1024,2048", "--episodes", "2",
         "--out", str(tmp_path), "--quiet"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "eval_repair_span.json").read_text())
    runs = doc["runs"]
    # 100 Mbit/s, one-way 40 ms: a round trip is ~770 slots, under both caps -> the same runs
    short = runs["ge-heavy+40ms@0.85 fixed:4/32 1024"], runs["ge-heavy+40ms@0.85 fixed:4/32 2048"]
    for a, b in zip(*short, strict=True):
        assert a["final_span"] == b["final_span"] < 1024
        assert a["utility"] == b["utility"] and a["packets"] == b["packets"]
    # one-way 80 ms: ~1540 slots; the 1024 cap binds, the 2048 one does not
    long = runs["ge-heavy+80ms@0.85 fixed:4/32 1024"], runs["ge-heavy+80ms@0.85 fixed:4/32 2048"]
    for a, b in zip(*long, strict=True):
        assert a["final_span"] == 1024 and 1400 < b["final_span"] < 2048
    cpu = doc["summary"]["ge-heavy+80ms@0.85 fixed:4/32"]["cpu"]
    assert cpu["2048"]["mean_wide_nss_sent"] > cpu["1024"]["mean_wide_nss_sent"] > 64
    table = (tmp_path / "eval_repair_span.md").read_text()
    assert table.startswith("| cell | scheme | utility @1024 | 2048 - 1024 |")
    assert "| ge-heavy+40ms@0.85 | fixed:4/32 |" in table and "(2=)" in table


def test_the_span_cap_is_a_sender_parameter():
    """SenderSession(max_repair_span=...) caps the proactive span (default MAX_REPAIR_SPAN;
    the attribute may be set later, and applies at once); outside 64..DECODER_WINDOW it is
    refused."""
    import pytest

    from kvtransport.core import protocol
    from kvtransport.core.sender import SenderSession
    from kvtransport.core.transfer import synthetic_transfer
    from kvtransport.policies.registry import make_policy

    tr = synthetic_transfer(2_000_000, 10, seed=1)

    def sender(**kw):  # 100 Mbit/s, 160 ms round trip: ~1500 slots
        return SenderSession(tr, make_policy("fixed:4/32"), rate_bps=100e6, deadline=1.0,
                             initial_rtt=0.16, **kw)  # fmt: skip

    assert sender().max_repair_span == protocol.MAX_REPAIR_SPAN == 1024
    assert sender()._proactive_span == 1024
    s = sender(max_repair_span=2048)
    assert 1400 < s._proactive_span < 2048
    s.max_repair_span = 512
    assert s._proactive_span == 512
    for bad in (63, protocol.DECODER_WINDOW + 1):
        with pytest.raises(ValueError, match="max_repair_span"):
            sender(max_repair_span=bad)
