"""Dilated attention as ``torch.library`` custom ops: one opaque node for ``torch.compile``, for
selective activation checkpointing and for CUDA graphs.

- ``ringdilated::attention`` (backward: ``ringdilated::attention_backward``): a call on a
  :class:`~ringdilated.SequenceLayout`, which the op takes as an opaque argument
  (:mod:`ringdilated.core.support.opaque`): a new layout per batch reuses the compiled graph. The
  op finds the call's plan on the layout (made, and agreed on a process group, at the layout's first
  call
  with that signature) and runs it: on a layout in steady state it reads nothing on the host, so
  CUDA graphs may capture it. Sharded calls take this op in eager mode too, so a selective
  activation-checkpointing policy can keep its output by name (``torch.ops.ringdilated.
  attention.default``) instead of running its exchanges again. A sharded call without a layout
  passes the names of its process groups instead, and the op plans (and agrees on) each call.
- ``ringdilated::dilated_attention`` (backward: ``ringdilated::dilated_attention_backward``): a
  one-process call given ``cu_seqlens`` or ``key_padding_mask`` tensors under ``torch.compile``;
  it reads their values on the host every call (tagged ``torch.Tag.cudagraph_unsafe``): pass a
  layout instead.

Both re-find their plan from their arguments (a cached lookup), so a graph holds no Python state
but the layout; the dropout seed is a tensor drawn in the graph, so each call draws new masks
without recompiling (reading it is one read of a CPU scalar, never of the device).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringdilated.core import TransferStats, accumulation_dtype
from ringdilated.core.call import (
    WHOLE_SEQUENCES,
    CallOptions,
    Grid,
    SequenceLayout,
    operands,
    plan_for,
    prepare_call,
)
from ringdilated.core.run import (
    BackwardInputs,
    CallState,
    Run,
    as_lse_layout,
    first_order_only,
    lse_buffer,
)
from ringdilated.core.select import autocast_off
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
    layout: SequenceLayout,
    stats: TransferStats,
    groups: Sequence[str],
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    mode: str,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    kernel: str,
    communicator: str,
    return_lse: bool,
    backward: bool,
) -> Any:
    """The plan of an ``attention`` op's call (see :func:`~ringdilated.core.call.prepare.plan_for`):
    on ``layout``, or, for the process-wide layout of whole sequences given process groups, a
    call that plans (and agrees) by itself. Process groups named with another layout must be
    its own (``ValueError`` otherwise, at once, on this rank)."""
    from ringdilated.registry import default_resolver

    if layout is not WHOLE_SEQUENCES and any(groups):
        own = group_names(layout.group)
        if tuple(groups) != own:
            raise ValueError(
                f"process_group {tuple(groups)} contradicts the layout's process group {own} "
                "(group names): build the SequenceLayout on the call's process group"
            )
    arguments: dict[str, object] = {
        "causal": causal,
        "scale": scale,
        "dropout_p": dropout_p,
        "return_lse": return_lse,
        "kernel": kernel,
        "communicator": communicator,
        "transfer_stats": None if stats is NO_STATS else stats,
        "cu_seqlens": None,
        "key_padding_mask": None,
    }
    per_call = layout is WHOLE_SEQUENCES and any(groups)
    return plan_for(
        (list(segment_lengths), list(dilation_rates), mode),
        q,
        k,
        v,
        arguments,
        default_resolver,
        _process_layout(groups) if per_call else None,
        None if per_call else layout,
        backward=backward,
    )


def _gradients(
    backward_op: Any,
    ctx: Any,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
    arguments: tuple[Any, ...],
    others: int,
) -> tuple[Any, ...]:
    """An op's autograd backward: its backward op on the saved ``q, k, v, seed, out, lse`` and
    ``arguments``, first-order only; ``None`` for the ``others`` non-tensor inputs."""
    q, k, v, seed, out, lse = ctx.saved_tensors
    grads = backward_op(
        torch.zeros_like(out) if dout is None else dout, dlse, q, k, v, out, lse, seed, *arguments
    )
    return (*first_order_only(grads, (q, k, v)), *(None,) * others)


def _contiguous_like(x: torch.Tensor) -> torch.Tensor:
    """What the ops' gradients are: contiguous, whatever the strides of the input (a fake must
    give the real strides, or inductor's generated code asserts)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_last = threading.local()


