"""Named link profiles shared by the simulator and the testbed.

A ``Profile`` is a loss model in netem notation plus rate, delay, jitter, queue and
burst. The built-in ones live in ``data/profiles.toml`` (clean, bernoulli-5, ge-light,
ge-heavy, 4state-bursty); users add their own in a TOML or JSON file of the same shape::

    [profiles.wifi-bad]               # JSON: {"profiles": {"wifi-bad": {...}}}
    description = "office Wi-Fi at lunch"
    loss = "gemodel 3% 25% 70% 0.2%"   # netem notation, or "none"
    rate_mbps = 50                     # default 100
    delay_ms = 8                       # default 5
    jitter_ms = 1                      # default 0
    jitter_distribution = "normal"     # "uniform" (netem's default) or "normal"
    queue_bytes = 300000               # default: 50 ms at the rate
    burst_bytes = 15000                # default: 1 ms at the rate, at least 2 frames
    rate_steps = "0.2:10, 0.6:50"      # the rate from set times on (s:Mbit/s; see below)

    [profiles.office-trace]
    trace = "office.csv.gz"            # relative to the profile file; see docs/traces.md
    trace_offset = 0                   # default: a window start drawn from the seed

``load_profile`` also accepts a netem loss string ("gemodel 2% 30% 80% 0.5%") or a trace
file path directly. Every mistake in a file is reported on one line (``ProfileError``).
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from kvtransport.netem.channel import UDP_OVERHEAD_BYTES, Channel, DelaySampler
from kvtransport.netem.loss import LossSampler, LossSpec, NoLoss, parse_loss
from kvtransport.netem.trace import TraceError, TraceReplay, read_trace

from kvtransport.errors import UserError

__all__ = [
    "Profile",
    "ProfileError",
    "builtin_profiles",
    "load_profiles_file",
    "load_profile",
    "make_channel",
    "profile_from_mapping",
    "profile_to_mapping",
    "DEFAULT_RATE_MBPS",
    "DEFAULT_DELAY_MS",
]

DEFAULT_RATE_MBPS = 100.0
DEFAULT_DELAY_MS = 5.0
QUEUE_MS = 50.0
BURST_MS = 1.0
MAX_FRAME_BYTES = 1514
NETEM_MIN_LIMIT = 1000

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_KEYS: dict[str, type | tuple[type, ...]] = {
    "description": str,
    "loss": str,
    "rate_mbps": (int, float),
    "delay_ms": (int, float),
    "jitter_ms": (int, float),
    "jitter_distribution": str,
    "queue_bytes": int,
    "burst_bytes": int,
    "trace": str,
    "trace_offset": int,
    "rate_steps": str,
}


class ProfileError(UserError, ValueError):
    """A profile name, file or value is wrong; the message is one line."""


def _fmt_num(x: float) -> str:
    return f"{x:.10g}"


@dataclass(frozen=True)
class Profile:
    """One direction of a link: loss model, rate limit with a byte queue, delay, jitter."""

    name: str
    loss: LossSpec = field(default_factory=NoLoss)
    rate_mbps: float = DEFAULT_RATE_MBPS
    delay_ms: float = DEFAULT_DELAY_MS
    jitter_ms: float = 0.0
    jitter_distribution: str = "uniform"
    queue_bytes: int | None = None
    burst_bytes: int | None = None
    description: str = ""
    source: str = "built-in"
    rate_steps: tuple[tuple[float, float], ...] = ()
    """(from_s, rate_mbps): the link's rate from ``from_s`` seconds of channel time on
    (times increasing); ``rate_mbps`` before the first. The queue and burst stay in bytes.
    The simulator's channel steps at channel time; the testbed shapes at ``rate_mbps``
    and plays the steps when told to (kvtransport.netem.testbed.RateSteps, from the moment
    a transfer starts)."""

    def __post_init__(self) -> None:
        if not self.rate_mbps > 0:  # math.inf: no rate limit (see reverse_profile)
            raise ProfileError(f"profile {self.name}: rate_mbps must be > 0")
        if self.rate_steps:
            if not math.isfinite(self.rate_mbps):
                raise ProfileError(f"profile {self.name}: rate_steps need a rate limit")
            times = [t for t, _ in self.rate_steps]
            if not all(math.isfinite(t) and t >= 0 for t in times) or any(
                b <= a for a, b in zip(times, times[1:], strict=False)
            ):
                raise ProfileError(
                    f"profile {self.name}: rate_steps times must be >= 0 and increasing"
                )
            if not all(r > 0 and math.isfinite(r) for _, r in self.rate_steps):
                raise ProfileError(f"profile {self.name}: rate_steps rates must be > 0 Mbit/s")
        if not (self.delay_ms >= 0 and math.isfinite(self.delay_ms)):
            raise ProfileError(f"profile {self.name}: delay_ms must be >= 0")
        if not (self.jitter_ms >= 0 and math.isfinite(self.jitter_ms)):
            raise ProfileError(f"profile {self.name}: jitter_ms must be >= 0")
        if self.jitter_distribution not in ("uniform", "normal"):
            raise ProfileError(
                f"profile {self.name}: jitter_distribution must be 'uniform' or 'normal'"
            )
        if self.queue_bytes is not None and self.queue_bytes < MAX_FRAME_BYTES:
            raise ProfileError(f"profile {self.name}: queue_bytes must be >= {MAX_FRAME_BYTES}")
        if self.burst_bytes is not None and self.burst_bytes < MAX_FRAME_BYTES:
            raise ProfileError(f"profile {self.name}: burst_bytes must be >= {MAX_FRAME_BYTES}")

    # -- derived values ----------------------------------------------------------

    @property
    def is_trace(self) -> bool:
        return isinstance(self.loss, TraceReplay)

    @property
    def rate_bps(self) -> float:
        return self.rate_mbps * 1e6

    def effective_queue_bytes(self) -> int:
        """The rate limiter's queue limit in bytes (default: 50 ms at the link rate)."""
        if self.queue_bytes is not None:
            return self.queue_bytes
        return max(int(self.rate_bps / 8 * QUEUE_MS / 1e3), 4 * MAX_FRAME_BYTES)

    def effective_burst_bytes(self) -> int:
        """The token bucket's depth in bytes (default: 1 ms at the rate, >= 2 frames)."""
        if self.burst_bytes is not None:
            return self.burst_bytes
        return max(int(self.rate_bps / 8 * BURST_MS / 1e3), 2 * MAX_FRAME_BYTES)

    def stationary_loss(self) -> float:
        """Long-run fraction of packets the loss model drops (queue drops excluded)."""
        return self.loss.stationary_loss()

    def mean_burst_length(self) -> float:
        """Mean number of consecutive packets the loss model drops."""
        return self.loss.mean_burst_length()

    def with_overrides(
        self, rate_mbps: float | None = None, delay_ms: float | None = None
    ) -> Profile:
        """The same profile with another rate and/or delay (a trace keeps its delays)."""
        changes: dict[str, Any] = {}
        if rate_mbps is not None:
            changes["rate_mbps"] = float(rate_mbps)
        if delay_ms is not None:
            if self.is_trace:
                raise ProfileError(
                    f"profile {self.name}: a trace profile takes its delay from the trace"
                )
            changes["delay_ms"] = float(delay_ms)
        return replace(self, **changes) if changes else self

    # -- rendering for tc --------------------------------------------------------

    @property
    def rate_limited(self) -> bool:
        return math.isfinite(self.rate_mbps)

    def netem_limit(self) -> int:
        """netem's packet limit: room for the byte queue of tiny packets plus in-flight."""
        in_flight_s = (self.delay_ms + 4 * self.jitter_ms) / 1e3
        rate_bps = self.rate_bps if self.rate_limited else 1e9  # unlimited: size for 1 Gbit/s
        queue = self.effective_queue_bytes() if self.rate_limited else 0
        pps = rate_bps / 8 / 64
        return max(NETEM_MIN_LIMIT, int(queue / 64 + 2 * pps * in_flight_s))

    def reverse_profile(self, mode: str = "delay") -> Profile:
        """The feedback direction (receiver -> sender) as the testbed builds it.

        "full": this profile (drawn independently); "delay": the same delay and jitter
        (a trace: its median one-way delay), no loss, no rate limit; "none": nothing.
        The simulator can build the same feedback path with
        ``make_channel(profile.reverse_profile(mode), seed)``.
        """
        if mode == "full":
            return self
        if mode not in ("delay", "none"):
            raise ProfileError(f"reverse mode must be full, delay or none, not {mode!r}")
        delay_ms, jitter_ms = (0.0, 0.0) if mode == "none" else (self.delay_ms, self.jitter_ms)
        if mode == "delay" and isinstance(self.loss, TraceReplay):
            delay_ms = float(np.nanmedian(self.loss.trace().owd_s)) * 1e3
        return Profile(
            name=f"{self.name}-reverse",
            loss=NoLoss(),
            rate_mbps=math.inf,
            delay_ms=delay_ms,
            jitter_ms=jitter_ms,
            jitter_distribution=self.jitter_distribution,
            description=f"feedback direction of {self.name} ({mode})",
            source=self.source,
        )

    def netem_args(self, rate: bool = False) -> list[str]:
        """tc-netem arguments for the loss, delay and jitter of this profile.

        With ``rate=True`` netem's own ``rate`` is appended, for a single self-contained
        ``tc qdisc add dev DEV root netem ...`` elsewhere. The testbed instead puts a tbf
        under netem (``tbf_args``) so the queue is limited in bytes, as in the simulator.
        """
        if self.is_trace:
            raise ProfileError(
                f"profile {self.name}: a trace cannot be replayed by kernel netem (use the relay)"
            )
        args = ["limit", str(self.netem_limit())]
        args += ["delay", f"{_fmt_num(self.delay_ms)}ms"]
        if self.jitter_ms > 0:
            args.append(f"{_fmt_num(self.jitter_ms)}ms")
            if self.jitter_distribution == "normal":
                args += ["distribution", "normal"]
        args += self.loss.netem_args()
        if rate and self.rate_limited:
            args += ["rate", _rate_arg(self.rate_mbps)]
        return args

    def tbf_args(self) -> list[str]:
        """tc-tbf arguments (rate, burst, limit in bytes) of the rate limiter."""
        if not self.rate_limited:
            raise ProfileError(f"profile {self.name}: no rate limit, so no tbf")
        return tbf_arguments(
            self.rate_mbps, self.effective_burst_bytes(), self.effective_queue_bytes()
        )

    def describe(self) -> str:
        """One line: name, loss model and its analytic loss rate, rate, delay."""
        loss = self.loss.describe()
        rate = self.stationary_loss()
        if self.is_trace:
            delay = "delay from trace"
        else:
            delay = f"delay {_fmt_num(self.delay_ms)} ms"
            if self.jitter_ms:
                delay += f" +- {_fmt_num(self.jitter_ms)} ms {self.jitter_distribution}"
        link = f"{_fmt_num(self.rate_mbps)} Mbit/s" if self.rate_limited else "no rate limit"
        for t, r in self.rate_steps:
            link += f", {_fmt_num(r)} from {_fmt_num(t)} s"
        return f"{self.name}: {loss} (expected loss {rate:.2%}), {link}, {delay}"

    # -- samplers ----------------------------------------------------------------

    def samplers(self, seed: int | np.random.SeedSequence) -> tuple[LossSampler, LossSampler]:
        """(loss sampler, per-packet delay sampler) for this profile, seeded.

        Loss and delay use independent streams spawned from ``seed``, so changing the
        delay or jitter does not change which packets are lost. The testbed relay uses
        these same samplers; the simulator's Channel wraps them with the rate limiter.
        """
        ss = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
        loss_ss, delay_ss, start_ss = ss.spawn(3)
        if isinstance(self.loss, TraceReplay):
            try:
                return self.loss.samplers(np.random.default_rng(start_ss))
            except TraceError as exc:
                raise ProfileError(f"profile {self.name}: {exc}") from None
        loss = self.loss.sampler(np.random.default_rng(loss_ss))
        delay = DelaySampler(
            self.delay_ms / 1e3,
            self.jitter_ms / 1e3,
            self.jitter_distribution,
            np.random.default_rng(delay_ss),
        )
        return loss, delay


