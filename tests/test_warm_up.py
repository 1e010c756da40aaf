"""daemon.warm_up: after it, a daemon's first real transfer compiles no numba kernel.

On a fresh install numba compiles each kernel at its first call (seconds in all); a daemon
that paid that inside its first transfer would miss that transfer's deadline. The check:
no kernel of the data path gains a new compiled signature during a transfer with loss,
reordering, duplication, authentication (source runs sealed and opened in one call), the
DDQN policy and two transfers sharing the allocator, once warm_up has run with the
daemon's arguments.
"""

import random

import numba
from kvtransport.codecs import aesgcm, gf256, rlc, tinymt32

from kvtransport.core.receiver import ReceiverSession
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.core.wire import LaidOutDatagrams
from kvtransport.daemons.daemon import warm_up
from kvtransport.policies import ddqn as runtime
from kvtransport.policies import features
from kvtransport.policies.registry import make_policy
from kvtransport.scheduling import allocator
from kvtransport.scheduling.utility_model import SigmoidUtility

KEY = bytes(range(32))
MODULES = (gf256, tinymt32, rlc, aesgcm, features, runtime, allocator)


def compiled_signatures():
    out = {}
    for m in MODULES:
        for name, obj in vars(m).items():
            if isinstance(obj, numba.core.registry.CPUDispatcher):
                out[f"{m.__name__}.{name}"] = len(obj.signatures)
    return out


def impaired_transfer(policy):
    tr = synthetic_transfer(600_000, 50, seed=34)
    s = SenderSession(tr, make_policy(policy), rate_bps=1e8, deadline=0.5, now=0.0, key=KEY)
    r = ReceiverSession(s.transfer_id, key=KEY, now=0.0, deadline=0.5)
    rnd, t, i = random.Random(7), 0.0, 0
    while not s.done and t < 0.5:
        held = [d for d in s.datagrams_to_send(t) for _ in (0, 1)]  # duplicated
        rnd.shuffle(held)  # reordered
        kept = []
        for d in held:
            i += 1
            if i % 9 != 4:  # lost
                kept.append(d)
        r.receive_datagrams(LaidOutDatagrams.join(kept), t)  # as the daemon hands over a read
        for fb in r.datagrams_to_send(t):
            s.receive_datagram(fb, t)
        t += 1e-3
    return r.result


def test_a_transfer_after_warm_up_compiles_nothing():
    policy = "ddqn" if runtime.shipped_policy_available() else "adaptive"
    warm_up(KEY, ("fixed:1/4", policy), allocator=True)
    before = compiled_signatures()
    assert before["kvtransport.codecs.rlc._decode_repair"] >= 1  # warm_up reached the decoder
    assert before["kvtransport.codecs.aesgcm.open_run"] >= 1  # and the source runs' kernels
    result = impaired_transfer(policy)
    sched = allocator.OnlineScheduler(1.25e7)
    for i in range(3):
        sched.add(allocator.ScheduledTransfer(i, 2e6, 0.3 + 0.1 * i, SigmoidUtility(0.8, 8.0, 0.3)))
    sched.step(0.0)
    assert result.utility_recovered > 0.5  # the transfer did real work
    grown = {
        k: (before.get(k, 0), n) for k, n in compiled_signatures().items() if n > before.get(k, 0)
    }
    assert grown == {}, f"compiled during the transfer: {grown}"


def test_a_cold_kernel_cache_is_announced_before_compiling_and_a_warm_one_is_silent(
    tmp_path, monkeypatch
):
    from kvtransport import kernel_cache
    from kvtransport.daemons import daemon

    folder = tmp_path / "0123456789abcdef"  # a digest folder, as kernel_cache.configure makes
    index = folder / "codecs_0" / "rlc._decode_repair-1.py311.nbi"
    index.parent.mkdir(parents=True)
    index.touch()
    monkeypatch.setattr(kernel_cache, "current", lambda: folder)
    notes = []

    def warm():
        monkeypatch.setattr(daemon, "_warm_keyed", set())  # a fresh process
        daemon.warm_data_path(KEY, notes.append)

    warm()  # no stamp: cold
    assert len(notes) == 2 and notes[0].startswith("compiling kernels (first run only, about ")
    assert notes[1].startswith("kernels compiled in ")
    assert kernel_cache.is_warm(folder)
    warm()  # stamped, every index file there: silent
    assert len(notes) == 2
    index.unlink()  # the cache was cleared under the stamp: cold again
    warm()
    assert len(notes) == 4 and notes[2].startswith("compiling kernels")
    # a new digest folder announces what the last compile beside it took
    spent = kernel_cache._stamp(folder)["compile_s"]
    assert kernel_cache.compile_estimate(tmp_path / "fedcba9876543210") == spent
