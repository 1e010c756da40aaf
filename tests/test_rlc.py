"""RFC 8681 sliding-window RLC codec: coefficient rules, encoder, and the on-the-fly decoder
checked against an independent rank computation over GF(2^8) written here."""

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kvtransport.codecs.rlc import RLCDecoder, RLCEncoder, coding_coefficients
from test_tinymt32 import (  # tests/ is on sys.path under pytest
    RFC8681_RAND16_SEED1,
    RFC8681_RAND256_SEED1,
    RFC8682_SEED1,
    PureTinyMT32,
)

# ---------------------------------------------------------------------------------------------
# An independent GF(2^8) (log/exp built with xtime) and rank oracle
# ---------------------------------------------------------------------------------------------


def _build_field():
    exp = [0] * 510
    log = [0] * 256
    a = 1
    for i in range(255):
        exp[i] = exp[i + 255] = a
        log[a] = i
        a <<= 1
        if a & 0x100:
            a ^= 0x11D
    mul = np.zeros((256, 256), dtype=np.uint8)
    for x in range(1, 256):
        for y in range(1, 256):
            mul[x, y] = exp[log[x] + log[y]]
    inv = [0] + [exp[(255 - log[x]) % 255] for x in range(1, 256)]
    return mul, inv


MUL, INV = _build_field()


def determined_unknowns(equations):
    """ESIs whose value the equations fix; each equation is {esi: non-zero coefficient}
    over unknown ESIs only. A variable is fixed iff its unit vector is in the row space,
    i.e. iff the reduced row echelon form has a row with that single non-zero entry."""
    cols = sorted({e for eq in equations for e in eq})
    if not cols:
        return set()
    index = {e: i for i, e in enumerate(cols)}
    a = np.zeros((len(equations), len(cols)), dtype=np.uint8)
    for r, eq in enumerate(equations):
        for e, c in eq.items():
            a[r, index[e]] = c
    row = 0
    pivots = []
    for col in range(len(cols)):
        nz = np.flatnonzero(a[row:, col])
        if nz.size == 0:
            continue
        p = row + nz[0]
        a[[row, p]] = a[[p, row]]
        a[row] = MUL[INV[a[row, col]]][a[row]]
        factors = a[:, col].copy()
        factors[row] = 0
        a ^= MUL[factors[:, None], a[row][None, :]]
        pivots.append((row, col))
        row += 1
        if row == a.shape[0]:
            break
    return {cols[c] for r, c in pivots if np.count_nonzero(a[r]) == 1}


def reference_repair(sources, first, nss, key, dt):
    coefs = pure_coefficients(key, nss, dt)
    out = np.zeros(len(sources[0]), dtype=np.uint8)
    for i, c in enumerate(coefs):
        out ^= MUL[c][sources[first + i]]
    return out.tobytes()


def pure_coefficients(key, nss, dt):
    """RFC 8681 section 3.6 generate_coding_coefficients for m=8, on the pure-Python TinyMT."""
    g = PureTinyMT32(key)
    out = []
    for _ in range(nss):
        if dt == 15 or (g.generate_uint32() & 0xF) <= dt:
            c = 0
            while c == 0:
                c = g.generate_uint32() & 0xFF
            out.append(c)
        else:
            out.append(0)
    return out


# ---------------------------------------------------------------------------------------------
# Coding coefficients
# ---------------------------------------------------------------------------------------------


def test_coefficients_follow_the_rfc_draws_for_seed_1():
    # With DT=15 the coefficients are the non-zero tinymt32_rand256 values in order; with DT<15
    # each one first draws rand16 (kept if <= DT) then rand256. Both derived here from the
    # published RFC 8682 / RFC 8681 sequences for seed 1, not from the code under test.
    assert [v & 0xFF for v in RFC8682_SEED1] == RFC8681_RAND256_SEED1
    assert [v & 0xF for v in RFC8682_SEED1] == RFC8681_RAND16_SEED1
    nonzero = [v for v in RFC8681_RAND256_SEED1 if v]
    assert coding_coefficients(1, 40, 15).tolist() == nonzero[:40]

    expected, i = [], 0
    while len(expected) < 15:
        keep = RFC8681_RAND16_SEED1[i] <= 7
        i += 1
        if keep:
            while RFC8681_RAND256_SEED1[i] == 0:
                i += 1
            expected.append(RFC8681_RAND256_SEED1[i])
            i += 1
        else:
            expected.append(0)
    assert coding_coefficients(1, 15, 7).tolist() == expected
    assert expected == [225, 176, 246, 139, 0, 0, 187, 0, 0, 0, 210, 176, 0, 0, 40]  # by hand


@settings(max_examples=80, deadline=None)
@given(key=st.integers(0, 0xFFFF), nss=st.integers(1, 300), dt=st.integers(0, 15))
def test_coefficients_match_pure_python_rfc_port(key, nss, dt):
    assert coding_coefficients(key, nss, dt).tolist() == pure_coefficients(key, nss, dt)