def tbf_arguments(rate_mbps: float, burst_bytes: int, limit_bytes: int) -> list[str]:
    """tc-tbf arguments for a rate, a bucket depth and a queue limit (both in bytes)."""
    return ["rate", _rate_arg(rate_mbps), "burst", str(burst_bytes), "limit", str(limit_bytes)]


def _rate_arg(rate_mbps: float) -> str:
    bits = rate_mbps * 1e6
    if bits == int(bits) and int(bits) % 1_000_000 == 0:
        return f"{int(bits) // 1_000_000}mbit"
    if bits == int(bits) and int(bits) % 1000 == 0:
        return f"{int(bits) // 1000}kbit"
    return f"{int(round(bits))}bit"


# ---------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------


def _profile_from_mapping(name: str, entry: Any, where: str, base_dir: Path | None) -> Profile:
    if not _NAME_RE.match(name):
        raise ProfileError(
            f"{where}: profile name {name!r} must be lowercase letters, digits, '.', '_' or '-'"
        )
    if not isinstance(entry, dict):
        raise ProfileError(f"{where}: profile {name} must be a table of settings")
    for key, value in entry.items():
        if key not in _KEYS:
            allowed = ", ".join(sorted(_KEYS))
            raise ProfileError(f"{where}: profile {name}: unknown key {key!r} (allowed: {allowed})")
        want = _KEYS[key]
        if isinstance(value, bool) or not isinstance(value, want):
            kind = want.__name__ if isinstance(want, type) else "number"
            raise ProfileError(f"{where}: profile {name}: {key} must be a {kind}, got {value!r}")
    kwargs: dict[str, Any] = {"name": name, "source": where}
    for key in ("description", "rate_mbps", "delay_ms", "jitter_ms", "queue_bytes", "burst_bytes"):
        if key in entry:
            kwargs[key] = entry[key]
    if "jitter_distribution" in entry:
        kwargs["jitter_distribution"] = entry["jitter_distribution"]
    if "rate_steps" in entry:
        kwargs["rate_steps"] = parse_rate_steps(entry["rate_steps"], f"{where}: profile {name}")
    if "trace" in entry:
        if "loss" in entry:
            raise ProfileError(f"{where}: profile {name}: give either loss or trace, not both")
        for key in ("delay_ms", "jitter_ms", "jitter_distribution"):
            if key in entry:
                raise ProfileError(
                    f"{where}: profile {name}: {key} does not apply to a trace "
                    "(the trace's owd_us is the delay)"
                )
        path = Path(entry["trace"]).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        offset = entry.get("trace_offset")
        if offset is not None and offset < 0:
            raise ProfileError(f"{where}: profile {name}: trace_offset must be >= 0")
        try:
            read_trace(path)
        except TraceError as exc:
            raise ProfileError(f"{where}: profile {name}: {exc}") from None
        kwargs["loss"] = TraceReplay(str(path), offset)
        kwargs["delay_ms"] = 0.0
    else:
        if "trace_offset" in entry:
            raise ProfileError(f"{where}: profile {name}: trace_offset needs a trace")
        try:
            kwargs["loss"] = parse_loss(entry.get("loss", "none"))
        except ValueError as exc:
            raise ProfileError(f"{where}: profile {name}: {exc}") from None
    try:
        return Profile(**kwargs)
    except ProfileError as exc:
        raise ProfileError(f"{where}: {exc}") from None


