"""The communicator interface: moves key/value pieces (and their gradients) between ranks.

The sharded run (:mod:`ringdilated.core.run.sharded`) decides *what* moves, from the pattern
(:mod:`ringdilated.core.plan.shards`) in the wire format of :mod:`ringdilated.core.run.wire`; a
communicator decides *how*: in which steps a rank meets which peers, and with which transport.
Call flow, per step (:mod:`ringdilated.core.run.exchange`)::

    pending = communicator.exchange(group, sends={peer: flat tensor}, recvs={peer: flat buffer})
    ... compute the previous step's blocks ...
    pending.wait()          # recvs are filled; sends may be reused

Every rank calls ``exchange`` for the same steps in the same order; a peer with nothing to send
or receive is simply absent from the mappings. A communicator is a transport and keeps no count:
the sharded run adds the bytes of each exchange to the call's :class:`TransferStats`.

**Delivery.** A communicator may declare a class attribute ``delivery``:

- ``"pairwise"`` (the default when absent): each rank sends each peer exactly what that peer's
  queries see (its payload, the analytic minimum); sizes differ per pair.
- ``"broadcast"``: at each step each rank sends *one* payload, the union of what any peer needs,
  padded to the largest of the group's, to every peer of the step, and every peer of the step
  is present in ``sends`` and ``recvs`` (``uniform=True``): what a collective such as
  ``all_gather`` moves. Receivers take their part and ignore the rest; the bytes above the
  minimum are counted like any others. Gradients always return pairwise (``uniform=False``).

**Parallelism.** A communicator may also declare ``parallelism``: ``"sequence"`` (the default:
ranks keep their sequence shards and exchange crossing pieces, as above) or ``"heads"``: the
call runs by head parallelism (:mod:`ringdilated.core.run.head_parallel`): each exchange sends every
peer one flat tensor of bytes at once (all peers in one step, ``uniform=False``), turning
sequence shards into whole-sequence head shares and back. ``"hybrid"``: on a 2-D
:class:`~ringdilated.core.call.grid.Grid`, head parallelism within its inner groups and sequence
pieces across its outer groups; the communicator then holds one communicator for each, as its
attributes ``heads`` (parallelism ``"heads"``) and ``sequence`` (``"sequence"``). That rule lives
in :func:`layout_mismatch` and :func:`hybrid_parts`, and nowhere else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs
import torch
import torch.distributed as dist

from ringdilated.core.support.opaque import OpaqueBase, register

if TYPE_CHECKING:
    from ringdilated.core.plan.shards import ShardPlan

__all__ = [
    "DELIVERIES",
    "PARALLELISMS",
    "Communicator",
    "Pending",
    "TransferStats",
    "delivery_of",
    "every_peer_at_once",
    "hybrid_parts",
    "layout_mismatch",
    "parallelism_of",
    "process_group",
]

DELIVERIES = ("pairwise", "broadcast")
"""The ways a communicator may deliver pieces (see the module docstring)."""

PARALLELISMS = ("sequence", "heads", "hybrid")
"""How a communicator splits a call's work between ranks (see the module docstring)."""


