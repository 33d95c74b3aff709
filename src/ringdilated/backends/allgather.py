"""The ``allgather`` communicator: one ``all_gather`` on the call's process group.

A *segment group* is a set of ranks that share crossing segments: every member needs every other
member's piece. Where each rank sends one and the same payload to all its peers, the groups are
consistent (each member sees the same group) and the members' pieces are equally large (gloo's
``all_gather`` takes equal sizes only), one asynchronous ``all_gather`` per group moves exactly the
minimum, overlapped with the local blocks' compute. Elsewhere the resolver rejects ``allgather``
with the reason, and ``ringpass`` (exact everywhere) serves. ``causal=True`` is rejected: an
``all_gather`` also sends to earlier ranks. Gradients return point to point.

The one all_gather runs on the call's own process group: no process group is ever created here.
Creating one inside a call (``dist.new_group`` is a collective over the whole default group)
deadlocks independent groups, such as the context-parallel groups of a data-parallel x
context-parallel mesh, which reach it with different members at different times. A segment group
narrower than the call's group is therefore declined, not served by a new subgroup.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from ringdilated.backends.ringpass import Works, point_to_point
from ringdilated.core.communicator import Pending
from ringdilated.core.communicator_spec import CommunicatorSpec
from ringdilated.core.shard_plan import ShardPlan, payload

__all__ = ["ALLGATHER_SPEC", "AllGatherCommunicator", "segment_groups"]


def _peers(plan: ShardPlan, rank: int, causal: bool) -> tuple[int, ...]:
    return tuple(y for y in range(plan.world_size) if y != rank and payload(plan, rank, y, causal))


def segment_groups(plans: Sequence[ShardPlan], causal: bool) -> tuple[tuple[int, ...], ...]:
    """The distinct groups ``{rank} + its peers`` over every rank with something to send."""
    groups = {tuple(sorted({p.rank, *_peers(p, p.rank, causal)})) for p in plans}
    return tuple(sorted(g for g in groups if len(g) > 1))


def plan_reasons(plans: Sequence[ShardPlan], causal: bool) -> tuple[str, ...]:
    """Why one all_gather per segment group cannot move these plans' pieces exactly."""
    reasons: list[str] = []
    group_of = {p.rank: tuple(sorted({p.rank, *_peers(p, p.rank, causal)})) for p in plans}
    for plan in plans:
        me = plan.rank
        sent = {
            (pl.heads, pl.positions)
            for y in _peers(plan, me, causal)
            for pl in [payload(plan, me, y, causal)]
        }
        if len(sent) > 1:
            reasons.append(
                f"rank {me} sends different pieces to different peers (segment groups overlap)"
            )
        for member in group_of[me]:
            if group_of[member] != group_of[me]:
                reasons.append(
                    f"ranks {me} and {member} see different segment groups "
                    f"{group_of[me]} and {group_of[member]}"
                )
                break
    world = plans[0].world_size if plans else 0
    for group in segment_groups(plans, causal):
        if len(group) < world:
            reasons.append(
                f"segment group {group} is narrower than the process group of {world} ranks: "
                "one all_gather would need a subgroup, and creating one inside a call can "
                "deadlock independent groups (a dp x cp mesh)"
            )
            continue
        sizes = [
            payload(plans[m], m, next(y for y in group if y != m), causal).positions_count
            for m in group
        ]
        if len(set(sizes)) > 1:
            reasons.append(
                f"pieces of uneven size in segment group {group} ({sizes} key/value rows): "
                "gloo's all_gather takes equal sizes only"
            )
    return tuple(dict.fromkeys(reasons))


class AllGatherCommunicator:
    """One ``all_gather`` on the call's group for pieces; point to point for gradients."""

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        peers = tuple(p for p in range(world_size) if p != rank)
        return (peers,) if peers else ()

    def prepare(self, group: object, plans: Sequence[ShardPlan], causal: bool) -> None:
        """Check the plans (every rank has the same, so every rank raises alike): the resolver
        declines plans this cannot move, but an instance passed as ``communicator=`` skips it.
        Nothing to set up: the all_gather runs on the call's own group (no group is created
        inside a call; see the module docstring)."""
        reasons = plan_reasons(plans, causal)
        if reasons:
            raise ValueError(
                "communicator 'allgather' cannot move these pieces exactly: " + "; ".join(reasons)
            )

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
        pg = group if isinstance(group, dist.ProcessGroup) else None
        me, world = dist.get_rank(pg), dist.get_world_size(pg)
        members = tuple(sorted({me, *sends, *recvs}))
        if members != tuple(range(world)):  # plan_reasons declines every other plan
            raise RuntimeError(
                f"allgather exchange among ranks {members} of a group of {world}: the resolver "
                "should have declined this plan"
            )
        outputs = [recvs[m] if m != me else torch.empty_like(payload_tensor) for m in members]
        work = dist.all_gather(outputs, payload_tensor, group=pg, async_op=True)
        return Works((work,))


ALLGATHER_SPEC = CommunicatorSpec(
    name="allgather",
    factory=AllGatherCommunicator,
    priority=50,
    distributed=True,
    causal=False,
    plan_reasons=plan_reasons,
    description="one all_gather on the call's group (exact where every rank needs every other's "
    "equal piece)",
)
