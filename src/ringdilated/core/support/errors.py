"""Every exception and warning ringdilated defines, in one hierarchy.

::

    RingDilatedError                          what ringdilated raises of its own
      KernelContractError (RuntimeError)      a kernel's result broke the contract; .kernel
      ResolutionError (ValueError)            no backend serves a request; a forced one does not fit
      SpecError (ValueError)                  a spec's field breaks its rule; .field
      PluginError (RuntimeError)              strict mode: a plugin failed; .plugin
      ConformanceError (AssertionError)       a backend failed a conformance check; .check
      AgreementError (ValueError)             raised on every rank by an agreement
        PeerRejectedError                     another rank rejected its input; .rank, .reason
        CallMismatchError                     the ranks' calls differ; .differences
      CudaDeviceNotSetError (RuntimeError)    NCCL without the tensors' GPU current; .device,
                                              .current

    EveryRankError                         any error an agreement raised on every rank
    RingDilatedWarning (UserWarning)
      SlowDtypeWarning, SlowFeatureWarning, DistributedNotInitializedWarning, PluginWarning,
      PaddingMaskWarning, and a backend's own

Input a caller passed is rejected with the built-in a caller would catch (``ValueError``,
``TypeError``), naming the value and the rule; the classes above add what a program may need to
tell apart or read (the culprit, as attributes).
"""

from __future__ import annotations

import copyreg
from typing import Any

__all__ = [
    "AgreementError",
    "CallMismatchError",
    "ConformanceError",
    "CudaDeviceNotSetError",
    "DistributedNotInitializedWarning",
    "EveryRankError",
    "KernelContractError",
    "PaddingMaskWarning",
    "PeerRejectedError",
    "PluginError",
    "PluginWarning",
    "ResolutionError",
    "RingDilatedError",
    "RingDilatedWarning",
    "SlowDtypeWarning",
    "SlowFeatureWarning",
    "SpecError",
    "raised_on_every_rank",
]


class RingDilatedError(Exception):
    """The base of every exception ringdilated defines. Each pickles with its attributes (a
    rank's error crosses processes), whatever its ``__init__`` takes."""

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuilt, (type(self), *_state(self)))


class KernelContractError(RingDilatedError, RuntimeError):
    """A kernel broke the kernel contract (:mod:`ringdilated.core.contract.kernel`): ``kernel``
    is its name; the message says what it returned and what was expected."""

    def __init__(self, kernel: str, message: str) -> None:
        super().__init__(f"kernel {kernel!r} broke the kernel contract: {message}")
        self.kernel = kernel


class ResolutionError(RingDilatedError, ValueError):
    """No backend can serve a request, or a forced backend does not fit it; the message names
    the request and every backend's reasons."""


class SpecError(RingDilatedError, ValueError):
    """A spec's field breaks its rule. ``field`` is its path (``capabilities.targets[0].dtypes``)
    and the message names the class, the field, the rule and the value received."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"field {field}: {message}")
        self.field = field


class PluginError(RingDilatedError, RuntimeError):
    """Strict mode: a plugin failed. ``plugin`` is its name; the message says why."""

    def __init__(self, plugin: str, message: str) -> None:
        super().__init__(message)
        self.plugin = plugin


class ConformanceError(RingDilatedError, AssertionError):
    """A backend failed a conformance check; ``check`` is its name."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"[{check}] {message}")
        self.check = check


class CudaDeviceNotSetError(RingDilatedError, RuntimeError):
    """A call on a process group that moves its CUDA tensors with NCCL, on a rank whose current
    CUDA device is not the one its tensors are on: ``torch.cuda.set_device(local_rank)`` was not
    called (or named another GPU), which NCCL needs before the first collective. ``device`` is
    the tensors' device (``"cuda:1"``), ``current`` the current device's index; the message says
    what to call."""

    def __init__(self, device: str, current: int, message: str) -> None:
        super().__init__(message)
        self.device, self.current = device, current


class EveryRankError(Exception):
    """An error an agreement raised on every rank of its group: a caller must not report it to
    the peers again (they raise too). :class:`AgreementError` is one; a rank's own error comes
    out of the agreement as :func:`raised_on_every_rank` of it."""


class AgreementError(RingDilatedError, EveryRankError, ValueError):
    """Raised on every rank by an agreement: the ranks cannot go on together."""


