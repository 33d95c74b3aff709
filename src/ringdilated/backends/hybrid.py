"""The ``hybrid`` communicator: ``ulysses`` within a 2-D layout's inner groups, ``ringpass``
across its outer groups (yunchang's USP, TransformerEngine's ``a2a+p2p``).

On a :class:`~ringdilated.core.call.grid.Grid` (a 2-D ``DeviceMesh`` ``(outer, inner)``, or two
process groups), rank ``(o, i)`` holds shard ``o * inner + i`` of the sequence. An all-to-all
within the inner group gives each rank every position of the group's chunk for its share of the
heads; the chunks then exchange only their crossing pieces of those heads across the outer
group, point to point (the minimum, for those heads); a second all-to-all returns the results.
So only crossing pieces travel over the outer links, which are typically the slow ones
(between nodes), and the all-to-all stays on the fast inner ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ringdilated.backends.ringpass import RingPassCommunicator
from ringdilated.backends.ulysses import UlyssesCommunicator
from ringdilated.core import CommunicatorSpec, Pending, ShardPlan

__all__ = ["HYBRID_SPEC", "HybridCommunicator"]


class HybridCommunicator:
    """Holds the two communicators of a 2-D run: ``heads`` (inner) and ``sequence`` (outer).
    Its own ``exchange`` is never called (the run uses the parts); it moves point to point."""

    parallelism = "hybrid"

    def __init__(self) -> None:
        self.heads = UlyssesCommunicator()
        self.sequence = RingPassCommunicator()

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        return self.sequence.schedule(rank, world_size)

    def prepare(self, group: object, plans: Sequence[ShardPlan], causal: bool) -> None:
        return None

    def exchange(
        self,
        group: object,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, torch.Tensor],
        uniform: bool = False,
    ) -> Pending:
        return self.sequence.exchange(group, sends, recvs, uniform)


def plan_reasons(plans: Sequence[ShardPlan], causal: bool) -> tuple[str, ...]:
    """Heads are dealt within each inner group: at least one query head per inner rank is
    checked when the run is built; nothing else limits it."""
    return ()


HYBRID_SPEC = CommunicatorSpec(
    name="hybrid",
    factory=HybridCommunicator,
    priority=20,
    distributed=True,
    causal=True,
    dims=2,
    description="on a 2-D layout: all-to-all head parallelism within inner groups, ringpass "
    "pieces across outer groups",
)
