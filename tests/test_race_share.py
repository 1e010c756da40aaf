"""A racer's search of a receiver daemon's race folder survives whatever is in it.

The mirror files themselves are written by a real receiver daemon and raced in
tests/test_live_race.py; here the folder holds garbage, truncated and lying files, and
the search must skip every one of them (None, never an exception)."""

import json
import os
import struct

import numpy as np
import pytest

from kvtransport.daemons.race_share import MAGIC, SUFFIX, SharedTransfers, open_shared
from kvtransport.errors import UserError


def _mirror_bytes(header: dict, body: int) -> bytes:
    h = json.dumps(header).encode()
    head = struct.pack("<8sI", MAGIC, len(h)) + h
    return head + bytes(-len(head) % 8) + bytes(body)


GOOD = {"transfer_id": "00", "num_blocks": 2, "payload_len": 64, "symbol_size": 1280,
        "deadline_s": 1.0, "first_packet": 5.0, "app_metadata": ""}  # fmt: skip


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"KVRACE01",
        os.urandom(4096),
        _mirror_bytes(GOOD, 16 + 64)[:40],  # truncated in its header
        _mirror_bytes(GOOD, 16),  # shorter than its payload
        _mirror_bytes({**GOOD, "num_blocks": "two"}, 16 + 64),
        _mirror_bytes({**GOOD, "app_metadata": "zz"}, 16 + 64),
        _mirror_bytes({k: v for k, v in GOOD.items() if k != "deadline_s"}, 16 + 64),
        struct.pack("<8sI", MAGIC, 1 << 30),  # a header longer than the file
    ],
)
def test_garbage_in_the_race_folder_is_skipped(tmp_path, content):
    (tmp_path / f"x{SUFFIX}").write_bytes(content)
    assert open_shared(tmp_path / f"x{SUFFIX}") is None
    assert SharedTransfers(str(tmp_path), np.arange(16))() is None


def test_a_well_formed_mirror_of_no_cache_is_opened_but_not_raced(tmp_path):
    """The layout is read (times, payload, first packet); its app metadata is not a KV
    cache's manifest, so no race takes it."""
    path = tmp_path / f"y{SUFFIX}"
    path.write_bytes(_mirror_bytes(GOOD, 16 + 64))
    shared = open_shared(path)
    assert shared is not None
    assert shared.complete_at.shape == (2,) and shared.payload_buffer.shape == (64,)
    assert shared.timings["first_packet"] == 5.0 and shared.manifest.deadline_s == 1.0
    assert SharedTransfers(str(tmp_path), np.arange(16))() is None


def test_a_folder_others_may_write_to_is_refused(tmp_path):
    tmp_path.chmod(0o733)
    with pytest.raises(UserError, match="writable by other users"):
        SharedTransfers(str(tmp_path), np.arange(16))
    with pytest.raises(UserError, match="not a directory"):
        SharedTransfers(str(tmp_path / "none"), np.arange(16))
