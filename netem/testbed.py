"""Linux testbed: a sender and a receiver namespace joined by a link impaired per a profile.

Layout (fixed names; ``prefix`` defaults to ``kvt``, tests use their own)::

    netem backend:
      [kvt-snd] kvt-s 10.77.0.1 <==veth==> kvt-r 10.77.0.2 [kvt-rcv]
      on kvt-s: root netem (loss, delay, jitter) -> child tbf (rate, byte queue)

    relay backend:
      [kvt-snd] kvt-s 10.77.0.1 <-> kvt-ms [kvt-mid] kvt-mr <-> kvt-r 10.77.0.2 [kvt-rcv]
      the relay in kvt-mid bridges kvt-ms <-> kvt-mr (loss, delay, jitter in userspace,
      the simulator's samplers); tbf (rate, byte queue) on kvt-mr

Both backends give the data direction (snd -> rcv) the full profile in the same order:
loss, then delay/jitter, then the rate limiter with its byte queue. The reverse direction
(feedback, rcv -> snd) gets, by ``reverse``: "full" (default: the whole profile, drawn
independently, as the simulator's default feedback channel), "delay" (the same delay, no
loss, no rate limit) or "none"; the simulator builds the same path with
``Profile.reverse_profile(mode)``. MAC addresses are fixed and neighbours static, so no
ARP crosses the impaired link. IPv6 is off.

Rate limiting under the relay backend (``shaper``): "tbf" (default) is kernel tbf on
kvt-mr; "relay" runs the simulator's own token bucket in the relay on the kernel's
arrival timestamps, and no tbf. They agree on an idle machine. On a CPU-starved one
the kernel sometimes delivers frames to the relay in bunches after a softirq stall
(measured: up to 0.3 s with both cores busy); tbf then sees a burst the sender never
sent and drops from it (1-3% extra loss on ge-heavy at 50 Mbit/s), while the relay's
bucket, working on arrival timestamps, drops exactly what the model drops.

The netem backend is used where the kernel has sch_netem (probed); otherwise the relay.

Segmentation offload: both end veths have ``gso_max_segs 1``, so TCP builds MTU-sized
packets and a UDP GSO send (one syscall, many datagrams) is cut into datagrams by the
kernel before it reaches the relay; loss then applies per datagram, as on a real link.
Caveat of the netem backend: the netem qdisc sits before that segmentation and drops or
keeps a whole UDP GSO batch as ONE packet; senders that want per-datagram loss under
kernel netem should not use UDP GSO (TCP is fine).

Rate changes: ``set_rate(prefix, mbit_s)`` (``Testbed.set_rate``, ``kvtransport netem
rate``) changes the data direction's kernel tbf rate now, its burst and queue limit in
bytes kept; ``Testbed.play_rate_steps()`` plays a profile's ``rate_steps`` from the moment
it is called (a link whose capacity dips during a transfer). The relay's own token bucket
(``shaper="relay"``) keeps one rate.

API: ``Testbed(profile, ...).up()`` / ``with Testbed(...) as tb:`` / ``tb.run("snd", argv)``
/ ``tb.popen("rcv", argv)``; ``teardown(prefix)`` and ``status(prefix)`` work from the
state directory ``/run/kvtransport/netem/PREFIX`` so the CLI can manage what another
process set up. Every failure is a ``TestbedError`` with a one-line message.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtransport.netem.profiles import Profile, load_profile, tbf_arguments

from kvtransport.errors import UserError

__all__ = [
    "SND_ADDR",
    "RCV_ADDR",
    "RateSteps",
    "DEFAULT_PREFIX",
    "STATE_ROOT",
    "Testbed",
    "TestbedError",
    "build_plan",
    "check_environment",
    "netem_available",
    "netns_exec",
    "netns_socket",
    "saved_state",
    "set_rate",
    "status",
    "teardown",
]

SND_ADDR = "10.77.0.1"
RCV_ADDR = "10.77.0.2"
PREFIX_LEN = 24
SND_MAC = "02:4b:56:00:00:01"
RCV_MAC = "02:4b:56:00:00:02"
IF_SND = "kvt-s"
IF_RCV = "kvt-r"
IF_MID_SND = "kvt-ms"
IF_MID_RCV = "kvt-mr"
DEFAULT_PREFIX = "kvt"
STATE_ROOT = Path(os.environ.get("KVT_NETEM_STATE", "/run/kvtransport/netem"))
BACKENDS = ("auto", "netem", "relay")
REVERSE_MODES = ("delay", "full", "none")
SHAPERS = ("tbf", "relay")
RELAY_READY_TIMEOUT_S = 20.0
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9-]{0,15}$")


class TestbedError(UserError):
    """The testbed cannot be set up, used or removed; the message is one line."""

    __test__ = False  # not a pytest test class


# ---------------------------------------------------------------------------
# environment checks and command helpers
# ---------------------------------------------------------------------------


def check_environment() -> None:
    """Raise a one-line TestbedError unless we are root with `ip` and `tc` available."""
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise TestbedError(f"`{tool}` not found: install {package} (apt-get install {package})")
    if os.geteuid() != 0:
        raise TestbedError(
            "the netem testbed needs root (network namespaces and tc); run it with sudo"
        )
    if not Path("/proc/self/ns/net").exists():
        raise TestbedError("this kernel has no network namespace support")


def _run(argv: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise TestbedError(f"`{argv[0]}` not found") from None
    except subprocess.TimeoutExpired:
        raise TestbedError(f"`{' '.join(argv)}` timed out after {timeout:g} s") from None
    if check and proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        first = err[0] if err else f"exit status {proc.returncode}"
        raise TestbedError(f"`{' '.join(argv)}` failed: {first}")
    return proc


def netns_exec(ns: str, argv: list[str]) -> list[str]:
    """The argv that runs ``argv`` inside network namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *argv]


