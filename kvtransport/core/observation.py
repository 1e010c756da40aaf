"""The policy's observation: its fields (:class:`Obs`) and the kernel that computes them.

The sender asks its policy for an action once per decision interval (and after a rate
rise, see kvtransport.core.sender), on the data path, so
the observation is built by a numba kernel rather than by Python arithmetic: the sender
copies its raw counters and the latest feedback into a float64 vector (:class:`Raw`, one
``struct.pack_into``) and :func:`observe_into` derives the scaled fields from it. A policy
that is itself a numba kernel (the DDQN runtime) calls ``observe_into`` inside its own
kernel, so one compiled call goes from the sender's counters to the action; Python policies
get the filled observation and act on it (``Policy.decide``). Either way there is one
implementation of the observation, and the Gymnasium environment sees exactly what the
daemon's policy sees.

The fields' definitions in words are in :class:`Obs`; the estimates they scale are the
sender's (``SenderSession.slots_left``, ``loss_estimate``, ``in_flight``, ``owed``), and
``tests/test_observe.py`` pins every field to them.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
from numba import njit

BURST_UNIT = 10.0
"""Packets per unit of the ``BURST_MEAN`` observation."""


class Obs(IntEnum):
    """Indices of the observation vector's fields."""

    TIME_LEFT = 0  # (stop - now) / (stop - start): share of the sending time left, 0..1
    SOURCE_LEFT = 1  # source symbols not yet sent / all source symbols, 0..1
    UTILITY_LEFT = 2  # utility of blocks not yet completely sent, 0..1
    CAPACITY_RATIO = 3  # slots left / (sources unsent + repairs owed), clipped 0..4
    SLACK = 4  # (expected surviving slots - owed) / interval / 8, clipped -1..8
    LOSS_RATE = 5  # receiver's smoothed packet loss rate (the prior before feedback), 0..1
    LOSS_RECENT = 6  # loss rate over the last feedback interval, 0..1
    BURST_MEAN = 7  # receiver's smoothed loss-burst length / 10, clipped 0..2
    DEFICIT = 8  # source symbols sent and known missing / interval, clipped 0..16
    IN_FLIGHT_SRC = 9  # sources sent after the last reported packet / interval, 0..16
    IN_FLIGHT_REP = 10  # repairs sent after the last reported packet / interval, 0..16
    OWED = 11  # expected repairs still needed for what was sent / interval, 0..16
    FEEDBACK_AGE = 12  # time since the last feedback / smoothed RTT, clipped 0..16
    RTT = 13  # smoothed RTT in intervals, clipped 0..16
    MANIFEST_ACKED = 14  # 1 once feedback says the manifest was decoded
    DECODED = 15  # receiver's decoded-through ESI / all source symbols, 0..1
    LAST_SHARE = 16  # repair share of the previous action
    LAST_ADMIT = 17  # admit flag of the previous action
    PREV_SHARE = 18  # repair share of the action before that
    RTT_LONG = 19  # smoothed RTT in intervals / 64, clipped 0..4 (RTT clips at 16 intervals)
    PRIOR_LOSS = 20  # loss prior of this path before any feedback (0 if none), 0..1
    PRIOR_KNOWN = 21  # 1 if the shell gave a loss prior (profile or previous transfers)


OBS_FIELDS = tuple(f.name.lower() for f in Obs)
OBS_SIZE = len(OBS_FIELDS)
OBS_CLIP = 16.0


