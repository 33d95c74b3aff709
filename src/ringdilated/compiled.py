"""The single-process call as a ``torch.library`` custom op, so ``torch.compile`` sees one opaque
node with a fake (shape-only) implementation and registered gradients, never a graph break.

:func:`ringdilated.functional.attend` routes here while ``torch.compiler.is_compiling()`` and
the call is single-process; eager calls keep the ``autograd.Function`` path. Both run the same
driver, so results are identical. The op re-resolves its kernel from its arguments (a cached
lookup), so the compiled graph holds no Python objects; the dropout seed is a tensor drawn in
the graph, so each compiled call draws new masks without recompiling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringdilated.core.accumulator import accumulation_dtype
from ringdilated.core.call import CallOptions, prepare_call
from ringdilated.core.driver import CallState, Run, as_lse_layout, first_order_only, lse_buffer
from ringdilated.core.dtypes import autocast_off

__all__ = ["dilated_attention_backward_op", "dilated_attention_op"]


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seed: torch.Tensor,
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
    """The op's :class:`Run`, from the same :func:`~ringdilated.core.call.prepare_call` as the
    eager path (re-validating costs microseconds; the resolution is a cached lookup)."""
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


@torch.library.custom_op("ringdilated::dilated_attention", mutates_args=())
def dilated_attention_op(
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
    """``(out (B, Lq, H, D), lse (B, H, Lq))`` of one single-process call. The arguments the
    caller's traced code could check are checked; the documents and padding, which need their
    values, are checked here (before any work), as in an eager call."""
    run = _run(
        q,
        k,
        v,
        seed,
        cu_seqlens,
        key_padding_mask,
        segment_lengths,
        dilation_rates,
        mode,
        causal,
        scale,
        dropout_p,
        kernel,
        backward,
    )
    with autocast_off(q.device.type):
        return run.forward(
            q.contiguous(), k.contiguous(), v.contiguous(), CallState(int(seed.item()))
        )


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


@torch.library.custom_op("ringdilated::dilated_attention_backward", mutates_args=())
def dilated_attention_backward_op(
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
    only when ``dlse`` has a nonzero entry. Skipping it for zeros is exact."""
    run = _run(
        q,
        k,
        v,
        seed,
        cu_seqlens,
        key_padding_mask,
        segment_lengths,
        dilation_rates,
        mode,
        causal,
        scale,
        dropout_p,
        kernel,
        True,
    )
    if dlse is not None and not bool(dlse.any()):
        dlse = None
    with autocast_off(q.device.type):
        return run.backward(
            dout.contiguous(),
            None if dlse is None else as_lse_layout(dlse.to(lse.dtype)),
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            out,
            as_lse_layout(lse),
            CallState(int(seed.item())),
        )


@dilated_attention_backward_op.register_fake
def _fake_backward(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:
    q, k, v, seed, out, lse = ctx.saved_tensors
    params = ctx.params[:-1]  # all but ``backward``
    grads = dilated_attention_backward_op(
        torch.zeros_like(out) if dout is None else dout,
        dlse,
        q,
        k,
        v,
        out,
        lse,
        seed,
        *ctx.layout,
        *params,
    )
    return (*first_order_only(grads, (q, k, v)), *(None,) * 11)


dilated_attention_op.register_autograd(_backward, setup_context=_setup_context)