@register
@attrs.define
class TransferStats(OpaqueBase):
    """Bytes this rank sent and received, and exchanges that moved anything to or from it: one
    call's (pass an instance as ``dilated_attention(..., transfer_stats=)``), forward and
    backward, or several calls' sums."""

    bytes_sent: int = 0
    bytes_received: int = 0
    exchanges: int = 0

    def record(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        self.bytes_sent += sum(t.numel() * t.element_size() for t in sends.values())
        self.bytes_received += sum(t.numel() * t.element_size() for t in recvs.values())
        if sends or recvs:
            self.exchanges += 1

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.exchanges = 0


@runtime_checkable
class Pending(Protocol):
    def wait(self) -> None:
        """Block until this exchange's receives are complete and its send buffers are free."""
        ...


@runtime_checkable
class Communicator(Protocol):
    """Moves flat tensors between ranks of a process group."""

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        """The peers ``rank`` exchanges with at each step; every peer appears exactly once."""
        ...

    def prepare(self, group: object, plans: Sequence[ShardPlan], causal: bool) -> None:
        """Called on every rank, with every rank's plan, once per planned call (when a call
        signature is first planned on a layout, or per call without a layout), before its first
        exchange; later calls of the plan exchange without it. It must not create process
        groups: ``dist.new_group`` is a collective over the whole default group, which
        independent groups (those of a mesh) reach at different times."""
        ...

    def exchange(
        self,
        group: object,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, torch.Tensor],
        uniform: bool = False,
    ) -> Pending:
        """Start sending ``sends[peer]`` to each peer and receiving into ``recvs[peer]``.

        Ranks are ranks within ``group``. Sizes agree between the two ends by construction (both
        derive them from the shard plan). ``uniform``: every tensor in ``sends`` holds the same
        data (a collective may serve the exchange).
        """
        ...


def delivery_of(communicator: object) -> str:
    """``communicator.delivery`` (``"pairwise"`` when absent); raises ``ValueError`` naming any
    other value."""
    delivery = getattr(communicator, "delivery", "pairwise")
    if not isinstance(delivery, str) or delivery not in DELIVERIES:
        raise ValueError(
            f"{type(communicator).__name__}.delivery must be one of {DELIVERIES}, got {delivery!r}"
        )
    return str(delivery)


def parallelism_of(communicator: object) -> str:
    """``communicator.parallelism`` (``"sequence"`` when absent); raises ``ValueError`` naming
    any other value."""
    parallelism = getattr(communicator, "parallelism", "sequence")
    if not isinstance(parallelism, str) or parallelism not in PARALLELISMS:
        raise ValueError(
            f"{type(communicator).__name__}.parallelism must be one of {PARALLELISMS}, got "
            f"{parallelism!r}"
        )
    return str(parallelism)


def layout_mismatch(runs_on: int, call_has: int) -> str | None:
    """Why a communicator that runs on ``runs_on``-D process layouts (1: a process group; 2: a
    2-D grid, parallelism ``hybrid``) cannot serve a call on a ``call_has``-D one; ``None``
    where they agree."""
    if runs_on == call_has:
        return None
    layouts = {1: "a process group", 2: "a 2-D process layout (a 2-D DeviceMesh)"}
    runs = layouts.get(runs_on, f"{runs_on}-D layouts")
    return f"runs on {runs}, the call has {layouts.get(call_has, f'a {call_has}-D layout')}"


def hybrid_parts(communicator: object) -> tuple[Communicator, Communicator]:
    """A ``hybrid`` communicator's ``heads`` and ``sequence`` communicators (module docstring);
    raises ``TypeError`` naming the one missing or of another parallelism."""
    parts: list[Communicator] = []
    for name in ("heads", "sequence"):
        part = getattr(communicator, name, None)
        with contextlib.suppress(ValueError):  # an unknown parallelism is another one
            if isinstance(part, Communicator) and parallelism_of(part) == name:
                parts.append(part)
                continue
        raise TypeError(
            f"{type(communicator).__name__}.{name} must be a Communicator of parallelism "
            f"{name!r} (a hybrid communicator holds one of each), got {part!r}"
        )
    return parts[0], parts[1]


def every_peer_at_once(rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
    """A schedule of one step meeting every peer (a collective's), or none on one rank."""
    peers = tuple(p for p in range(world_size) if p != rank)
    return (peers,) if peers else ()


def process_group(group: object) -> dist.ProcessGroup | None:
    """``group`` as a transport takes it: a ``ProcessGroup``, or ``None`` (the default group).
    Raises ``TypeError`` naming anything else (a 2-D layout reaching a communicator of process
    groups), rather than falling back to the whole world."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(
        f"a communicator exchanges on a torch.distributed ProcessGroup (or None), got "
        f"{type(group).__name__}"
    )
