"""Erasure-codec benchmark: GF(2^8) kernels, RLC repair generation and decoding, against zfec
(block Reed-Solomon in C) and the block Reed-Solomon baseline (kvtransport.codecs.blockrs: the
reedsolo code run as matrices in numba, and reedsolo called directly in pure Python), side by
side.

Everything runs in one process on one core, interleaved round by round so that the noise of
a shared machine hits every codec alike; compare the ratios first. Each figure is given per
wall-clock second (median and best of the rounds) and per CPU-second of this process (time
other processes held the core left out); the targets are judged on the latter. Prints the
tables and writes them to a results folder (``--out``): bench_codec.json (every figure) and
bench_codec.md (issue 15's rows: kvtransport beside zfec, ratios, targets).

    .venv/bin/python scripts/bench_codec.py                # full run (a few minutes)
    .venv/bin/python scripts/bench_codec.py --quick        # smoke run

Workloads (defaults: symbol 1280 B, window 32, 4 repairs per 32 sources, 10% loss):
  gf_muladd   dst ^= c * src over 1280-byte symbols. "kernel": called from a numba loop, so it
              measures the kernel; "per call": one Python call per symbol (numba dispatch
              included). Every kernel this host runs (GFNI, split-nibble shuffle, bit-sliced;
              the shuffle one is the fallback where GFNI is missing) and the 256x256 table.
  block_repair  `repairs` repairs of every block of `window` sources (the issue's workload),
              through the API: RLCEncoder.repairs_into (all repairs of the block in one pass),
              repair_into once per repair, and zfec encoding the same blocks. Cache-hot: one
              block over and over; cache-cold: a --cold-mb stream of blocks, each once.
  repair      a stream of source symbols through the encoder's API with one repair every
              window/repairs sources over the last `window` sources (RLC; one add_source call
              per symbol, or one add_sources call per window/repairs symbols), or blocks of
              `window` sources with `repairs` parity symbols (zfec; block RS through
              BlockRSEncoder; reedsolo directly, one call per byte position, on --rs-blocks
              blocks only). GB/s of source.
  decode      the same streams with independent losses, fed to the decoder's API. GB/s of
              source. zfec only decodes the blocks that lost a source and cannot be recovered
              otherwise, so its figure excludes the bookkeeping the RLC decoder does for every
              packet (buffering each source, tracking what is known). "add_packets": the same
              packets in runs of --batch through RLCDecoder.add_packets, as a batched receive
              path holds them (metadata rows and a payload array). The block RS rows
              decode the same loss pattern, made so that every block needs decoding (source 0
              lost, k symbols kept): through BlockRSDecoder (every packet, whole stream) and
              reedsolo directly (--rs-blocks blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zfec
from kvtransport.codecs import gf256
from kvtransport.codecs.blockrs import (
    BlockRSDecoder,
    BlockRSEncoder,
    reedsolo_decode_block,
    reedsolo_encode_block,
)
from kvtransport.codecs.rlc import RLCDecoder, RLCEncoder
from numba import njit
from tqdm import tqdm

TARGETS_GBPS = {"gf_muladd": 5.0, "repair": 1.5, "decode": 0.5}
ISSUE_TARGETS = {  # issue 15: (measure, target, unit)
    "repair_vs_zfec": ("repair generation through the API vs zfec, same work", 10.0, "x"),
    "repair_hot": ("repair generation, cache-hot", 7.0, "GB/s"),
    "decode_vs_zfec": ("decoding at 10 % loss vs zfec", 1.5, "x"),
    "fallback_muladd": ("fallback multiply-add (no GFNI)", 30.0, "GB/s"),
}


# ---------------------------------------------------------------------------------------------
# GF(2^8) region kernels
# ---------------------------------------------------------------------------------------------


@njit(nogil=True)
def _loop(kernel, dst, symbols, coefs, rounds):
    for _ in range(rounds):
        for i in range(symbols.shape[0]):
            kernel(dst, symbols[i], coefs[i])


def _per_call(dst, symbols, coefs, rounds):
    muladd = gf256.region_muladd
    rows = list(symbols)
    cs = [int(c) for c in coefs]
    for _ in range(rounds):
        for row, c in zip(rows, cs, strict=True):
            muladd(dst, row, c)


# ---------------------------------------------------------------------------------------------
# Workloads: each returns a closure that does the timed work once and reports what it did
# ---------------------------------------------------------------------------------------------


class Stream:
    """The source data and the packet schedule shared by all codecs."""

    def __init__(self, size: int, window: int, repairs: int, n: int, loss: float, seed: int):
        if window % repairs:
            raise SystemExit("--window must be a multiple of --repairs")
        self.size, self.window, self.repairs = size, window, repairs
        self.n = n - n % window  # whole blocks for the block codes
        rng = np.random.default_rng(seed)
        self.data = rng.integers(0, 256, (self.n, size), dtype=np.uint8)
        self.payloads = [row.tobytes() for row in self.data]
        self.every = window // repairs
        self.loss = loss
        self.seed = seed

    def rlc_packets(self) -> list[tuple]:
        """("s", esi, payload) and ("r", first, nss, key, payload) in sending order."""
        enc = RLCEncoder(self.size, window=self.window)
        packets: list[tuple] = []
        for i, p in enumerate(self.payloads):
            enc.add_source(p)
            packets.append(("s", i, p))
            if i % self.every == self.every - 1:
                first = max(0, i + 1 - self.window)
                key = i & 0xFFFF
                nss = i + 1 - first
                packets.append(("r", first, nss, key, enc.repair(first, nss, key)))
        return packets

    def lost(self, count: int, salt: int) -> np.ndarray:
        return np.random.default_rng([self.seed, salt]).random(count) < self.loss


def rlc_repair(st: Stream) -> Callable[[], dict]:
    """One add_source call per source symbol, repair_into every ``every`` sources."""

    def run() -> dict:
        enc = RLCEncoder(st.size, window=st.window)
        out = np.empty(st.size, dtype=np.uint8)
        every, window = st.every, st.window
        add, repair_into = enc.add_source, enc.repair_into
        for i, p in enumerate(st.payloads):
            add(p)
            if i % every == every - 1:
                first = max(0, i + 1 - window)
                repair_into(out, first, i + 1 - first, i & 0xFFFF)
        return {"source_bytes": st.n * st.size}

    return run


def rlc_repair_bulk(st: Stream) -> Callable[[], dict]:
    """The ``every`` sources between two repairs added with one add_sources call (a sender
    that packetizes a block at a time)."""
    chunks = [st.data[i : i + st.every] for i in range(0, st.n, st.every)]

    def run() -> dict:
        enc = RLCEncoder(st.size, window=st.window)
        out = np.empty(st.size, dtype=np.uint8)
        window = st.window
        add, repair_into = enc.add_sources, enc.repair_into
        for chunk in chunks:
            add(chunk)
            end = enc.next_esi
            first = max(0, end - window)
            repair_into(out, first, end - first, end & 0xFFFF)
        return {"source_bytes": st.n * st.size}

    return run


def zfec_repair(st: Stream) -> Callable[[], dict]:
    k, m = st.window, st.window + st.repairs
    wanted = tuple(range(k, m))

    def run() -> dict:
        enc = zfec.Encoder(k, m)
        for b in range(st.n // k):
            enc.encode(tuple(st.payloads[b * k : (b + 1) * k]), wanted)
        return {"source_bytes": st.n * st.size}

    return run


def reedsolo_repair(st: Stream, blocks: int) -> Callable[[], dict]:
    """reedsolo called directly, once per byte position of each block (the reference path)."""
    k, p = st.window, st.repairs

    def run() -> dict:
        for b in range(blocks):
            reedsolo_encode_block(st.data[b * k : (b + 1) * k], p)
        return {"source_bytes": blocks * k * st.size}

    return run


def blockrs_repair(st: Stream) -> Callable[[], dict]:
    """The same RS code through BlockRSEncoder (parity matrix + numba), as the sender uses it:
    one add_source call per symbol, all p repairs of each block once it is complete."""
    k, p = st.window, st.repairs

    def run() -> dict:
        enc = BlockRSEncoder(st.size, k, p, max_blocks=2)
        add, repairs = enc.add_source, enc.repairs
        for b in range(st.n // k):
            for i in range(b * k, (b + 1) * k):
                add(st.payloads[i])
            repairs(b)
        return {"source_bytes": st.n * st.size}

    return run


def rlc_decode(st: Stream) -> Callable[[], dict]:
    packets = st.rlc_packets()
    lost = st.lost(len(packets), 1)
    received = [pk for pk, gone in zip(packets, lost, strict=True) if not gone]
    n_lost = sum(1 for pk, gone in zip(packets, lost, strict=True) if gone and pk[0] == "s")

    def run() -> dict:
        dec = RLCDecoder(st.size, max_window=8 * st.window)
        add_source, add_repair = dec.add_source, dec.add_repair
        for pk in received:
            if pk[0] == "s":
                add_source(pk[1], pk[2])
            else:
                add_repair(pk[1], pk[2], pk[3], 15, pk[4])
        recovered = dec.stats["recovered"]
        return {
            "source_bytes": st.n * st.size,
            "sources_lost": n_lost,
            "sources_recovered": recovered,
            "residual_loss": (n_lost - recovered) / st.n,
        }

    return run


def rlc_decode_batched(st: Stream, batch: int) -> Callable[[], dict]:
    """The packets rlc_decode feeds one by one, in runs of ``batch`` through add_packets."""
    packets = st.rlc_packets()
    lost = st.lost(len(packets), 1)
    received = [pk for pk, gone in zip(packets, lost, strict=True) if not gone]
    n_lost = sum(1 for pk, gone in zip(packets, lost, strict=True) if gone and pk[0] == "s")
    runs = []
    for i in range(0, len(received), batch):
        chunk = received[i : i + batch]
        meta = np.array(
            [(pk[1], 0, 0, 0) if pk[0] == "s" else (pk[1], pk[2], pk[3], 15) for pk in chunk],
            dtype=np.int64,
        )
        pay = np.frombuffer(b"".join(pk[-1] for pk in chunk), dtype=np.uint8)
        runs.append((meta, pay.reshape(len(chunk), st.size)))

    def run() -> dict:
        dec = RLCDecoder(st.size, max_window=8 * st.window)
        add = dec.add_packets
        for meta, pay in runs:
            add(meta, pay)
        recovered = dec.stats["recovered"]
        return {
            "source_bytes": st.n * st.size,
            "sources_lost": n_lost,
            "sources_recovered": recovered,
            "residual_loss": (n_lost - recovered) / st.n,
        }

    return run


def _block_schedule(st: Stream, blocks: int) -> list[tuple[list[int], list[bool]]]:
    m = st.window + st.repairs
    lost = st.lost(blocks * m, 2).reshape(blocks, m)
    return [(list(range(m)), lost[b].tolist()) for b in range(blocks)]


def zfec_decode(st: Stream) -> Callable[[], dict]:
    k, m = st.window, st.window + st.repairs
    blocks = st.n // k
    enc = zfec.Encoder(k, m)
    parity = [
        enc.encode(tuple(st.payloads[b * k : (b + 1) * k]), tuple(range(k, m)))
        for b in range(blocks)
    ]
    schedule = _block_schedule(st, blocks)

    def run() -> dict:
        dec = zfec.Decoder(k, m)
        n_lost = recovered = 0
        for b, (nums, gone) in enumerate(schedule):
            lost_src = sum(gone[:k])
            n_lost += lost_src
            if lost_src == 0:
                continue
            have = [j for j in nums if not gone[j]]
            if len(have) < k:
                continue
            shares = tuple(st.payloads[b * k + j] if j < k else parity[b][j - k] for j in have[:k])
            dec.decode(shares, tuple(have[:k]))
            recovered += lost_src
        return {
            "source_bytes": st.n * st.size,
            "sources_lost": n_lost,
            "sources_recovered": recovered,
            "residual_loss": (n_lost - recovered) / st.n,
        }

    return run


def _rs_blocks_to_decode(st: Stream, blocks: int) -> tuple[list[list[bytes]], list[list[bool]]]:
    """Parities of the first ``blocks`` blocks, and a loss pattern per block in which every
    block needs decoding: the stream's losses, plus source 0, minus what keeps k symbols."""
    k, p = st.window, st.repairs
    enc = BlockRSEncoder(st.size, k, p, max_blocks=2)
    parity = []
    for b in range(blocks):
        for i in range(b * k, (b + 1) * k):
            enc.add_source(st.payloads[i])
        parity.append(enc.repairs(b))
    losses = [gone for _, gone in _block_schedule(st, blocks)]
    for gone in losses:
        gone[0] = True
        while sum(not g for g in gone) < k:
            gone[gone.index(True, 1)] = False
    return parity, losses