def test_dt15_never_draws_zero():
    for key in range(0, 65536, 97):
        assert coding_coefficients(key, 4095, 15).all()


@pytest.mark.parametrize("dt", [0, 3, 7, 11, 14])
def test_dt_below_15_zeroes_coefficients_at_the_rfc_rate(dt):
    coefs = np.concatenate([coding_coefficients(key, 200, dt) for key in range(200)])
    zero_rate = float(np.mean(coefs == 0))
    expected = (15 - dt) / 16  # non-zero when rand16 <= dt: probability (dt + 1) / 16
    sigma = (expected * (1 - expected) / coefs.size) ** 0.5
    assert abs(zero_rate - expected) < 5 * sigma + 1e-3


@pytest.mark.parametrize(
    ("key", "nss", "dt"), [(-1, 4, 15), (65536, 4, 15), (1, 0, 15), (1, 4096, 15), (1, 4, 16)]
)
def test_coefficient_parameters_are_checked(key, nss, dt):
    with pytest.raises(ValueError):
        coding_coefficients(key, nss, dt)


# ---------------------------------------------------------------------------------------------
# Encoder
# ---------------------------------------------------------------------------------------------


def test_encoder_repairs_are_rfc_linear_combinations():
    rng = np.random.default_rng(5)
    size = 37
    enc = RLCEncoder(size, window=16)
    sources = []
    for i in range(40):
        payload = rng.integers(0, 256, size, dtype=np.uint8)
        sources.append(payload)
        assert enc.add_source(payload) == i
    for first, nss, key, dt in [
        (24, 16, 9, 15),
        (30, 10, 0, 15),
        (39, 1, 65535, 15),
        (25, 12, 3, 6),
    ]:
        assert enc.repair(first, nss, key, dt) == reference_repair(sources, first, nss, key, dt)


def test_encoder_accepts_buffers_and_zero_pads_short_payloads():
    enc = RLCEncoder(8, window=4)
    inputs = [b"ab", bytearray(b"cde"), memoryview(b"fghi"), np.frombuffer(b"jk", np.uint8)]
    for payload in inputs:
        enc.add_source(payload)
    assert enc.source(0) == b"ab" + bytes(6)
    assert enc.source(2) == b"fghi" + bytes(4)
    enc.add_source(b"12345678")
    enc.add_source(b"x")  # reuses the slot of ESI 1: no stale bytes may survive
    assert enc.source(5) == b"x" + bytes(7)
    with pytest.raises(ValueError, match="exceeds"):
        enc.add_source(b"123456789")


@pytest.mark.parametrize(("window", "sizes"), [(8, [3, 5, 1, 8]), (4, [11, 2]), (16, [1, 40])])
def test_add_sources_equals_one_call_per_symbol(window, sizes):
    size = 6
    rng = np.random.default_rng(window)
    one, bulk = RLCEncoder(size, window=window), RLCEncoder(size, window=window)
    one.add_source(b"\xff" * size)  # start mid-ring so that the bulk copy wraps around
    bulk.add_source(b"\xff" * size)
    for count in sizes:
        data = rng.integers(0, 256, count * size - 2, dtype=np.uint8)  # last symbol short
        firsts = [one.add_source(data[i : i + size]) for i in range(0, data.size, size)]
        assert bulk.add_sources(data.tobytes()) == firsts[0]
        assert bulk.next_esi == one.next_esi
    for esi in range(bulk.oldest_esi, bulk.next_esi):
        assert bulk.source(esi) == one.source(esi)
    assert bulk.repair(bulk.oldest_esi, window, 5) == one.repair(one.oldest_esi, window, 5)


