"""The ``ringpass`` communicator: point-to-point rotation over ``torch.distributed``.

At step ``t`` (``t = 1 .. P-1``) rank ``r`` exchanges with ``r + t`` and ``r - t`` (when they
exist): each piece goes straight from its owner to a rank that needs it, never forwarded through
ranks that do not, so the bytes sent are the shard plan's minimum. The driver starts step
``t + 1`` before computing step ``t`` (double buffering: separate send and receive buffers per
step, at most two steps alive), so transfers overlap compute. Works on gloo (CPU) and NCCL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch
import torch.distributed as dist

from ringdilated.core import CommunicatorSpec, KeyWindow, ShardPlan, process_group

__all__ = ["RINGPASS_SPEC", "NothingToPrepare", "RingPassCommunicator", "Works", "point_to_point"]


@attrs.frozen
class Works:
    """Pending ``torch.distributed`` work handles, waited on together."""

    works: tuple[object, ...]

    def wait(self) -> None:
        for work in self.works:
            work.wait()  # type: ignore[attr-defined]


class NothingToPrepare:
    """Base of the built-in communicators, which have nothing to set up before a planned call's
    first exchange: they move bytes on the group they are handed, as given."""

    def prepare(self, group: object, plans: Sequence[ShardPlan], window: KeyWindow) -> None:
        return None


class RingPassCommunicator(NothingToPrepare):
    """Point-to-point exchange with partners at growing distance."""

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        steps = []
        for t in range(1, world_size):
            steps.append(tuple(p for p in (rank + t, rank - t) if 0 <= p < world_size))
        return tuple(s for s in steps if s)

    def exchange(
        self,
        group: object,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, torch.Tensor],
        uniform: bool = False,
    ) -> Works:
        return point_to_point(group, sends, recvs)


def point_to_point(
    group: object, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]
) -> Works:
    """``isend`` each ``sends[peer]``, ``irecv`` each ``recvs[peer]`` (group ranks), batched."""
    pg = process_group(group)

    def global_rank(peer: int) -> int:
        return peer if pg is None else dist.get_global_rank(pg, peer)

    ops = [dist.P2POp(dist.isend, t, global_rank(p), group=pg) for p, t in sends.items()]
    ops += [dist.P2POp(dist.irecv, t, global_rank(p), group=pg) for p, t in recvs.items()]
    return Works(tuple(dist.batch_isend_irecv(ops)) if ops else ())


RINGPASS_SPEC = CommunicatorSpec(
    name="ringpass",
    factory=RingPassCommunicator,
    priority=100,
    distributed=True,
    delivery="pairwise",
    parallelism="sequence",
    description="point-to-point rotation (isend/irecv), overlapped with compute",
)