def last_plan() -> Any:
    """The plan of the last ``ringdilated::attention`` call on this thread (eager callers show
    it in ``explain()``; a graph has no use for it)."""
    return getattr(_last, "plan", None)


def _state(plan: Any, seed: torch.Tensor, stats: TransferStats) -> CallState:
    drawn = int(seed.item()) if plan.dropout_p > 0.0 else 0
    return CallState(drawn, None if stats is NO_STATS else stats, plan.lse_used, True)


def _define_attention_ops() -> tuple[Any, Any]:
    """``ringdilated::attention`` and its backward (torch with opaque types only)."""

    def attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seed: torch.Tensor,
        layout: SequenceLayout,
        stats: TransferStats,
        group: str,
        inner_group: str,
        segment_lengths: list[int],
        dilation_rates: list[int],
        mode: str,
        causal: bool,
        scale: float | None,
        dropout_p: float,
        kernel: str,
        communicator: str,
        return_lse: bool,
        backward: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (B, Lq, H, D), lse (B, H, Lq))`` of one call on ``layout`` (see the module
        docstring); everything is checked as an eager call checks it, on every rank."""
        plan = _planned(
            q, k, v, layout, stats, (group, inner_group), segment_lengths, dilation_rates, mode,
            causal, scale, dropout_p, kernel, communicator, return_lse, backward,
        )  # fmt: skip
        _last.plan = plan
        q, k, v = operands(q, k, v)
        with autocast_off(q.device.type):
            out, lse = plan.forward(q, k, v, _state(plan, seed, stats))
        return out, as_lse_layout(lse)

    IMPLEMENTATIONS["ringdilated::attention"] = attention
    attention = torch.library.custom_op("ringdilated::attention", mutates_args=())(attention)

    @attention.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any) -> Any:
        b, length, heads, _ = q.shape
        out = q.new_empty(b, length, heads, v.shape[-1])
        return out, lse_buffer(b, heads, length, accumulation_dtype(q.dtype), q.device)

    def attention_backward(
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        seed: torch.Tensor,
        layout: SequenceLayout,
        stats: TransferStats,
        group: str,
        inner_group: str,
        segment_lengths: list[int],
        dilation_rates: list[int],
        mode: str,
        causal: bool,
        scale: float | None,
        dropout_p: float,
        kernel: str,
        communicator: str,
        return_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of :func:`attention` (the same plan, the same masks)."""
        plan = _planned(
            q, k, v, layout, stats, (group, inner_group), segment_lengths, dilation_rates, mode,
            causal, scale, dropout_p, kernel, communicator, return_lse, True,
        )  # fmt: skip
        q, k, v = operands(q, k, v)
        with autocast_off(q.device.type):
            dlse = None if dlse is None or not return_lse else as_lse_layout(dlse.to(lse.dtype))
            inputs = BackwardInputs(
                dout.contiguous(), dlse, q, k, v, out.contiguous(), as_lse_layout(lse)
            )
            grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = plan.backward(
                inputs, _state(plan, seed, stats)
            )
        return grads

    IMPLEMENTATIONS["ringdilated::attention_backward"] = attention_backward
    attention_backward = torch.library.custom_op(
        "ringdilated::attention_backward", mutates_args=()
    )(attention_backward)

    @attention_backward.register_fake
    def _(
        dout: torch.Tensor, dlse: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *a: Any
    ) -> Any:
        return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v)

    def setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        q, k, v, seed, layout, stats, group, inner_group, *params = inputs
        ctx.save_for_backward(q, k, v, seed, *output)
        ctx.objects = (layout, stats, group, inner_group)
        ctx.params = params[:-1]  # all but ``backward``

    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> Any:
        return _gradients(attention_backward, ctx, dout, dlse, (*ctx.objects, *ctx.params), 15)

    attention.register_autograd(backward, setup_context=setup)
    return attention, attention_backward


attention_op, attention_backward_op = _define_attention_ops() if OP_SUPPORTED else (None, None)


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