def parse_rate_steps(text: str, where: str) -> tuple[tuple[float, float], ...]:
    """``"0.2:10, 0.6:50"`` (seconds:Mbit/s, comma-separated) as ``Profile.rate_steps``."""
    steps = []
    for part in text.split(","):
        t, sep, r = part.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            steps.append((float(t), float(r)))
        except ValueError:
            raise ProfileError(
                f"{where}: rate_steps must be SECONDS:MBIT_S pairs separated by commas, "
                f"like '0.2:10, 0.6:50' (got {part.strip()!r})"
            ) from None
    return tuple(steps)


def profile_to_mapping(profile: Profile) -> dict[str, Any]:
    """The profile as one entry of a profiles file (inverse of ``profile_from_mapping``)."""
    m: dict[str, Any] = {"rate_mbps": profile.rate_mbps}
    if profile.description:
        m["description"] = profile.description
    if isinstance(profile.loss, TraceReplay):
        m["trace"] = profile.loss.path
        if profile.loss.offset is not None:
            m["trace_offset"] = profile.loss.offset
    else:
        m["loss"] = " ".join(profile.loss.netem_args()[1:]) or "none"
        m["delay_ms"] = profile.delay_ms
        m["jitter_ms"] = profile.jitter_ms
        m["jitter_distribution"] = profile.jitter_distribution
    if profile.queue_bytes is not None:
        m["queue_bytes"] = profile.queue_bytes
    if profile.burst_bytes is not None:
        m["burst_bytes"] = profile.burst_bytes
    if profile.rate_steps:
        m["rate_steps"] = ", ".join(f"{t!r}:{r!r}" for t, r in profile.rate_steps)
    return m