def reedsolo_decode(st: Stream, blocks: int) -> Callable[[], dict]:
    """reedsolo erasure decoding called directly, once per byte position of each block."""
    k, p = st.window, st.repairs
    parity, losses = _rs_blocks_to_decode(st, blocks)
    words = [
        np.concatenate([st.data[b * k : (b + 1) * k], np.frombuffer(b"".join(parity[b]), np.uint8)
                        .reshape(p, st.size)])
        for b in range(blocks)
    ]  # fmt: skip
    for word, gone in zip(words, losses, strict=True):
        word[np.flatnonzero(gone)] = 0  # what never arrived is not there to use

    def run() -> dict:
        recovered = 0
        for word, gone in zip(words, losses, strict=True):
            erasures = np.flatnonzero(gone).tolist()
            reedsolo_decode_block(word, erasures, k)
            recovered += sum(gone[:k])
        return {"source_bytes": blocks * k * st.size, "sources_recovered": recovered}

    return run


def blockrs_decode(st: Stream) -> Callable[[], dict]:
    """The same blocks and loss patterns (every block needs decoding) through the
    BlockRSDecoder API, as the receiver uses it, over the whole stream."""
    k, p = st.window, st.repairs
    blocks = st.n // k
    parity, losses = _rs_blocks_to_decode(st, blocks)

    def run() -> dict:
        dec = BlockRSDecoder(st.size, k, p)
        add_source, add_repair = dec.add_source, dec.add_repair
        for b, gone in enumerate(losses):
            for j in range(k + p):
                if gone[j]:
                    continue
                if j < k:
                    add_source(b * k + j, st.payloads[b * k + j])
                else:
                    add_repair(b * k, k, j - k, 15, parity[b][j - k])
        return {"source_bytes": blocks * k * st.size, "sources_recovered": dec.stats["recovered"]}

    return run


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def measure(cases: dict[str, Callable[[], dict]], repeats: int, label: str) -> dict[str, dict]:
    """Run every case ``repeats`` times, round-robin. GB/s from the median and best wall time,
    and from the median CPU time of this process (which leaves out the time other processes
    held the core: the steadier figure on a shared machine)."""
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    info: dict[str, dict] = {}
    for _ in tqdm(range(repeats), desc=label, leave=False):
        for name, run in cases.items():
            t0, c0 = time.perf_counter(), time.process_time()
            info[name] = run()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - t0)
    out = {}
    for name, ts in wall.items():
        nbytes = info[name]["source_bytes"]
        cpu_med = max(statistics.median(cpu[name]), 1e-9)
        out[name] = {
            **info[name],
            "seconds_median": statistics.median(ts),
            "seconds_best": min(ts),
            "cpu_seconds_median": cpu_med,
            "gbps_median": nbytes / statistics.median(ts) / 1e9,
            "gbps_best": nbytes / min(ts) / 1e9,
            "gbps_cpu": nbytes / cpu_med / 1e9,
        }
    return out