@pytest.mark.parametrize(
    ("size", "nbytes", "window"), [(37, 37 * 30 - 5, 16), (8, 80, 64), (6, 1, 4)]
)
def test_stream_mode_repairs_equal_ring_mode(size, nbytes, window):
    """A sender holding its payload encodes in place: same repairs, same held span."""
    rng = np.random.default_rng(nbytes)
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    n = -(-nbytes // size)
    ring = RLCEncoder(size, window=window)
    stream = RLCEncoder(size, window=window, stream=data)
    assert stream.stream_symbols == n
    for esi in range(n):
        ring.add_source(data[esi * size : esi * size + size])  # the last one zero-padded
        stream.add_stream_sources(esi + 1)
        assert (stream.oldest_esi, stream.next_esi) == (ring.oldest_esi, ring.next_esi)
        lo = ring.oldest_esi
        for first, nss, key, dt in [
            (lo, esi + 1 - lo, esi, 15),
            (esi, 1, 7, 15),
            (lo, esi + 1 - lo, 3, 5),
        ]:
            assert stream.repair(first, nss, key, dt) == ring.repair(first, nss, key, dt)
        assert stream.source(esi) == ring.source(esi)
    with pytest.raises(ValueError, match="not all held"):
        stream.repair(max(0, n - window - 1), min(window + 1, n + 1), 1)
    with pytest.raises(ValueError, match="add_stream_sources"):
        stream.add_source(b"x")
    with pytest.raises(ValueError, match="add_stream_sources"):
        stream.add_sources(b"x")
    with pytest.raises(ValueError, match="outside"):
        stream.add_stream_sources(n + 1)  # beyond the stream
    with pytest.raises(ValueError, match="outside"):
        stream.add_stream_sources(n - 1)  # backwards
    with pytest.raises(ValueError, match="stream="):
        ring.add_stream_sources(1)


@pytest.mark.parametrize(
    ("size", "window", "nbytes"), [(1280, 48, 1280 * 60 - 7), (37, 16, 37 * 40), (5000, 6, 9997)]
)
def test_repairs_into_is_one_repair_call_per_key(size, window, nbytes):
    """The one-pass multi-repair kernel: row k is exactly repair(..., keys[k]), ring and
    stream mode, dense and sparse, tiles of a long symbol and a short last symbol."""
    rng = np.random.default_rng(size)
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    n = -(-nbytes // size)
    ring, stream = RLCEncoder(size, window=window), RLCEncoder(size, window=window, stream=data)
    for e in range(n):
        ring.add_source(data[e * size : (e + 1) * size])
    stream.add_stream_sources(n)
    lo = max(0, n - window)
    keys = [3, 65535, 0, 77, 12]
    out = np.full((6, size + 9), 0xAA, dtype=np.uint8)
    for enc in (ring, stream):
        for first, nss in [(lo, n - lo), (n - 1, 1), (lo + 1, max(1, n - lo - 3))]:
            for dt in (15, 4):
                enc.repairs_into(out, first, nss, keys, dt)
                for k, key in enumerate(keys):
                    assert out[k, :size].tobytes() == enc.repair(first, nss, key, dt)
                assert (out[5] == 0xAA).all() and (out[:, size:] == 0xAA).all()


def test_repairs_into_checks_its_arguments():
    enc = RLCEncoder(16, window=4)
    for i in range(6):
        enc.add_source(bytes([i]) * 16)
    out = np.zeros((2, 16), dtype=np.uint8)
    with pytest.raises(ValueError, match="need 3"):
        enc.repairs_into(out, 2, 4, [1, 2, 3])
    with pytest.raises(ValueError, match="need 16"):
        enc.repairs_into(np.zeros((2, 15), np.uint8), 2, 4, [1])
    with pytest.raises(ValueError, match="not all held"):
        enc.repairs_into(out, 1, 4, [1])
    with pytest.raises(ValueError, match="repair keys"):
        enc.repairs_into(out, 2, 4, [1, 65536])
    with pytest.raises(TypeError, match="2-D"):
        enc.repairs_into(out[0], 2, 4, [1])
    frozen = np.zeros((2, 16), np.uint8)
    frozen.setflags(write=False)
    for bad in (frozen, np.zeros((16, 2), np.uint8).T):  # read-only, not C-contiguous
        with pytest.raises(TypeError, match="writable 2-D C-contiguous"):
            enc.repairs_into(bad, 2, 4, [1])


def test_repair_into_revalidates_a_new_buffer_after_a_cached_one():
    enc = RLCEncoder(16, window=4)
    enc.add_source(bytes(range(16)))
    packet = memoryview(bytearray(40))[24:]
    enc.repair_into(packet, 0, 1, 3)
    enc.repair_into(packet, 0, 1, 3)  # the same view: validated once, written again
    assert bytes(packet) == enc.repair(0, 1, 3)
    with pytest.raises(ValueError, match="need 16"):
        enc.repair_into(memoryview(bytearray(8)), 0, 1, 3)
    with pytest.raises(TypeError, match="writable"):
        enc.repair_into(memoryview(bytes(16)), 0, 1, 3)


def test_encoder_ring_is_bounded_and_checked():
    enc = RLCEncoder(4, window=8)
    for i in range(20):
        enc.add_source(bytes([i]) * 4)
    assert (enc.oldest_esi, enc.next_esi) == (12, 20)
    enc.repair(12, 8, 1)
    for first, nss in [(11, 8), (13, 8), (19, 2)]:
        with pytest.raises(ValueError, match="not all held"):
            enc.repair(first, nss, 1)
    with pytest.raises(ValueError):
        enc.repair(12, 8, 70000)


@pytest.mark.parametrize(
    ("first", "nss", "key", "dt", "match"),
    [(12, 8, 70000, 15, "repair_key"), (12, 0, 1, 15, "nss"), (12, 8, 1, 16, "dt"),
     (-1, 8, 1, 15, "first_esi"), (11, 8, 1, 15, "not all held")],
)  # fmt: skip
def test_repair_calls_refuse_bad_fields_with_the_reason_and_write_nothing(
    first, nss, key, dt, match
):
    """The checks run in the kernel call; the refusal names the field, out is untouched."""
    enc = RLCEncoder(4, window=8)
    enc.add_sources(bytes(range(80)))
    one = np.full(4, 7, dtype=np.uint8)
    with pytest.raises(ValueError, match=match):
        enc.repair_into(one, first, nss, key, dt)
    assert one.tolist() == [7] * 4
    rows = np.full((2, 4), 7, dtype=np.uint8)
    with pytest.raises(ValueError, match="repair keys" if match == "repair_key" else match):
        enc.repairs_into(rows, first, nss, [1, key], dt)
    assert rows.tolist() == [[7] * 4] * 2


def test_repair_into_writes_a_caller_buffer():
    enc = RLCEncoder(16, window=8)
    for i in range(8):
        enc.add_source(bytes(range(i, i + 16)))
    expected = enc.repair(0, 8, 42, 15)
    packet = bytearray(24 + 16)
    enc.repair_into(memoryview(packet)[24:], 0, 8, 42, 15)
    assert bytes(packet[24:]) == expected and packet[:24] == bytes(24)
    arr = np.full(20, 0xAA, dtype=np.uint8)
    enc.repair_into(arr, 0, 8, 42)
    assert arr[:16].tobytes() == expected and (arr[16:] == 0xAA).all()
    with pytest.raises(ValueError, match="need 16"):
        enc.repair_into(bytearray(10), 0, 8, 42)
    with pytest.raises(TypeError):
        enc.repair_into(b"\0" * 16, 0, 8, 42)


# ---------------------------------------------------------------------------------------------
# Decoder against the rank oracle
# ---------------------------------------------------------------------------------------------


class Oracle:
    """What the received packets determine, following the decoder's documented window rules:
    the window holds ``max_window`` ESIs from ``base``; an ESI past its top slides it; sources
    below ``base`` are ignored; repairs with a non-zero coefficient below ``base`` are dropped."""

    def __init__(self, max_window):
        self.w = max_window
        self.base = 0
        self.received = set()
        self.equations = []

    def _slide(self, last):
        if last >= self.base + self.w:
            self.base = last - self.w + 1

    def source(self, esi):
        if esi < self.base:
            return
        self._slide(esi)
        self.received.add(esi)

    def repair(self, first, nss, key, dt):
        self._slide(first + nss - 1)
        coefs = pure_coefficients(key, nss, dt)
        eq = {first + i: c for i, c in enumerate(coefs) if c}
        if any(e < self.base for e in eq):
            return
        self.equations.append(eq)

    def release(self, bound):
        self.base = max(self.base, bound)

    def known(self):
        eqs = [{e: c for e, c in eq.items() if e not in self.received} for eq in self.equations]
        return self.received | determined_unknowns([eq for eq in eqs if eq])


def check_equations(dec, sources):
    """White-box: the pending equations are true, in reduced row echelon form, with each
    row's pivot its lowest unknown ESI, and none of them already solved."""
    w = dec.max_window
    active = [r for r in range(dec._piv.shape[0]) if dec._piv[r] >= 0]
    assert len(active) == dec.pending_equations
    pivots = {}
    for r in active:
        esi = int(dec._piv[r])
        assert dec.base <= esi < dec.base + w and not dec.known(esi)
        pivots[esi % w] = r
        assert dec._colrow[esi % w] == r and dec._coef[r, esi % w] == 1
        cols = np.flatnonzero(dec._coef[r])
        assert cols.max() < w
        esis = dec.base + (cols - dec.base % w) % w
        assert esis.min() == esi and len(esis) > 1
        assert not any(dec.known(int(e)) for e in esis)
        assert esis.max() <= dec._ints[2]  # the highest ESI any equation may involve
        value = np.zeros(dec.symbol_size, dtype=np.uint8)
        for c, e in zip(cols, esis, strict=True):
            value ^= MUL[dec._coef[r, c]][sources[int(e)]]
        assert np.array_equal(value, dec._pay[r, : dec.symbol_size])
    assert int((dec._colrow >= 0).sum()) == len(pivots)
    for col, r in pivots.items():
        assert all(dec._coef[o, col] == 0 for o in active if o != r)


def make_stream(
    n, size, enc_window, max_window, seed, loss_kind, loss, repair_every, dt_mode, reorder,
    dups, n_releases,
):  # fmt: skip
    """A lossy, reordered, duplicated packet sequence of an RLC stream of ``n`` sources."""
    rng = random.Random(seed)
    events = []  # (kind, args)
    for i in range(n):
        events.append(("source", i))
        if (i + 1) % repair_every == 0 or i == n - 1:
            for _ in range(rng.randint(1, 2)):
                lo = max(0, i + 1 - enc_window)
                first = rng.randint(lo, i)
                nss = rng.randint(1, i + 1 - first)
                dt = 15 if dt_mode == 15 else rng.randint(0, 15)
                events.append(("repair", (first, nss, rng.randint(0, 0xFFFF), dt)))
    # Losses: independent, one burst, or a two-state (Gilbert) channel.
    if loss_kind == "iid":
        kept = [e for e in events if rng.random() >= loss]
    elif loss_kind == "burst":
        start = rng.randint(0, len(events))
        length = rng.randint(0, max(1, int(loss * len(events))))
        kept = events[:start] + events[start + length :]
    else:
        bad, kept = False, []
        for e in events:
            bad = rng.random() < (0.7 if bad else loss / 2)
            if not bad:
                kept.append(e)
    # Reordering (each packet delayed by a random number of slots) and duplicates.
    keyed = [(i + rng.randint(0, reorder), i, e) for i, e in enumerate(kept)]
    arrivals = [e for _, _, e in sorted(keyed)]
    for _ in range(dups if arrivals else 0):
        k = rng.randint(0, len(arrivals) - 1)
        arrivals.insert(min(len(arrivals), k + rng.randint(1, 4)), arrivals[k])
    # Explicit releases, a little behind the highest ESI seen so far (as a receiver would).
    releases = {}
    for _ in range(n_releases if arrivals else 0):
        k = rng.randint(0, len(arrivals) - 1)
        top = max(a if kind == "source" else a[0] + a[1] - 1 for kind, a in arrivals[: k + 1])
        releases[k] = rng.randint(max(0, top - max_window), top)
    return size, enc_window, max_window, seed, n, arrivals, releases


@st.composite
def streams(draw, max_sources, slide):
    n = draw(st.integers(1, max_sources))
    enc_window = draw(st.integers(1, 24))
    return make_stream(
        n=n,
        size=draw(st.integers(1, 40)),
        enc_window=enc_window,
        max_window=draw(st.integers(enc_window, enc_window + 12))
        if slide
        else n + draw(st.integers(0, 8)),
        seed=draw(st.integers(0, 2**32 - 1)),
        loss_kind=draw(st.sampled_from(["iid", "burst", "gilbert"])),
        loss=draw(st.floats(0.0, 0.6)),
        repair_every=draw(st.integers(1, 6)),
        dt_mode=draw(st.sampled_from([15, 15, "random"])),
        reorder=draw(st.integers(0, 8)),
        dups=draw(st.integers(0, 4)),
        n_releases=draw(st.integers(0, 2)) if slide else 0,
    )


def run_against_oracle(size, enc_window, max_window, seed, n, arrivals, releases):
    rng = np.random.default_rng(seed)
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    enc = RLCEncoder(size, window=max(enc_window, n))
    for s in sources:
        enc.add_source(s)
    dec = RLCDecoder(size, max_window=max_window)
    oracle = Oracle(max_window)
    known_before = set()
    decoded = set()  # ESIs a call returned that were not that call's own source symbol

    def check(got, own):
        nonlocal known_before
        assert dec.base == oracle.base
        window = range(dec.base, dec.base + max_window)
        known_now = {e for e in window if dec.known(e)}
        # Exactly the symbols the received equations determine, as soon as they do.
        assert known_now == {e for e in oracle.known() if e in window}
        # Each call returns exactly what became known, once.
        assert len(got) == len(set(got))
        assert set(got) == known_now - known_before
        known_before = known_now
        # Never a wrong byte.
        for e in got:
            assert dec.get(e) == sources[e].tobytes()
        decoded.update(set(got) - own)
        check_equations(dec, sources)

    for step, (kind, args) in enumerate(arrivals):
        if kind == "source":
            got = dec.add_source(args, sources[args].tobytes())
            oracle.source(args)
            check(got, {args})
        else:
            first, nss, key, dt = args
            got = dec.add_repair(first, nss, key, dt, enc.repair(first, nss, key, dt))
            oracle.repair(first, nss, key, dt)
            check(got, set())
        if step in releases:
            dec.release_before(releases[step])
            oracle.release(releases[step])
            check([], set())
    for e in range(n):
        value = dec.get(e)
        assert value is None or value == sources[e].tobytes()
        assert (e in dec.recovered) == (dec.known(e) and e in decoded)
    through = -1
    while through + 1 < n and dec.known(through + 1):
        through += 1
    if dec.base == 0:
        assert dec.decoded_through == through
    top = min(n, dec.base + max_window)  # missing() reports inside the window only
    assert dec.missing(0, n) == [e for e in range(dec.base, top) if not dec.known(e)]
    return dec


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(max_sources=60, slide=False))
def test_decoder_recovers_exactly_what_the_equations_determine(stream):
    dec = run_against_oracle(*stream)
    event(f"recovered {'none' if not dec.stats['recovered'] else 'some'}")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(max_sources=120, slide=True))
