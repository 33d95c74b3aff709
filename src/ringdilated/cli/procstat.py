"""Linux process memory counters for the benchmarks: resident and peak resident bytes."""

from __future__ import annotations


def status_bytes(field: str) -> int:
    """``VmRSS``, ``VmHWM``, ... from ``/proc/self/status``, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current resident size (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
