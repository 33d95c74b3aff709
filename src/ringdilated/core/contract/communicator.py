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

**Description.** A communicator is described by its
:class:`~ringdilated.core.select.communicator_spec.CommunicatorSpec`, never by the instance,
which only moves bytes. The spec's ``delivery`` says what the sharded run sends it:

- ``"pairwise"`` (the default): each rank sends each peer exactly what that peer's queries see
  (its payload, the analytic minimum); sizes differ per pair.
- ``"broadcast"``: at each step each rank sends *one* payload, the union of what any peer needs,
  padded to the largest of the group's, to every peer of the step, and every peer of the step
  is present in ``sends`` and ``recvs`` (``uniform=True``): what a collective such as
  ``all_gather`` moves. Receivers take their part and ignore the rest; the bytes above the
  minimum are counted like any others. Gradients always return pairwise (``uniform=False``).

Its ``parallelism`` says how the call uses it: ``"sequence"`` (the default: ranks keep their
sequence shards and exchange crossing pieces, as above) or ``"heads"``: the call runs by head
parallelism (:mod:`ringdilated.core.run.head_parallel`): each exchange sends every peer one flat
tensor of bytes at once (all peers in one step, ``uniform=False``), turning sequence shards into
whole-sequence head shares and back. ``"hybrid"``: on a 2-D
:class:`~ringdilated.core.call.grid.Grid`, head parallelism within its inner groups and sequence
pieces across its outer groups, by the two communicators the spec names as its ``parts``
(``"heads"``, then ``"sequence"``), each resolved by name and prepared like any other.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs
import torch
import torch.distributed as dist

from ringdilated.core.support.opaque import OpaqueBase, register

if TYPE_CHECKING:
    from ringdilated.core.plan.shards import ShardPlan
    from ringdilated.core.plan.window import KeyWindow

__all__ = [
    "DELIVERIES",
    "PARALLELISMS",
    "Communicator",
    "Pending",
    "TransferStats",
    "every_peer_at_once",
    "layout_mismatch",
    "mask_argument",
    "process_group",
]

DELIVERIES = ("pairwise", "broadcast")
"""The ways a communicator may deliver pieces (``CommunicatorSpec.delivery``; see the module
docstring)."""

PARALLELISMS = ("sequence", "heads", "hybrid")
"""How a communicator splits a call's work between ranks (``CommunicatorSpec.parallelism``; see
the module docstring)."""


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

    def prepare(self, group: object, plans: Sequence[ShardPlan], window: KeyWindow) -> None:
        """Called on every rank of ``group`` (the group it exchanges on), with each of its ranks'
        plans and the call's key window, once per planned call (when a call signature is first
        planned on a layout, or per call without a layout), before its first exchange; later calls
        of the plan exchange without it. A hybrid's parts are prepared alike, each on its own group.
        One instance serves every plan (each layer, each group of padded rows), so what it keeps
        must hold for all of them: ``exchange`` is never told which plan it serves. It must not
        create process groups: ``dist.new_group`` is a collective over the whole default group,
        which independent groups (those of a mesh) reach at different times."""
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


def layout_mismatch(runs_on: int, call_has: int) -> str | None:
    """Why a communicator that runs on ``runs_on``-D process layouts (1: a process group; 2: a
    2-D grid, parallelism ``hybrid``) cannot serve a call on a ``call_has``-D one; ``None``
    where they agree."""
    if runs_on == call_has:
        return None
    layouts = {1: "a process group", 2: "a 2-D process layout (a 2-D DeviceMesh)"}
    runs = layouts.get(runs_on, f"{runs_on}-D layouts")
    return f"runs on {runs}, the call has {layouts.get(call_has, f'a {call_has}-D layout')}"


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


def mask_argument(function: Callable[..., object], window: KeyWindow) -> KeyWindow | bool:
    """What to pass ``function`` (a communicator's ``prepare``, a spec's ``plan_reasons``) for
    the call's mask: ``window``; or, for one release, ``window.hides_later_keys`` with a
    ``DeprecationWarning`` to a 0.1 function whose parameter is still named ``causal``."""
    try:
        legacy = "causal" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read: pass the window
        legacy = False
    if not legacy:
        return window
    warnings.warn(
        f"{getattr(function, '__qualname__', function)!s} takes `causal`: ringdilated now "
        "passes the call's KeyWindow (name the parameter `window`); it gets "
        "window.hides_later_keys for one release",
        DeprecationWarning,
        stacklevel=2,
    )
    return window.hides_later_keys
