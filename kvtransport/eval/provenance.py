"""Where and when a figure was made: the CPU, its cores and the load average (the
machines are shared and noisy), and the command and seeds under a table."""

from __future__ import annotations

import os
import platform
import time
from typing import Any


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo; the platform's processor string else)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """CPU model, core count and load average now."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "time_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def machine_text(before: dict[str, Any], after: dict[str, Any] | None = None) -> str:
    """'AMD EPYC, 2 cores, load 1.9 -> 2.4 (1-min average)'."""
    load = f"{before['load_avg'][0]:.1f}"
    if after is not None:
        load += f" -> {after['load_avg'][0]:.1f}"
    return (
        f"{before['cpu']}, {before['cores']} cores, load {load} (1-min avg), {before['time_utc']}"
    )


def provenance_md(command: str, seeds: str, machine_line: str, wall_s: float) -> str:
    """The command, seeds and machine under a Markdown table."""
    return (
        f"command: `{command}`  \nseeds: {seeds}  \nmachine: {machine_line}; "
        f"this figure's wall time {wall_s:.0f} s\n"
    )
