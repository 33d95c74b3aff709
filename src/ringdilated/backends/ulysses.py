"""The ``ulysses`` communicator: head parallelism by all-to-all (DeepSpeed Ulysses' scheme).

Each rank gives every peer its shard of the peer's heads and receives every position of its own
share of the heads (:mod:`ringdilated.core.run.head_parallel`), in one ``all_to_all_single`` with
split sizes (gloo's list ``all_to_all`` takes equal sizes only; NCCL takes both), then attends its
heads over the whole sequence with no crossing segments, and a second all-to-all returns the
results. Heads are dealt so that every rank gets the same work
(:func:`~ringdilated.core.plan.heads.deal_heads`). It needs at least one query head per rank.

CPU tensors (gloo) move by point-to-point ``isend``/``irecv`` instead of the collective, the same
bytes: gloo runs a collective on a worker thread of its own, which keeps the collective's
tensors until it drops its handle, just after the wait returns; when that thread holds the last
handle, it takes the GIL to free the tensors' Python objects, and if the interpreter is exiting
by then, Python ends the thread inside a C++ destructor and the process aborts ("terminate
called without an active exception", issue 21). Point-to-point works hold their tensors only in
the caller's handles, so every tensor is freed on the calling thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from ringdilated.backends.ringpass import NothingToPrepare, Works, point_to_point
from ringdilated.core import (
    CommunicatorSpec,
    KeyWindow,
    Pending,
    ShardPlan,
    every_peer_at_once,
    process_group,
)

__all__ = ["ULYSSES_SPEC", "UlyssesCommunicator", "all_to_all"]


class _Unpacked:
    """An all_to_all in flight; on ``wait()`` its output is copied into the receive buffers."""

    def __init__(self, work: object, output: torch.Tensor, recvs: Mapping[int, torch.Tensor]):
        self.work, self.output, self.recvs = work, output, recvs

    def wait(self) -> None:
        self.work.wait()  # type: ignore[attr-defined]
        sizes = [t.numel() for t in self.recvs.values()]
        for buffer, part in zip(self.recvs.values(), torch.split(self.output, sizes), strict=True):
            buffer.copy_(part.view(buffer.shape))


def all_to_all(
    group: object, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]
) -> Pending:
    """One ``all_to_all_single`` with split sizes: ``sends[peer]`` to each peer, ``recvs[peer]``
    from each (flat tensors of one dtype; a peer absent from a mapping exchanges nothing). CPU
    tensors move point to point instead (see the module's docstring): never through a gloo
    worker thread."""
    pg = process_group(group)
    world = dist.get_world_size(pg)
    sample = next(iter((*sends.values(), *recvs.values())))
    if sample.device.type == "cpu":
        return _point_to_point(pg, sends, recvs)
    empty = sample.new_empty(0)
    send_list = [sends.get(p, empty).reshape(-1) for p in range(world)]
    ordered = {p: recvs[p] for p in range(world) if p in recvs}
    output = sample.new_empty(sum(t.numel() for t in ordered.values()))
    work = dist.all_to_all_single(
        output,
        torch.cat(send_list),
        output_split_sizes=[recvs[p].numel() if p in recvs else 0 for p in range(world)],
        input_split_sizes=[t.numel() for t in send_list],
        group=pg,
        async_op=True,
    )
    return _Unpacked(work, output, ordered)


def _point_to_point(
    pg: dist.ProcessGroup | None,
    sends: Mapping[int, torch.Tensor],
    recvs: Mapping[int, torch.Tensor],
) -> Works:
    """The all-to-all as ``isend``/``irecv`` pairs; this rank's part to itself is copied."""
    me = dist.get_rank(pg)
    if me in recvs and me in sends:
        recvs[me].copy_(sends[me].reshape(-1))
    peers_sends = {p: t.reshape(-1) for p, t in sends.items() if p != me}
    peers_recvs = {p: t for p, t in recvs.items() if p != me}
    return point_to_point(pg, peers_sends, peers_recvs)


class UlyssesCommunicator(NothingToPrepare):
    """Head parallelism (its spec's ``parallelism="heads"``): every peer in one step, moved by
    one all_to_all."""

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        return every_peer_at_once(rank, world_size)

    def exchange(
        self,
        group: object,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, torch.Tensor],
        uniform: bool = False,
    ) -> Pending:
        if not (sends or recvs):
            return Works(())
        return all_to_all(group, sends, recvs)


def plan_reasons(plans: Sequence[ShardPlan], window: KeyWindow) -> tuple[str, ...]:
    """Head parallelism deals query heads to ranks: it needs at least one per rank."""
    if plans and plans[0].num_heads < len(plans):
        return (
            f"head parallelism needs at least one query head per rank: {plans[0].num_heads} "
            f"heads over {len(plans)} ranks",
        )
    return ()


ULYSSES_SPEC = CommunicatorSpec(
    name="ulysses",
    factory=UlyssesCommunicator,
    priority=30,
    distributed=True,
    causal=True,
    parallelism="heads",
    plan_reasons=plan_reasons,
    description="head parallelism: all-to-all to whole-sequence head shares and back (exact "
    "for any plan with at least one query head per rank)",
)
