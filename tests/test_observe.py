"""SenderSession.observe() inlines the arithmetic of slots_left, loss_estimate, in_flight
and owed for speed (it runs once per decision on the data path). This pins the inlined
copy to the methods it mirrors, at every step of a lossy transfer with feedback, so the
two cannot drift apart."""

import numpy as np

from kvtransport.policy import OBS_CLIP, Obs, make_policy
from kvtransport.receiver import ReceiverSession
from kvtransport.sender import SenderSession
from kvtransport.transfer import synthetic_transfer


def _expected(s, t):
    iv = float(s.decision_packets)
    unsent = s.n_source - s.next_esi
    owed = s.owed()
    src, rep = s.in_flight()
    p = s.loss_estimate()
    left = s.slots_left(t)
    return {
        Obs.LOSS_RATE: p,
        Obs.OWED: min(owed / iv, OBS_CLIP),
        Obs.IN_FLIGHT_SRC: min(src / iv, OBS_CLIP),
        Obs.IN_FLIGHT_REP: min(rep / iv, OBS_CLIP),
        Obs.CAPACITY_RATIO: min(left / max(1.0, unsent + owed), 4.0),
        Obs.SLACK: min(max((left * (1.0 - p) - owed) / iv / 8.0, -1.0), 8.0),
        Obs.SOURCE_LEFT: unsent / (s.n_source or 1),
    }


def test_observe_matches_the_methods_it_inlines_through_a_lossy_transfer():
    for policy in ("adaptive", "fixed:2/16", "arq"):
        tr = synthetic_transfer(400_000, 40, seed=3)
        s = SenderSession(tr, make_policy(policy), rate_bps=1e8, deadline=0.05, now=0.0)
        r = ReceiverSession(s.transfer_id, now=0.0, deadline=0.05)
        t, n, checked, owed_seen, delayed = 0.0, 0, 0, 0, []
        while not s.done and t < 0.05:
            for d in s.datagrams_to_send(t):
                n += 1
                if n % 7 not in (3, 4):  # bursts of two losses
                    r.receive_datagram(d, t)
            delayed += [(t + 0.004, fb) for fb in r.datagrams_to_send(t)]  # 4 ms back
            while delayed and delayed[0][0] <= t:
                s.receive_datagram(delayed.pop(0)[1], t)
            obs = s.observe(t)
            for field, want in _expected(s, t).items():
                assert obs[field] == np.float32(want), (policy, t, field.name)
            checked += 1
            owed_seen += s.owed() > 0
            t += 2e-4
        # feedback arrived and repairs were owed at some steps: every branch was compared
        assert checked > 100 and s.fb_time is not None and owed_seen > 0, policy
