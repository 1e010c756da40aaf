"""When each block became complete: from a receiver session, through a published result
(the daemon's ZeroMQ frames and result files), to the demo's per-block arrival times."""

import numpy as np

from kvtransport.core.transfer import TransferResult
from kvtransport.daemons.api import (
    read_result_file,
    result_frames,
    result_from_frames,
    write_result_file,
)
from kvtransport.demo.demo_links import LinkOutcome


def _manual() -> TransferResult:
    """A result of 4 blocks: two complete at session times 5.2 and 5.5, finished at 6.0."""
    from kvtransport.core.transfer import BlockTable, TransportManifest

    b = BlockTable(np.array([0, 10, 20, 30], np.uint64), np.full(4, 10, np.uint64),
                   np.full(4, 0.25))  # fmt: skip
    m = TransportManifest(symbol_size=16, payload_len=40, blocks=b, app_metadata=b"meta")
    complete = np.array([True, False, True, False])
    return TransferResult(
        transfer_id=7, manifest=m, payload=np.zeros(40, np.uint8), complete=complete,
        missing=np.flatnonzero(~complete), utility_recovered=0.5, reason="deadline",
        timings={"first_packet": 5.0, "finished": 6.0},
        complete_at=np.array([5.2, np.inf, 5.5, np.inf]),
    )  # fmt: skip


def test_arrival_times_survive_publication_and_result_files(tmp_path):
    res = _manual()
    expect = np.array([1.7, np.inf, 2.0, np.inf])  # the result came 2.5 s after the start
    direct = LinkOutcome.from_result(res, 2.5)
    np.testing.assert_allclose(direct.arrival_s, expect)
    published = result_from_frames([bytes(memoryview(f)) for f in result_frames(res, {})])
    np.testing.assert_allclose(LinkOutcome.from_result(published, 2.5).arrival_s, expect)
    path = write_result_file(tmp_path, res, {})
    np.testing.assert_allclose(LinkOutcome.from_result(read_result_file(path), 2.5).arrival_s,
                               expect)  # fmt: skip


def test_an_incomplete_block_never_arrives_even_with_a_time():
    res = _manual()
    res.complete_at[1] = 5.1  # a time for a block not marked complete: not trusted
    assert np.isinf(LinkOutcome.from_result(res, 2.5).arrival_s[1])


def test_a_receiver_session_records_when_each_block_completed():
    """Over a lossy channel, every complete block has a time inside the transfer, and the
    blocks recovered late (by repair) complete after blocks further down the stream."""
    from kvtransport.netem import make_channel

    from kvtransport.core.transfer import synthetic_transfer
    from kvtransport.policies.registry import make_policy
    from kvtransport.sim.simulator import Simulation, full_send_time

    tr = synthetic_transfer(600_000, 60, "zipf", seed=2)
    deadline = 1.5 * full_send_time(tr.nbytes, 100e6, 1280)
    sim = Simulation(tr, make_policy("adaptive"), make_channel("ge-heavy", 5),
                     make_channel("ge-heavy", 6), rate_bps=100e6, deadline=deadline,
                     record=False)  # fmt: skip
    sim.run()
    res = sim.receiver.result
    done = res.complete
    assert done.sum() > 0.9 * done.size
    t = res.complete_at
    assert np.all(np.isinf(t[~done]))
    first, end = res.timings["first_packet"], res.timings["finished"]
    assert np.all((t[done] >= first) & (t[done] <= end))
    # losses delay some blocks past later ones (repair), so times are not all in order
    assert np.any(np.diff(t[done]) < 0)
    assert np.all(np.isfinite(res.complete_age_s[done]))