class PeerRejectedError(AgreementError):
    """Another rank rejected its input (or failed before its call), so every rank stops.
    ``rank`` is that rank; ``reason`` its error's text."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank} rejected its input, so every rank stops: {reason}")
        self.rank, self.reason = rank, reason


class CallMismatchError(AgreementError):
    """The ranks' calls differ; ``differences`` names each differing field, with the values."""

    def __init__(self, differences: tuple[str, ...]) -> None:
        super().__init__(
            "ranks disagree on the call (every rank must pass the same): " + "; ".join(differences)
        )
        self.differences = differences


_on_every_rank: dict[type[BaseException], type[BaseException]] = {}


def raised_on_every_rank(error: BaseException) -> BaseException:
    """``error`` as an agreement raises it: an instance of a subclass of its own class and of
    :class:`EveryRankError`, of the same name, arguments, state and traceback (``except TypeError``
    catches it). ``error`` itself if it is one already, no ``Exception``, or cannot be copied."""
    cls = type(error)
    if isinstance(error, EveryRankError) or not isinstance(error, Exception):
        return error
    agreed = _on_every_rank.get(cls)
    try:
        if agreed is None:
            body = {"__module__": cls.__module__, "__reduce__": _reduce}
            agreed = _on_every_rank[cls] = type(cls.__name__, (cls, EveryRankError), body)
            agreed.__qualname__ = cls.__qualname__
        copy = _rebuilt(agreed, *_state(error))
    except Exception:  # a class that forbids subclasses, or whose copy fails (its own __new__)
        return error
    chained = error.__suppress_context__ or error.__cause__ is not None
    copy.__cause__ = error.__cause__ if chained else error.__context__  # error's chain, shown
    copy.__suppress_context__ = True  # once where a caller handling error raises it, not twice
    return copy.with_traceback(error.__traceback__)


def _state(error: BaseException) -> tuple[tuple[object, ...], dict[str, object]]:
    """What rebuilds ``error``: its built-in base's ``__reduce__``, and its slots."""
    _, args, *rest = _builtin(type(error)).__reduce__(error)
    slots = copyreg._slotnames(type(error))  # type: ignore[attr-defined]
    state = {n: getattr(error, n) for n in slots if hasattr(error, n)}
    return args, {**(rest[0] or {} if rest else {}), **state}


def _builtin(cls: type[BaseException]) -> Any:
    """``cls``'s nearest base written in C (a static type: no ``__module__`` of its own)."""
    return next(c for c in cls.__mro__ if "__module__" not in vars(c))


def _rebuilt(
    cls: type[BaseException], args: tuple[object, ...], state: dict[str, Any], agreed: bool = False
) -> BaseException:
    """An instance of ``cls`` from :func:`_state`, its ``__init__`` not run (it may take other
    arguments than its ``args``), only its built-in base's (``UnicodeError.start``); ``agreed``:
    its agreed copy (an agreed copy unpickled: its class exists in one process)."""
    made = cls.__new__(cls, *args)
    _builtin(cls).__init__(made, *args)
    made.__setstate__(state)
    return raised_on_every_rank(made) if agreed else made


def _reduce(self: BaseException) -> tuple[object, ...]:
    """Pickle an agreed copy by the class it copies."""
    return (_rebuilt, (type(self).__mro__[1], *_state(self), True))


class RingDilatedWarning(UserWarning):
    """The base of every warning ringdilated defines."""


class SlowDtypeWarning(RingDilatedWarning):
    """float16 on a GPU without fast float16 arithmetic."""


class SlowFeatureWarning(RingDilatedWarning):
    """A feature the call needs (dropout, say) turned away the fused kernels preferred for it,
    so the automatic choice fell to one that materialises attention scores (much slower); the
    message names the features and the kernels. Emitted once per process and (features,
    kernel); never for a kernel the caller chose."""


class DistributedNotInitializedWarning(RingDilatedWarning):
    """A one-process call (``process_group=None``) in a process that a launcher started as one
    of several ranks (``WORLD_SIZE > 1`` in its environment) while ``torch.distributed`` is not
    initialised: each rank then attends over its own shard as if it were the whole sequence.
    The usual cause: ``process_group=dist.group.WORLD`` passed before
    ``torch.distributed.init_process_group()`` (``dist.group.WORLD`` is ``None`` until then).
    Emitted once per process."""


class PluginWarning(RingDilatedWarning):
    """A plugin was skipped because it failed; the message names it and says why."""


class PaddingMaskWarning(RingDilatedWarning):
    """A ``key_padding_mask`` that is ``True`` (padding) at every position of every row: almost
    surely transformers' convention (``attention_mask``, 1 = token) passed where ringdilated's
    (``True`` = padding) is read. The output of such a call is all zeros."""
