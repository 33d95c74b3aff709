"""``dtype="auto"``: a module's parameters take the dtype policy of the device they are moved to.

A module built with ``dtype="auto"`` (the default of :class:`~ringdilated.MultiheadDilatedAttention`
and :class:`~ringdilated.DilatedTransformerBlock`) computes in
:func:`ringdilated.recommended_dtype` of the device its parameters live on. When that device is
known at construction (``device="cuda"``, or ``with torch.device("cuda"):``), the parameters are
made in that dtype. When it is not (no ``device``: CPU; or ``"meta"``), the dtype is *open*: the
parameters are made in float32 (the CPU policy, so a module that stays on CPU never changes), and
the first of these decides it, once:

- a move through ``nn.Module._apply`` (``.to(device)``, ``.cuda()``, ``.to_empty(device=)``,
  called on the module or on any module holding it) that lands on a device other than CPU or
  ``meta``: the floating parameters and buffers are cast in place (``tensor.data``: the same
  ``Parameter`` objects, so an optimizer built before the move still holds them; gradients
  too) to ``recommended_dtype`` of that device, after the move. Later moves change nothing
  (``.cpu()`` keeps bfloat16, as ``nn.Module`` does);
- a dtype the caller sets (``.to(dtype)``, ``.to(device, dtype)``, ``.half()``, ``.float()``,
  ``.type(...)``, on the module or a module holding it): that dtype, kept; nothing is ever cast
  over it. Which dtype a conversion sets is learnt by applying it to two empty probe tensors of
  different dtypes (a conversion that sets one turns both into it).

A move between CPU and ``meta`` leaves the dtype open. Parameters that are tensor subclasses
wrapping others (``DTensor`` from FSDP2's ``fully_shard`` or tensor parallelism) are never cast:
a deciding move raises ``TypeError`` before anything moves, as FSDP2 keeps float32 parameters and
computes in its ``MixedPrecisionPolicy(param_dtype=...)``. Tools that place parameters without
``_apply`` (FSDP2's ``fully_shard`` moving CPU parameters itself, ``load_state_dict(assign=True)``)
leave the dtype open: a forward on a device other than CPU or ``meta`` then raises
``RuntimeError`` (:meth:`AutoDtype._check_dtype_decided`) instead of computing silently in
float32. Pass ``dtype=`` explicitly in both cases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ringdilated.core.select import recommended_dtype

__all__ = ["OPEN_DEVICE_TYPES", "AutoDtype", "resolve_dtype"]

OPEN_DEVICE_TYPES = frozenset({"cpu", "meta"})
"""Device types on which ``dtype="auto"`` stays open: parameters there hold float32, the CPU
policy's dtype (a placeholder on ``meta``)."""

DtypeArgument = torch.dtype | Literal["auto"] | None

Conversion = Callable[[torch.Tensor], torch.Tensor]
"""What ``nn.Module._apply`` applies to every parameter, gradient and buffer."""


def resolve_dtype(dtype: DtypeArgument, device: torch.device | str | None) -> torch.dtype:
    """The dtype parameters are made in on ``device`` (``None``: torch's default device).
    ``"auto"``: :func:`ringdilated.recommended_dtype` there; ``None``: torch's default dtype;
    otherwise a floating ``torch.dtype`` (anything else raises ``TypeError`` naming it)."""
    if dtype == "auto":
        return recommended_dtype(_construction_device(device))
    if dtype is None:
        return torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be 'auto', None or a floating torch.dtype, got {dtype!r}")
    return dtype


def _construction_device(device: torch.device | str | None) -> torch.device:
    """Where a factory call with ``device`` puts a tensor (``torch.device("cuda")`` context
    managers included)."""
    return torch.device(device) if device is not None else torch.get_default_device()


def _conversion(fn: Conversion, device: torch.device) -> tuple[torch.dtype | None, torch.device]:
    """What the conversion ``fn`` does to a floating tensor on ``device``: the dtype it sets
    (``None`` when it keeps each one's) and where it puts it. ``fn`` is applied to an empty
    float64 and an empty float16 tensor there: a conversion that sets a dtype turns both into it."""
    wide = fn(torch.empty(0, dtype=torch.float64, device=device))
    narrow = fn(torch.empty(0, dtype=torch.float16, device=device))
    return (wide.dtype if wide.dtype == narrow.dtype else None), wide.device


