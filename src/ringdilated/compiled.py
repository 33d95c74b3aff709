"""Dilated attention as ``torch.library`` custom ops: one opaque node for ``torch.compile``, for
selective activation checkpointing and for CUDA graphs.

- ``ringdilated::attention`` (backward: ``ringdilated::attention_backward``): a call on a
  :class:`~ringdilated.SequenceLayout`, which the op takes as an opaque argument
  (:mod:`ringdilated.core.support.opaque`): a new layout per batch reuses the compiled graph. The
  op finds the call's plan on the layout (made, and agreed on a process group, at the layout's
  first call with that signature) and runs it: on a layout in steady state it reads nothing on
  the host, so CUDA graphs may capture it. Sharded calls take this op in eager mode too, so a
  selective activation-checkpointing policy can keep its output by name
  (``torch.ops.ringdilated.attention.default``) instead of running its exchanges again. A sharded
  call without a layout passes the names of its process groups instead, and the op plans (and
  agrees on) each call.
- ``ringdilated::dilated_attention`` (backward: ``ringdilated::dilated_attention_backward``): a
  one-process call given ``cu_seqlens`` or ``key_padding_mask`` tensors under ``torch.compile``;
  it reads their values on the host every call (tagged ``torch.Tag.cudagraph_unsafe``): pass a
  layout instead.

Both re-find their plan from their arguments (a cached lookup), so a graph holds no Python state
but the layout; the dropout seed is a tensor drawn in the graph, so each call draws new masks
without recompiling (reading it is one read of a CPU scalar, never of the device). The call's
attention sinks (``Tensor?``, after the seed) are an input like ``q``: their gradient is the
backward op's fourth result (an empty tensor without sinks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringdilated.core import TransferStats, accumulation_dtype
from ringdilated.core.call import (
    WHOLE_SEQUENCES,
    CallPlan,
    Grid,
    SequenceLayout,
    execute,
    execute_backward,
    plan_for,
)
from ringdilated.core.run import first_order_only, lse_buffer
from ringdilated.core.support import opaque

__all__ = [
    "IMPLEMENTATIONS",
    "NO_STATS",
    "OP_SUPPORTED",
    "attention_op",
    "dilated_attention_backward_op",
    "dilated_attention_op",
    "group_names",
    "last_plan",
    "shard_positions",
]

OP_SUPPORTED = opaque.SUPPORTED
"""Whether ``ringdilated::attention`` exists (torch has opaque types)."""

IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}
"""Each op's Python implementation by op name: what a ``TorchDispatchMode`` that must see the
ops inside an op (:class:`~ringdilated.testing.hot_path.HotPathCounter`) runs in its place."""

NO_STATS = TransferStats()
"""What ``ringdilated::attention`` takes for "count no bytes" (an op argument cannot be None)."""


def group_names(group: object) -> tuple[str, str]:
    """The names of a process layout's groups, which the op resolves again: ``("", "")`` on one
    process, ``(name, "")`` for a ``ProcessGroup``, ``(outer, inner)`` for a
    :class:`~ringdilated.core.call.grid.Grid`."""
    if group is None:
        return "", ""
    if isinstance(group, Grid):
        return group.outer.group_name, group.inner.group_name
    return group.group_name, ""  # type: ignore[attr-defined]


def _process_layout(names: Sequence[str]) -> object:
    from torch.distributed import distributed_c10d

    resolve = distributed_c10d._resolve_process_group  # type: ignore[attr-defined]
    groups = [resolve(name) for name in names if name]  # type: ignore[arg-type]
    if not groups:
        return None
    return groups[0] if len(groups) == 1 else Grid(groups[0], groups[1])


def _planned(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SequenceLayout | None,
    stats: TransferStats,
    groups: Sequence[str],
    pattern: tuple[Sequence[int], Sequence[int], str],
    causal: bool,
    window: tuple[int | None, int | None],
    scale: float | None,
    dropout_p: float,
    softcap: float | None,
    kernel: str,
    communicator: str,
    return_lse: bool,
    backward: bool,
    sinks: torch.Tensor | None,
    documents: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> CallPlan:
    """The plan of an op's call (:func:`~ringdilated.core.call.prepare.plan_for`) on ``layout``,
    made (and agreed) anew every call for a one-process call given ``documents`` (``layout=None``)
    or a sharded one on the process-wide layout of whole sequences. Process groups named with
    another layout must be its own (``ValueError`` otherwise, at once, on this rank).
    ``window``: the ops' ``(window_left, window_right)``; ``(None, None)`` is no window (the
    same mask: unbounded on both sides, ``causal`` then bounding the right)."""
    from ringdilated.registry import default_resolver

    if layout is not None and layout is not WHOLE_SEQUENCES and any(groups):
        own = group_names(layout.group)
        if tuple(groups) != own:
            raise ValueError(
                f"process_group {tuple(groups)} contradicts the layout's process group {own} "
                "(group names): build the SequenceLayout on the call's process group"
            )
    arguments: dict[str, object] = {
        "causal": causal,
        "window": None if window == (None, None) else tuple(window),
        "scale": scale,
        "dropout_p": dropout_p,
        "return_lse": return_lse,
        "kernel": kernel,
        "communicator": communicator,
        "transfer_stats": _counted(stats),
        "cu_seqlens": documents[0],
        "key_padding_mask": documents[1],
        "softcap": softcap,
        "sinks": sinks,
    }
    per_call = layout is WHOLE_SEQUENCES and any(groups)
    group, on = (_process_layout(groups), None) if per_call else (None, layout)
    as_lists = (list(pattern[0]), list(pattern[1]), pattern[2])
    return plan_for(as_lists, q, k, v, arguments, default_resolver, group, on, backward=backward)


def _counted(stats: TransferStats) -> TransferStats | None:
    """Where an op's call counts its bytes (``None``: :data:`NO_STATS`, not counted)."""
    return None if stats is NO_STATS else stats


