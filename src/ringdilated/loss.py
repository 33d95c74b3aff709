"""A loss over sequence shards that equals the one-process mean: :func:`sharded_cross_entropy`
and :func:`token_weighted_mean`.

Each rank of a sequence-parallel group holds some of a batch's tokens, and not the same number
of counted ones (``ignore_index`` labels, padding, uneven shards). The mean over the batch is the
sum of every rank's per-token losses divided by the count of every rank's counted tokens; the
mean of the ranks' own means is not it. Both functions return, on every rank:

- the **value** of the one-process mean over every counted token of the group's batch (for
  logging: no further ``all_reduce``); and
- a **gradient** that reaches this rank's own per-token losses as if the loss were
  ``averaged_over * local_sum / global_count``: summed over the ranks of ``process_group``, the
  parameters' gradients are the one-process gradient (times ``averaged_over``).

So sum the parameter gradients over the group (``all_reduce``, or a wrapper that sums), or let
a data-parallel wrapper average them and pass ``averaged_over`` = the number of ranks it
averages over, with ``process_group`` = the ranks whose tokens form the mean:

- FSDP2 or DDP over every rank of a ``dp x cp`` mesh, the mean over the whole global batch
  (token-weighted across the data-parallel ranks too): ``process_group`` = all its ranks
  (``dist.group.WORLD``, or ``(mesh, ("dp", "cp"))``), ``averaged_over = mesh.size()``;
- the same wrapper, each data-parallel replica's own mean, averaged over the replicas:
  ``process_group = (mesh, "cp")``, ``averaged_over = mesh["cp"].size()``;
- sequence parallelism alone, gradients summed by hand (examples/train_tiny.py):
  ``process_group`` = the sequence group, ``averaged_over = 1``.

The value and the count travel in one ``all_reduce`` of two float64 numbers on the loss's
device (counts are exact below 2**53), which also runs when ``total_count`` is given; nothing is
read on the host. Why not ``torch.distributed.nn.functional.all_reduce`` of the loss: its
backward all-reduces the incoming gradient, so each of ``P`` ranks calling ``backward()`` on the
reduced loss gives its own tokens ``P`` times their share (torch 2.13,
``torch/distributed/nn/functional.py``, ``_AllReduce.backward``): the summed gradients would be
``P`` times the one-process gradient.

A batch with no counted token has the value ``nan`` (``0 / 0``, as ``F.cross_entropy``'s
``reduction="mean"`` gives) and zero gradients (as that mean's backward gives).

These are collectives: every rank of ``process_group`` calls them together. Bad arguments raise
``TypeError``/``ValueError`` on their own rank only (checking them together would cost a host
read per step), and its peers wait in the ``all_reduce`` until the backend's timeout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ringdilated.core.call import grid, safe_repr

__all__ = ["sharded_cross_entropy", "token_weighted_mean"]


def sharded_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    process_group: object = None,
    *,
    ignore_index: int = -100,
    total_count: int | torch.Tensor | None = None,
    averaged_over: int = 1,
) -> torch.Tensor:
    """The mean cross-entropy over every label of the group's batch that is not
    ``ignore_index`` (see the module docstring for the value, the gradient and
    ``averaged_over``).

    ``logits``: ``(..., V)`` floating, this rank's; float16 and bfloat16 logits are upcast to
    float32 here (as transformers' ``ForCausalLMLoss`` does: a float16 sum overflows past 65504,
    a bfloat16 one loses 0.5% at 8k tokens), which holds a float32 copy of them and of their
    log-softmax; the value is float32 then. ``labels``: int64 of ``logits.shape[:-1]``, already
    shifted (:attr:`BatchShard.labels <ringdilated.BatchShard.labels>`).
    ``total_count``: the count to divide by when it is known beforehand, for gradient
    accumulation: the sum of every micro-batch's :attr:`BatchShard.batch_token_count
    <ringdilated.BatchShard.batch_token_count>` (shifted labels counted over the group), summed
    over the data-parallel ranks too when the loss group spans them. It must be the same on
    every rank (it is not checked). transformers' ``num_items_in_batch`` counts unshifted labels
    and is not this number. Default: this call's count, all-reduced."""
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(
            f"logits and labels must be torch.Tensors, got {type(logits).__name__} and "
            f"{type(labels).__name__}"
        )
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits must be a floating tensor, got {logits.dtype}")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be an int64 tensor (class indices), got {labels.dtype}")
    if logits.dim() < 1 or labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have logits' shape without its last (class) dimension, "
            f"{tuple(logits.shape[:-1])}, got {tuple(labels.shape)}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {safe_repr(ignore_index)}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    local_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    count = labels.ne(ignore_index).sum()
    return token_weighted_mean(
        local_sum, count, process_group, total_count=total_count, averaged_over=averaged_over
    )


def token_weighted_mean(
    local_sum: torch.Tensor,
    local_count: int | torch.Tensor,
    process_group: object = None,
    *,
    total_count: int | torch.Tensor | None = None,
    averaged_over: int = 1,
) -> torch.Tensor:
    """``sum(local_sum) / sum(local_count)`` over the ranks of ``process_group``, for any
    per-token loss: ``local_sum`` a 0-d floating tensor (this rank's per-token losses summed),
    ``local_count`` the tokens it counts (an int or a 0-d integer tensor); divided by
    ``total_count`` instead when given. The value and the gradient: see the module docstring.
    ``process_group`` takes what :class:`~ringdilated.SequenceLayout` takes (a 2-D layout
    reduces over all its ranks)."""
    group = grid.as_process_group(process_group)
    ranks = grid.group_size(group)
    if not isinstance(local_sum, torch.Tensor) or local_sum.dim() != 0:
        raise ValueError(f"local_sum must be a 0-d tensor, got {_shape(local_sum)}")
    if not local_sum.dtype.is_floating_point:
        raise TypeError(f"local_sum must be a floating tensor, got {local_sum.dtype}")
    if isinstance(averaged_over, bool) or not isinstance(averaged_over, int) or averaged_over < 1:
        raise ValueError(
            f"averaged_over must be a positive int (the ranks a wrapper averages gradients "
            f"over), got {safe_repr(averaged_over)}"
        )
    device = local_sum.device
    packed = torch.stack(
        [
            local_sum.detach().to(torch.float64),
            _count("local_count", local_count, device),
        ]
    )
    if ranks > 1:
        _all_reduce(group, packed)  # type: ignore[arg-type]
    total, count = packed.unbind()
    if total_count is not None:
        count = _count("total_count", total_count, device)
    return _TokenMean.apply(local_sum, total, count, averaged_over)  # type: ignore[no-untyped-call,no-any-return]


class _TokenMean(torch.autograd.Function):
    """Forward: ``total / count`` in ``local_sum``'s dtype, float32 at least. Backward: the
    incoming gradient times ``averaged_over / count`` (kept in float64: a token count's
    reciprocal in float16 rounds to 0 past about 3e7) to ``local_sum``, in its dtype (0 when
    ``count`` is 0)."""

    @staticmethod
    def forward(
        ctx: Any,
        local_sum: torch.Tensor,
        total: torch.Tensor,
        count: torch.Tensor,
        averaged_over: int,
    ) -> torch.Tensor:
        scale = torch.where(count > 0, averaged_over / count, 0.0)
        ctx.save_for_backward(scale)
        ctx.dtype = local_sum.dtype
        return (total / count).to(torch.promote_types(local_sum.dtype, torch.float32))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (scale,) = ctx.saved_tensors
        return (grad.to(scale.dtype) * scale).to(ctx.dtype), None, None, None


def _count(name: str, value: object, device: torch.device) -> torch.Tensor:
    """A non-negative count as a 0-d float64 tensor on ``device`` (not read on the host)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(
                f"{name} must be an int or a 0-d integer tensor, got {value.dtype} of shape "
                f"{tuple(value.shape)}"
            )
        return value.detach().to(device=device, dtype=torch.float64)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {safe_repr(value)}")
    # A fill on the device, not a copy from the host (which would wait for the stream).
    return torch.full((), float(value), dtype=torch.float64, device=device)


def _all_reduce(layout: dist.ProcessGroup | grid.Grid, tensor: torch.Tensor) -> None:
    """Sum ``tensor`` in place over every rank of ``layout`` (a grid: along both dimensions)."""
    if isinstance(layout, grid.Grid):
        dist.all_reduce(tensor, group=layout.inner)
        dist.all_reduce(tensor, group=layout.outer)
    else:
        dist.all_reduce(tensor, group=layout)


def _shape(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    return type(value).__name__
