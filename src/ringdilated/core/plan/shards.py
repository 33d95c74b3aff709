"""What a rank computes and what moves between ranks, derived from the pattern (docs/spec.md,
section 3).

Rank ``r`` of ``P`` holds the contiguous positions ``[S_r, S_r + n_r)``, in rank order:
``n_r = L / P`` by default, or any positive lengths summing to ``L``. For every block of the
pattern, the segments a shard meets are of two kinds:

- **inner**: wholly inside the shard. Computed locally, exactly as on one process; nothing moves.
- **crossing**: spanning a shard boundary (at most two per shard and block). Each rank holding
  selected positions of such a segment is a *participant*; its selected keys and values (its
  *piece*) go to every other participant whose queries see them (by the call's key window,
  :mod:`.window`): every other participant, or only later ones when no query sees a later key.
  Nothing else moves, so the bytes sent are the minimum.

Every rank computes the same :class:`ShardPlan` from the same arguments, so senders and receivers
agree on sizes and order without asking each other.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Iterable

import attrs

from ringdilated.core.plan.pattern import Block, DilationPattern, Selection
from ringdilated.core.plan.window import KeyWindow, as_window

__all__ = [
    "Crossing",
    "Payload",
    "Piece",
    "ShardPlan",
    "broadcast_payload",
    "broadcast_positions",
    "payload",
    "payload_positions",
    "shard_plan",
    "shard_starts",
]


@attrs.frozen
class Piece:
    """The selected positions of one crossing segment held by ``rank``, in its local coordinates."""

    rank: int
    selection: Selection

    @property
    def count(self) -> int:
        return self.selection.count


@attrs.frozen
class Crossing:
    """One crossing segment of one block: every participant's piece (in rank order)."""

    block: Block
    pieces: tuple[Piece, ...]

    def piece(self, rank: int) -> Piece | None:
        return next((piece for piece in self.pieces if piece.rank == rank), None)

    def sends(self, src: int, dst: int, window: KeyWindow | bool) -> bool:
        """Whether ``src``'s piece goes to ``dst``: both take part, and ``window``'s send rule
        (:meth:`~ringdilated.core.plan.window.KeyWindow.sends`) lets it."""
        if src == dst or self.piece(src) is None or self.piece(dst) is None:
            return False
        return as_window(window).sends(src, dst)  # a 0.1 caller's bool: causal or not


@attrs.frozen(cache_hash=True)
class ShardPlan:
    """Rank ``rank``'s work: inner blocks (local selections) and the crossings it takes part in.
    ``starts``: where each rank's shard begins, then the sequence length (``P + 1`` values);
    ``pattern``, ``num_heads``, ``num_kv_heads``, ``documents``: what it plans."""

    rank: int
    world_size: int
    starts: tuple[int, ...]
    inner: tuple[Block, ...]
    crossings: tuple[Crossing, ...]
    pattern: DilationPattern
    num_heads: int
    num_kv_heads: int
    documents: tuple[tuple[int, int], ...] | None = None

    @property
    def shard_len(self) -> int:
        """The length of this rank's shard."""
        return self.starts[self.rank + 1] - self.starts[self.rank]

    def transfers(self, src: int, dst: int, window: KeyWindow) -> tuple[Crossing, ...]:
        """The crossings whose ``src`` piece goes to ``dst``, in the fixed order both agree on."""
        return tuple(c for c in self.crossings if c.sends(src, dst, window))

    def elements_sent(self, head_dim: int, batch: int, window: KeyWindow) -> int:
        """Key plus value elements this rank sends in a forward pass: the analytic minimum."""
        return sum(
            payload(self, self.rank, dst, window).elements(batch, head_dim)
            for dst in range(self.world_size)
        )