def test_decoder_with_sliding_window_and_releases(stream):
    dec = run_against_oracle(*stream)
    event(f"recovered {'none' if not dec.stats['recovered'] else 'some'}")
    event(f"stale {'none' if not dec.stats['stale'] else 'some'}")


def _decoder_state(dec):
    n = dec._ints[1]  # pending rows
    return (dec.base, dec.decoded_through, dec.stats, dec.state.tobytes(), dec.sym.tobytes(),
            dec._ints[:4].tolist(), n)  # fmt: skip


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(max_sources=120, slide=True), st.integers(1, 9))
def test_add_source_run_is_add_source_once_per_symbol(stream, longest):
    """Runs of consecutive sources handed over in one call leave the decoder exactly as one
    call per symbol does (bulk path or not), and return the same ESIs."""
    size, enc_window, max_window, seed, n, arrivals, releases = stream
    rng = np.random.default_rng(seed)
    sources = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
    enc = RLCEncoder(size, window=max(enc_window, n))
    for src in sources:
        enc.add_source(src)
    one, bulk = RLCDecoder(size, max_window=max_window), RLCDecoder(size, max_window=max_window)
    run: list[int] = []  # consecutive source ESIs not yet given to ``bulk``

    def flush():
        if run:
            got = bulk.add_source_run(run[0], b"".join(sources[e] for e in run))
            assert got == expected[: len(got)] and len(got) == len(expected)
            run.clear()
            expected.clear()

    expected: list[int] = []
    for step, (kind, args) in enumerate(arrivals):
        if kind == "source":
            if run and (args != run[-1] + 1 or len(run) >= longest):
                flush()
            run.append(args)
            expected.extend(one.add_source(args, sources[args]))
        else:
            flush()
            first, nss, key, dt = args
            payload = enc.repair(first, nss, key, dt)
            assert one.add_repair(*args, payload) == bulk.add_repair(*args, payload)
        if step in releases:
            flush()
            one.release_before(releases[step])
            bulk.release_before(releases[step])
        if not run:
            assert _decoder_state(one) == _decoder_state(bulk)
    flush()
    assert _decoder_state(one) == _decoder_state(bulk)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    streams(max_sources=120, slide=True), st.integers(1, 40), st.integers(0, 10**6),
    st.integers(0, 100),
)  # fmt: skip
def test_a_window_widened_mid_stream_decodes_as_one_that_was_wide_from_the_start(
    stream, extra, cut_draw, shift
):
    """A decoder widened (``widen``) at any point before it had to slide decodes the rest
    of the stream exactly as one made that wide with the same ``max_pending`` (``widen``
    keeps it, as the receiver's bounded state needs): the same ESIs per call, the same
    symbols, pending pivots, base and counters. The stream starts at ESI ``shift`` (the ones
    below received and released), so held ESIs lie in other ring slots once widened."""
    size, enc_window, max_window, seed, n, arrivals, releases = stream
    rng = np.random.default_rng(seed)
    sources = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(shift + n)]
    enc = RLCEncoder(size, window=max(enc_window, shift + n))
    for src in sources:
        enc.add_source(src)
    wide_window = max_window + extra
    narrow = RLCDecoder(size, max_window=max_window, max_pending=max_window)
    wide = RLCDecoder(size, max_window=wide_window, max_pending=max_window)
    for d in (narrow, wide):
        for e in range(shift):
            d.add_source(e, sources[e])
        d.release_before(shift)
    arrivals = [
        (kind, args + shift if kind == "source" else (args[0] + shift, *args[1:]))
        for kind, args in arrivals
    ]
    releases = {step: bound + shift for step, bound in releases.items()}
    # the last step at which the narrow window has not had to slide yet
    base, cut = shift, len(arrivals)
    for step, (kind, args) in enumerate(arrivals):
        top = args if kind == "source" else args[0] + args[1] - 1
        if top >= base + max_window:
            cut = step
            break
        if step in releases:
            base = max(base, releases[step])
    widen_at = cut_draw % (cut + 1)
    for step, (kind, args) in enumerate(arrivals):
        if step == widen_at:
            narrow.widen(wide_window)
            assert narrow.max_window == narrow.capacity == wide_window
        if kind == "source":
            got = [d.add_source(args, sources[args]) for d in (narrow, wide)]
        else:
            payload = enc.repair(*args)
            got = [d.add_repair(*args, payload) for d in (narrow, wide)]
        assert sorted(got[0]) == sorted(got[1])
        if step in releases:
            narrow.release_before(releases[step])
            wide.release_before(releases[step])
        assert narrow.pending_pivots().tolist() == wide.pending_pivots().tolist()
    if widen_at == len(arrivals):
        narrow.widen(wide_window)
    assert (narrow.base, narrow.decoded_through, narrow.stats) == (
        wide.base,
        wide.decoded_through,
        wide.stats,
    )
    for e in range(shift + n):
        assert narrow.get(e) == wide.get(e)
    check_equations(narrow, [np.frombuffer(x, np.uint8) for x in sources])