def _fake_out(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *arguments: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    b, length, heads, _ = q.shape
    out = q.new_empty(b, length, heads, v.shape[-1])
    return out, lse_buffer(b, heads, length, accumulation_dtype(q.dtype), q.device)


def _fake_grads(
    dout: torch.Tensor,
    dlse: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor,
    sinks: torch.Tensor | None,
    *a: Any,
) -> tuple[torch.Tensor, ...]:
    """The gradients are contiguous, whatever the strides of the inputs (a fake must give the
    real strides, or inductor's generated code asserts); the sinks' too, or an empty tensor."""
    grads = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    return (*grads, _no_sinks(q) if sinks is None else torch.empty_like(sinks))


def _no_sinks(q: torch.Tensor) -> torch.Tensor:
    """The backward op's sink gradient for a call without sinks (an op returns a tensor)."""
    return q.new_empty(0)


def _define(
    name: str, forward: Callable[..., Any], backward: Callable[..., Any], *tags: torch.Tag
) -> tuple[Any, Any]:
    """The op ``ringdilated::<name>`` running ``forward``, and its backward op
    ``ringdilated::<name>_backward`` running ``backward`` (both kept in :data:`IMPLEMENTATIONS`),
    with their fakes and the op's autograd: the backward op on the saved ``q, k, v, seed,
    sinks, out, lse`` and the op's other arguments but its last (``backward``), first-order
    only."""
    ops = []
    for suffix, function, fake in (("", forward, _fake_out), ("_backward", backward, _fake_grads)):
        qualified = f"ringdilated::{name}{suffix}"
        IMPLEMENTATIONS[qualified] = function
        ops.append(torch.library.custom_op(qualified, mutates_args=(), tags=tags)(function))
        ops[-1].register_fake(fake)
    op, backward_op = ops

    def setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        q, k, v, seed, sinks, *arguments = inputs
        ctx.save_for_backward(q, k, v, seed, sinks, *output)
        ctx.arguments = arguments[:-1]  # all but ``backward``

    def gradients(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> Any:
        q, k, v, seed, sinks, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        *grads, dsinks = backward_op(dout, dlse, q, k, v, out, lse, seed, sinks, *ctx.arguments)
        rest = (None,) * (len(ctx.arguments) + 1)  # the other arguments and ``backward``
        if sinks is None:
            return (*first_order_only(grads, (q, k, v)), None, None, *rest)
        *tied, dsinks = first_order_only((*grads, dsinks), (q, k, v, sinks))
        return (*tied, None, dsinks, *rest)

    op.register_autograd(gradients, setup_context=setup)
    return op, backward_op


_last = threading.local()


def last_plan() -> Any:
    """The plan of the last ``ringdilated::attention`` call on this thread (eager callers show
    it in ``explain()``; a graph has no use for it)."""
    return getattr(_last, "plan", None)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seed: torch.Tensor,
    sinks: torch.Tensor | None,
    layout: SequenceLayout,
    stats: TransferStats,
    group: str,
    inner_group: str,
    segment_lengths: list[int],
    dilation_rates: list[int],
    mode: str,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
    scale: float | None,
    dropout_p: float,
    softcap: float | None,
    kernel: str,
    communicator: str,
    return_lse: bool,
    backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Lq, H, D), lse (B, H, Lq))`` of one call on ``layout`` (see the module
    docstring); everything is checked as an eager call checks it, on every rank."""
    _last.plan = plan = _planned(
        q, k, v, layout, stats, (group, inner_group), (segment_lengths, dilation_rates, mode),
        causal, (window_left, window_right), scale, dropout_p, softcap, kernel, communicator,
        return_lse, backward, sinks,
    )  # fmt: skip
    return execute(plan, q, k, v, _counted(stats), seed=seed, sinks=sinks)


def _attention_backward(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor,
    sinks: torch.Tensor | None,
    layout: SequenceLayout,
    stats: TransferStats,
    group: str,
    inner_group: str,
    segment_lengths: list[int],
    dilation_rates: list[int],
    mode: str,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
    scale: float | None,
    dropout_p: float,
    softcap: float | None,
    kernel: str,
    communicator: str,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsinks)`` of :func:`_attention` (the same plan, the same masks)."""
    plan = _planned(
        q, k, v, layout, stats, (group, inner_group), (segment_lengths, dilation_rates, mode),
        causal, (window_left, window_right), scale, dropout_p, softcap, kernel, communicator,
        return_lse, True, sinks,
    )  # fmt: skip
    dlse = dlse if return_lse else None
    *grads, dsinks = execute_backward(
        plan, dout, dlse, q, k, v, out, lse, seed, _counted(stats), sinks
    )
    return (*grads, _no_sinks(q) if dsinks is None else dsinks)  # type: ignore[return-value]


