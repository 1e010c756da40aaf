"""The observation kernel (kvtransport.core.observation) against the definitions it encodes.

The sender keeps the kernel's input (``Raw``) current in three groups packed at different
moments (each decision, each feedback, rate changes), and the kernel repeats the
arithmetic of ``slots_left``, ``loss_estimate``, ``in_flight`` and ``owed``. This computes
every field from the session's attributes and methods instead, at every step of lossy
transfers with delayed feedback and a rate change, for each repair mode: a group packed
too late, a field left out, or kernel arithmetic that drifts from the methods fails here.
"""

import numpy as np
import pytest

from kvtransport.core.observation import OBS_CLIP, OBS_SIZE, Obs
from kvtransport.core.receiver import ReceiverSession
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.policies.registry import make_policy


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def _expected(s, t):
    """Every observation field, from the session's attributes and estimate methods."""
    iv = float(s.decision_packets)
    n = s.n_source or 1
    unsent = s.n_source - s.next_esi
    owed = s.owed()
    src, rep = s.in_flight()
    p = s.loss_estimate()
    left = s.slots_left(t)
    rtt = 2.0 * s.owd  # the smoothed RTT, or the initial one before any was measured
    rtt_iv = rtt / (iv * s.slot_s)
    if s.fb_time is None:
        age = OBS_CLIP
    else:
        age = min((t - s.fb_time) / max(rtt, 1e-3), OBS_CLIP - 1e-3)
    last_share, last_admit, prev_share = s.driver.last
    return {
        Obs.TIME_LEFT: _clip((s.stop_time - t) / s.driver.budget, 0.0, 1.0),
        Obs.SOURCE_LEFT: unsent / n,
        Obs.UTILITY_LEFT: s.source.utility_after[s.next_esi],
        Obs.CAPACITY_RATIO: min(left / max(1.0, unsent + owed), 4.0),
        Obs.SLACK: _clip((left * (1.0 - p) - owed) / iv / 8.0, -1.0, 8.0),
        Obs.LOSS_RATE: p,
        Obs.LOSS_RECENT: s.fb_loss_recent,
        Obs.BURST_MEAN: min(s.fb_burst / 10.0, 2.0),
        Obs.DEFICIT: min((s.fb_deficit + s.fb_unseen) / iv, OBS_CLIP),
        Obs.IN_FLIGHT_SRC: min(src / iv, OBS_CLIP),
        Obs.IN_FLIGHT_REP: min(rep / iv, OBS_CLIP),
        Obs.OWED: min(owed / iv, OBS_CLIP),
        Obs.FEEDBACK_AGE: age,
        Obs.RTT: min(rtt_iv, OBS_CLIP),
        Obs.MANIFEST_ACKED: 1.0 if s.manifest.acked else 0.0,
        Obs.DECODED: s.fb_through / n,
        Obs.LAST_SHARE: last_share,
        Obs.LAST_ADMIT: last_admit,
        Obs.PREV_SHARE: prev_share,
        Obs.RTT_LONG: min(rtt_iv / 64.0, 4.0),
        Obs.PRIOR_LOSS: s.prior_loss if s.prior_loss is not None else 0.0,
        Obs.PRIOR_KNOWN: 1.0 if s.prior_loss is not None else 0.0,
    }


@pytest.mark.parametrize(
    "policy,prior",
    [("adaptive", None), ("fixed:2/16", None), ("arq", None), ("block-rs:4/16", None),
     ("none", None), ("adaptive", 0.08), ("arq", 0.3)],
)  # fmt: skip
def test_every_field_follows_the_sessions_state_through_a_lossy_transfer(policy, prior):
    tr = synthetic_transfer(400_000, 40, seed=3)
    s = SenderSession(tr, make_policy(policy), rate_bps=1e8, deadline=0.05, now=0.0)
    r = ReceiverSession(s.transfer_id, now=0.0, deadline=0.05)
    t, n, checked, delayed = 0.0, 0, 0, []
    seen = {"owed": 0, "feedback": 0, "rate": 0, "prior": 0}
    while not s.done and t < 0.05:
        if prior is not None and abs(t - 0.0004) < 1e-9:  # the shell learns a prior
            s.set_prior_loss(prior)
        if s.fb_time is None and s.prior_loss is not None:
            assert s.loss_estimate() == prior  # the prior stands in for feedback
            seen["prior"] += 1
        if abs(t - 0.012) < 1e-9 or abs(t - 0.024) < 1e-9:  # the link's share changes
            s.set_rate(6e7 if t < 0.02 else 1.2e8, t)
            seen["rate"] += 1
        for d in s.datagrams_to_send(t):
            n += 1
            if n % 7 not in (3, 4):  # bursts of two losses
                r.receive_datagram(d, t)
        delayed += [(t + 0.004, fb) for fb in r.datagrams_to_send(t)]  # 4 ms back
        while delayed and delayed[0][0] <= t:
            s.receive_datagram(delayed.pop(0)[1], t)
        obs = s.observe(t)
        want = _expected(s, t)
        assert len(want) == OBS_SIZE
        for field, value in want.items():
            assert obs[field] == np.float32(value), (policy, t, field.name)
        checked += 1
        seen["owed"] += s.owed() > 0
        seen["feedback"] += s.fb_time is not None
        t = round(t + 2e-4, 6)
    # feedback arrived, repairs were owed (where the mode owes any) and the rate changed
    # at some steps: every branch was compared
    assert checked > 100 and seen["feedback"] > 50 and seen["rate"] == 2, policy
    assert (seen["owed"] > 0) == (policy != "none"), policy
    assert (seen["prior"] > 0) == (prior is not None), policy