def _settled_state(dec):
    """_decoder_state without the scratch count of the last kernel call (ints[3])."""
    state = list(_decoder_state(dec))
    state[5] = state[5][:3]
    return tuple(state)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(max_sources=120, slide=True), st.integers(1, 12), st.integers(1, 40))
def test_add_packets_is_one_call_per_packet(stream, longest, max_pending):
    """Runs of sources and repairs handed over in one add_packets call leave the decoder
    exactly as add_source / add_repair once per packet do, and return the same ESIs."""
    size, enc_window, max_window, seed, n, arrivals, releases = stream
    rng = np.random.default_rng(seed)
    sources = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
    enc = RLCEncoder(size, window=max(enc_window, n))
    for src in sources:
        enc.add_source(src)
    pend = min(max_pending, max_window)
    one = RLCDecoder(size, max_window=max_window, max_pending=pend)
    batch = RLCDecoder(size, max_window=max_window, max_pending=pend)
    meta, pays, expected = [], [], []

    def flush():
        if meta:
            assert batch.add_packets(meta, b"".join(pays)) == expected
            meta.clear(), pays.clear(), expected.clear()
            assert _settled_state(one) == _settled_state(batch)
            assert one.pending_pivots().tolist() == batch.pending_pivots().tolist()

    for step, (kind, args) in enumerate(arrivals):
        if kind == "source":
            meta.append((args, 0, 0, 0))
            pays.append(sources[args])
            expected.extend(one.add_source(args, sources[args]))
        else:
            payload = enc.repair(*args)
            meta.append(args)
            pays.append(payload)
            expected.extend(one.add_repair(*args, payload))
        if len(meta) >= longest:
            flush()
        if step in releases:
            flush()
            one.release_before(releases[step])
            batch.release_before(releases[step])
    flush()
    for e in range(n):
        assert batch.get(e) == one.get(e)


