"""Tasks for the compile and checkpointing tests of sharded calls, run on every rank of a gloo
pool (``Workers``)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["compiled_module_on_a_group", "selective_checkpointing"]

SEGMENTS, RATES = [8, 16], [1, 2]


def _inputs(seed: int, world: int, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, 8 * world, 4, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    shard = slice(8 * rank, 8 * (rank + 1))
    return full, [x[:, shard].clone().requires_grad_() for x in full]


def compiled_module_on_a_group(payload: dict[str, Any]) -> dict[str, Any]:
    """A ``DilatedAttention`` on the world group compiled with ``fullgraph=True``: one call
    without a layout, then three with a new ``SequenceLayout`` each. Returns every call's
    output and gradients, their full inputs, and dynamo's counts."""
    import ringdilated

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    attn = ringdilated.DilatedAttention(
        SEGMENTS, RATES, causal=True, process_group=dist.group.WORLD,
        communicator=payload["communicator"],
    )  # fmt: skip
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    calls = []
    for i, bounds in enumerate((None, [0, 8 * world], [0, 5, 8 * world], [0, 3, 13, 8 * world])):
        full, (q, k, v) = _inputs(i, world, rank)
        if bounds is None:
            out = compiled(q, k, v)
        else:
            layout = ringdilated.SequenceLayout(
                cu_seqlens=torch.tensor(bounds), process_group=dist.group.WORLD
            )
            out = compiled(q, k, v, layout=layout)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        calls.append({"bounds": bounds, "out": out.detach(), "grads": grads, "full": full})
    counters = torch._dynamo.utils.counters
    return {
        "calls": calls,
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": dict(counters["graph_break"]),
    }


def selective_checkpointing(payload: dict[str, Any]) -> dict[str, Any]:
    """The backward of a sharded call under non-reentrant checkpointing, three ways: not
    checkpointed, checkpointed, and checkpointed with a selective policy that saves
    ``ringdilated::attention``'s output by name. Returns the exchanges each backward made and
    each way's gradients."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    import ringdilated
    from ringdilated.testing.hot_path import HotPathCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    layout = ringdilated.SequenceLayout(process_group=dist.group.WORLD, agree_every_call=False)

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = ringdilated.dilated_attention(q, k, v, SEGMENTS, RATES, causal=True, layout=layout)
        return (out * out).sum()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is torch.ops.ringdilated.attention.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    ways = {
        "plain": block,
        "checkpointed": functools.partial(checkpoint, block, use_reentrant=False),
        "selective": functools.partial(
            checkpoint,
            block,
            use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, policy),
        ),
    }
    result: dict[str, Any] = {}
    block(*_inputs(0, world, rank)[1]).backward()  # plans the call
    for name, way in ways.items():
        _, inputs = _inputs(1, world, rank)
        loss = way(*inputs)
        with HotPathCounter() as counts:
            loss.backward()
        result[name] = {"exchanges": counts.exchanges, "grads": [x.grad for x in inputs]}
    return result
