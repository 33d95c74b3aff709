"""How a communicator plugin describes itself to the resolver."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from ringdilated.core.contract import rules
from ringdilated.core.contract.communicator import layout_mismatch

if TYPE_CHECKING:
    from ringdilated.core.plan.shards import ShardPlan

__all__ = ["CommunicatorSpec"]


@attrs.frozen
class CommunicatorSpec:
    """A communicator as a plugin offers it.

    ``distributed``: serves process groups of more than one rank (``False``: one process only).
    ``causal``: honours the causal rule of sending only toward later ranks.
    ``dims``: the process layout it runs on: 1, a process group; 2, a 2-D
    :class:`~ringdilated.core.call.grid.Grid` (``hybrid``; the rule:
    :func:`~ringdilated.core.contract.communicator.layout_mismatch`). ``plan_reasons``: given
    every rank's shard plan and the causal flag, the reasons this communicator cannot move that
    plan's data exactly (empty: it can); if it raises or returns anything but str,
    :meth:`reasons` turns that into a reason against this communicator.
    ``name`` follows the kernel name rule (non-empty, no whitespace or commas, not ``"auto"``),
    ``priority`` is an int (not a bool); every field is validated on construction, and again
    by the plugin manager.
    """

    name: str = attrs.field(validator=rules.names)
    factory: Callable[[], object] = attrs.field(validator=rules.callables)
    priority: int = attrs.field(default=0, validator=rules.ints)
    distributed: bool = attrs.field(default=True, validator=rules.bools)
    causal: bool = attrs.field(default=True, validator=rules.bools)
    dims: int = attrs.field(default=1, validator=rules.ints)
    description: str = attrs.field(default="", validator=rules.strs)
    plan_reasons: Callable[[Sequence[ShardPlan], bool], tuple[str, ...]] | None = attrs.field(
        default=None, validator=rules.optional(rules.callables)
    )

    def reasons(
        self, world_size: int, causal: bool, plans: Sequence[ShardPlan] = (), dims: int = 1
    ) -> tuple[str, ...]:
        """Every reason this communicator cannot serve the group (empty: it can); never raises
        for what ``plan_reasons`` does. ``dims``: the call's process layout (1: a group; 2: a
        2-D grid)."""
        out: list[str] = []
        mismatch = layout_mismatch(self.dims, dims)
        if world_size > 1 and mismatch is not None:
            out.append(mismatch)
        if world_size > 1 and not self.distributed:
            out.append(f"serves one process only, the group has {world_size} ranks")
        if world_size == 1 and self.distributed:
            out.append("a group of one rank needs no communication (local serves it)")
        if causal and not self.causal:
            out.append("cannot restrict sends to later ranks under causal=True")
        if plans and self.plan_reasons is not None and not out:
            out.extend(rules.contained_reasons("plan_reasons", self.plan_reasons, plans, causal))
        return tuple(out)
