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

import os
import warnings

import attrs
import torch
import torch.distributed as dist

from ringdilated.core.support.caller import user_stacklevel
from ringdilated.core.support.errors import DistributedNotInitializedWarning

__all__ = [
    "LAUNCHER_WORLD_SIZE_ENV",
    "DistributedNotInitializedWarning",
    "Grid",
    "as_process_group",
    "gather",
    "gather_objects",
    "group_size",
    "rank",
    "size",
    "warn_if_launched_alone",
]

LAUNCHER_WORLD_SIZE_ENV = "WORLD_SIZE"
"""The variable a launcher (``torchrun``, ``torch.distributed.launch``, SLURM setups) sets to the
number of ranks it started, beside ``RANK`` and ``LOCAL_RANK``."""


_warned_alone = False
"""Whether :func:`warn_if_launched_alone` has warned in this process."""


def warn_if_launched_alone(subject: str = "this call runs") -> None:
    """Warn, once per process, with :class:`DistributedNotInitializedWarning` when the
    environment says this process is one of several ranks (``WORLD_SIZE``, an integer above 1)
    and ``torch.distributed`` is not initialised; the caller is about to run a call as one
    process, or (``subject`` naming it) to build a module that runs every call so. Does nothing
    otherwise (``WORLD_SIZE`` unset, ``1``, not an integer, or the default group initialised: a
    one-process call beside it is then the caller's choice). Reads the environment only until
    it has warned; called once per planned call and per module built with
    ``process_group=None`` (a module's group is fixed then), never per step."""
    global _warned_alone
    if _warned_alone:
        return
    value = os.environ.get(LAUNCHER_WORLD_SIZE_ENV)
    if value is None:
        return
    try:
        ranks = int(value.strip())
    except ValueError:  # not a launcher's value: nothing to say about it
        return
    if ranks <= 1 or (dist.is_available() and dist.is_initialized()):
        return
    _warned_alone = True  # before warning: a filter may turn the warning into an error
    warnings.warn(
        f"{LAUNCHER_WORLD_SIZE_ENV}={value.strip()} in the environment says this process is one "
        f"of {ranks} ranks (a launcher such as torchrun set it), but torch.distributed is not "
        f"initialised, so {subject} as one process over this rank's tensors alone, as if "
        "they were the whole sequence (process_group=None; dist.group.WORLD is None until "
        "torch.distributed.init_process_group() is called). To shard the sequence, call "
        "torch.distributed.init_process_group() before taking the process_group you pass. If "
        "every rank should attend over its own whole sequences (data parallelism: DDP, FSDP "
        "over the batch), this is expected: silence it with warnings.filterwarnings('ignore', "
        "category=ringdilated.DistributedNotInitializedWarning). (Warned once per process.)",
        DistributedNotInitializedWarning,
        stacklevel=user_stacklevel(),
    )


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


def as_process_group(group: object) -> object:
    """The process layout a call runs on: ``group`` itself (``None`` or a ``ProcessGroup``), the
    group of a 1-D ``DeviceMesh``, or of one dimension of a larger one, ``(mesh, "cp")`` or
    ``(mesh, 1)``; or a 2-D :class:`Grid` (for ``communicator="hybrid"``) from two dimensions of
    a mesh named explicitly, ``(mesh, ("ring", "ulysses"))`` (outer, inner), or a pair ``(outer,
    inner)`` of process groups. A mesh of more than one dimension alone is refused: which
    dimension is the sequence's (a data-parallel one is not) is the caller's to say. Anything
    else is returned unchanged, for :func:`group_size` to reject. Reads the mesh's existing
    groups: nothing is created, nothing is sent.

    Every rank must pass the same valid value: this runs before the ranks can agree (it says
    which ranks those are), so a bad dimension raises on its own rank only, and its peers wait
    in the call's agreement until the backend's timeout."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, tuple) and len(group) == 2:
        mesh, dim = group
        if isinstance(mesh, DeviceMesh):
            if isinstance(dim, tuple) and len(dim) == 2:
                return Grid(_mesh_group(mesh, dim[0]), _mesh_group(mesh, dim[1]))
            return _mesh_group(mesh, dim)
        if all(isinstance(g, dist.ProcessGroup) for g in group):
            return Grid(*group)
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"process_group takes a 1-D DeviceMesh; for a {group.ndim}-D one (dimensions "
                f"{group.mesh_dim_names}) name the sequence's dimension, (mesh, 'cp'), or two "
                "for a 2-D layout (communicator='hybrid'), (mesh, ('ring', 'ulysses'))"
            )
        return group.get_group()
    return group


def _mesh_group(mesh: object, dim: object) -> dist.ProcessGroup:
    """The existing group of one dimension of ``mesh``, by name or index."""
    import operator

    names = getattr(mesh, "mesh_dim_names", None) or ()
    try:
        if isinstance(dim, bool):
            raise TypeError
        key: str | int = dim if isinstance(dim, str) else operator.index(dim)  # type: ignore[arg-type]
        return mesh.get_group(key)  # type: ignore[attr-defined,no-any-return]
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"process_group=(mesh, dim) needs a dimension name of {names} or an index below "
            f"{getattr(mesh, 'ndim', '?')} (or a pair of them for a 2-D layout), got {dim!r}"
        ) from None


def group_size(group: object) -> int:
    """Ranks in ``group`` (``None``: one process; a :class:`Grid`: all of its ranks)."""
    if group is None:
        return 1
    if not isinstance(group, (dist.ProcessGroup, Grid)):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh, "
            "(mesh, dimension), (mesh, (outer, inner)), (outer group, inner group) or None, got "
            f"{group!r}"
        )
    return size(group)
