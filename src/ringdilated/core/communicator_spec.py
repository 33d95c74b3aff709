"""How a communicator plugin describes itself to the resolver."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from ringdilated.core.shard import ShardPlan

__all__ = ["CommunicatorSpec"]


@attrs.frozen
class CommunicatorSpec:
    """A communicator as a plugin offers it.

    ``distributed``: serves process groups of more than one rank (``False``: one process only).
    ``causal``: honours the causal rule of sending only toward later ranks.
    ``plan_reasons``: given every rank's shard plan and the causal flag, the reasons this
    communicator cannot move that plan's data exactly (empty: it can).
    """

    name: str
    factory: Callable[[], object]
    priority: int = 0
    distributed: bool = True
    causal: bool = True
    description: str = ""
    plan_reasons: Callable[[Sequence[ShardPlan], bool], tuple[str, ...]] | None = None

    def reasons(
        self, world_size: int, causal: bool, plans: Sequence[ShardPlan] = ()
    ) -> tuple[str, ...]:
        out = []
        if world_size > 1 and not self.distributed:
            out.append(f"serves one process only, the group has {world_size} ranks")
        if world_size == 1 and self.distributed:
            out.append("a group of one rank needs no communication (local serves it)")
        if causal and not self.causal:
            out.append("cannot restrict sends to later ranks under causal=True")
        if plans and self.plan_reasons is not None and not out:
            out.extend(self.plan_reasons(plans, causal))
        return tuple(out)
