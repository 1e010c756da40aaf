"""The TCP baseline across a real impaired link: ``python -m kvtransport.demo.tcp_baseline`` recv
in the testbed's receiver namespace, send in the sender namespace (kvtransport.demo.demo_netns
.tcp_across, what NetnsLink.tcp_transfer runs), through the relay's loss model.

The profile is bernoulli-5 (5 % independent loss, 100 Mbit/s, 5 ms each way), not
ge-heavy: on ge-heavy one TCP connection delivers well under 1 MB in 30 s (its
retransmissions meet the loss model's long bad runs, see scripts/eval_tcp_baseline.py),
so a "generous deadline" would make this test minutes long; 5 % loss still costs TCP
retransmissions (asserted) and a few Mbit/s.

Needs root; CI runs as root."""

import os
import shutil

import numpy as np
import pytest
from kvtransport.netem.testbed import Testbed, teardown

from kvtransport.core.transfer import synthetic_transfer
from kvtransport.demo.demo_netns import tcp_across

CC = "cubic"  # the usual Linux default (this host defaults to bbr)
PREFIX = f"kvtt{os.getpid() % 100000}"
SKIP = (
    "needs root (network namespaces, tc); CI runs as root"
    if os.geteuid() != 0
    else "needs iproute2 (ip, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None
    else None
)


@pytest.mark.netns
@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_tcp_baseline_across_a_lossy_link(tmp_path):
    small = synthetic_transfer(600_000, 24, "linear", seed=11, app_metadata=b"kv manifest")
    large = synthetic_transfer(4_000_000, 64, "linear", seed=12)
    short_s = 0.6  # a 4 MB transfer is cut (TCP at 5 % loss moves well under 1 MB/s)
    try:
        with Testbed("bernoulli-5", prefix=PREFIX, seed=3, backend="relay", shaper="relay") as tb:
            full = tcp_across(tb, small, 60.0, tmp_path, congestion=CC)
            cut = tcp_across(tb, large, short_s, tmp_path, congestion=CC)
    finally:
        teardown(PREFIX)

    # generous deadline: everything arrives, byte-identical, through a lossy link
    assert full.reason == "complete", full.counters
    assert full.complete.all() and full.utility == pytest.approx(1.0)
    np.testing.assert_array_equal(full.payload, small.payload)
    assert full.app_metadata == b"kv manifest"
    assert full.counters["bytes_delivered"] == small.nbytes
    assert full.counters["retransmits"] > 0, full.counters  # the link really lost packets
    assert np.all(np.diff(full.arrival_s) >= 0)
    assert full.transfer_s >= full.arrival_s[-1]

    # too short: only a prefix of the blocks, each complete before the deadline, in order
    assert cut.reason == "deadline", cut.counters
    k = int(cut.complete.sum())
    assert 0 < k < len(large.blocks), cut.counters
    np.testing.assert_array_equal(cut.complete, np.arange(len(large.blocks)) < k)
    assert np.all(np.diff(cut.arrival_s[:k]) >= 0)
    assert np.all(cut.arrival_s[:k] < short_s)
    assert np.isinf(cut.arrival_s[k:]).all()
    end = int(large.blocks.offsets[k - 1] + large.blocks.lengths[k - 1])
    np.testing.assert_array_equal(cut.payload[:end], large.payload[:end])
    assert cut.utility == pytest.approx(float(large.blocks.utilities[:k].sum()))
    assert cut.counters["sender"] == "reset"  # the receiver cut the connection
