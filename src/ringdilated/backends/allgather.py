"""The ``allgather`` communicator: one ``all_gather`` on the call's process group per exchange.

Each rank contributes one payload, the union of what any peer's queries see (its *broadcast
payload*, :func:`~ringdilated.core.plan.shards.broadcast_payload`), padded to the largest of the
group's; every rank receives all of them and extracts its own part (its spec declares
``delivery="broadcast"``, see :mod:`ringdilated.core.contract.communicator`). This serves
every plan ``ringpass`` serves, exactly:

- **causal**: the collective also delivers pieces to earlier ranks, who ignore them;
- **uneven pieces**: padded to the group's largest;
- **overlapping or narrower segment groups**: one gather over the whole group, where ranks that
  need nothing from a peer ignore its payload.

What the collective moves beyond the minimum (copies for ranks that ignore them, padding) is
counted in the call's ``TransferStats`` and shown by ``explain()``, and the resolver weighs it
(:mod:`ringdilated.core.select.cost`). Gradients return point to point, the minimum.

Why padding and ``all_gather`` rather than split sizes: NCCL's ``all_gather`` (a ring or tree
over every link at once) is its fastest collective and takes equal sizes only, and gloo's
``all_gather`` takes equal sizes too. The split-size alternative, ``all_to_all_single``, would
copy the same payload once per peer into its input and runs as P - 1 point-to-point pairs on
both backends, which is ``ringpass`` with less overlap. The padding is at most the difference
between the largest and a rank's payload, and is counted.

CPU tensors (gloo) move point to point instead, the same payload to every peer (what gloo's ring
``all_gather`` sends too), never through a gloo worker thread (issue 21; see
:mod:`ringdilated.backends.ulysses`). It gathers on the call's own group and never creates one
inside a call (``Communicator.prepare`` says why).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from ringdilated.backends.ringpass import NothingToPrepare, Works, point_to_point
from ringdilated.core import CommunicatorSpec, Pending, every_peer_at_once, process_group

__all__ = ["ALLGATHER_SPEC", "AllGatherCommunicator"]


class AllGatherCommunicator(NothingToPrepare):
    """One ``all_gather`` of broadcast payloads for pieces; point to point for gradients."""

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        return every_peer_at_once(rank, world_size)

    def exchange(
        self,
        group: object,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, torch.Tensor],
        uniform: bool = False,
    ) -> Pending:
        if not uniform or not (sends or recvs):
            return point_to_point(group, sends, recvs)
        payload_tensor = next(iter(sends.values()))
        pg = process_group(group)
        me, world = dist.get_rank(pg), dist.get_world_size(pg)
        members = tuple(sorted({me, *sends, *recvs}))
        if members != tuple(range(world)):  # broadcast delivery names every peer
            raise RuntimeError(
                f"allgather exchange among ranks {members} of a group of {world}: a broadcast "
                "exchange must name every peer"
            )
        if payload_tensor.device.type == "cpu":  # never through a gloo worker thread
            return point_to_point(group, sends, recvs)
        outputs = [recvs[m] if m != me else torch.empty_like(payload_tensor) for m in members]
        work = dist.all_gather(outputs, payload_tensor, group=pg, async_op=True)
        return Works((work,))


ALLGATHER_SPEC = CommunicatorSpec(
    name="allgather",
    factory=AllGatherCommunicator,
    priority=50,
    distributed=True,
    causal=True,
    delivery="broadcast",
    description="one all_gather of each rank's pieces on the call's group (exact for every "
    "plan; moves more than the minimum where not every rank needs every piece)",
)