@attrs.frozen(cache_hash=True)
class Payload:
    """What ``src`` sends ``dst``: for each key/value head, the union of the positions (local to
    ``src``, sorted) that any of ``crossings`` needs. A key two patterns need travels once."""

    crossings: tuple[Crossing, ...]
    heads: tuple[int, ...]
    positions: tuple[tuple[int, ...], ...]
    #: for each crossing, for each of its key/value heads: indices into that head's positions
    index: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def positions_count(self) -> int:
        return sum(len(p) for p in self.positions)

    def elements(self, batch: int, head_dim: int) -> int:
        """Key plus value elements of this payload for ``batch`` rows of ``head_dim``."""
        return 2 * batch * head_dim * self.positions_count

    def __bool__(self) -> bool:
        return bool(self.crossings)


def _piece_positions(crossing: Crossing, rank: int) -> range:
    """The selected positions (local to ``rank``) of ``rank``'s piece of ``crossing``."""
    piece = crossing.piece(rank)
    assert piece is not None
    sel = piece.selection
    first = sel.start + sel.offset
    return range(first, first + sel.count * sel.rate, sel.rate)


def _union(crossings: Iterable[Crossing], src: int) -> dict[int, set[int]]:
    """Per key/value head, the positions of ``src``'s pieces of ``crossings`` that read it."""
    union: dict[int, set[int]] = {}
    for c in crossings:
        positions = _piece_positions(c, src)
        for h in range(c.block.heads.kv_start, c.block.heads.kv_stop):
            union.setdefault(h, set()).update(positions)
    return union


def _broadcast_crossings(plan: ShardPlan, window: KeyWindow) -> tuple[Crossing, ...]:
    """The crossings whose piece ``plan.rank`` sends to some peer."""
    me = plan.rank
    return tuple(c for c in plan.crossings if any(c.sends(me, x.rank, window) for x in c.pieces))


@functools.lru_cache(maxsize=1024)
def payload(plan: ShardPlan, src: int, dst: int, window: KeyWindow) -> Payload:
    """The deduplicated payload from ``src`` to ``dst`` (one of them is ``plan.rank``)."""
    return _payload(plan.transfers(src, dst, window), src)


@functools.lru_cache(maxsize=1024)
def broadcast_payload(plan: ShardPlan, window: KeyWindow) -> Payload:
    """What ``plan.rank`` sends when it sends one payload to every peer at once (a collective):
    the union of its payloads to each peer. A receiver finds its own payload inside it."""
    return _payload(_broadcast_crossings(plan, window), plan.rank)


def payload_positions(plan: ShardPlan, window: KeyWindow) -> dict[int, int]:
    """For each rank ``plan.rank`` sends anything, ``payload(plan, plan.rank, dst,
    window).positions_count``, without building (or caching) the payloads: the distinct
    (key/value head, position) pairs it sends ``dst``. Work in the crossings' participants, not
    in the world size."""
    me = plan.rank
    sent: dict[int, list[Crossing]] = {}
    for c in plan.crossings:
        for other in c.pieces:
            if c.sends(me, other.rank, window):
                sent.setdefault(other.rank, []).append(c)
    return {dst: sum(map(len, _union(cs, me).values())) for dst, cs in sent.items()}


def broadcast_positions(plan: ShardPlan, window: KeyWindow) -> int:
    """``broadcast_payload(plan, window).positions_count``, without building the payload."""
    return sum(map(len, _union(_broadcast_crossings(plan, window), plan.rank).values()))


def _payload(crossings: tuple[Crossing, ...], src: int) -> Payload:
    union = _union(crossings, src)
    heads = tuple(sorted(union))
    positions = tuple(tuple(sorted(union[h])) for h in heads)
    where = {h: {p: i for i, p in enumerate(pos)} for h, pos in zip(heads, positions, strict=True)}
    index = tuple(
        tuple(
            tuple(where[h][p] for p in _piece_positions(c, src))
            for h in range(c.block.heads.kv_start, c.block.heads.kv_stop)
        )
        for c in crossings
    )
    return Payload(crossings, heads, positions, index)


