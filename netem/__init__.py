"""kvtransport.netem: lossy-link models for the simulator and a Linux testbed.

Userspace side (used by the simulator, the Gymnasium environment and the relay):

- loss models with exactly netem's semantics: ``Bernoulli``, ``GilbertElliott``
  (``loss gemodel p r 1-h 1-k``), ``FourState`` (``loss state p13 p31 p32 p23 p14``),
  ``TraceReplay`` (CSV ``seq,lost,owd_us``, see docs/traces.md);
- ``Channel``: loss -> token-bucket queue -> delay and jitter, ``transmit(t, nbytes)``
  returning the arrival time or None, ``clone()`` for a clairvoyant look-ahead;
- named ``Profile`` s (clean, bernoulli-5, ge-light, ge-heavy, 4state-bursty, or your
  own file): ``load_profile``, ``make_channel``, ``Profile.netem_args()``.

Testbed side (``kvtransport.netem.testbed``, needs root): two network namespaces joined
by an impaired link, through kernel netem where available or a userspace relay.
"""

from pathlib import Path

from kvtransport.netem.channel import CHUNK, UDP_OVERHEAD_BYTES, Channel, DelaySampler
from kvtransport.netem.loss import (
    Bernoulli,
    FourState,
    GilbertElliott,
    LossSampler,
    LossSpec,
    NoLoss,
    markov_loss_stats,
    parse_loss,
)
from kvtransport.netem.profiles import (
    Profile,
    ProfileError,
    builtin_profiles,
    load_profile,
    load_profiles_file,
    make_channel,
)
from kvtransport.netem.trace import Trace, TraceError, TraceReplay, read_trace, write_trace

SAMPLE_TRACE = str(Path(__file__).with_name("data") / "sample-trace.csv.gz")
"""A small example trace in the format of docs/traces.md (synthetic, see its comments)."""

__all__ = [
    "CHUNK",
    "SAMPLE_TRACE",
    "UDP_OVERHEAD_BYTES",
    "Bernoulli",
    "Channel",
    "DelaySampler",
    "FourState",
    "GilbertElliott",
    "LossSampler",
    "LossSpec",
    "NoLoss",
    "Profile",
    "ProfileError",
    "Trace",
    "TraceError",
    "TraceReplay",
    "builtin_profiles",
    "load_profile",
    "load_profiles_file",
    "make_channel",
    "markov_loss_stats",
    "parse_loss",
    "read_trace",
    "write_trace",
]