class AutoDtype(nn.Module):
    """A module whose ``dtype="auto"`` is decided by where it is moved (see the module
    docstring). A subclass calls :meth:`_init_dtype` in its ``__init__`` before making its
    parameters, and :meth:`_check_dtype_decided` with its input's device in ``forward``."""

    _dtype_open: bool = False
    """Whether ``dtype="auto"`` is still undecided (the class default: decided)."""

    def _init_dtype(self, dtype: DtypeArgument, device: torch.device | str | None) -> torch.dtype:
        """The dtype to make the parameters in, for the constructor's ``dtype`` and ``device``;
        records whether it stays open (``"auto"`` on CPU or ``meta``)."""
        open_device = _construction_device(device).type in OPEN_DEVICE_TYPES
        self._dtype_open = dtype == "auto" and open_device
        return resolve_dtype(dtype, device)

    def _apply(self, fn: Conversion, recurse: bool = True) -> AutoDtype:
        outcome = self._decision(fn) if self._dtype_open else None
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        if isinstance(outcome, torch.device):
            self._cast(recommended_dtype(outcome))  # after the move, on the device
        if outcome is not None:
            self._dtype_open = False
        return self

    def _decision(self, fn: Conversion) -> torch.dtype | torch.device | None:
        """What the conversion ``fn`` decides while the dtype is open: the dtype it sets (the
        caller's, kept), the device other than CPU or ``meta`` it moves the parameters to (cast
        for it; wrapped parameters refused, before anything moves), or ``None`` (still open)."""
        first = next(self.parameters(), None)
        if first is None:
            return None
        dtype, target = _conversion(fn, first.device)
        if dtype is not None:
            return dtype
        if target.type in OPEN_DEVICE_TYPES:
            return None
        self._refuse_wrapped(target)
        return target

    def _refuse_wrapped(self, target: torch.device) -> None:
        """Raise ``TypeError`` naming the first parameter that wraps other tensors (``DTensor``)."""
        for name, p in self.named_parameters():
            if is_traceable_wrapper_subclass(p):
                raise TypeError(
                    f"{type(self).__name__}(dtype='auto') cannot choose a dtype for {target}: "
                    f"its parameter {name} is a {type(p).__name__} (FSDP2's fully_shard or "
                    "tensor parallelism own such parameters' dtype). Build it with dtype= "
                    "(with FSDP2: dtype=torch.float32 and fully_shard(mp_policy="
                    "MixedPrecisionPolicy(param_dtype=ringdilated.recommended_dtype(device))))"
                )

    def _cast(self, dtype: torch.dtype) -> None:
        """Floating parameters, their gradients and buffers to ``dtype``, in place (the same
        tensor objects)."""
        for t in (*self.parameters(), *self.buffers()):
            if t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)
                if t.grad is not None:
                    t.grad.data = t.grad.data.to(dtype)

    def _check_dtype_decided(self, device: torch.device) -> None:
        """Raise ``RuntimeError`` when this module runs on ``device`` (its input's) with
        ``dtype="auto"`` still open and ``device`` not CPU or ``meta``: its parameters got there
        without ``nn.Module._apply`` (or the input is on another device than they are)."""
        if self._dtype_open and device.type not in OPEN_DEVICE_TYPES:
            weight = next(self.parameters())
            raise RuntimeError(
                f"{type(self).__name__} was built with dtype='auto' without a GPU, and its "
                f"parameters ({weight.dtype} on {weight.device}) were never moved with .to(), "
                f".cuda() or .to_empty(), so no dtype was chosen for the input's device "
                f"{device}. Move the module with .to({str(device)!r}) before calling it "
                "(dtype='auto' then takes ringdilated.recommended_dtype there), or build it "
                "with dtype= (FSDP2's fully_shard and load_state_dict(assign=True) place "
                "parameters themselves: pass dtype= explicitly with them)"
            )