def test_max_pending_bounds_the_equations_held_and_counts_the_rest():
    size, w = 16, 64
    rng = np.random.default_rng(9)
    sources = rng.integers(0, 256, (w, size), dtype=np.uint8)
    enc = RLCEncoder(size, window=w)
    enc.add_sources(sources)
    dec = RLCDecoder(size, max_window=w, max_pending=5)
    for key in range(12):  # every source lost: each repair is a new equation
        assert dec.add_repair(0, w, key, 15, enc.repair(0, w, key)) == []
    assert dec.pending_equations == 5 and dec._coef.shape[0] == 5
    assert dec.stats["repairs_dropped"] == 7 and dec.stats["repairs_useful"] == 5
    got = dec.add_packets([(e, 0, 0, 0) for e in range(5, w)], sources[5:])
    assert sorted(got) == list(range(w))  # the five equations held still solve their part
    assert all(dec.get(e) == sources[e].tobytes() for e in range(w))
    with pytest.raises(ValueError, match="max_pending"):
        RLCDecoder(size, max_window=w, max_pending=w + 1)


def test_add_packets_rejects_bad_rows_without_changing_state():
    dec = RLCDecoder(4, max_window=8)
    assert dec.add_packets(np.zeros((0, 4), np.int64), b"") == []
    assert dec.add_packets([(1, 0, 0, 0)], bytes(4)) == [1]
    before = _decoder_state(dec)
    for meta, match in [
        ([(0, 0, 0, 0), (2, 9, 1, 15)], "packet 1"),  # nss beyond the window
        ([(0, 2, 70000, 15)], "packet 0"),  # repair key
        ([(0, 2, 1, 16)], "packet 0"),  # dt
        ([(-1, 0, 0, 0)], "packet 0"),  # esi
        ([(0, 0, 0, 0)] * 2, "expected 2 x 4"),  # payload size
        ([(0, 0, 0)], "n x 4"),
    ]:
        with pytest.raises(ValueError, match=match):
            dec.add_packets(meta, bytes(4 * (len(meta) if "expected" not in match else 1)))
        assert _decoder_state(dec) == before