def _netns_list() -> set[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}


_CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def _in_netns(ns: str) -> Iterator[None]:
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        try:
            target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        except FileNotFoundError:
            raise TestbedError(f"network namespace {ns} does not exist") from None
        try:
            if libc.setns(target, _CLONE_NEWNET) != 0:
                raise TestbedError(f"setns({ns}) failed: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            libc.setns(own, _CLONE_NEWNET)
    finally:
        os.close(own)


def netns_socket(
    ns: str, family: int = socket.AF_INET, type: int = socket.SOCK_DGRAM
) -> socket.socket:
    """A socket created inside namespace ``ns`` from this process (it stays there)."""
    with _in_netns(ns):
        return socket.socket(family, type)


def netem_available() -> bool:
    """Whether this kernel can run a netem qdisc (probed in a scratch namespace)."""
    check_environment()
    ns = f"kvt-probe-{os.getpid()}"
    _run(["ip", "netns", "add", ns])
    try:
        proc = _run(
            ["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            check=False,
        )
        return proc.returncode == 0
    finally:
        _run(["ip", "netns", "del", ns], check=False)


# ---------------------------------------------------------------------------
# the plan: every command that builds a testbed (pure, testable without root)
# ---------------------------------------------------------------------------


def namespaces(prefix: str, backend: str) -> dict[str, str]:
    names = {"snd": f"{prefix}-snd", "rcv": f"{prefix}-rcv"}
    if backend == "relay":
        names["mid"] = f"{prefix}-mid"
    return names


def _cmd(text: str, *extra: str) -> list[str]:
    """A command from a space-separated template (no argument contains a space)."""
    return text.split() + list(extra)


def build_plan(
    profile: Profile,
    backend: str,
    reverse: str = "full",
    prefix: str = DEFAULT_PREFIX,
    shaper: str = "tbf",
) -> list[list[str]]:
    """The ip/tc commands that build the topology and apply ``profile`` (relay not included)."""
    if backend not in ("netem", "relay"):
        raise TestbedError(f"backend must be netem or relay, not {backend!r}")
    if shaper not in SHAPERS:
        raise TestbedError(f"shaper must be one of {', '.join(SHAPERS)}, not {shaper!r}")
    if reverse not in REVERSE_MODES:
        raise TestbedError(f"reverse must be one of {', '.join(REVERSE_MODES)}")
    ns = namespaces(prefix, backend)
    snd, rcv = ns["snd"], ns["rcv"]
    no_v6 = "net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1"
    cmds = [_cmd(f"ip netns add {n}") for n in ns.values()]
    for n in ns.values():
        cmds.append(_cmd(f"ip netns exec {n} sysctl -qw {no_v6}"))
        cmds.append(_cmd(f"ip -n {n} link set dev lo up"))
    snd_end = f"{IF_SND} address {SND_MAC} netns {snd}"
    rcv_end = f"{IF_RCV} address {RCV_MAC} netns {rcv}"
    if backend == "netem":
        cmds.append(_cmd(f"ip link add {snd_end} type veth peer name {rcv_end}"))
    else:
        mid = ns["mid"]
        cmds.append(_cmd(f"ip link add {snd_end} type veth peer name {IF_MID_SND} netns {mid}"))
        cmds.append(_cmd(f"ip link add {rcv_end} type veth peer name {IF_MID_RCV} netns {mid}"))
        for dev in (IF_MID_SND, IF_MID_RCV):
            cmds.append(_cmd(f"ip -n {mid} link set dev {dev} up"))
    for n, dev, addr, peer_addr, peer_mac in (
        (snd, IF_SND, SND_ADDR, RCV_ADDR, RCV_MAC),
        (rcv, IF_RCV, RCV_ADDR, SND_ADDR, SND_MAC),
    ):
        cmds.append(_cmd(f"ip -n {n} addr add {addr}/{PREFIX_LEN} dev {dev}"))
        # one segment per packet: TCP sends MTU-sized packets and the kernel cuts UDP GSO
        # batches before the link, so loss applies per datagram (see the module doc)
        cmds.append(_cmd(f"ip -n {n} link set dev {dev} gso_max_segs 1 up"))
        cmds.append(
            _cmd(f"ip -n {n} neigh replace {peer_addr} lladdr {peer_mac} dev {dev} nud permanent")
        )
    if backend == "netem":
        cmds += _netem_qdiscs(snd, IF_SND, profile)
        if reverse == "full":
            cmds += _netem_qdiscs(rcv, IF_RCV, profile)
        elif reverse == "delay":
            delay_only = profile.reverse_profile("delay").netem_args()
            cmds.append(
                _cmd(f"tc -n {rcv} qdisc add dev {IF_RCV} root handle 1: netem", *delay_only)
            )
    elif shaper == "tbf":
        tbf = profile.tbf_args()
        mid, dev, attach = data_tbf_place(prefix, backend)
        cmds.append(["tc", "-n", mid, "qdisc", "add", "dev", dev, *attach, "tbf", *tbf])
        if reverse == "full":
            cmds.append(
                ["tc", "-n", mid, "qdisc", "add", "dev", IF_MID_SND, *_TBF_AT_ROOT, "tbf", *tbf]
            )
    return cmds


_TBF_UNDER_NETEM = ("parent", "1:1", "handle", "10:")  # the netem backend's tbf, per direction
_TBF_AT_ROOT = ("root", "handle", "1:")  # the relay backend's tbf in the middle namespace


def data_tbf_place(prefix: str, backend: str) -> tuple[str, str, list[str]]:
    """Where the data direction's kernel tbf sits: (namespace, device, tc attach
    arguments). netem backend: under the sender's root netem; relay backend: at the root
    of the middle namespace's receiver-side device."""
    ns = namespaces(prefix, backend)
    if backend == "netem":
        return ns["snd"], IF_SND, list(_TBF_UNDER_NETEM)
    return ns["mid"], IF_MID_RCV, list(_TBF_AT_ROOT)


def _netem_qdiscs(ns: str, dev: str, profile: Profile) -> list[list[str]]:
    """netem (loss, delay, jitter) at the root and tbf (rate, byte queue) as its child."""
    return [
        _cmd(f"tc -n {ns} qdisc add dev {dev} root handle 1: netem", *profile.netem_args()),
        ["tc", "-n", ns, "qdisc", "add", "dev", dev, *_TBF_UNDER_NETEM, "tbf", *profile.tbf_args()],
    ]


# ---------------------------------------------------------------------------
# state directory, teardown, status
# ---------------------------------------------------------------------------


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix):
        raise TestbedError(f"prefix {prefix!r} must be lowercase letters, digits or '-' (<= 16)")


def _state_dir(prefix: str) -> Path:
    return STATE_ROOT / prefix


@contextlib.contextmanager
def _locked(prefix: str) -> Iterator[None]:
    # one lock file for all prefixes: set-up and tear-down are short, and a per-prefix
    # file could not be removed safely by `down`
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(STATE_ROOT / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _is_relay(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]
    except OSError:
        return False
    return b"kvtransport.netem.relay" in cmdline and state != "Z"


def _stop_relay(pid: int, timeout_s: float = 5.0) -> bool:
    """SIGTERM the relay (only if that pid really is our relay); SIGKILL if it lingers."""
    if not _is_relay(pid):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        if not _is_relay(pid):
            return True
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    return True


def teardown(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove a testbed: stop its relay, delete its namespaces and state. Idempotent.

    Returns what was removed (empty if nothing was up).
    """
    _check_prefix(prefix)
    check_environment()
    removed = []
    with _locked(prefix):
        sdir = _state_dir(prefix)
        state = _read_json(sdir / "state.json") or {}
        pid = state.get("relay_pid")
        if isinstance(pid, int) and _stop_relay(pid):
            removed.append(f"relay (pid {pid})")
        existing = _netns_list()
        for n in namespaces(prefix, "relay").values():
            if n in existing:
                _run(["ip", "netns", "del", n], check=False)
                removed.append(f"namespace {n}")
        if sdir.exists():
            for f in sdir.iterdir():
                with contextlib.suppress(OSError):
                    f.unlink()
            with contextlib.suppress(OSError):
                sdir.rmdir()
    return removed


def status(prefix: str = DEFAULT_PREFIX) -> dict[str, Any]:
    """What is up: the saved state plus live checks (namespaces, relay, qdisc counters)."""
    _check_prefix(prefix)
    check_environment()
    sdir = _state_dir(prefix)
    state = _read_json(sdir / "state.json")
    existing = _netns_list()
    present = [n for n in namespaces(prefix, "relay").values() if n in existing]
    out: dict[str, Any] = {
        "prefix": prefix,
        "up": bool(state) and bool(present),
        "namespaces": present,
        "state": state,
    }
    if state:
        pid = state.get("relay_pid")
        if pid:
            out["relay_running"] = _is_relay(pid)
            out["relay"] = _read_json(sdir / "relay-status.json")
        qd = {}
        for ns_name, dev in state.get("shaped", []):
            if ns_name in existing:
                proc = _run(["tc", "-s", "-n", ns_name, "qdisc", "show", "dev", dev], check=False)
                qd[f"{ns_name}/{dev}"] = proc.stdout.strip()
        out["qdiscs"] = qd
    return out


# ---------------------------------------------------------------------------
# changing the rate of a testbed that is up
# ---------------------------------------------------------------------------


def saved_state(prefix: str) -> dict[str, Any]:
    """What ``up()`` recorded of the testbed under ``prefix`` (one-line TestbedError when
    nothing is up there)."""
    _check_prefix(prefix)
    state = _read_json(_state_dir(prefix) / "state.json")
    if not state:
        raise TestbedError(f"no testbed is up with prefix {prefix}")
    return state


def set_rate(prefix: str, rate_mbps: float) -> None:
    """Change the rate limit of a testbed's data direction (snd -> rcv) now: ``tc qdisc
    change`` on its kernel tbf, with the profile's burst and queue limit in bytes kept, as
    the simulator's channel keeps them across a rate step. The feedback direction keeps
    its rate. Raises a one-line TestbedError when nothing is up under ``prefix`` or the
    relay's own token bucket shapes it (it keeps the profile's rate)."""
    if not (rate_mbps > 0 and math.isfinite(rate_mbps)):
        raise TestbedError(f"the rate must be a positive number of Mbit/s, not {rate_mbps}")
    state = saved_state(prefix)
    if "data_tbf" not in state:
        raise TestbedError(
            f"testbed {prefix} was set up by an older kvtransport, which did not record its "
            f"shaper; bring it up again (kvtransport netem up --replace)"
        )
    tbf = state["data_tbf"]
    if not tbf:
        raise TestbedError(
            f"testbed {prefix} is shaped by the relay's own token bucket, which keeps the "
            "profile's rate; bring it up with the tbf shaper (the default) to change it"
        )
    args = tbf_arguments(rate_mbps, int(tbf["burst_bytes"]), int(tbf["limit_bytes"]))
    _run(
        ["tc", "-n", tbf["ns"], "qdisc", "change", "dev", tbf["dev"], *tbf["attach"], "tbf", *args]
    )


class RateSteps:
    """Plays rate steps (``Profile.rate_steps``: from ``t`` seconds on, ``r`` Mbit/s) on a
    testbed, timed from the moment it is built, on a thread of its own, as the simulator's
    channel steps from its time 0: build it when the transfer starts. ``applied`` lists
    ``(planned_s, applied_s, rate_mbps)`` per step taken (``applied_s`` when the thread
    started its ``tc`` call: the thread's own timing; ``tc`` itself takes a few
    milliseconds, and up to about 0.1 s while the queue it reshapes is full). ``stop()``
    skips the steps not yet due and sets ``base_mbps`` again; ``wait()`` lets every step
    play. A step that fails ends the playing; ``wait()`` and ``stop()`` then raise its
    TestbedError.

    ``priority``: the playing thread's SCHED_FIFO priority (1..99; its ``tc`` calls inherit
    it), or None for ordinary scheduling. Give it one above real-time daemons that share
    its cores: below them, a busy sender delays the steps by the whole transfer."""

    def __init__(
        self,
        prefix: str,
        steps: tuple[tuple[float, float], ...],
        base_mbps: float,
        priority: int | None = None,
    ) -> None:
        if priority is not None and not 1 <= priority <= 99:
            raise TestbedError(f"rate steps' priority must be 1..99, not {priority}")
        self.prefix = prefix
        self.priority = priority
        self.steps = tuple((float(t), float(r)) for t, r in steps)
        self.base_mbps = float(base_mbps)
        self.applied: list[tuple[float, float, float]] = []
        self._error: TestbedError | None = None
        self._cancel = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._play, name="rate-steps", daemon=True)
        self._thread.start()

    def _play(self) -> None:
        if self.priority is not None:
            try:  # pid 0: this thread only
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(self.priority))
            except OSError as e:
                self._error = TestbedError(f"rate steps cannot run at real-time priority: {e}")
                return
        for planned, rate in self.steps:
            if self._cancel.wait(max(0.0, self._start + planned - time.monotonic())):
                return
            started = time.monotonic() - self._start
            try:
                set_rate(self.prefix, rate)
            except TestbedError as e:
                self._error = e
                return
            except Exception as e:  # (a fork failing on a loaded host, a damaged state)
                self._error = TestbedError(f"rate step to {rate:g} Mbit/s failed: {e}")
                return
            self.applied.append((planned, started, rate))

    def wait(self, timeout_s: float | None = None) -> None:
        """Return once every step is played (TestbedError if one failed or time ran out)."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TestbedError(f"rate steps still playing after {timeout_s} s")
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Skip the steps not yet due, and return once none can be taken any more."""
        self._cancel.set()
        self._thread.join()

    def stop(self) -> None:
        """Skip the steps not yet due and set the base rate again."""
        self.cancel()
        set_rate(self.prefix, self.base_mbps)
        if self._error is not None:
            raise self._error


# ---------------------------------------------------------------------------
# the testbed
# ---------------------------------------------------------------------------


class Testbed:
    """Two namespaces joined by an impaired link. ``up()`` builds it, ``down()`` removes it.

    Use as a context manager in tests and demos::

        with Testbed("ge-heavy", prefix="kvtt") as tb:
            rx = tb.popen("rcv", [sys.executable, "-m", "my.receiver", RCV_ADDR])
            tb.run("snd", [sys.executable, "-m", "my.sender", RCV_ADDR])

    ``relay_priority`` (relay backend): the relay's SCHED_FIFO priority, 1..99, or 0 for
    ordinary scheduling; None keeps the relay's default (kvtransport.netem.relay
    RT_PRIORITY). Give it the same priority as real-time daemons that share its cores
    (rather than changing the relay's scheduling from outside with ``chrt``).
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        profile: str | Profile = "ge-heavy",
        *,
        rate_mbps: float | None = None,
        delay_ms: float | None = None,
        backend: str = "auto",
        reverse: str = "full",
        seed: int = 0,
        profiles_file: str | Path | None = None,
        prefix: str = DEFAULT_PREFIX,
        shaper: str = "tbf",
        relay_priority: int | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise TestbedError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
        if reverse not in REVERSE_MODES:
            raise TestbedError(f"reverse must be one of {', '.join(REVERSE_MODES)}")
        if shaper not in SHAPERS:
            raise TestbedError(f"shaper must be one of {', '.join(SHAPERS)}, not {shaper!r}")
        if relay_priority is not None and not 0 <= relay_priority <= 99:
            raise TestbedError(f"relay priority must be 0..99, not {relay_priority}")
        _check_prefix(prefix)
        self.profile = load_profile(profile, profiles_file).with_overrides(rate_mbps, delay_ms)
        self.requested_backend = backend
        self.backend: str | None = None
        self.reverse = reverse
        self.shaper = shaper
        self.seed = int(seed)
        self.relay_priority = relay_priority
        self.prefix = prefix
        self.state_dir = _state_dir(prefix)
        self._relay: subprocess.Popen | None = None
        self._players: list[RateSteps] = []
        if backend == "relay":  # (auto: checked in up(), once the backend is known)
            self._check_rate_steps("relay")

    # -- names -------------------------------------------------------------------

    @property
    def snd_ns(self) -> str:
        return f"{self.prefix}-snd"

    @property
    def rcv_ns(self) -> str:
        return f"{self.prefix}-rcv"

    @property
    def mid_ns(self) -> str:
        return f"{self.prefix}-mid"

    def ns(self, side: str) -> str:
        """Namespace of a side: "snd", "rcv" or "mid" (or a namespace name itself)."""
        return {"snd": self.snd_ns, "rcv": self.rcv_ns, "mid": self.mid_ns}.get(side, side)

    # -- lifecycle -----------------------------------------------------------------

    def _choose_backend(self) -> str:
        want = self.requested_backend
        if want == "relay":
            return "relay"
        if self.profile.is_trace:
            if want == "netem":
                raise TestbedError(
                    f"profile {self.profile.name} replays a trace, which kernel netem cannot; "
                    "use --backend relay"
                )
            return "relay"
        have = netem_available()
        if want == "netem" and not have:
            raise TestbedError(
                "this kernel has no sch_netem (tc: Specified qdisc kind is unknown); "
                "use --backend relay"
            )
        return "netem" if have else "relay"

    def _check_rate_steps(self, backend: str) -> None:
        if self.profile.rate_steps and backend == "relay" and self.shaper == "relay":
            raise TestbedError(
                f"profile {self.profile.name} changes its rate at set times (rate_steps), "
                "which the relay's own token bucket cannot; use the tbf shaper (the default)"
            )

    def up(self) -> Testbed:
        """Build the testbed; raises TestbedError (and leaves nothing behind) on failure."""
        check_environment()
        backend = self._choose_backend()
        self._check_rate_steps(backend)
        with _locked(self.prefix):
            existing = _netns_list() & set(namespaces(self.prefix, "relay").values())
            if existing or (self.state_dir / "state.json").exists():
                raise TestbedError(
                    f"a testbed with prefix {self.prefix} is already up "
                    f"({', '.join(sorted(existing)) or 'stale state'}); run "
                    f"`kvtransport netem down{self._prefix_flag()}` first"
                )
            self.state_dir.mkdir(parents=True, exist_ok=True)
            try:
                plan = build_plan(self.profile, backend, self.reverse, self.prefix, self.shaper)
                for argv in plan:
                    _run(argv)
                relay_pid = self._start_relay() if backend == "relay" else None
                self.backend = backend
                self._write_state(backend, relay_pid)
            except BaseException:
                self._abort()
                raise
        return self

    def _prefix_flag(self) -> str:
        return "" if self.prefix == DEFAULT_PREFIX else f" --prefix {self.prefix}"

    def _abort(self) -> None:
        if self._relay is not None:
            _stop_relay(self._relay.pid)
            self._relay = None
        for n in namespaces(self.prefix, "relay").values():
            _run(["ip", "netns", "del", n], check=False)
        for f in self.state_dir.glob("*"):
            with contextlib.suppress(OSError):
                f.unlink()
        with contextlib.suppress(OSError):
            self.state_dir.rmdir()

    def _start_relay(self) -> int:
        from kvtransport.netem.profiles import profile_to_mapping

        cfg = {
            "profile": self.profile.name,
            "profile_spec": profile_to_mapping(self.profile),
            "seed": self.seed,
            "fwd_in": IF_MID_SND,
            "fwd_out": IF_MID_RCV,
            "reverse": self.reverse,
            "shaper": self.shaper,
            "status_file": str(self.state_dir / "relay-status.json"),
            "sndbuf_bytes": max(8 << 20, 4 * self.profile.effective_queue_bytes()),
        }
        if self.relay_priority is not None:
            cfg["priority"] = self.relay_priority
        cfg_path = self.state_dir / "relay.json"
        cfg_path.write_text(json.dumps(cfg, indent=1))
        log = open(self.state_dir / "relay.log", "ab")  # noqa: SIM115 (handed to the child)
        try:
            self._relay = subprocess.Popen(
                netns_exec(
                    self.mid_ns, [sys.executable, "-m", "kvtransport.netem.relay", str(cfg_path)]
                ),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            log.close()
        (self.state_dir / "relay.pid").write_text(f"{self._relay.pid}\n")
        status_file = self.state_dir / "relay-status.json"
        deadline = time.monotonic() + RELAY_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if status_file.exists():
                return self._relay.pid
            if self._relay.poll() is not None:
                tail = (self.state_dir / "relay.log").read_text(errors="replace").strip()
                last = tail.splitlines()[-1] if tail else f"exit status {self._relay.returncode}"
                raise TestbedError(f"the impairment relay failed to start: {last}")
            time.sleep(0.05)
        raise TestbedError(f"the impairment relay did not start within {RELAY_READY_TIMEOUT_S} s")

    def _write_state(self, backend: str, relay_pid: int | None) -> None:
        if backend == "netem":
            shaped = [[self.snd_ns, IF_SND]]
            shaped += [[self.rcv_ns, IF_RCV]] if self.reverse != "none" else []
        elif self.shaper == "tbf":
            shaped = [[self.mid_ns, IF_MID_RCV]]
            shaped += [[self.mid_ns, IF_MID_SND]] if self.reverse == "full" else []
        else:
            shaped = []
        state = {
            "prefix": self.prefix,
            "profile": self.profile.name,
            "description": self.profile.describe(),
            "backend": backend,
            "reverse": self.reverse,
            "shaper": "netem+tbf" if backend == "netem" else self.shaper,
            "seed": self.seed,
            "rate_mbps": self.profile.rate_mbps,
            "delay_ms": None if self.profile.is_trace else self.profile.delay_ms,
            "expected_loss": self.profile.stationary_loss(),
            "namespaces": namespaces(self.prefix, backend),
            "addresses": {"snd": SND_ADDR, "rcv": RCV_ADDR},
            "relay_pid": relay_pid,
            "shaped": shaped,
            "data_tbf": self._data_tbf(backend),
            "rate_steps": [list(step) for step in self.profile.rate_steps],
            "created_unix": time.time(),
        }
        (self.state_dir / "state.json").write_text(json.dumps(state, indent=1))

    def _data_tbf(self, backend: str) -> dict[str, Any] | None:
        """Where the data direction's kernel tbf sits and its byte limits (None: the relay
        shapes), recorded so that ``set_rate`` can change its rate from any process."""
        if backend == "relay" and self.shaper == "relay":
            return None
        ns, dev, attach = data_tbf_place(self.prefix, backend)
        return {
            "ns": ns,
            "dev": dev,
            "attach": attach,
            "burst_bytes": self.profile.effective_burst_bytes(),
            "limit_bytes": self.profile.effective_queue_bytes(),
        }

    def set_rate(self, rate_mbps: float) -> None:
        """Change the data direction's rate limit now (see :func:`set_rate`)."""
        set_rate(self.prefix, rate_mbps)

    def play_rate_steps(self, priority: int | None = None) -> RateSteps:
        """Start playing the profile's ``rate_steps`` from now (see :class:`RateSteps`);
        ``down()`` stops it if it still plays."""
        player = RateSteps(self.prefix, self.profile.rate_steps, self.profile.rate_mbps, priority)
        self._players.append(player)
        return player

    def down(self) -> list[str]:
        """Remove everything this testbed (or a previous one with its prefix) created."""
        for player in self._players:
            player.cancel()  # no step of it reaches a later testbed with this prefix
        self._players.clear()
        removed = []
        if self._relay is not None:
            if _stop_relay(self._relay.pid):
                removed.append(f"relay (pid {self._relay.pid})")
            with contextlib.suppress(Exception):
                self._relay.wait(timeout=5)
            self._relay = None
        return removed + teardown(self.prefix)

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- using it ------------------------------------------------------------------

    def command(self, side: str, argv: list[str]) -> list[str]:
        """The argv that runs ``argv`` in a side's namespace ("snd", "rcv" or "mid")."""
        return netns_exec(self.ns(side), argv)

    def run(self, side: str, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """``subprocess.run`` inside a side's namespace (kwargs go to subprocess.run)."""
        return subprocess.run(self.command(side, argv), **kwargs)

    def popen(self, side: str, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen`` inside a side's namespace."""
        return subprocess.Popen(self.command(side, argv), **kwargs)

    def socket(
        self, side: str, family: int = socket.AF_INET, type: int = socket.SOCK_DGRAM
    ) -> socket.socket:
        """A socket living in a side's namespace, created from this process."""
        return netns_socket(self.ns(side), family, type)

    def measure_udp(
        self,
        rate_mbps: float,
        count: int,
        size: int = 1300,
        port: int = 9000,
        reverse: bool = False,
        trace: str | Path | None = None,
        realtime: bool = True,
        timeout_s: float = 120.0,
    ) -> dict[str, Any]:
        """Send ``count`` paced UDP datagrams across the link with the probe and return its
        summary (loss rate, loss runs, one-way delay, wire throughput, sender report).

        ``reverse`` measures rcv -> snd. ``realtime`` runs both probe ends at a low
        SCHED_FIFO priority (via chrt) so that a busy machine does not stall them: a
        stalled sender's softirq work delays and bunches its packets before they even
        reach the link, which would read as link delay and queue loss.
        """
        src, dst = ("rcv", "snd") if reverse else ("snd", "rcv")
        addr = SND_ADDR if reverse else RCV_ADDR
        rt = ["chrt", "-f", "5"] if realtime and shutil.which("chrt") else []
        probe = [*rt, sys.executable, "-m", "kvtransport.netem.probe"]
        recv_cmd = [*probe, "recv", f"{addr}:{port}", "--idle-s", "1.0", "--max-s", str(timeout_s)]
        if trace is not None:
            recv_cmd += ["--trace", str(trace)]
        rx = self.popen(dst, recv_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = rx.stdout.readline().strip() if rx.stdout else ""
            if line != "ready":
                err = rx.stderr.read() if rx.stderr else ""
                raise TestbedError(f"probe receiver did not start: {line or err}")
            args = f"send {addr}:{port} --rate-mbps {rate_mbps} --size {size} --count {count}"
            send_cmd = probe + args.split()
            tx = self.run(src, send_cmd, capture_output=True, text=True, timeout=timeout_s)
            if tx.returncode != 0:
                raise TestbedError(f"probe sender failed: {tx.stderr.strip()[-300:]}")
            out, err = rx.communicate(timeout=timeout_s)
        finally:
            if rx.poll() is None:
                rx.kill()
                rx.wait()
        if rx.returncode != 0:
            raise TestbedError(f"probe receiver failed: {err.strip()[-300:]}")
        summary = json.loads(out.strip().splitlines()[-1])
        summary["sender"] = json.loads(tx.stdout.strip().splitlines()[-1])
        return summary

    def queue_drops(self) -> int:
        """Packets the data direction's rate limiter dropped because its queue was full:
        the kernel tbf's counter (either backend), or the relay's when it shapes. Link
        loss and queue loss are told apart this way."""
        if self.backend == "relay" and self.shaper == "relay":
            return int((self.relay_status() or {})["forward"]["queue_dropped"])
        ns, dev, _ = data_tbf_place(self.prefix, str(self.backend))
        text = _run(["tc", "-s", "-n", ns, "qdisc", "show", "dev", dev]).stdout
        m = re.search(r"qdisc tbf .*?\n\s*Sent \d+ bytes \d+ pkt \(dropped (\d+)", text)
        if not m:
            raise TestbedError(f"no tbf qdisc on {ns}/{dev}")
        return int(m.group(1))

    def relay_status(self) -> dict[str, Any] | None:
        """The relay's counters (None for the netem backend)."""
        return _read_json(self.state_dir / "relay-status.json")


@contextlib.contextmanager
def testbed(profile: str | Profile = "ge-heavy", **kwargs: Any) -> Iterator[Testbed]:
    """``with testbed("ge-heavy", rate_mbps=50) as tb: ...`` (same arguments as Testbed)."""
    tb = Testbed(profile, **kwargs)
    tb.up()
    try:
        yield tb
    finally:
        tb.down()