# The one-process op of calls given cu_seqlens / key_padding_mask tensors under torch.compile.


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    mode: str,
    causal: bool,
    scale: float,
    dropout_p: float,
    kernel: str,
    backward: bool,
) -> Run:
    """The op's :class:`Run`, from the same :func:`~ringdilated.core.call.prepare.prepare_call` as
    the eager path (re-validating costs microseconds; the resolution is a cached lookup)."""
    from ringdilated.registry import default_resolver

    options = CallOptions(
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        kernel=kernel,
        cu_seqlens=cu_seqlens,
        key_padding_mask=key_padding_mask,
    )
    plan = prepare_call(
        (segment_lengths, dilation_rates, mode),
        q,
        k,
        v,
        options,
        default_resolver(),
        backward=backward,
    )
    return plan.run(q, k)


def _dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seed: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    segment_lengths: list[int],
    dilation_rates: list[int],
    mode: str,
    causal: bool,
    scale: float,
    dropout_p: float,
    kernel: str,
    backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Lq, H, D), lse (B, H, Lq))`` of one single-process call. The documents and
    padding, which need their values, are read and checked here (before any work), every call,
    as in an eager call without a layout."""
    run = _run(
        q, k, v, cu_seqlens, key_padding_mask, segment_lengths, dilation_rates, mode, causal,
        scale, dropout_p, kernel, backward,
    )  # fmt: skip
    with autocast_off(q.device.type):
        seed_value = int(seed.item()) if dropout_p > 0.0 else 0
        return run.forward(*operands(q, k, v), CallState(seed_value))


IMPLEMENTATIONS["ringdilated::dilated_attention"] = _dilated_attention
dilated_attention_op = torch.library.custom_op(
    "ringdilated::dilated_attention", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)(_dilated_attention)


@dilated_attention_op.register_fake
def _fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: torch.Tensor, *args: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    b, length, heads, _ = q.shape
    out = q.new_empty(b, length, heads, v.shape[-1])
    return out, lse_buffer(b, heads, length, accumulation_dtype(q.dtype), q.device)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    q, k, v, seed, cu_seqlens, key_padding_mask, *params = inputs
    ctx.save_for_backward(q, k, v, seed, *output)
    ctx.layout = (cu_seqlens, key_padding_mask)
    ctx.params = params


def _dilated_attention_backward(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    segment_lengths: list[int],
    dilation_rates: list[int],
    mode: str,
    causal: bool,
    scale: float,
    dropout_p: float,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`dilated_attention_op` (the same kernel, the same masks).

    The op always returns the lse, so autograd hands this backward a ``dlse`` of zeros whenever
    the lse's gradient is not used: the lse pass (one more kernel backward per block) then runs
    only when ``dlse`` has a nonzero entry (read on the host: this op reads it anyway)."""
    run = _run(
        q, k, v, cu_seqlens, key_padding_mask, segment_lengths, dilation_rates, mode, causal,
        scale, dropout_p, kernel, True,
    )  # fmt: skip
    if dlse is not None and not bool(dlse.any()):
        dlse = None
    q, k, v = operands(q, k, v)
    with autocast_off(q.device.type):
        dlse = None if dlse is None else as_lse_layout(dlse.to(lse.dtype))
        inputs = BackwardInputs(dout.contiguous(), dlse, q, k, v, out, as_lse_layout(lse))
        return run.backward(inputs, CallState(int(seed.item()) if dropout_p > 0.0 else 0))


IMPLEMENTATIONS["ringdilated::dilated_attention_backward"] = _dilated_attention_backward
dilated_attention_backward_op = torch.library.custom_op(
    "ringdilated::dilated_attention_backward",
    mutates_args=(),
    tags=(torch.Tag.cudagraph_unsafe,),
)(_dilated_attention_backward)


@dilated_attention_backward_op.register_fake
def _fake_backward(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v)


def _backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:
    arguments = (*ctx.layout, *ctx.params[:-1])  # all params but ``backward``
    return _gradients(dilated_attention_backward_op, ctx, dout, dlse, arguments, 11)


dilated_attention_op.register_autograd(_backward, setup_context=_setup_context)