def profile_from_mapping(name: str, entry: dict[str, Any], where: str = "mapping") -> Profile:
    """Build a profile from one entry of a profiles file (relative paths: to the cwd)."""
    return _profile_from_mapping(name, entry, where, None)


def _parse_profiles_text(text: str, where: str, is_json: bool) -> dict[str, Any]:
    try:
        doc = json.loads(text) if is_json else tomllib.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{where}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{where}: invalid TOML ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("profiles"), dict):
        raise ProfileError(f"{where}: expected a 'profiles' table of named profiles")
    extra = set(doc) - {"profiles"}
    if extra:
        raise ProfileError(f"{where}: unknown top-level key {sorted(extra)[0]!r}")
    if not doc["profiles"]:
        raise ProfileError(f"{where}: the 'profiles' table is empty")
    return doc["profiles"]


def load_profiles_file(path: str | Path) -> dict[str, Profile]:
    """Read a user's profile file (TOML, or JSON when it ends in .json)."""
    p = Path(path).expanduser()
    where = str(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ProfileError(f"{where}: no such profiles file") from None
    except IsADirectoryError:
        raise ProfileError(f"{where}: is a directory, not a profiles file") from None
    except OSError as exc:
        raise ProfileError(f"{where}: cannot read ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProfileError(f"{where}: not a UTF-8 text file") from None
    is_json = p.suffix.lower() == ".json" or text.lstrip().startswith("{")
    entries = _parse_profiles_text(text, where, is_json)
    builtins = builtin_profiles()
    out = {}
    for name, entry in entries.items():
        if name in builtins:
            raise ProfileError(f"{where}: profile {name!r} is built in; choose another name")
        out[name] = _profile_from_mapping(name, entry, where, p.resolve().parent)
    return out


_BUILTINS: dict[str, Profile] | None = None


def builtin_profiles() -> dict[str, Profile]:
    """The built-in profiles, by name (from the packaged data/profiles.toml)."""
    global _BUILTINS
    if _BUILTINS is None:
        text = resources.files("kvtransport.netem").joinpath("data/profiles.toml").read_text()
        entries = _parse_profiles_text(text, "built-in profiles", is_json=False)
        _BUILTINS = {
            name: _profile_from_mapping(name, entry, "built-in", None)
            for name, entry in entries.items()
        }
    return dict(_BUILTINS)


def load_profile(name_or_path: str | Profile, profiles_file: str | Path | None = None) -> Profile:
    """Resolve a profile: a name (built-in or from ``profiles_file``), a profiles file
    holding exactly one profile, a trace file (.csv / .csv.gz), or a netem loss string."""
    if isinstance(name_or_path, Profile):
        return name_or_path
    key = str(name_or_path).strip()
    known = builtin_profiles()
    if profiles_file is not None:
        known.update(load_profiles_file(profiles_file))
    if key in known:
        return known[key]
    path = Path(key).expanduser()
    lower = key.lower()
    if lower.endswith((".toml", ".json")):
        found = load_profiles_file(path)
        if len(found) != 1:
            names = ", ".join(sorted(found))
            raise ProfileError(
                f"{key}: holds {len(found)} profiles ({names}); name one and pass the file "
                "with --profiles"
            )
        return next(iter(found.values()))
    if lower.endswith((".csv", ".csv.gz", ".gz")):
        try:
            read_trace(path)
        except TraceError as exc:
            raise ProfileError(str(exc)) from None
        return Profile(name=path.name, loss=TraceReplay(str(path)), delay_ms=0.0, source=str(path))
    if " " in key or key.startswith(("gemodel", "state", "random", "loss")):
        try:
            loss = parse_loss(key)
        except ValueError as exc:
            raise ProfileError(str(exc)) from None
        return Profile(name="custom", loss=loss, source="command line")
    names = ", ".join(sorted(known))
    raise ProfileError(
        f"unknown profile {key!r}; known: {names} (or a profiles file, a trace file, "
        "or netem loss notation like 'gemodel 5% 30% 80% 0.5%')"
    )


def make_channel(
    profile: str | Profile,
    seed: int | np.random.SeedSequence = 0,
    rate_mbps: float | None = None,
    delay_ms: float | None = None,
    overhead_bytes: int = UDP_OVERHEAD_BYTES,
) -> Channel:
    """A seeded userspace Channel for a profile, optionally with another rate or delay."""
    prof = load_profile(profile).with_overrides(rate_mbps, delay_ms)
    loss, delay = prof.samplers(seed)
    if not prof.rate_limited:
        return Channel(loss, delay, overhead_bytes=overhead_bytes)
    return Channel(
        loss,
        delay,
        rate_bps=prof.rate_bps,
        queue_bytes=prof.effective_queue_bytes(),
        burst_bytes=prof.effective_burst_bytes(),
        overhead_bytes=overhead_bytes,
        rate_steps=tuple((t, r * 1e6) for t, r in prof.rate_steps),
    )
