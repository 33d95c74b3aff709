"""Counting what a layer call costs the host: device reads, copies from Python data, collectives.

On a GPU each of these stalls the launch queue or the peers: a device value read on the host
(``.item()``, ``bool(tensor)``, ``.tolist()``, ``nonzero``, ``torch.equal``) waits for every
queued kernel; a tensor made from Python data (``torch.tensor(list, device=)``, indexing with a
list) is a synchronous host-to-device copy; a collective that moves no data (an agreement)
waits for every peer. :class:`HotPathCounter` counts them while it is active, on any device,
so a CPU test can hold the GPU path to zero::

    with HotPathCounter() as counts:
        out = attn(q, k, v, layout=layout)
        out.sum().backward()
    assert counts.host_reads == counts.host_copies == counts.control_collectives == 0, counts

How each is seen:

- ``host_reads``: the aten ops that hand a device value to the host (``_local_scalar_dense``,
  behind ``item``, ``bool``, ``int``, ``float``; ``nonzero``; ``equal``; ops whose output shape
  depends on values: ``masked_select``, ``unique``...), seen by a ``TorchDispatchMode``, plus
  wrappers on ``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.cpu``, which read without an aten op.
  Counted whatever the device: on CPU they cost little, on CUDA each is a synchronisation.
- ``host_copies``: tensors made from Python data (``aten.lift_fresh``: ``torch.tensor``,
  ``torch.as_tensor`` of a list, indexing with a list), each a synchronous copy when the target
  is a GPU, and copies between devices (``aten._to_copy`` and ``copy_`` across devices).
- ringdilated's own registered ops (:mod:`ringdilated.compiled`) are counted through: the
  counter runs their implementations with itself active (a dispatch mode is off inside its own
  dispatch, which would otherwise hide every op they run).
- ``control_collectives`` and ``exchanges``: every ``torch.distributed`` collective or
  point-to-point call, by wrapper (``batch_isend_irecv`` for the point-to-point ops it batches:
  ``isend`` and ``irecv`` themselves are left unwrapped, as ``P2POp`` checks their identity);
  an *exchange* is one made while moving a call's data (from
  :mod:`ringdilated.core.run.exchange` or :mod:`ringdilated.core.run.head_parallel`), anything else
  (the agreement, a stray check) is a *control* collective.

``events`` lists every counted event as ``(kind, what)``, ``what`` naming the op and the
``file:line`` that asked (the innermost frame outside torch), for the failure message. The counter
sees the thread it was entered on (the dispatch mode is thread-local; autograd runs a CPU
backward on the calling thread) and every thread for the wrapped functions; it is for tests and
benchmarks, not production: the wrappers cost microseconds per call.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HotPathCounter"]

_aten = torch.ops.aten

_READS = frozenset(
    {
        _aten._local_scalar_dense.default,
        _aten.item.default,
        _aten.nonzero.default,
        _aten.nonzero_static.default,
        _aten.argwhere.default,
        _aten.equal.default,
        _aten.masked_select.default,
        _aten._unique.default,
        _aten._unique2.default,
        _aten.unique_dim.default,
        _aten.unique_consecutive.default,
        _aten.repeat_interleave.Tensor,
        _aten.allclose.default,
    }
)

_FRESH = frozenset({_aten.lift_fresh.default, _aten.lift_fresh_copy.default})

_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)

_EXCHANGE_MODULES = ("ringdilated.core.run.exchange", "ringdilated.core.run.head_parallel")


def _devices(args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[torch.device]:
    return {x.device for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)}


@attrs.define
class HotPathCounter:
    """A context manager counting host reads, copies from Python data and collectives (see the
    module docstring). Not reentrant; one may be active per process at a time."""

    host_reads: int = 0
    host_copies: int = 0
    control_collectives: int = 0
    exchanges: int = 0
    events: list[tuple[str, str]] = attrs.field(factory=list)
    _mode: TorchDispatchMode | None = attrs.field(default=None, repr=False)
    _saved: list[tuple[object, str, object]] = attrs.field(factory=list, repr=False)

    def _record(self, kind: str, what: str) -> None:
        what = f"{what} at {_caller()}"
        if kind == "read":
            self.host_reads += 1
        elif kind == "copy":
            self.host_copies += 1
        elif kind == "control":
            self.control_collectives += 1
        else:
            self.exchanges += 1
        self.events.append((kind, what))

    def reset(self) -> None:
        """Zero every count (the counter stays active)."""
        self.host_reads = self.host_copies = self.control_collectives = self.exchanges = 0
        self.events.clear()

    @property
    def host_traffic(self) -> int:
        """Host reads plus copies plus control collectives: what a planned layer call keeps at 0."""
        return self.host_reads + self.host_copies + self.control_collectives

    def _count_calls(
        self, owner: object, name: str, what: str, kind: Callable[[], str] = lambda: "read"
    ) -> None:
        """Replace ``owner.name`` until exit by a wrapper recording each call as ``kind()``."""
        original = getattr(owner, name)
        self._saved.append((owner, name, original))

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._record(kind(), what)
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    def __enter__(self) -> HotPathCounter:
        counter = self
        from ringdilated.compiled import IMPLEMENTATIONS

        class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]
            def __torch_dispatch__(
                self,
                func: Any,
                types: Any,
                args: tuple[Any, ...] = (),
                kwargs: dict[str, Any] | None = None,
            ) -> Any:
                kwargs = kwargs or {}
                implementation = IMPLEMENTATIONS.get(func.name())
                if implementation is not None:  # counted through (module docstring)
                    with self:
                        return implementation(*args, **kwargs)
                if func in _READS:
                    counter._record("read", str(func))
                elif func in _FRESH:
                    counter._record("copy", str(func))
                elif func is _aten._to_copy.default:
                    target = kwargs.get("device")
                    source = args[0].device if isinstance(args[0], torch.Tensor) else None
                    if target is not None and torch.device(target) != source:
                        counter._record("copy", f"{func} {source} -> {target}")
                elif func is _aten.copy_.default and len(_devices(args, kwargs)) > 1:
                    counter._record("copy", f"{func} across devices")
                return func(*args, **kwargs)

        for name in ("tolist", "numpy", "cpu"):
            self._count_calls(torch.Tensor, name, f"Tensor.{name}")
        if dist.is_available():
            for name in _COLLECTIVES:
                if hasattr(dist, name):
                    self._count_calls(dist, name, f"torch.distributed.{name}", _collective_kind)
        if torch.cuda.is_available():
            self._count_calls(torch.cuda, "synchronize", "torch.cuda.synchronize")
        self._mode = _Mode()  # type: ignore[no-untyped-call]
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)  # type: ignore[no-untyped-call]
        self._mode = None
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def _frame(accepts: Callable[[str], bool]) -> types.FrameType | None:
    """The innermost frame on the stack whose module name ``accepts``."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and not accepts(frame.f_globals.get("__name__", "")):
        frame = frame.f_back
    return frame


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module: who asked."""
    frame = _frame(lambda module: not (module.startswith("torch") or module == __name__))
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _collective_kind() -> str:
    """``"exchange"`` when called while moving a call's data, else ``"control"``."""
    exchanging = _frame(lambda module: module.startswith(_EXCHANGE_MODULES)) is not None
    return "exchange" if exchanging else "control"
