"""The dtype policy: which floating dtype to compute in on a device.

- CPU: float32 (half precision on CPU is emulated or narrow-use).
- CUDA below compute capability 7.0 (Pascal and older): float32. No fast float16 there: float16
  runs 10-100x slower (the seed reports measured 17.8x and 119x on a GTX 1080).
- CUDA 7.x (Volta, Turing): float16 (tensor cores, no bfloat16).
- CUDA 8.0 and newer (Ampere, Hopper): bfloat16 (tensor cores, float32's range).

A call in float16 on a CUDA device below 7.0 warns once per process (:class:`SlowDtypeWarning`).
"""

from __future__ import annotations

import warnings

import torch

from ringdilated.core.capabilities import Environment, Request

__all__ = ["DTYPE_POLICY", "SlowDtypeWarning", "recommended_dtype", "warn_if_slow"]

#: ``(minimum compute capability, dtype)`` for CUDA, highest first.
DTYPE_POLICY: tuple[tuple[tuple[int, int], torch.dtype], ...] = (
    ((8, 0), torch.bfloat16),
    ((7, 0), torch.float16),
    ((0, 0), torch.float32),
)


class SlowDtypeWarning(UserWarning):
    """float16 on a GPU without fast float16 arithmetic."""


def recommended_dtype(
    device: torch.device | str | None = None, env: Environment | None = None
) -> torch.dtype:
    """The dtype to compute in on ``device`` (default: the current CUDA device, else CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    capability = (env or Environment.from_environ()).capability(device)
    if capability is None:
        return torch.float32
    return next(dtype for minimum, dtype in DTYPE_POLICY if capability >= minimum)


_warned: set[tuple[int, int]] = set()


def warn_if_slow(request: Request) -> None:
    """Warn, once per compute capability, when float16 runs on a CUDA device below 7.0."""
    cc = request.compute_capability
    if request.dtype != torch.float16 or cc is None or cc >= (7, 0) or cc in _warned:
        return
    _warned.add(cc)
    warnings.warn(
        f"float16 on a GPU of compute capability {cc[0]}.{cc[1]} (below 7.0, no fast float16): "
        "expect it 10-100x slower than float32; ringdilated.recommended_dtype() says float32",
        SlowDtypeWarning,
        stacklevel=4,
    )
