"""Common mistakes on a process group, run on every rank of a gloo pool (``Workers``): each task
reports, per rank, what the call raised or warned."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from tests.fault_tasks import caught_as

__all__ = [
    "empty_shard_on_layout",
    "nccl_without_set_device",
    "one_process_call_beside_a_group",
]


def _outcome(call: Any) -> dict[str, Any]:
    try:
        call()
    except Exception as exc:
        return {"raised": caught_as(exc), "message": str(exc)}
    return {"raised": None, "message": ""}


def empty_shard_on_layout(payload: dict[str, Any]) -> dict[str, Any]:
    """Rank ``payload['rank']`` passes an empty shard to a call on a
    :class:`~ringdilated.SequenceLayout` of the group (``payload['shard_length']``: every rank's
    given shard length, or ``None``: equal shards)."""
    import ringdilated

    rank = dist.get_rank()
    n = 0 if rank == payload["rank"] else 8
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    layout = ringdilated.SequenceLayout(
        process_group=dist.group.WORLD, shard_length=payload["shard_length"]
    )
    return _outcome(lambda: ringdilated.dilated_attention(q, k, v, [16], [1], layout=layout))


def one_process_call_beside_a_group(payload: dict[str, Any]) -> list[str]:
    """A one-process call (``process_group=None``) with ``WORLD_SIZE`` set, torch.distributed
    initialised: the warnings it gave (none expected: running alone is then a choice)."""
    import ringdilated

    before = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            q = torch.randn(1, 8, 2, 8)
            layout = ringdilated.SequenceLayout()  # a fresh one: the call is planned anew
            ringdilated.dilated_attention(q, q, q, [8], [1], layout=layout)
    finally:
        if before is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = before
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def nccl_without_set_device(payload: dict[str, Any]) -> dict[str, Any]:
    """Every rank holds its tensors on ``cuda:<rank>`` (FakeTensor ``cuda`` tensors: no GPU here)
    while ``cuda:0`` is current on every rank (``torch.cuda.set_device`` never called), on the
    world group read as ``"cpu:gloo,cuda:nccl"`` (CUDA tensors through NCCL; the gloo part runs
    the agreement, as on a real group of that backend)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import ringdilated

    rank = dist.get_rank()
    saved = (
        dist.get_backend,
        torch.cuda.current_device,
        os.environ.get("RINGDILATED_COMPUTE_CAPABILITY"),
    )
    dist.get_backend = lambda group=None: "cpu:gloo,cuda:nccl"  # type: ignore[assignment]
    torch.cuda.current_device = lambda: 0
    os.environ["RINGDILATED_COMPUTE_CAPABILITY"] = "8.0"  # rank 0 resolves a kernel for its call
    ringdilated.default_resolver.cache_clear()  # read when the default resolver is built
    try:
        with FakeTensorMode():
            q = torch.empty(1, 8, 2, 8, device=f"cuda:{rank}")
        world = dist.group.WORLD
        return _outcome(
            lambda: ringdilated.dilated_attention(q, q, q, [8], [1], process_group=world)
        )
    finally:
        dist.get_backend, torch.cuda.current_device = saved[0], saved[1]  # type: ignore[assignment]
        if saved[2] is None:
            del os.environ["RINGDILATED_COMPUTE_CAPABILITY"]
        else:
            os.environ["RINGDILATED_COMPUTE_CAPABILITY"] = saved[2]
        ringdilated.default_resolver.cache_clear()
