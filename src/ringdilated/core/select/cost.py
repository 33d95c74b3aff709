"""What each communicator would move for a sharded call, and the model ``communicator="auto"``
chooses by (docs/distributed.md, "Choosing a communicator").

For every rank, from every rank's shard plan (nothing is sent to compute this):

- **minimum**: the bytes of keys and values this rank's peers' queries see under the call's key
  window (the sum of its pairwise payloads, :func:`~ringdilated.core.plan.shards.payload`: with a
  sliding window only the keys within reach of a peer's queries); what ``ringpass`` sends.
  Head parallelism (``ulysses``) moves whole shards of its heads whatever the window.
- **sent / received**: what the communicator's delivery moves. Pairwise: the minimum. Broadcast
  (``allgather``): at each step of its schedule, one payload to every peer of the step, the union
  of what any peer needs, padded to the group's largest.
- **steps**: exchanges that move anything, each a synchronization the forward pass waits on;
  **hops**: the sequential hops inside them beyond that (a ring ``all_gather`` of ``P`` ranks
  passes each payload on ``P - 1`` times: ``P - 1`` hops a step; point-to-point and all-to-all
  exchanges run their pairs concurrently: none).

The modelled time of one forward exchange is ``steps * latency + hops * hop + max over ranks of
(sent + received) / bandwidth``, with a :class:`Link` per transport (rough defaults for gloo and
NCCL, not measured on GPUs; what decides is their ratios: the bytes one step's or one hop's
latency is worth). The delivery and parallelism are those the communicator's
:class:`~ringdilated.core.select.communicator_spec.CommunicatorSpec` declares, the steps its
instance's ``schedule``. ``auto`` takes the fitting communicator of least modelled time, priority
breaking ties, and one whose traffic cannot be modelled (its ``schedule`` fails) after every one
that can. The backward pass moves the same pieces again, plus the gradients of received pieces
back to their owners (the minimum, pairwise), so the comparison holds for training too.
Compute, and how well each communicator overlaps it, is not modelled: ``ringpass`` overlaps
each step with the previous step's compute, ``allgather`` its one step with the inner blocks'.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs

from ringdilated.core.contract.communicator import Communicator
from ringdilated.core.plan.heads import deal_heads, share_plan
from ringdilated.core.plan.shards import (
    ShardPlan,
    broadcast_positions,
    payload_positions,
    shard_plan,
)
from ringdilated.core.plan.window import KeyWindow, as_window
from ringdilated.core.select.communicator_spec import CommunicatorChoice

__all__ = ["GLOO", "NCCL", "Link", "PieceSize", "Traffic", "link_for", "traffic"]


@attrs.frozen
class Link:
    """A transport's rough figures: seconds per exchange step (started, waited on), seconds per
    hop inside a ring collective, and bytes per second per rank."""

    name: str
    latency_s: float
    hop_s: float
    bytes_per_s: float


GLOO = Link("gloo", latency_s=100e-6, hop_s=30e-6, bytes_per_s=1.5e9)
"""gloo over TCP on one host: about 0.1 ms per exchange, 1-2 GB/s (16 MiB in 10-15 ms)."""

NCCL = Link("nccl", latency_s=20e-6, hop_s=5e-6, bytes_per_s=50e9)
"""NCCL within a node (NVLink class): about 20 us per exchange, tens of GB/s per rank."""


def link_for(device_type: str) -> Link:
    """The link a call's tensors travel on: NCCL for CUDA tensors, gloo for anything else."""
    return NCCL if device_type == "cuda" else GLOO


@attrs.frozen
class PieceSize:
    """What one key/value position of one head weighs on the wire, and the link it crosses."""

    batch: int
    head_dim: int
    element_size: int
    link: Link = GLOO

    @property
    def position_bytes(self) -> int:
        """Bytes of one position's key and value for one key/value head, over the batch."""
        return 2 * self.batch * self.head_dim * self.element_size


