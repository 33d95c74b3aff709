"""What a rank computes and what moves between ranks, derived from the pattern (docs/spec.md,
section 3).

Rank ``r`` of ``P`` holds the contiguous positions ``[S_r, S_r + n_r)``, in rank order:
``n_r = L / P`` by default, or any positive lengths summing to ``L``. For every block of the
pattern, the segments a shard meets are of two kinds:

- **inner**: wholly inside the shard. Computed locally, exactly as on one process; nothing moves.
- **crossing**: spanning a shard boundary (at most two per shard and block). Each rank holding
  selected positions of such a segment is a *participant*; of its selected keys and values (its
  *piece*) each other participant is sent exactly those some query of its own piece sees, by
  the call's key window (:mod:`.window`): with no window every key, none toward an earlier rank
  when no query sees a later key (causal), and with bounds only the keys within reach of the
  receiver's queries (:meth:`Crossing.sent`: a contiguous run of the piece, since its queries
  are contiguous and each sees a run), so under a sliding window a rank sends only the last
  ``left`` positions' keys to the next rank, and nothing to a rank beyond its reach. Nothing
  else moves, so the bytes sent are the minimum.

A **query suffix** (docs/spec.md, sections 1 and 3: the queries are the last positions of the whole
sequence, from ``query_start`` on) keeps every key where it is and drops queries: inner blocks keep
the segments holding a query (:func:`~ringdilated.core.plan.pattern.from_query`), a crossing's
receiver is sent only the keys its pieces' query rows see (:meth:`Crossing.query_rows`), so a rank
without queries is sent nothing (a broadcast communicator still delivers the padded union to
it) and still sends its keys.

Every rank computes the same :class:`ShardPlan` from the same arguments, so senders and receivers
agree on sizes and order without asking each other.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Iterable

import attrs

from ringdilated.core.plan.pattern import Block, DilationPattern, Selection, from_query
from ringdilated.core.plan.window import KeyWindow, as_window

__all__ = [
    "Crossing",
    "Payload",
    "Piece",
    "ShardPlan",
    "Transfer",
    "broadcast_payload",
    "broadcast_positions",
    "payload",
    "payload_positions",
    "shard_plan",
    "shard_starts",
]


@attrs.frozen
class Piece:
    """The selected positions of one crossing segment held by ``rank``, in its local coordinates;
    ``origin``: the global position of that rank's first (its shard's start)."""

    rank: int
    selection: Selection
    origin: int = 0

    @property
    def count(self) -> int:
        return self.selection.count

    @property
    def first(self) -> int:
        """The global position of the piece's first selected position."""
        return self.origin + self.selection.start + self.selection.offset


