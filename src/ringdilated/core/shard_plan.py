"""What a rank computes and what moves between ranks, derived from the pattern (docs/spec.md,
section 3).

Rank ``r`` of ``P`` holds positions ``[r * S, (r + 1) * S)``, ``S = L / P``. For every block of the
pattern, the segments a shard meets are of two kinds:

- **inner**: wholly inside the shard. Computed locally, exactly as on one process; nothing moves.
- **crossing**: spanning a shard boundary (at most two per shard and block). Each rank holding
  selected positions of such a segment is a *participant*; its selected keys and values (its
  *piece*) go to every other participant whose queries see them: every other participant without
  a causal mask, only later ones with it. Nothing else moves, so the bytes sent are the minimum.

Every rank computes the same :class:`ShardPlan` from the same arguments, so senders and receivers
agree on sizes and order without asking each other.
"""

from __future__ import annotations

import functools

import attrs

from ringdilated.core.pattern import Block, DilationPattern, Selection

__all__ = ["Crossing", "Payload", "Piece", "ShardPlan", "payload", "shard_plan"]


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
        for piece in self.pieces:
            if piece.rank == rank:
                return piece
        return None

    def sends(self, src: int, dst: int, causal: bool) -> bool:
        """Whether ``src``'s piece goes to ``dst``: both take part, and ``src < dst`` if causal."""
        if src == dst or self.piece(src) is None or self.piece(dst) is None:
            return False
        return src < dst or not causal


@attrs.frozen
class ShardPlan:
    """Rank ``rank``'s work: inner blocks (local selections) and the crossings it takes part in."""

    rank: int
    world_size: int
    shard_len: int
    inner: tuple[Block, ...]
    crossings: tuple[Crossing, ...]

    def transfers(self, src: int, dst: int, causal: bool) -> tuple[Crossing, ...]:
        """The crossings whose ``src`` piece goes to ``dst``, in the fixed order both agree on."""
        return tuple(c for c in self.crossings if c.sends(src, dst, causal))

    def elements_sent(self, head_dim: int, batch: int, causal: bool) -> int:
        """Key plus value elements this rank sends in a forward pass: the analytic minimum."""
        return sum(
            payload(self, self.rank, dst, causal).elements(batch, head_dim)
            for dst in range(self.world_size)
        )


@attrs.frozen
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


def _piece_positions(piece: Piece) -> tuple[int, ...]:
    sel = piece.selection
    return tuple(sel.start + sel.offset + j * sel.rate for j in range(sel.count))


@functools.lru_cache(maxsize=1024)
def payload(plan: ShardPlan, src: int, dst: int, causal: bool) -> Payload:
    """The deduplicated payload from ``src`` to ``dst`` (one of them is ``plan.rank``)."""
    crossings = plan.transfers(src, dst, causal)
    union: dict[int, set[int]] = {}
    for c in crossings:
        piece = c.piece(src)
        assert piece is not None
        for h in range(c.block.heads.kv_start, c.block.heads.kv_stop):
            union.setdefault(h, set()).update(_piece_positions(piece))
    heads = tuple(sorted(union))
    positions = tuple(tuple(sorted(union[h])) for h in heads)
    where = {h: {p: i for i, p in enumerate(pos)} for h, pos in zip(heads, positions, strict=True)}
    index = []
    for c in crossings:
        piece = c.piece(src)
        assert piece is not None
        own = _piece_positions(piece)
        index.append(
            tuple(
                tuple(where[h][p] for p in own)
                for h in range(c.block.heads.kv_start, c.block.heads.kv_stop)
            )
        )
    return Payload(crossings, heads, positions, tuple(index))


def _local(selection: Selection, lo: int, hi: int, shard_start: int) -> Selection | None:
    """The selected positions of ``selection``'s single segment that lie in ``[lo, hi)``, local."""
    first = selection.start + selection.offset
    if first < lo:
        first += -(-(lo - first) // selection.rate) * selection.rate
    if first >= hi:
        return None
    return Selection(lo - shard_start, 1, hi - lo, selection.rate, first - lo)


@functools.lru_cache(maxsize=256)
def shard_plan(
    pattern: DilationPattern,
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    rank: int,
    world_size: int,
    documents: tuple[tuple[int, int], ...] | None = None,
) -> ShardPlan:
    """The plan of ``rank`` for a global sequence of ``seq_len`` split over ``world_size`` ranks,
    made of ``documents`` (global ``[start, stop)`` spans; ``None``: one document). A segment of a
    document that crosses a shard boundary is a crossing like any other; one that ends at a
    document boundary is never joined to the next document's, so nothing travels across it."""
    if seq_len % world_size:
        raise ValueError(
            f"the global sequence length {seq_len} must be a multiple of the world size "
            f"{world_size} (contiguous equal shards)"
        )
    shard = seq_len // world_size
    lo, hi = rank * shard, (rank + 1) * shard
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
            for x in range(segment.start // shard, (segment.stop - 1) // shard + 1):
                piece = _local(
                    segment,
                    max(segment.start, x * shard),
                    min(segment.stop, (x + 1) * shard),
                    x * shard,
                )
                if piece is not None:
                    pieces.append(Piece(x, piece))
            if any(p.rank == rank for p in pieces):
                crossings.append(Crossing(block, tuple(pieces)))
    return ShardPlan(rank, world_size, shard, tuple(inner), tuple(crossings))