@attrs.frozen
class Traffic:
    """One communicator's forward traffic for one call: per rank, bytes sent, received and the
    analytic minimum it must send; ``steps``: exchanges that move anything (the most of any
    rank); ``hops``: sequential hops inside them beyond that (see the module docstring)."""

    communicator: str
    sent: tuple[int, ...]
    received: tuple[int, ...]
    minimum: tuple[int, ...]
    steps: int
    link: Link
    hops: int = 0

    @property
    def above_minimum(self) -> int:
        """The most any rank sends beyond its minimum."""
        return max(s - m for s, m in zip(self.sent, self.minimum, strict=True))

    @property
    def seconds(self) -> float:
        """The modelled time of the forward exchange (see the module docstring)."""
        busiest = max(s + r for s, r in zip(self.sent, self.received, strict=True))
        latency = self.steps * self.link.latency_s + self.hops * self.link.hop_s
        return latency + busiest / self.link.bytes_per_s

    def describe(self) -> str:
        """One line: bytes sent and received per rank (the range over ranks), the most any rank
        sends above its minimum, the steps and the modelled time."""
        extra = self.above_minimum
        over = f", up to {_size(extra)} above the minimum" if extra else " (the minimum)"
        return (
            f"per rank sends {_span(self.sent)}{over}, receives {_span(self.received)}; "
            f"{self.steps} step(s), about {self.seconds * 1e3:.3g} ms on {self.link.name}"
        )