class Raw(IntEnum):
    """The sender state an observation is computed from (float64 vector indices), in groups
    by when they change, each written by one ``struct.pack_into`` at that moment: at every
    decision (``T`` .. ``PREV_SHARE``), when feedback arrives (``HAS_FEEDBACK`` ..
    ``MANIFEST_ACKED``: the decision then packs 10 fields, not 31) and when the transfer
    starts, its rate changes or the shell sets its loss prior (``SLOT_S`` ..
    ``PRIOR_LOSS``). ``STOP_TIME`` is stored alone
    whenever the RTT estimate or the rate moves it."""

    # at every decision
    T = 0  # the decision's time (shell clock, s)
    NEXT_ESI = 1  # next source symbol to admit
    SOURCE_SENT = 2  # sources sent so far
    REPAIR_SENT = 3  # repairs sent so far (all kinds)
    REACTIVE_SENT = 4  # repairs sent for holes feedback reported
    SEG_NEEDED = 5  # RLC: equations the reported segments still lack
    UTILITY_LEFT = 6  # utility of blocks not yet completely sent
    LAST_SHARE = 7  # repair share of the previous action
    LAST_ADMIT = 8  # admit flag of the previous action
    PREV_SHARE = 9  # repair share of the action before that
    # when the RTT estimate or the rate moves it
    STOP_TIME = 10  # last moment a datagram can leave and arrive in time
    # when feedback arrives
    HAS_FEEDBACK = 11  # 1 once any feedback arrived
    FB_TIME = 12  # arrival time of the latest feedback
    FB_LOSS = 13  # receiver's smoothed loss rate
    FB_LOSS_RECENT = 14  # loss rate over the last feedback interval
    FB_BURST = 15  # receiver's smoothed loss-burst length (packets)
    FB_DEFICIT = 16  # sources the receiver reported missing
    FB_UNSEEN = 17  # sources sent before the reported packet that it never mentioned
    FB_THROUGH = 18  # receiver's decoded-through ESI
    SRTT = 19  # smoothed RTT (0: none measured yet)
    SOURCE_MARK = 20  # sources sent up to the last packet feedback reported
    REPAIR_MARK = 21  # repairs sent up to it
    REACTIVE_MARK = 22  # reactive repairs sent up to it
    MANIFEST_ACKED = 23  # 1 once feedback acknowledged the manifest
    # per transfer (the slot length changes with the rate; the shell may set the prior)
    SLOT_S = 24  # seconds per data-path slot at the paced rate
    BUDGET = 25  # sending time from start to the stop time (s)
    INTERVAL = 26  # slots per decision interval
    N_SOURCE = 27  # source symbols in the stream
    INITIAL_RTT = 28  # RTT assumed before any measurement (s)
    MODE = 29  # how the repair scheme counts what is owed (OWED_*)
    PRIOR_LOSS = 30  # the shell's loss prior for this path (-1: none)


RAW_SIZE = len(Raw)
RAW_DECISION = (int(Raw.T), int(Raw.STOP_TIME))
RAW_FEEDBACK = (int(Raw.HAS_FEEDBACK), int(Raw.SLOT_S))
RAW_TRANSFER = (int(Raw.SLOT_S), RAW_SIZE)
"""The packed groups as (first, end) index ranges."""

OWED_NONE = 0
"""``Raw.MODE`` of a scheme that never owes a repair (sources only)."""
OWED_SEGMENTS = 1
"""... of a scheme whose reactive repairs are counted per reported segment
(``Raw.SEG_NEEDED``, the sliding-window RLC)."""
OWED_REPORTED = 2
"""... of a scheme that owes one repair per reported hole not yet answered by a reactive
repair (``Raw.FB_DEFICIT`` minus reactive repairs in flight: block RS, ARQ)."""


