"""How much memory a ``bench`` or ``demo`` run needs, and a refusal when it cannot have it.

The estimates are lower bounds built from the large arrays a run holds at once; they leave out
the kernels' own working memory (bounded per chunk), allocator slack and Python objects. A run
refused here cannot fit; one allowed may still run out when memory is close.
"""

from __future__ import annotations

import torch

__all__ = [
    "RANK_PROCESS_BYTES",
    "available",
    "bench_bytes",
    "demo_bytes",
    "format_bytes",
    "require_fits",
]

RANK_PROCESS_BYTES = 200 * 2**20
"""What one spawned gloo rank costs before any tensor: a Python process with torch imported."""


def bench_bytes(
    length: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    world_size: int = 1,
    backward: bool = False,
    dense: bool = False,
) -> int:
    """Bytes one ``bench`` row at ``length`` needs at its peak, all ranks together.

    With ``n = (length / world_size) * heads * head_dim`` elements per ``(1, L/N, H, D)`` tensor,
    ``e`` bytes per element of ``dtype`` and ``a`` of the merge state, each rank holds:

    - its inputs ``q``, ``k``, ``v``: ``3 n e``;
    - then the largest of: the forward's output and merge state ``n e + n a``, plus with
      ``backward`` the output gradient and ``dq``, ``dk``, ``dv`` (``4 n e``); with ``dense``,
      the dense call's contiguous copies of ``q``, ``k``, ``v`` and its output (``4 n e``; the
      math fallback's ``L x L`` scores are not counted);
    - with ``world_size > 1``, the ``k`` and ``v`` blocks received from a peer (``2 n e``) and
      :data:`RANK_PROCESS_BYTES` for the process itself.

    On CUDA (one process) this is the device memory; on CPU all ranks share this machine.
    """
    e = dtype.itemsize
    a = 8 if dtype == torch.float64 else 4  # the merge state: float32, float64 for float64
    n = (length // world_size) * heads * head_dim
    forward = n * e + n * a + (4 * n * e if backward else 0)
    per_rank = 3 * n * e + max(forward, 4 * n * e if dense else 0)
    if world_size > 1:
        per_rank += 2 * n * e + RANK_PROCESS_BYTES
    return world_size * per_rank


def demo_bytes(length: int, heads: int, head_dim: int, world_size: int) -> int:
    """Bytes the ``demo`` needs at its peak, all processes on this machine together.

    With ``n = length * heads * head_dim``: the float64 reference run holds 11 float64 arrays of
    ``n`` (4 inputs, 3 leaves, the output, 3 gradients: ``88 n``) while the float32 results are
    kept (``16 n``); afterwards this process keeps both results (``48 n``) while every spawned
    rank builds the full-length float32 inputs (``16 n``) and costs :data:`RANK_PROCESS_BYTES`.
    """
    n = length * heads * head_dim
    return max(104 * n, 48 * n + world_size * (16 * n + RANK_PROCESS_BYTES))


def _mem_available() -> int | None:
    """Linux ``MemAvailable`` in bytes, or ``None`` where ``/proc/meminfo`` has none."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available(device: str) -> tuple[int, str] | None:
    """``(bytes free, where that figure comes from)`` for ``device``; ``None`` when unknown.

    CUDA: ``torch.cuda.mem_get_info`` (free device memory). Otherwise Linux ``MemAvailable``;
    on systems without ``/proc/meminfo`` there is no figure and nothing is refused.
    """
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, f"free on {device} (torch.cuda.mem_get_info)"
    found = _mem_available()
    return None if found is None else (found, "MemAvailable in /proc/meminfo")


def format_bytes(count: int) -> str:
    """``count`` bytes in the largest binary unit that keeps it at least 1 (``1.5 GiB``)."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{count} B"
        value /= 1024
    raise AssertionError("unreachable")


def require_fits(command: str, need: int, device: str, what: str, reduce: str) -> None:
    """Raise ``MemoryError`` when ``need`` bytes exceed what :func:`available` reports.

    ``what`` says what was counted (the flags that sized it); ``reduce`` names the flags to
    change. The message gives the estimate, the figure available and its source.
    """
    free = available(device)
    if free is None or need <= free[0]:
        return
    raise MemoryError(
        f"{command} needs at least {format_bytes(need)} for {what}, but "
        f"{format_bytes(free[0])} is available ({free[1]}); reduce {reduce}"
    )