attention_op, attention_backward_op = (
    _define("attention", _attention, _attention_backward) if OP_SUPPORTED else (None, None)
)


def _shard_positions(
    layout: SequenceLayout, batch: int, shard_length: int, device: torch.device
) -> torch.Tensor:
    """``(batch, shard_length)`` int64: this rank's positions, each counted from its
    document's start (:meth:`~ringdilated.SequenceLayout.shard_positions`, a fresh copy)."""
    positions = layout.shard_positions(device, shard_length)
    return positions.expand(batch, shard_length).clone()


def _define_positions_op() -> Any:
    IMPLEMENTATIONS["ringdilated::shard_positions"] = _shard_positions
    op = torch.library.custom_op("ringdilated::shard_positions", mutates_args=())(_shard_positions)

    @op.register_fake
    def _(layout: Any, batch: int, shard_length: int, device: torch.device) -> torch.Tensor:
        return torch.empty((batch, shard_length), dtype=torch.int64, device=device)

    return op


_positions_op = _define_positions_op() if OP_SUPPORTED else None


def shard_positions(
    layout: SequenceLayout, batch: int, shard_length: int, device: torch.device
) -> torch.Tensor:
    """This rank's rotary positions on ``layout``, ``(batch or 1, shard_length)``: the layout's
    own (made once per device) in eager mode; under ``torch.compile``, an op that reads them
    from the layout (an opaque graph input)."""
    if torch.compiler.is_compiling() and _positions_op is not None:
        return _positions_op(layout, batch, shard_length, device)  # type: ignore[no-any-return]
    return layout.shard_positions(device, shard_length)


def _dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seed: torch.Tensor,
    sinks: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    segment_lengths: list[int],
    dilation_rates: list[int],
    mode: str,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
    scale: float,
    dropout_p: float,
    softcap: float | None,
    kernel: str,
    backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Lq, H, D), lse (B, H, Lq))`` of one single-process call. The documents and
    padding, which need their values, are read and checked here (before any work), every call,
    as in an eager call without a layout."""
    plan = _planned(
        q, k, v, None, NO_STATS, ("", ""), (segment_lengths, dilation_rates, mode), causal,
        (window_left, window_right), scale, dropout_p, softcap, kernel, "auto", False, backward,
        sinks,
        (cu_seqlens, key_padding_mask),
    )  # fmt: skip
    return execute(plan, q, k, v, seed=seed, sinks=sinks)


def _dilated_attention_backward(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor,
    sinks: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    segment_lengths: list[int],
    dilation_rates: list[int],
    mode: str,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
    scale: float,
    dropout_p: float,
    softcap: float | None,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsinks)`` of :func:`dilated_attention_op` (the same kernel, the same
    masks).

    The op always returns the lse, so autograd hands this backward a ``dlse`` of zeros whenever
    the lse's gradient is not used: the lse pass (one more kernel backward per block, or the
    kernel's ``backward_with_lse`` in place of its backward) then runs only when ``dlse`` has a
    nonzero entry (read on the host: this op reads it anyway)."""
    plan = _planned(
        q, k, v, None, NO_STATS, ("", ""), (segment_lengths, dilation_rates, mode), causal,
        (window_left, window_right), scale, dropout_p, softcap, kernel, "auto", False, True,
        sinks,
        (cu_seqlens, key_padding_mask),
    )  # fmt: skip
    dlse = dlse if dlse is not None and bool(dlse.any()) else None
    *grads, dsinks = execute_backward(plan, dout, dlse, q, k, v, out, lse, seed, sinks=sinks)
    return (*grads, _no_sinks(q) if dsinks is None else dsinks)  # type: ignore[return-value]


dilated_attention_op, dilated_attention_backward_op = _define(
    "dilated_attention", _dilated_attention, _dilated_attention_backward, torch.Tag.cudagraph_unsafe
)
