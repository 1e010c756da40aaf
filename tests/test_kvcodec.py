"""The entropy-coded KV block codec: exact round trip of the quantized codes, the error
bound, what prediction and entropy coding buy, and refusal of forged blocks."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from kvtransport.codecs import kvcodec, quant

H, T, D = 3, 16, 64


def _blocks(n=6, seed=0, offsets=True):
    """``[n, 2, H, T, D]`` KV-like blocks: keys on per-channel offsets (a few large outlier
    channels, as real keys), values plain."""
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((n, 2, H, T, D)).astype(np.float32)
    if offsets:
        kv[:, 0] += (rng.standard_normal((1, H, 1, D)) * 2).astype(np.float32)
        kv[:, 0, :, :, [3, 40]] += 25.0
    return kv


def _reference(kv, rel_step):
    """The codec's quantization in numpy: per (half, head) step, codes rint(x / step),
    decoded float32(code) * step."""
    steps = kvcodec.steps_of(kv, rel_step).astype(np.float32)
    q = np.rint(kv.astype(np.float64) / steps[..., None, None].astype(np.float64))
    return q.astype(np.float32) * steps[..., None, None], steps


@pytest.mark.parametrize("rel_step", [(0.02, 0.02), (0.1, 0.2), (0.5, 0.5)])
@pytest.mark.parametrize("tokens", [16, 5, 1])
def test_round_trip_gives_exactly_the_quantized_values(rel_step, tokens):
    kv = _blocks()[:, :, :, :tokens]
    coded = kvcodec.encode_blocks(kv, rel_step)
    ref, steps = _reference(kv, rel_step)
    for j, c in enumerate(coded):
        got = kvcodec.decode_block(c, H, tokens, D)
        assert np.array_equal(got, ref[j])
        bound = steps[j][..., None, None] / 2 + np.spacing(np.abs(got))
        assert np.all(np.abs(got - kv[j]) <= bound)


def test_escapes_and_extreme_blocks_round_trip():
    kv = _blocks(n=4)
    kv[0] *= 0.0  # all zero: one symbol, frequency 2**SCALE_BITS
    kv[1, 1, 0] = np.linspace(-3e4, 3e4, T * D, dtype=np.float32).reshape(T, D)  # escapes
    kv[2, 0, :, 7, :] = 6e4  # one token far off (the anchor is the median: it stays put)
    kv[3] = np.float32(1e-6) * np.sign(kv[3])  # tiny values
    coded = kvcodec.encode_blocks(kv, (0.01, 0.01))
    ref, _ = _reference(kv, (0.01, 0.01))
    for j, c in enumerate(coded):
        assert np.array_equal(kvcodec.decode_block(c, H, T, D), ref[j])
    assert coded[0].size < 100


def test_decoding_many_blocks_in_place_matches_one_at_a_time():
    kv = _blocks(n=5)
    coded = kvcodec.encode_blocks(kv, (0.1, 0.1))
    buf = np.concatenate([np.zeros(7, np.uint8), *coded])  # blocks need not start at 0
    lengths = np.array([c.size for c in coded])
    offsets = 7 + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    keys = np.full((2, H, 5 * T, D), -1.0, np.float32)
    values = keys.copy()
    layers = np.array([0, 1, 0, 1, 1])
    starts = np.array([0, 16, 32, 48, 64])
    kvcodec.decode_blocks_into(buf, offsets, lengths, layers, starts, T, keys, values)
    for j in range(5):
        one = kvcodec.decode_block(coded[j], H, T, D)
        sl = slice(starts[j], starts[j] + T)
        assert np.array_equal(keys[layers[j], :, sl], one[0])
        assert np.array_equal(values[layers[j], :, sl], one[1])
    assert np.all(keys[1, :, :16] == -1.0)  # slots no block names are left alone


def test_real_model_kv_round_trips_in_fewer_bytes_than_int8(smollm):
    from kvtransport.model import hf

    model, tokenizer = smollm
    text = "The quick brown fox jumps over the lazy dog. " * 8
    kv = hf.prefill(model, tokenizer, text)
    keys, values, sizes = kvcodec.code_cache(kv.keys, kv.values, T, (0.1, 0.1))
    n = kv.num_tokens
    g_blocks = -(-n // T)
    assert sizes.shape == (kv.num_layers, g_blocks)
    for b in range(g_blocks):
        lo, hi = b * T, min((b + 1) * T, n)
        block = np.stack([kv.keys[:, :, lo:hi], kv.values[:, :, lo:hi]], axis=1)
        ref, _ = _reference(block, (0.1, 0.1))
        assert np.array_equal(keys[:, :, lo:hi], ref[:, 0])
        assert np.array_equal(values[:, :, lo:hi], ref[:, 1])
    # at a step whose error is about int4 keys' (per channel), well below int8's bytes
    int8 = sum(quant.kv_nbytes(kv.num_kv_heads, min(T, n - b * T), kv.head_dim, 8, 64, False)
               for b in range(g_blocks)) * kv.num_layers  # fmt: skip
    assert sizes.sum() < 0.7 * int8


def test_prediction_across_tokens_removes_the_channel_offsets():
    """Channels sitting on large offsets with a little noise around them (keys, much
    exaggerated) cost about what the noise costs: the anchor takes each channel's offset,
    the residuals never see it."""
    rng = np.random.default_rng(9)
    kv = (rng.standard_normal((4, 2, H, 1, D)) * 10).astype(np.float32)  # the offsets
    kv = kv + (rng.standard_normal((4, 2, H, T, D)) * 0.1).astype(np.float32)
    coded = kvcodec.encode_blocks(kv, (0.05, 0.05))  # step 0.5: the noise is 0.2 step
    bits = 8 * sum(c.size for c in coded) / kv.size
    assert bits < 2.0, bits  # coding the codes themselves: about 6.4 bits per value
    ref, _ = _reference(kv, (0.05, 0.05))
    assert np.array_equal(kvcodec.decode_block(coded[0], H, T, D), ref[0])


def test_entropy_coding_spends_bits_by_probability():
    """A peaked block codes below its raw symbol width: a mostly-zero block is far smaller
    than one of uniform noise at the same step."""
    rng = np.random.default_rng(3)
    peaked = np.zeros((1, 2, H, T, D), np.float32)
    peaked[..., ::9] = 1.0
    noise = rng.uniform(-1, 1, (1, 2, H, T, D)).astype(np.float32)
    a = kvcodec.encode_blocks(peaked, (0.5, 0.5))[0].size
    b = kvcodec.encode_blocks(noise, (0.05, 0.05))[0].size
    symbols = 2 * H * (T + 1) * D
    assert a < symbols * 0.15  # about 0.5 bit per symbol plus the table
    assert symbols * 0.5 < b < symbols * 0.9  # about 5 bits per symbol


def test_normalized_frequencies_keep_every_symbol_and_sum_to_the_scale():
    rng = np.random.default_rng(4)
    for counts in (
        rng.integers(0, 3, 256),
        np.r_[10**6, np.ones(255, np.int64)],
        np.r_[np.zeros(200, np.int64), rng.integers(1, 10**5, 56)],
    ):
        f = kvcodec.normalized_frequencies(counts)
        assert f.sum() == 1 << kvcodec.SCALE_BITS
        assert np.all((f > 0) == (counts > 0))


def test_bad_arguments_raise():
    kv = _blocks(n=1)
    with pytest.raises(ValueError, match="rel_step"):
        kvcodec.encode_blocks(kv, (0.0, 0.1))
    bad = kv.copy()
    bad[0, 0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        kvcodec.encode_blocks(bad, (0.1, 0.1))
    with pytest.raises(ValueError, match="blocks must be"):
        kvcodec.encode_blocks(kv[0], (0.1, 0.1))
    c = kvcodec.encode_blocks(kv, (0.1, 0.1))[0]
    out = np.zeros((1, H, T, D), np.float32)
    with pytest.raises(ValueError, match="outside the buffer"):
        kvcodec.decode_blocks_into(c, [1], [c.size], [0], [0], T, out, out.copy())
    with pytest.raises(ValueError, match="tokens"):
        kvcodec.decode_blocks_into(c, [0], [c.size], [0], [1], T, out, out.copy())


def _forgeries(coded: np.ndarray, seed: int) -> list[np.ndarray]:
    """Truncations at every length, single bytes flipped everywhere, and random edits."""
    rng = np.random.default_rng(seed)
    out = [coded[:n] for n in range(coded.size)]
    for i in range(coded.size):
        f = coded.copy()
        f[i] ^= 1 << int(rng.integers(8))
        out.append(f)
    for _ in range(200):
        f = coded.copy()
        at = rng.integers(0, f.size, int(rng.integers(1, 8)))
        f[at] = rng.integers(0, 256, at.size)
        out.append(f)
    out.append(np.concatenate([coded, [0, 0]]))  # trailing bytes
    return out


def test_forged_blocks_raise_codec_error_never_anything_else():
    kv = _blocks(n=1)
    kv[0, 1, 0, 0, :5] = 3e3  # an escape stream to forge too
    coded = kvcodec.encode_blocks(kv, (0.1, 0.1))[0]
    refused = 0
    for f in _forgeries(coded, seed=5):
        try:
            got = kvcodec.decode_block(f, H, T, D)
        except kvcodec.CodecError:
            refused += 1
            continue
        assert np.all(np.isfinite(got))  # an edit that still decodes gives finite values
    assert refused >= coded.size  # every truncation, and most edits, are refused


_PROBE = """
import json, sys
import numpy as np
from numba.core import config
from kvtransport.codecs import kvcodec
assert config.BOUNDSCHECK, "bounds checking is off"
sys.path.insert(0, sys.argv[1])
from test_kvcodec import _blocks, _forgeries
kv = _blocks(n=1)
kv[0, 1, 0, 0, :5] = 3e3
coded = kvcodec.encode_blocks(kv, (0.1, 0.1))[0]
errors = {}
for f in _forgeries(coded, seed=6):
    try:
        kvcodec.decode_block(f, 3, 16, 64)
    except kvcodec.CodecError:
        pass
    except Exception as exc:
        errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