def _local(segment: Selection, starts: tuple[int, ...], rank: int) -> Selection | None:
    """The selected positions of ``segment`` (a single segment) in ``rank``'s shard, local to it
    (``starts``: where each shard begins, then the sequence length)."""
    lo, hi = max(segment.start, starts[rank]), min(segment.stop, starts[rank + 1])
    first = segment.start + segment.offset
    if first < lo:
        first += -(-(lo - first) // segment.rate) * segment.rate
    if first >= hi:
        return None
    return Selection(lo - starts[rank], 1, hi - lo, segment.rate, first - lo)


def shard_starts(
    seq_len: int, world_size: int, lengths: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """Where each of ``world_size`` contiguous shards of ``seq_len`` begins, then ``seq_len``:
    equal shards when ``lengths`` is ``None``, else shards of ``lengths`` (each positive, one per
    rank, summing to ``seq_len``). Raises ``ValueError`` naming the rule a value breaks."""
    if lengths is None:
        if seq_len % world_size:
            raise ValueError(
                f"the global sequence length {seq_len} must be a multiple of the world size "
                f"{world_size} for equal shards (or pass every rank's shard length)"
            )
        lengths = (seq_len // world_size,) * world_size
    empty = next((r for r, n in enumerate(lengths) if n < 1), None)
    if empty is not None:
        raise ValueError(
            f"every rank's shard must hold at least one position, got shard lengths {lengths} "
            f"(rank {empty} holds {lengths[empty]})"
        )
    if len(lengths) != world_size or sum(lengths) != seq_len:
        raise ValueError(
            f"shard lengths {lengths} must be {world_size} positive lengths summing to the "
            f"sequence length {seq_len}"
        )
    return (0, *itertools.accumulate(lengths))


@functools.lru_cache(maxsize=256)
def shard_plan(
    pattern: DilationPattern,
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    rank: int,
    world_size: int,
    documents: tuple[tuple[int, int], ...] | None = None,
    lengths: tuple[int, ...] | None = None,
) -> ShardPlan:
    """The plan of ``rank`` for a global sequence of ``seq_len`` split over ``world_size`` ranks
    (equal shards, or shards of ``lengths``; see :func:`shard_starts`), made of ``documents``
    (global ``[start, stop)`` spans; ``None``: one document). A segment of a document that
    crosses a shard boundary is a crossing like any other; one that ends at a document boundary
    is never joined to the next document's, so nothing travels across it."""
    starts = shard_starts(seq_len, world_size, lengths)
    lo, hi = starts[rank], starts[rank + 1]
    inner: list[Block] = []
    crossings: list[Crossing] = []
    blocks = (
        pattern.blocks(seq_len, num_heads, num_kv_heads)
        if documents is None
        else pattern.document_blocks(documents, num_heads, num_kv_heads)
    )
    for block in blocks:
        sel = block.selection
        w = sel.segment_length
        # Segments of this selection that meet the shard: [first, last).
        first = max(0, (lo - sel.start) // w)
        last = min(sel.num_segments, -(-(hi - sel.start) // w))
        inside_first = max(first, -(-(lo - sel.start) // w))
        inside_last = min(last, (hi - sel.start) // w)
        if inside_last > inside_first:
            local = sel.segments(inside_first, inside_last - inside_first)
            inner.append(attrs.evolve(block, selection=attrs.evolve(local, start=local.start - lo)))
        for s in range(first, last):
            if inside_first <= s < inside_last:
                continue
            segment = sel.segments(s, 1)
            pieces = []
            owner = bisect.bisect_right(starts, segment.start) - 1
            for x in range(owner, bisect.bisect_left(starts, segment.stop)):
                piece = _local(segment, starts, x)
                if piece is not None:
                    pieces.append(Piece(x, piece))
            if any(p.rank == rank for p in pieces):
                crossings.append(Crossing(block, tuple(pieces)))
    return ShardPlan(
        rank,
        world_size,
        starts,
        tuple(inner),
        tuple(crossings),
        pattern,
        num_heads,
        num_kv_heads,
        documents,
    )