@njit(cache=True, nogil=True)
def observe_into(raw: np.ndarray, obs: np.ndarray) -> None:
    """Write the observation (float32[OBS_SIZE], ``Obs`` order) of sender state ``raw``.

    Fields are indexed by ``.value``: numba 0.65 (the version vLLM pins) cannot index an
    array with an IntEnum member itself.

    float64 arithmetic in the order of the sender's estimate methods, each field rounded
    to float32 once when stored."""
    t = raw[Raw.T.value]
    slot_s = raw[Raw.SLOT_S.value]
    iv = raw[Raw.INTERVAL.value]
    n_source = raw[Raw.N_SOURCE.value]
    n = n_source if n_source != 0.0 else 1.0
    left_s = raw[Raw.STOP_TIME.value] - t
    left = float(int(left_s / slot_s) + 1) if left_s >= 0.0 else 0.0
    has_fb = raw[Raw.HAS_FEEDBACK.value] != 0.0
    prior = raw[Raw.PRIOR_LOSS.value]
    has_prior = prior >= 0.0
    p = raw[Raw.FB_LOSS.value] if has_fb else (prior if has_prior else 0.0)
    src_f = raw[Raw.SOURCE_SENT.value] - raw[Raw.SOURCE_MARK.value]
    rep_f = raw[Raw.REPAIR_SENT.value] - raw[Raw.REPAIR_MARK.value]
    mode = int(raw[Raw.MODE.value])
    if mode == OWED_NONE:
        owed = 0.0
    else:
        rea_f = raw[Raw.REACTIVE_SENT.value] - raw[Raw.REACTIVE_MARK.value]
        if mode == OWED_SEGMENTS:
            needed = raw[Raw.SEG_NEEDED.value]
        else:
            needed = raw[Raw.FB_DEFICIT.value] - rea_f
            needed = needed if needed > 0.0 else 0.0
        owed = needed + raw[Raw.FB_UNSEEN.value] + p * src_f - (1.0 - p) * (rep_f - rea_f)
        owed = owed if owed > 0.0 else 0.0
    unsent = n_source - raw[Raw.NEXT_ESI.value]
    clip = OBS_CLIP
    if not has_fb:
        age = clip
        rtt_iv = raw[Raw.INITIAL_RTT.value] / (iv * slot_s)
    else:
        rtt = raw[Raw.SRTT.value] if raw[Raw.SRTT.value] != 0.0 else raw[Raw.INITIAL_RTT.value]
        age = (t - raw[Raw.FB_TIME.value]) / (rtt if rtt > 1e-3 else 1e-3)
        age = age if age < clip - 1e-3 else clip - 1e-3
        rtt_iv = rtt / (iv * slot_s)
    time_left = left_s / raw[Raw.BUDGET.value]
    time_left = 0.0 if 0.0 > time_left else (time_left if time_left < 1.0 else 1.0)
    cap = unsent + owed
    cap = left / (cap if cap > 1.0 else 1.0)
    slack = (left * (1.0 - p) - owed) / iv / 8.0
    slack = -1.0 if -1.0 > slack else (slack if slack < 8.0 else 8.0)
    burst = raw[Raw.FB_BURST.value] / BURST_UNIT
    deficit = (raw[Raw.FB_DEFICIT.value] + raw[Raw.FB_UNSEEN.value]) / iv
    src_f /= iv
    rep_f /= iv
    owed /= iv
    rtt_long = rtt_iv / 64.0
    obs[Obs.TIME_LEFT.value] = time_left
    obs[Obs.SOURCE_LEFT.value] = unsent / n
    obs[Obs.UTILITY_LEFT.value] = raw[Raw.UTILITY_LEFT.value]
    obs[Obs.CAPACITY_RATIO.value] = cap if cap < 4.0 else 4.0
    obs[Obs.SLACK.value] = slack
    obs[Obs.LOSS_RATE.value] = p
    obs[Obs.LOSS_RECENT.value] = raw[Raw.FB_LOSS_RECENT.value]
    obs[Obs.BURST_MEAN.value] = burst if burst < 2.0 else 2.0
    obs[Obs.DEFICIT.value] = deficit if deficit < clip else clip
    obs[Obs.IN_FLIGHT_SRC.value] = src_f if src_f < clip else clip
    obs[Obs.IN_FLIGHT_REP.value] = rep_f if rep_f < clip else clip
    obs[Obs.OWED.value] = owed if owed < clip else clip
    obs[Obs.FEEDBACK_AGE.value] = age
    obs[Obs.RTT.value] = rtt_iv if rtt_iv < clip else clip
    obs[Obs.MANIFEST_ACKED.value] = raw[Raw.MANIFEST_ACKED.value]
    obs[Obs.DECODED.value] = raw[Raw.FB_THROUGH.value] / n
    obs[Obs.LAST_SHARE.value] = raw[Raw.LAST_SHARE.value]
    obs[Obs.LAST_ADMIT.value] = raw[Raw.LAST_ADMIT.value]
    obs[Obs.PREV_SHARE.value] = raw[Raw.PREV_SHARE.value]
    obs[Obs.RTT_LONG.value] = rtt_long if rtt_long < 4.0 else 4.0
    obs[Obs.PRIOR_LOSS.value] = prior if has_prior else 0.0
    obs[Obs.PRIOR_KNOWN.value] = 1.0 if has_prior else 0.0