def test_add_source_run_takes_whole_symbols_only():
    dec = RLCDecoder(4, max_window=8)
    assert dec.add_source_run(0, b"") == []
    with pytest.raises(ValueError, match="whole"):
        dec.add_source_run(0, bytes(6))
    assert dec.add_source_run(6, bytes(8)) == [6, 7]
    assert dec.add_source_run(0, bytes(24)) == [0, 1, 2, 3, 4, 5]
    assert dec.decoded_through == 7 and dec.stats["sources"] == 8


@pytest.mark.parametrize(
    ("seed", "loss_kind", "slide"),
    [(1, "gilbert", False), (2, "iid", True), (3, "burst", True), (4, "gilbert", True)],
)
def test_decoder_on_longer_streams_against_oracle(seed, loss_kind, slide):
    stream = make_stream(
        n=160, size=24, enc_window=24, max_window=40 if slide else 170, seed=seed,
        loss_kind=loss_kind, loss=0.3, repair_every=3, dt_mode=15 if seed % 2 else "random",
        reorder=6, dups=5, n_releases=2 if slide else 0,
    )  # fmt: skip
    dec = run_against_oracle(*stream)
    assert dec.stats["recovered"] >= 5


def test_repairs_before_their_sources_and_full_loss_recovery():
    size, n = 16, 12
    rng = np.random.default_rng(3)
    sources = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
    enc = RLCEncoder(size, window=n)
    for s in sources:
        enc.add_source(s)
    dec = RLCDecoder(size, max_window=32)
    got = []
    for key in range(n - 1):  # n-1 equations over n unknowns: nothing is determined yet
        got += dec.add_repair(0, n, key, 15, enc.repair(0, n, key, 15))
    assert got == [] and dec.pending_equations == n - 1
    assert dec.pending_pivots().tolist() == list(range(n - 1))  # lowest unknown of each row
    got += dec.add_source(5, sources[5])  # the last missing piece solves everything
    assert sorted(got) == list(range(n))
    assert [dec.get(e) for e in range(n)] == sources
    assert dec.decoded_through == n - 1 and dec.pending_equations == 0
    assert set(dec.recovered) == set(range(n)) - {5}