from kvtransport.codecs import quant
rows = quant.quantize_kv(kv, 8, 64, False)
buf, lengths = kvcodec.encode_int8_rows(rows, 3, 16, 64)
out = np.empty_like(rows)
for f in _forgeries(buf, seed=7):
    try:
        kvcodec.decode_int8_rows(f, [0], [f.size], 3, 16, 64, out)
    except Exception as exc:
        errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
print(json.dumps(errors))
"""


def test_forged_blocks_never_read_out_of_bounds(tmp_path):
    """The decoders (the lossy codec's and int8r's) compiled with numba's bounds checking
    (a fresh kernel cache) meet every forgery: an index outside any array would raise
    IndexError."""
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, os.path.dirname(__file__)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_bench_script_runs_small(capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import bench_kvcodec

    assert bench_kvcodec.main(["--synthetic", "8", "--rounds", "1", "--steps", "0.1,0.1",
                               "--json"]) == 0  # fmt: skip
    lossy, int8r = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines())
    assert lossy["blocks"] == 8 and 0 < lossy["size_vs_int8"] < 1
    assert lossy["codec_gbit_s_cpu"] > 0 and lossy["int8_gbit_s_cpu"] > 0
    assert lossy["encode_gbit_s_cpu"] > 0
    assert int8r["kind"] == "int8r" and int8r["blocks"] == 8 and int8r["size_vs_int8"] > 0
    assert int8r["encode_gbit_s_cpu"] > 0 and int8r["decode_gbit_s_cpu"] > 0


def _rans_start(coded: np.ndarray) -> int:
    """Where a coded block's rANS stream starts (the module's layout)."""
    pos = kvcodec.header_nbytes(H)
    top = int(coded[pos])
    pos += 1
    for _ in range(top + 1):  # the frequency varints
        while coded[pos] >= 0x80:
            pos += 1
        pos += 1
    escapes = int.from_bytes(coded[pos : pos + 4].tobytes(), "little")
    return pos + 8 + escapes


def test_a_flipped_bit_in_the_rans_stream_is_refused_almost_always():
    """The lanes must end in the state the encoder began with and the stream at its last
    word: a corrupted stream breaks one or the other but by chance."""
    coded = kvcodec.encode_blocks(_blocks(n=1, seed=11), (0.1, 0.1))[0]
    start = _rans_start(coded)
    refused = total = 0
    for i in range(start, coded.size, 3):
        for bit in range(8):
            f = coded.copy()
            f[i] ^= 1 << bit
            total += 1
            try:
                kvcodec.decode_block(f, H, T, D)
            except kvcodec.CodecError:
                refused += 1
    assert refused >= 0.99 * total, (refused, total)
