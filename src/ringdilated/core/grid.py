"""Process layouts a call runs on: one process group, or a 2-D :class:`Grid` of two.

A :class:`Grid` holds, for this rank, the ``inner`` group (the ranks sharing its outer index;
consecutive shards) and the ``outer`` group (the ranks sharing its inner index). Rank ``(o, i)``
is flat rank ``o * inner_size + i``, and the sequence is sharded in flat rank order, so an inner
group's shards form one contiguous chunk. A 2-D ``DeviceMesh`` ``(outer, inner)`` gives one.

Every collective a call makes before it runs (the agreement) goes through :func:`gather`,
:func:`gather_objects`, :func:`size` and :func:`rank`, which take either layout: on a grid, one
collective along ``inner`` then one along ``outer`` give every rank every rank's values, in
flat rank order. Nothing here creates a process group.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

__all__ = ["Grid", "gather", "gather_objects", "rank", "size"]


@attrs.frozen
class Grid:
    """A 2-D process layout: ``outer`` and ``inner`` process groups (see the module docstring)."""

    outer: dist.ProcessGroup
    inner: dist.ProcessGroup

    @property
    def shape(self) -> tuple[int, int]:
        """``(outer size, inner size)``."""
        return dist.get_world_size(self.outer), dist.get_world_size(self.inner)

    @property
    def coordinates(self) -> tuple[int, int]:
        """This rank's ``(outer index, inner index)``."""
        return dist.get_rank(self.outer), dist.get_rank(self.inner)


def size(layout: dist.ProcessGroup | Grid) -> int:
    """Ranks in the layout."""
    if isinstance(layout, Grid):
        outer, inner = layout.shape
        return outer * inner
    return dist.get_world_size(layout)


def rank(layout: dist.ProcessGroup | Grid) -> int:
    """This rank's flat index in the layout (its shard's place in the sequence)."""
    if isinstance(layout, Grid):
        o, i = layout.coordinates
        return o * layout.shape[1] + i
    return dist.get_rank(layout)


def backend(layout: dist.ProcessGroup | Grid) -> str:
    """The backend of the layout's collectives (a grid's inner group's)."""
    return str(dist.get_backend(layout.inner if isinstance(layout, Grid) else layout))


def gather(layout: dist.ProcessGroup | Grid, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (equal shapes), in flat rank order."""
    if not isinstance(layout, Grid):
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(layout))]
        dist.all_gather(out, tensor, group=layout)
        return out
    outer, inner = layout.shape
    row = [torch.empty_like(tensor) for _ in range(inner)]
    dist.all_gather(row, tensor, group=layout.inner)
    stacked = torch.stack(row)
    rows = [torch.empty_like(stacked) for _ in range(outer)]
    dist.all_gather(rows, stacked, group=layout.outer)
    return [t for r in rows for t in r.unbind(0)]


def gather_objects(layout: dist.ProcessGroup | Grid, value: object) -> list[object]:
    """Every rank's picklable ``value``, in flat rank order."""
    if not isinstance(layout, Grid):
        out: list[object] = [None] * dist.get_world_size(layout)
        dist.all_gather_object(out, value, group=layout)
        return out
    outer, inner = layout.shape
    row: list[object] = [None] * inner
    dist.all_gather_object(row, value, group=layout.inner)
    rows: list[object] = [None] * outer
    dist.all_gather_object(rows, row, group=layout.outer)
    return [v for r in rows for v in r]  # type: ignore[attr-defined]