def test_release_keeps_what_the_equations_say_about_the_rest():
    # Two equations over lost x0, x1, x2. Releasing x0 leaves one equation in x1, x2 (the
    # decoder eliminates x0 rather than dropping both); x2 then arrives and yields x1.
    size = 8
    sources = [bytes([i + 1]) * size for i in range(3)]
    enc = RLCEncoder(size, window=3)
    for s in sources:
        enc.add_source(s)
    dec = RLCDecoder(size, max_window=8)
    assert dec.add_repair(0, 3, 11, 15, enc.repair(0, 3, 11, 15)) == []
    assert dec.add_repair(0, 3, 12, 15, enc.repair(0, 3, 12, 15)) == []
    dec.release_before(1)
    assert dec.pending_equations == 1
    assert dec.add_source(2, sources[2]) == [2, 1]
    assert dec.get(1) == sources[1]
    assert dec.get(0) is None and dec.decoded_through == -1  # x0 was released unknown


def test_duplicates_stale_and_redundant_input_are_counted_not_harmful():
    dec = RLCDecoder(4, max_window=4)
    enc = RLCEncoder(4, window=8)
    for i in range(8):
        enc.add_source(bytes([i]) * 4)
    assert dec.add_source(0, b"\0\0\0\0") == [0]
    assert dec.add_source(0, b"\0\0\0\0") == []
    assert dec.add_repair(0, 1, 1, 15, enc.repair(0, 1, 1)) == []  # covers only known ESIs
    assert dec.add_source(6, b"\6\6\6\6") == [6]  # slides the window to 3..6
    assert dec.base == 3 and dec.get(0) is None
    assert dec.add_source(1, b"\1\1\1\1") == []  # below the window
    assert dec.add_repair(2, 2, 5, 15, enc.repair(2, 2, 5)) == []  # touches released ESI 2
    s = dec.stats
    assert (s["duplicates"], s["repairs_all_known"], s["stale"]) == (1, 1, 2)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda d: d.add_source(0, bytes(9)), "exceeds"),
        (lambda d: d.add_source(-1, b""), "esi"),
        (lambda d: d.add_repair(0, 4, 1, 15, bytes(7)), "expected 8"),
        (lambda d: d.add_repair(0, 17, 1, 15, bytes(8)), "max_window"),
        (lambda d: d.add_repair(0, 4, 1, 16, bytes(8)), "dt"),
        (lambda d: d.add_repair(0, 0, 1, 15, bytes(8)), "nss"),
        (lambda d: d.add_repair(2**32 - 2, 4, 1, 15, bytes(8)), "past ESI"),
    ],
)
def test_decoder_rejects_bad_arguments_without_changing_state(call, match):
    dec = RLCDecoder(8, max_window=16)
    dec.add_source(3, b"abc")
    with pytest.raises(ValueError, match=match):
        call(dec)
    assert dec.base == 0 and dec.known(3) and dec.pending_equations == 0
    assert dec.get(3) == b"abc" + bytes(5)


def test_memory_stays_bounded_on_a_long_lossy_stream():
    size, w, n = 32, 64, 20000
    rng = np.random.default_rng(11)
    enc = RLCEncoder(size, window=32)
    dec = RLCDecoder(size, max_window=w)
    lost = 0
    bad = False
    for i in range(n):
        payload = rng.integers(0, 256, size, dtype=np.uint8)
        enc.add_source(payload)
        bad = rng.random() < (0.5 if bad else 0.04)  # bursty: mean loss ~7%
        if not bad:
            dec.add_source(i, payload)
        else:
            lost += 1
        if i % 8 == 7 and rng.random() > 0.1:
            first = max(0, i - 31)
            dec.add_repair(
                first, i - first + 1, i & 0xFFFF, 15, enc.repair(first, i - first + 1, i)
            )
    assert dec.stats["recovered"] > 0.5 * lost  # the decoder did real work throughout
    assert dec.base == n - w
    owned = [v for v in vars(dec).values() if isinstance(v, np.ndarray) and v.base is None]
    array_bytes = sum(v.nbytes for v in owned)
    # The window (symbols, states), at most w pending rows (coefficients + payload), the int64
    # bookkeeping and a staging buffer: a function of w and the symbol size, not of n.
    bound = w * (size + 1) + w * (w + size) + 8 * (8 + 3 * w) + size
    assert array_bytes <= bound
    assert dec.pending_equations <= w and len(dec.recovered) <= w
    containers = [v for v in vars(dec).values() if isinstance(v, list | set | dict)]
    assert all(len(c) <= 16 for c in containers)
