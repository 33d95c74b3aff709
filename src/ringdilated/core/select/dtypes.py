"""The dtype policy: which floating dtype to compute in on a device.

- CPU: float32 (half precision on CPU is emulated or narrow-use).
- CUDA below compute capability 7.0 (Pascal and older): float32. No fast float16 there: float16
  runs 10-100x slower (the seed reports measured 17.8x and 119x on a GTX 1080).
- CUDA 7.x (Volta, Turing): float16 (tensor cores, no bfloat16).
- CUDA 8.0 and newer (Ampere, Hopper): bfloat16 (tensor cores, float32's range).

A call in float16 on a CUDA device below 7.0 warns once per process (:class:`SlowDtypeWarning`).

Under ``torch.autocast``, inputs are cast as ``scaled_dot_product_attention``'s are, and the
result comes back in the autocast dtype (:func:`autocast_inputs`); the kernels run with autocast
off (:func:`autocast_off`), so their float32 softmax state stays float32.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from ringdilated.core.select.capabilities import Environment, Request
from ringdilated.core.support.caller import user_stacklevel
from ringdilated.core.support.errors import SlowDtypeWarning

__all__ = [
    "DTYPE_POLICY",
    "SlowDtypeWarning",
    "autocast_enabled",
    "autocast_inputs",
    "autocast_off",
    "recommended_dtype",
    "warn_if_slow",
]

#: ``(minimum compute capability, dtype)`` for CUDA, highest first.
DTYPE_POLICY: tuple[tuple[tuple[int, int], torch.dtype], ...] = (
    ((8, 0), torch.bfloat16),
    ((7, 0), torch.float16),
    ((0, 0), torch.float32),
)


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


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (``False`` for one autocast does not know,
    such as ``meta``, where torch's own query raises)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_inputs(*tensors: object) -> tuple[object, ...]:
    """``tensors`` cast to the autocast dtype of their device type where autocast is on there
    (SDPA's policy: attention computes in the lower precision); anything else unchanged. Like
    autocast itself, float64 is left alone (only float32 and lower precisions are eligible)."""
    first = tensors[0] if tensors else None
    if isinstance(first, torch.Tensor) and not autocast_enabled(first.device.type):
        # The common case, decided by the first tensor alone: tensors on devices that differ
        # from it are rejected by the call's validation whatever autocast does to them.
        return tensors
    out: list[object] = []
    for x in tensors:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64:
            kind = x.device.type
            if autocast_enabled(kind):
                x = x.to(torch.get_autocast_dtype(kind))
        out.append(x)
    return tuple(out)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager[object]:
    """A context with autocast off for ``device_type`` (a no-op where it is not on)."""
    if autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


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
        stacklevel=user_stacklevel(),
    )