def _span(values: tuple[int, ...]) -> str:
    low, high = min(values), max(values)
    return _size(high) if low == high else f"{_size(low)} to {_size(high)}"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def traffic(
    chosen: CommunicatorChoice,
    plans: Sequence[ShardPlan],
    window: KeyWindow | bool,
    size: PieceSize,
    grid: tuple[int, int] | None = None,
) -> Traffic:
    """What the communicator ``chosen`` (a spec beside its instance; see the module docstring) moves
    in a forward pass over ``plans`` (every rank's, in flat rank order); ``grid``: ``(outer,
    inner)`` of a 2-D layout; ``window``: the call's key window (a bool: causal or not). Raises what
    the communicator's ``schedule`` raises, and ``ValueError`` for a hybrid communicator without a
    grid. Cached per problem (the plans are cached values, and hash once)."""
    ring = chosen.parts[1] if len(chosen.parts) == 2 else None
    # An instance (and a choice) hashes by identity: the resolver keeps one instance per name.
    return _traffic(
        chosen.name, chosen.instance, chosen.parallelism,  # type: ignore[arg-type]
        chosen.broadcast, ring, tuple(plans), as_window(window), size, grid,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _traffic(
    name: str,
    communicator: Communicator,
    parallelism: str,
    broadcast: bool,
    ring: CommunicatorChoice | None,
    plans: tuple[ShardPlan, ...],
    window: KeyWindow,
    size: PieceSize,
    grid: tuple[int, int] | None,
) -> Traffic:
    world = len(plans)
    unit = size.position_bytes
    schedules = [communicator.schedule(r, world) for r in range(world)]
    # Not payload(): its cache is the exchange's.
    counts = [payload_positions(plan, window) for plan in plans]

    def pairwise(src: int, dst: int) -> int:
        return unit * counts[src].get(dst, 0)

    minimum = tuple(sum(pairwise(r, y) for y in range(world) if y != r) for r in range(world))
    if parallelism == "heads":
        sent, received = _head_parallel_bytes(plans, size)
        return Traffic(name, sent, received, minimum, 2, size.link)
    if parallelism == "hybrid":
        if grid is None:
            raise ValueError(f"{name!r} runs on a 2-D layout: its traffic needs the grid's shape")
        if ring is None:
            raise ValueError(f"{name!r} has no sequence part to move pieces across its groups")
        return _hybrid_traffic(name, ring, plans, window, size, grid, minimum)
    if broadcast:
        width = unit * max(broadcast_positions(p, window) for p in plans)
        sent = tuple(width * sum(len(step) for step in schedules[r]) for r in range(world))
        steps = max(len(s) for s in schedules) if width else 0
        hops = max(sum(len(step) for step in s) for s in schedules) if width else 0
        return Traffic(name, sent, sent, minimum, steps, size.link, hops)
    received = tuple(sum(pairwise(y, r) for y in range(world) if y != r) for r in range(world))
    steps = max(
        sum(1 for step in schedules[r] if any(pairwise(r, y) or pairwise(y, r) for y in step))
        for r in range(world)
    )
    return Traffic(name, minimum, received, minimum, steps, size.link)


def _head_parallel_bytes(
    plans: Sequence[ShardPlan], size: PieceSize, starts: tuple[int, ...] | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Bytes each rank sends and receives in a head-parallel forward: its shard of every peer's
    query and key/value heads out, every peer's shard of its own heads in; then ``out`` (and
    ``lse``, 4 bytes a value, 8 for float64) of its heads at every peer's positions back.
    ``starts``: the ranks' shards (default: the plans'), whose heads are dealt over them."""
    first = plans[0]
    starts = first.starts if starts is None else starts
    world = len(starts) - 1
    length, heads, kv_heads = first.starts[-1], first.num_heads, first.num_kv_heads
    shares = deal_heads(first.pattern, length, heads, kv_heads, world)
    row = size.batch * size.head_dim * size.element_size  # one position of one head
    lse = size.batch * (8 if size.element_size == 8 else 4)
    n = [starts[r + 1] - starts[r] for r in range(world)]
    heads_in = [len(s.q_heads) + 2 * len(s.kv_heads) for s in shares]  # q, k, v
    sent, received = [], []
    for r in range(world):
        peers = [y for y in range(world) if y != r]
        out_back = sum(n[y] for y in peers) * len(shares[r].q_heads) * (row + lse)
        sent.append(n[r] * row * sum(heads_in[y] for y in peers) + out_back)
        results_in = n[r] * sum(len(shares[y].q_heads) for y in peers) * (row + lse)
        received.append(row * heads_in[r] * sum(n[y] for y in peers) + results_in)
    return tuple(sent), tuple(received)


def _hybrid_traffic(
    name: str,
    ring: CommunicatorChoice,
    plans: Sequence[ShardPlan],
    window: KeyWindow,
    size: PieceSize,
    grid: tuple[int, int],
    minimum: tuple[int, ...],
) -> Traffic:
    """A 2-D run: head parallelism within each inner group, over the group's chunk, then the
    pieces of each rank's share of the heads across its outer group (pairwise, the minimum for
    those heads, moved by ``ring``: the hybrid's sequence part)."""
    outer, inner = grid
    first = plans[0]
    starts, length = first.starts, first.starts[-1]
    sent, received = [0] * len(plans), [0] * len(plans)
    for o in range(outer):
        local = tuple(s - starts[o * inner] for s in starts[o * inner : (o + 1) * inner + 1])
        group_sent, group_received = _head_parallel_bytes(plans, size, local)
        for i in range(inner):
            sent[o * inner + i] += group_sent[i]
            received[o * inner + i] += group_received[i]
    chunks = tuple(starts[(o + 1) * inner] - starts[o * inner] for o in range(outer))
    shares = deal_heads(first.pattern, length, first.num_heads, first.num_kv_heads, inner)
    ring_steps = 0
    for i, share in enumerate(shares):
        across = [
            share_plan(
                shard_plan(
                    first.pattern, length, first.num_heads, first.num_kv_heads, o, outer,
                    first.documents, chunks,
                ),
                share,
            )
            for o in range(outer)
        ]  # fmt: skip
        moved = traffic(ring, across, window, size)
        ring_steps = max(ring_steps, moved.steps)
        for o in range(outer):
            sent[o * inner + i] += moved.sent[o]
            received[o * inner + i] += moved.received[o]
    return Traffic(name, tuple(sent), tuple(received), minimum, 2 + ring_steps, size.link)