def gf_cases(size: int, window: int, rounds: int) -> dict[str, Callable[[], dict]]:
    rng = np.random.default_rng(0)
    symbols = rng.integers(0, 256, (window, size), dtype=np.uint8)
    coefs = rng.integers(2, 256, window).astype(np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    kernels = {name: gf256.KERNELS[name][0] for name in gf256.AVAILABLE}
    # Warm up (compile) before anything is timed, and check the kernels agree.
    ref = dst.copy()
    _loop(gf256.region_muladd_table, ref, symbols, coefs, 1)
    for name, kernel in kernels.items():
        a = dst.copy()
        _loop(kernel, a, symbols, coefs, 1)
        if not np.array_equal(a, ref):
            raise SystemExit(f"the {name} and table kernels disagree")
    _per_call(dst, symbols, coefs, 1)

    def case(fn: Callable, kernel: Callable, r: int) -> Callable[[], dict]:
        return lambda: (fn(kernel, dst, symbols, coefs, r), {"source_bytes": r * window * size})[1]

    def per_call(r: int) -> Callable[[], dict]:
        return lambda: (_per_call(dst, symbols, coefs, r), {"source_bytes": r * window * size})[1]

    cases = {f"{name} (kernel)": case(_loop, k, rounds) for name, k in kernels.items()}
    cases["256x256 table (kernel)"] = case(_loop, gf256.region_muladd_table, max(1, rounds // 8))
    cases[f"{gf256.KERNEL} (per call)"] = per_call(max(1, rounds // 8))
    return cases


# ---------------------------------------------------------------------------------------------
# Block repair generation (issue 15: 32 sources, 4 repairs per block)
# ---------------------------------------------------------------------------------------------


def block_repair_cases(st: Stream, cold_mb: float, hot_rounds: int) -> dict[str, Callable]:
    """RLC one pass, RLC once per repair, zfec: cache-hot (one block again and again) and
    cache-cold (each block of a --cold-mb stream once). Same blocks, same repair count."""
    k, r, size = st.window, st.repairs, st.size
    hot = st.data[:k].copy()
    n_cold = max(k, int(cold_mb * 1e6 / size) // k * k)
    cold = np.random.default_rng(st.seed + 1).integers(0, 256, n_cold * size, dtype=np.uint8)
    hot_shares = tuple(row.tobytes() for row in hot)
    cold_blocks = [
        tuple(memoryview(cold)[(b * k + i) * size : (b * k + i + 1) * size] for i in range(k))
        for b in range(n_cold // k)
    ]

    def rlc(data: np.ndarray, blocks: int, rounds: int, one_pass: bool) -> Callable[[], dict]:
        enc = RLCEncoder(size, window=data.size // size, stream=data)
        enc.add_stream_sources(enc.stream_symbols)
        out = np.empty((r, size), dtype=np.uint8)
        # the keys of every block's repairs, made before the clock starts (a numpy
        # operation per block would cost about what the block's repairs do)
        keys = list(np.arange(rounds * blocks * r, dtype=np.int64).reshape(-1, r) & 0xFFFF)
        key_lists = [row.tolist() for row in keys]
        rows = list(out)

        def run() -> dict:
            repairs_into, repair_into = enc.repairs_into, enc.repair_into
            t = 0
            for _ in range(rounds):
                for b in range(blocks):
                    if one_pass:
                        repairs_into(out, b * k, k, keys[t])
                    else:
                        for j, key in enumerate(key_lists[t]):
                            repair_into(rows[j], b * k, k, key)
                    t += 1
            return {"source_bytes": rounds * blocks * k * size}

        return run

    def zf(blocks: list[tuple], rounds: int) -> Callable[[], dict]:
        enc = zfec.Encoder(k, k + r)
        wanted = tuple(range(k, k + r))

        def run() -> dict:
            encode = enc.encode
            for _ in range(rounds):
                for shares in blocks:
                    encode(shares, wanted)
            return {"source_bytes": rounds * len(blocks) * k * size}

        return run

    def kernel(multi: Callable, data: np.ndarray, blocks: int, rounds: int) -> Callable[[], dict]:
        """One multi-output kernel alone on the same blocks (no API around it)."""
        offsets = [(b * k + np.arange(k, dtype=np.int64)) * size for b in range(blocks)]
        coefs = np.random.default_rng(st.seed + 2).integers(1, 256, (r, k), dtype=np.uint8)
        out = np.empty((r, size), dtype=np.uint8)

        def run() -> dict:
            for _ in range(rounds):
                for off in offsets:
                    multi(out, data, off, coefs, k, size)
            return {"source_bytes": rounds * blocks * k * size}

        return run

    # the multi-output kernels this host runs, each alone (the API's is gf256.MULTI_KERNEL)
    kernels = {"tiles of the host kernel": gf256.region_dot_multi_tiled}
    if gf256.HAVE_SHUFFLE:
        kernels["shuffle accumulators"] = gf256.region_dot_multi_shuffle
    # the same repairs either way (checked before anything is timed)
    enc = RLCEncoder(size, window=k, stream=hot)
    enc.add_stream_sources(k)
    both = np.empty((r, size), dtype=np.uint8)
    enc.repairs_into(both, 0, k, np.arange(r))
    if any(both[j].tobytes() != enc.repair(0, k, j) for j in range(r)):
        raise SystemExit("repairs_into and repair disagree")
    nb = n_cold // k
    return {
        "hot": {
            "RLC repairs_into (one pass)": rlc(hot, 1, hot_rounds, True),
            "RLC repair_into per repair": rlc(hot, 1, hot_rounds, False),
            "zfec (block RS, C)": zf([hot_shares], hot_rounds),
            **{
                f"kernel: {name}": kernel(f, hot.reshape(-1), 1, hot_rounds)
                for name, f in kernels.items()
            },
        },
        "cold": {
            "RLC repairs_into (one pass)": rlc(cold, nb, 1, True),
            "RLC repair_into per repair": rlc(cold, nb, 1, False),
            "zfec (block RS, C)": zf(cold_blocks, 1),
            **{f"kernel: {name}": kernel(f, cold, nb, 1) for name, f in kernels.items()},
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--symbol-size", type=int, default=1280, help="bytes per symbol (1280)")
    ap.add_argument("--window", type=int, default=32, help="RLC window = block size k (32)")
    ap.add_argument("--repairs", type=int, default=4, help="repairs per window of sources (4)")
    ap.add_argument("--sources", type=int, default=16384, help="source symbols per stream")
    ap.add_argument("--loss", type=float, default=0.10, help="independent loss rate (0.10)")
    ap.add_argument("--batch", type=int, default=64, help="packets per add_packets call (64)")
    ap.add_argument("--cold-mb", type=float, default=96.0, help="cache-cold stream MB (96)")
    ap.add_argument("--rs-blocks", type=int, default=2, help="blocks for reedsolo direct (slow)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per case (5)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    ap.add_argument("--out", type=Path, default=Path("results"), help="results folder")
    args = ap.parse_args(argv)
    if args.quick:
        args.sources, args.repeats, args.rs_blocks, args.cold_mb = 2048, 2, 1, 8.0
    if args.out.suffix == ".json":
        raise SystemExit("--out is a folder now (bench_codec.json and .md go in it)")

    load_before = os.getloadavg()
    st = Stream(args.symbol_size, args.window, args.repairs, args.sources, args.loss, args.seed)
    print(
        f"symbol {st.size} B, window {st.window}, {st.repairs} repairs per {st.window} sources, "
        f"{st.n} sources, loss {st.loss:.0%}; GF kernel {gf256.KERNEL} (host runs "
        f"{', '.join(gf256.AVAILABLE)}); load average {load_before[0]:.2f}",
        flush=True,
    )

    sections: dict[str, dict[str, dict]] = {}
    gf = gf_cases(st.size, st.window, rounds=2000 if not args.quick else 200)
    sections["gf_muladd"] = measure(gf, args.repeats, "gf_muladd")

    # Warm the codecs up (numba compiles on first use) on a short stream.
    warm = Stream(st.size, st.window, st.repairs, 4 * st.window, st.loss, 7)
    for make in (rlc_repair, rlc_repair_bulk, rlc_decode, blockrs_repair, blockrs_decode):
        make(warm)()
    rlc_decode_batched(warm, args.batch)()
    blocks = block_repair_cases(st, args.cold_mb, hot_rounds=4000 if not args.quick else 400)
    for cases in blocks.values():
        for run in cases.values():
            run()  # warm (and the cold stream paged in once)
    sections["block_repair_hot"] = measure(blocks["hot"], args.repeats, "block repair, hot")
    sections["block_repair_cold"] = measure(blocks["cold"], args.repeats, "block repair, cold")

    sections["repair"] = measure(
        {
            "RLC (numba, this package)": rlc_repair(st),
            "RLC, add_sources per block": rlc_repair_bulk(st),
            "zfec (block RS, C)": zfec_repair(st),
            "block RS, matrix (numba)": blockrs_repair(st),
            "reedsolo (block RS, Python)": reedsolo_repair(st, args.rs_blocks),
        },
        args.repeats,
        "repair",
    )
    sections["decode"] = measure(
        {
            "RLC (numba, this package)": rlc_decode(st),
            f"RLC, add_packets (runs of {args.batch})": rlc_decode_batched(st, args.batch),
            "zfec (block RS, C)": zfec_decode(st),
            "block RS, matrix (numba)": blockrs_decode(st),
            "reedsolo (block RS, Python)": reedsolo_decode(st, args.rs_blocks),
        },
        args.repeats,
        "decode",
    )

    rows = []
    for section, cases in sections.items():
        base = next(iter(cases.values()))["gbps_cpu"]
        for name, r in cases.items():
            extra = f"residual loss {r['residual_loss']:.2%}" if "residual_loss" in r else ""
            ratio = base / r["gbps_cpu"]
            rows.append(
                (section, name, r["gbps_median"], r["gbps_best"], r["gbps_cpu"], ratio, extra)
            )
    print()
    head = f"{'workload':17} {'implementation':34} {'GB/s med':>9} {'best':>8} {'per CPU-s':>9}"
    print(f"{head} {'first/this':>10}  notes")
    for section, name, med, best, per_cpu, ratio, extra in rows:
        print(
            f"{section:17} {name:34} {med:9.3f} {best:8.3f} {per_cpu:9.3f} {ratio:10.2f}  {extra}"
        )
    ours = {
        "gf_muladd": sections["gf_muladd"][f"{gf256.KERNEL} (kernel)"],
        "repair": sections["repair"]["RLC (numba, this package)"],
        "decode": sections["decode"]["RLC (numba, this package)"],
    }
    # Judged on CPU time (one core while we hold it): wall time on a shared 2-core machine
    # mostly measures the other tenants. Both are printed and kept.
    verdict = {
        k: {
            "target_gbps": TARGETS_GBPS[k],
            "gbps_cpu": r["gbps_cpu"],
            "gbps_wall_median": r["gbps_median"],
            "met": r["gbps_cpu"] >= TARGETS_GBPS[k],
        }
        for k, r in ours.items()
    }
    print()
    for k, v in verdict.items():
        status = "met" if v["met"] else "NOT met"
        print(
            f"target {k}: >= {v['target_gbps']} GB/s per CPU-second: {v['gbps_cpu']:.2f} "
            f"({status}); wall median {v['gbps_wall_median']:.2f}"
        )
    # The block RS baseline's two paths compute the same code: how much the matrix path saves.
    rs_speedup = {
        section: sections[section]["block RS, matrix (numba)"]["gbps_cpu"]
        / sections[section]["reedsolo (block RS, Python)"]["gbps_cpu"]
        for section in ("repair", "decode")
    }
    print(
        "block RS, matrix path vs reedsolo direct (per CPU-second): "
        + ", ".join(f"{k} {v:,.0f}x" for k, v in rs_speedup.items())
    )
    issue_rows, issue_targets = issue15_table(sections, args.batch)
    md = issue15_markdown(issue_rows, issue_targets, st, args)
    print()
    print(md)
    load_after = os.getloadavg()
    print(f"load average {load_after[0]:.2f} (2 cores shared: figures scale with what else runs)")

    report = {
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {
            "cpu": _cpu_name(),
            "gf_kernel": gf256.KERNEL,
            "gf_kernels_available": list(gf256.AVAILABLE),
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "numba": __import__("numba").__version__,
            "zfec": getattr(zfec, "__version__", "?"),
            "platform": platform.platform(),
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "results": sections,
        "targets": verdict,
        "issue15": {"rows": issue_rows, "targets": issue_targets},
        "block_rs_matrix_vs_reedsolo": rs_speedup,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_codec.json").write_text(json.dumps(report, indent=2))
    (args.out / "bench_codec.md").write_text(md + "\n")
    print(f"wrote {args.out / 'bench_codec.json'} and {args.out / 'bench_codec.md'}")
    return 0


def issue15_table(sections: dict, batch: int) -> tuple[list[dict], list[dict]]:
    """Issue 15's rows (GB/s per CPU-second, kvtransport beside zfec, ratios) and targets."""
    gf = sections["gf_muladd"]
    hot, cold = sections["block_repair_hot"], sections["block_repair_cold"]
    dec = sections["decode"]
    zf = "zfec (block RS, C)"
    one, per = "RLC repairs_into (one pass)", "RLC repair_into per repair"

    def g(case: dict) -> float:
        return case["gbps_cpu"]

    fallback = "shuffle" if "shuffle" in gf256.AVAILABLE else "bitsliced"
    rows = [
        {"operation": f"GF(2^8) multiply-add, host kernel ({gf256.KERNEL})",
         "kvtransport": g(gf[f"{gf256.KERNEL} (kernel)"]), "zfec": None},
        {"operation": f"GF(2^8) multiply-add, no-GFNI fallback ({fallback})",
         "kvtransport": g(gf[f"{fallback} (kernel)"]), "zfec": None},
        {"operation": "GF(2^8) multiply-add, bit-sliced (the old fallback)",
         "kvtransport": g(gf["bitsliced (kernel)"]), "zfec": None},
        {"operation": "repair generation via API, one pass, cache-cold",
         "kvtransport": g(cold[one]), "zfec": g(cold[zf])},
        {"operation": "repair generation via API, one pass, cache-hot",
         "kvtransport": g(hot[one]), "zfec": g(hot[zf])},
        {"operation": "repair generation, a call per repair, cache-cold",
         "kvtransport": g(cold[per]), "zfec": g(cold[zf])},
        {"operation": "repair generation, a call per repair, cache-hot",
         "kvtransport": g(hot[per]), "zfec": g(hot[zf])},
        {"operation": "decoding at 10 % loss, per-packet API",
         "kvtransport": g(dec["RLC (numba, this package)"]), "zfec": g(dec[zf])},
        {"operation": f"decoding at 10 % loss, add_packets (runs of {batch})",
         "kvtransport": g(dec[f"RLC, add_packets (runs of {batch})"]), "zfec": g(dec[zf])},
    ]  # fmt: skip
    for name in (c.removeprefix("kernel: ") for c in hot if c.startswith("kernel: ")):
        for where, cases in (("cache-cold", cold), ("cache-hot", hot)):
            case = cases[f"kernel: {name}"]
            rows.append({"operation": f"repair kernel alone, {name}, {where}",
                         "kvtransport": g(case), "zfec": g(cases[zf])})  # fmt: skip
    for row in rows:
        row["ratio"] = row["kvtransport"] / row["zfec"] if row["zfec"] else None
    measured = {
        "repair_vs_zfec": min(rows[3]["ratio"], rows[4]["ratio"]),
        "repair_hot": rows[4]["kvtransport"],
        "decode_vs_zfec": max(rows[7]["ratio"], rows[8]["ratio"]),
        "fallback_muladd": rows[1]["kvtransport"],
    }
    targets = [
        {"measure": text, "target": goal, "unit": unit, "measured": measured[key],
         "met": measured[key] >= goal}
        for key, (text, goal, unit) in ISSUE_TARGETS.items()
    ]  # fmt: skip
    return rows, targets


def issue15_markdown(rows: list[dict], targets: list[dict], st: Stream, args: object) -> str:
    def f(x: float | None, unit: str = "") -> str:
        return "" if x is None else f"{x:.2f}{unit}"

    lines = [
        f"Issue 15 codec rows ({st.window} sources of {st.size} B, {st.repairs} repairs per "
        f"block; GB/s of source per CPU-second, medians of {args.repeats}; one process, "
        f"zfec measured in the same run; host GF kernel {gf256.KERNEL}; CPU {_cpu_name()})",
        "",
        "| operation | kvtransport GB/s | zfec GB/s | kvtransport / zfec |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['operation']} | {f(r['kvtransport'])} | {f(r['zfec'])} | {f(r['ratio'], 'x')} |"
        for r in rows
    ]
    lines += ["", "| target | goal | measured | met |", "|---|---|---|---|"]
    lines += [
        f"| {t['measure']} | >= {t['target']:g} {t['unit']} | {t['measured']:.2f} {t['unit']} "
        f"| {'yes' if t['met'] else 'no'} |"
        for t in targets
    ]
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