@attrs.frozen
class Crossing:
    """One crossing segment of one block: every participant's piece (in rank order).
    ``query_start``: the first query position of the sequence (a query suffix; ``0``: every
    position is a query)."""

    block: Block
    pieces: tuple[Piece, ...]
    query_start: int = 0

    def piece(self, rank: int) -> Piece | None:
        return next((piece for piece in self.pieces if piece.rank == rank), None)

    def query_rows(self, rank: int) -> tuple[int, int]:
        """``(first, count)``: rows ``[first, count)`` of ``rank``'s piece are queries (those at
        positions ``>= query_start``); ``first == count`` when none is."""
        piece = self.piece(rank)
        assert piece is not None
        before = -(-(self.query_start - piece.first) // self.block.selection.rate)
        return min(piece.count, max(0, before)), piece.count

    def has_queries(self, rank: int) -> bool:
        """Whether ``rank``'s piece holds a query (a rank holding none computes nothing here)."""
        first, count = self.query_rows(rank)
        return first < count

    def query_selection(self, rank: int) -> Selection:
        """The query rows of ``rank``'s piece (:meth:`query_rows`, at least one), as one segment
        in that rank's local coordinates."""
        piece = self.piece(rank)
        assert piece is not None
        sel, (skip, _) = piece.selection, self.query_rows(rank)
        if self.query_start <= piece.origin + sel.start:  # the piece's span lies in the queries
            return sel
        first = sel.start + sel.offset + skip * sel.rate
        return Selection(first, 1, sel.start + sel.segment_length - first, sel.rate, 0)

    def sends(self, src: int, dst: int, window: KeyWindow | bool) -> bool:
        """Whether ``src``'s piece goes to ``dst``: both take part, ``window``'s send rule
        (:meth:`~ringdilated.core.plan.window.KeyWindow.sends`) lets it, and some query of
        ``dst``'s piece sees some key of ``src``'s (:meth:`sent`)."""
        if src == dst or self.piece(src) is None or self.piece(dst) is None:
            return False
        window = as_window(window)  # a 0.1 caller's bool: causal or not
        if not window.sends(src, dst):
            return False
        first, stop = self.sent(src, dst, window)
        return stop > first

    def window(self, src: int, dst: int, window: KeyWindow) -> KeyWindow:
        """The call's ``window`` (in positions) between ``dst``'s queries and ``src``'s keys, in
        their coordinates (query ``i`` of ``dst``'s query rows, :meth:`query_rows`; key ``j`` of
        ``src``'s piece): both lie on the segment's grid of stride ``rate``, so it is
        :meth:`~.window.KeyWindow.dilated` by the rate and shifted by how many selected
        positions ``dst``'s first query lies after ``src``'s first key."""
        queries, keys = self.piece(dst), self.piece(src)
        assert queries is not None and keys is not None
        rate = self.block.selection.rate
        skip = self.query_rows(dst)[0]
        return window.dilated(rate).shifted((queries.first - keys.first) // rate + skip)

    def sent(self, src: int, dst: int, window: KeyWindow) -> tuple[int, int]:
        """``(start, stop)``: the keys of ``src``'s piece (numbered from its first) that some
        query of ``dst``'s piece sees under ``window``, one contiguous run (``(0, 0)``: none,
        as when ``dst``'s piece holds no query). Every key of the piece without a window and
        a suffix; what moves from ``src`` to ``dst``."""
        keys = self.piece(src)
        assert keys is not None
        first, count = self.query_rows(dst)
        if first >= count:
            return 0, 0
        between = self.window(src, dst, window)
        return between.visible_keys(0, count - first, keys.count)


@attrs.frozen(cache_hash=True)
class ShardPlan:
    """Rank ``rank``'s work: inner blocks (local selections) and the crossings it takes part in.
    ``starts``: where each rank's shard begins, then the sequence length (``P + 1`` values);
    ``pattern``, ``num_heads``, ``num_kv_heads``, ``documents``: what it plans;
    ``query_start``: the first query position of the whole sequence (a query suffix; ``0``:
    every position is a query)."""

    rank: int
    world_size: int
    starts: tuple[int, ...]
    inner: tuple[Block, ...]
    crossings: tuple[Crossing, ...]
    pattern: DilationPattern
    num_heads: int
    num_kv_heads: int
    documents: tuple[tuple[int, int], ...] | None = None
    query_start: int = 0

    @property
    def shard_len(self) -> int:
        """The length of this rank's shard."""
        return self.starts[self.rank + 1] - self.starts[self.rank]

    @property
    def query_origin(self) -> int:
        """This rank's first query row in its shard: its ``q`` holds the shard's positions from
        here on (``shard_len``: none)."""
        return min(self.shard_len, max(0, self.query_start - self.starts[self.rank]))

    @property
    def query_length(self) -> int:
        """How many query positions this rank holds: the last ones of its shard."""
        return self.shard_len - self.query_origin

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


Transfer = tuple[Crossing, tuple[int, ...]]
"""A crossing and the positions (local to the sender, sorted) of its piece that move."""


def _sent_positions(crossing: Crossing, src: int, dst: int, window: KeyWindow) -> range:
    """The positions (local to ``src``) of ``src``'s piece of ``crossing`` that ``dst``'s
    queries see (:meth:`Crossing.sent`)."""
    piece = crossing.piece(src)
    assert piece is not None
    sel = piece.selection
    first, stop = crossing.sent(src, dst, window)
    local = sel.start + sel.offset
    return range(local + first * sel.rate, local + stop * sel.rate, sel.rate)


def _union(transfers: Iterable[Transfer]) -> dict[int, set[int]]:
    """Per key/value head, the positions of the transfers that read it."""
    union: dict[int, set[int]] = {}
    for c, positions in transfers:
        for h in range(c.block.heads.kv_start, c.block.heads.kv_stop):
            union.setdefault(h, set()).update(positions)
    return union


def _transfers(plan: ShardPlan, src: int, dst: int, window: KeyWindow) -> tuple[Transfer, ...]:
    """What ``src`` sends ``dst``: each crossing with the positions of its piece that move."""
    return tuple(
        (c, tuple(_sent_positions(c, src, dst, window))) for c in plan.transfers(src, dst, window)
    )


def _broadcast_transfers(plan: ShardPlan, window: KeyWindow) -> tuple[Transfer, ...]:
    """What ``plan.rank`` sends when one payload goes to every peer: each crossing whose piece
    it sends some peer, with the union of the positions any peer needs."""
    me = plan.rank
    out = []
    for c in plan.crossings:
        peers = [x.rank for x in c.pieces if c.sends(me, x.rank, window)]
        if peers:
            union = set().union(*(_sent_positions(c, me, x, window) for x in peers))
            out.append((c, tuple(sorted(union))))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def payload(plan: ShardPlan, src: int, dst: int, window: KeyWindow) -> Payload:
    """The deduplicated payload from ``src`` to ``dst`` (one of them is ``plan.rank``)."""
    return _payload(_transfers(plan, src, dst, as_window(window)))


@functools.lru_cache(maxsize=1024)
def broadcast_payload(plan: ShardPlan, window: KeyWindow) -> Payload:
    """What ``plan.rank`` sends when it sends one payload to every peer at once (a collective):
    the union of its payloads to each peer. A receiver finds its own payload inside it."""
    return _payload(_broadcast_transfers(plan, as_window(window)))


def payload_positions(plan: ShardPlan, window: KeyWindow) -> dict[int, int]:
    """For each rank ``plan.rank`` sends anything, ``payload(plan, plan.rank, dst,
    window).positions_count``, without building (or caching) the payloads: the distinct
    (key/value head, position) pairs it sends ``dst``. Work in the crossings' participants, not
    in the world size."""
    me = plan.rank
    sent: dict[int, list[Transfer]] = {}
    for c in plan.crossings:
        for other in c.pieces:
            if c.sends(me, other.rank, window):
                positions = tuple(_sent_positions(c, me, other.rank, window))
                sent.setdefault(other.rank, []).append((c, positions))
    return {dst: sum(map(len, _union(ts).values())) for dst, ts in sent.items()}


def broadcast_positions(plan: ShardPlan, window: KeyWindow) -> int:
    """``broadcast_payload(plan, window).positions_count``, without building the payload."""
    return sum(map(len, _union(_broadcast_transfers(plan, window)).values()))


def _payload(transfers: tuple[Transfer, ...]) -> Payload:
    union = _union(transfers)
    heads = tuple(sorted(union))
    positions = tuple(tuple(sorted(union[h])) for h in heads)
    where = {h: {p: i for i, p in enumerate(pos)} for h, pos in zip(heads, positions, strict=True)}
    index = tuple(
        tuple(
            tuple(where[h][p] for p in sent)
            for h in range(c.block.heads.kv_start, c.block.heads.kv_stop)
        )
        for c, sent in transfers
    )
    return Payload(tuple(c for c, _ in transfers), heads, positions, index)


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
    query_start: int = 0,
) -> ShardPlan:
    """The plan of ``rank`` for a global sequence of ``seq_len`` split over ``world_size`` ranks
    (equal shards, or shards of ``lengths``; see :func:`shard_starts`), made of ``documents``
    (global ``[start, stop)`` spans; ``None``: one document). A segment of a document that
    crosses a shard boundary is a crossing like any other; one that ends at a document boundary
    is never joined to the next document's, so nothing travels across it. ``query_start``: the
    queries are the positions from there on (a query suffix): inner segments without a query are
    dropped, and crossings send only what the queries see (:meth:`Crossing.sent`)."""
    starts = shard_starts(seq_len, world_size, lengths)
    lo, hi = starts[rank], starts[rank + 1]
    origin = min(hi, max(lo, query_start)) - lo  # this rank's first query row
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
            shifted = attrs.evolve(block, selection=attrs.evolve(local, start=local.start - lo))
            inner.extend(from_query(shifted, origin))
        for s in range(first, last):
            if inside_first <= s < inside_last:
                continue
            segment = sel.segments(s, 1)
            pieces = []
            owner = bisect.bisect_right(starts, segment.start) - 1
            for x in range(owner, bisect.bisect_left(starts, segment.stop)):
                piece = _local(segment, starts, x)
                if piece is not None:
                    pieces.append(Piece(x, piece, starts[x]))
            if any(p.rank == rank for p in pieces):
                crossings.append(Crossing(block, tuple(pieces), query_start))
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
        query_start,
    )
