"""The ``hybrid`` communicator: ``ulysses`` within a 2-D layout's inner groups, ``ringpass``
across its outer groups (yunchang's USP, TransformerEngine's ``a2a+p2p``).

On a :class:`~ringdilated.core.call.grid.Grid` (a 2-D ``DeviceMesh`` ``(outer, inner)``, or two
process groups), rank ``(o, i)`` holds shard ``o * inner + i`` of the sequence. An all-to-all
within the inner group gives each rank every position of the group's chunk for its share of the
heads; the chunks then exchange only their crossing pieces of those heads across the outer
group, point to point (the minimum, for those heads); a second all-to-all returns the results.
So only crossing pieces travel over the outer links, which are typically the slow ones
(between nodes), and the all-to-all stays on the fast inner ones.

The spec says all of it: ``parallelism="hybrid"`` and ``parts=("ulysses", "ringpass")``, which
the resolver resolves by name (as forced names are) and the run prepares and uses.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ringdilated.backends.ringpass import NothingToPrepare, RingPassCommunicator, point_to_point
from ringdilated.core import CommunicatorSpec, Pending

__all__ = ["HYBRID_SPEC", "HybridCommunicator"]


class HybridCommunicator(NothingToPrepare):
    """What ``hybrid``'s factory builds: the run exchanges through the spec's parts, never
    through this (it would move point to point, on ``ringpass``'s schedule)."""

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        return RingPassCommunicator().schedule(rank, world_size)

    def exchange(
        self,
        group: object,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, torch.Tensor],
        uniform: bool = False,
    ) -> Pending:
        return point_to_point(group, sends, recvs)


HYBRID_SPEC = CommunicatorSpec(
    name="hybrid",
    factory=HybridCommunicator,
    priority=20,
    distributed=True,
    causal=True,
    parallelism="hybrid",
    parts=("ulysses", "ringpass"),
    description="on a 2-D layout: all-to-all head parallelism within inner groups, ringpass "
    "pieces across outer groups",
)
