"""The dilation pattern: which positions each head selects (docs/spec.md, section 2).

A :class:`DilationPattern` is a frozen value. For a sequence length and head counts it answers with
:class:`Block` descriptions: a run of query heads, the key/value heads they read, and a
:class:`Selection` of positions. A selection is always a *stride* (every ``rate``-th position
of each segment, starting at ``offset``), so the driver turns it into a strided view of
``(B, L, H, D)`` tensors: no index tensors, no gathers, nothing device-specific to cache.

Call flow::

    pattern = DilationPattern((2048, 4096), (1, 2))          # validated here, once
    blocks = pattern.blocks(seq_len=L, num_heads=H, num_kv_heads=Hkv)   # cached per (L, H, Hkv)
    for block in blocks: ... selection.view(q) ...
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Literal, TypeAlias

import attrs
import torch

__all__ = [
    "MODES",
    "Block",
    "DilationPattern",
    "HeadRun",
    "Mode",
    "Selection",
    "from_query",
    "split_by_kv",
]

Mode: TypeAlias = Literal["head_groups", "longnet"]
MODES: tuple[Mode, ...] = ("head_groups", "longnet")


def _to_positive_ints(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of positive ints, got {value!r}")
    items = tuple(value)
    if not items:
        raise ValueError(f"{name} must hold at least one value, got {value!r}")
    for item in items:
        # bool is an int subclass; True as a segment length is a bug, not a 1.
        if isinstance(item, bool) or not isinstance(item, int):
            raise TypeError(f"{name} must hold ints, got {item!r} in {value!r}")
        if item < 1:
            raise ValueError(f"{name} must be positive, got {item} in {value!r}")
    return items


def _segment_lengths(value: object) -> tuple[int, ...]:
    return _to_positive_ints("segment_lengths", value)


def _dilation_rates(value: object) -> tuple[int, ...]:
    return _to_positive_ints("dilation_rates", value)


def _check_mode(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {value!r}")


@attrs.frozen
class Selection:
    """Positions ``start + s * segment_length + offset + j * rate`` for ``s < num_segments`` and
    ``j < count``: the selected positions of ``num_segments`` consecutive segments.

    A partial last segment is a selection of its own with ``num_segments == 1`` and the partial
    length as ``segment_length``.
    """

    start: int
    num_segments: int
    segment_length: int
    rate: int
    offset: int

    @property
    def count(self) -> int:
        """Selected positions per segment."""
        return max(0, -(-(self.segment_length - self.offset) // self.rate))

    @property
    def stop(self) -> int:
        """One past the last position of the covered segments."""
        return self.start + self.num_segments * self.segment_length

    def segments(self, first: int, count: int) -> Selection:
        """The sub-selection of ``count`` segments starting at segment ``first``."""
        if not 0 <= first < first + count <= self.num_segments:
            raise ValueError(
                f"segments [{first}, {first + count}) outside [0, {self.num_segments})"
            )
        return attrs.evolve(
            self, start=self.start + first * self.segment_length, num_segments=count
        )

    def view(self, x: torch.Tensor, dim: int = 1, origin: int = 0) -> torch.Tensor:
        """A strided view of ``x``, ``dim`` (the sequence) replaced by ``(num_segments, count)``.

        For ``(B, L, H, D)`` and ``dim=1`` this is ``(B, num_segments, count, H, D)``; for an
        ``lse`` of ``(B, H, L)`` and ``dim=2`` it is ``(B, H, num_segments, count)``. No copy.
        ``origin``: the position of ``x``'s first row (a query suffix's tensors start there).
        """
        region = x.narrow(dim, self.start - origin, self.num_segments * self.segment_length)
        segmented = torch.unflatten(region, dim, (self.num_segments, self.segment_length))
        span = self.segment_length - self.offset
        # A rate at or past the span selects one position: step by the span instead, so a huge
        # rate never becomes a stride (rate * stride would overflow int64).
        step = min(self.rate, max(1, span))
        return segmented.narrow(dim + 1, self.offset, span)[
            (slice(None),) * (dim + 1) + (slice(None, None, step),)
        ]


@attrs.frozen
class HeadRun:
    """Query heads ``[q_start, q_stop)`` reading key/value heads ``[kv_start, kv_stop)``.

    The query-head count is a multiple of the key/value-head count and query head
    ``q_start + j`` reads key/value head ``kv_start + j // (q count / kv count)``: the grouped-query
    layout every kernel accepts.
    """

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start


@attrs.frozen
class Block:
    """One attention problem of the pattern: pattern ``index`` on ``heads`` over ``selection``.

    ``queries``: the query positions when only the last ones of the selection's single segment
    are queries (a query suffix starting inside it; docs/spec.md, section 1), ``None`` when
    every selected position is a query.
    """

    index: int
    heads: HeadRun
    selection: Selection
    queries: Selection | None = None

    @property
    def query_selection(self) -> Selection:
        return self.selection if self.queries is None else self.queries


@attrs.frozen
class DilationPattern:
    """Segment lengths, dilation rates and mode of a dilated attention (docs/spec.md, section 2).

    Validated on construction: both sequences hold positive ints, the same number of them, and
    ``1 <= dilation_rates[i] <= segment_lengths[i]``; ``mode`` is ``"head_groups"`` or
    ``"longnet"``.
    """

    segment_lengths: tuple[int, ...] = attrs.field(converter=_segment_lengths)
    dilation_rates: tuple[int, ...] = attrs.field(converter=_dilation_rates)
    mode: Mode = attrs.field(default="head_groups", validator=_check_mode)

    def __attrs_post_init__(self) -> None:
        if len(self.segment_lengths) != len(self.dilation_rates):
            raise ValueError(
                "segment_lengths and dilation_rates must have the same length, got "
                f"{len(self.segment_lengths)} segment lengths {self.segment_lengths} and "
                f"{len(self.dilation_rates)} dilation rates {self.dilation_rates}"
            )
        for i, (w, r) in enumerate(zip(self.segment_lengths, self.dilation_rates, strict=True)):
            if r > w:
                raise ValueError(
                    f"dilation_rates[{i}] = {r} exceeds segment_lengths[{i}] = {w}; "
                    "each rate must satisfy 1 <= rate <= segment length"
                )

    @property
    def num_patterns(self) -> int:
        """``G``: the number of (segment length, dilation rate) pairs."""
        return len(self.segment_lengths)

    def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """Raise ``ValueError`` unless the head counts fit this pattern and each other."""
        if num_heads < 1 or num_kv_heads < 1:
            raise ValueError(
                f"head counts must be positive, got {num_heads} query and {num_kv_heads} "
                "key/value heads"
            )
        if num_heads % num_kv_heads:
            raise ValueError(
                f"key/value heads ({num_kv_heads}) must divide query heads ({num_heads}) for "
                "grouped-query attention"
            )
        if self.mode == "head_groups" and num_heads < self.num_patterns:
            raise ValueError(
                f"mode 'head_groups' splits heads among {self.num_patterns} patterns and needs "
                f"num_heads >= {self.num_patterns}, got {num_heads}"
            )

    def group_sizes(self, num_heads: int) -> tuple[int, ...]:
        """Heads per pattern (``head_groups``): ``H // G``, one more for the first ``H % G``."""
        base, extra = divmod(num_heads, self.num_patterns)
        return tuple(base + (i < extra) for i in range(self.num_patterns))

    def head_offsets(self, num_heads: int) -> tuple[tuple[int, int, int, int], ...]:
        """``(pattern, offset, first head, stop head)`` for every run of heads sharing an offset.

        ``head_groups``: group ``i`` uses offset ``i % r_i``. ``longnet``: under pattern ``i``,
        head ``h`` uses offset ``(h * r_i) // H``; runs with no heads are left out.
        """
        if self.mode == "head_groups":
            bounds = (0, *itertools.accumulate(self.group_sizes(num_heads)))
            rates = enumerate(self.dilation_rates)
            return tuple((i, i % r, bounds[i], bounds[i + 1]) for i, r in rates)
        runs: list[tuple[int, int, int, int]] = []
        # Walk the heads, not the offsets: the work is O(H) whatever the rate (a rate of 2**62
        # must not loop 2**62 times).
        for i, r in enumerate(self.dilation_rates):
            first = 0
            while first < num_heads:
                offset = first * r // num_heads
                # The last head whose offset (h * r) // H is still ``offset``.
                stop = min(num_heads, -(-(offset + 1) * num_heads // r))
                runs.append((i, offset, first, stop))
                first = stop
        return tuple(runs)

    def blocks(self, seq_len: int, num_heads: int, num_kv_heads: int) -> tuple[Block, ...]:
        """Every attention problem for a sequence of ``seq_len``, in pattern order. Cached."""
        return _blocks(self, seq_len, num_heads, num_kv_heads)

    def document_blocks(
        self,
        documents: tuple[tuple[int, int], ...],
        num_heads: int,
        num_kv_heads: int,
        query_start: int = 0,
    ) -> tuple[Block, ...]:
        """The blocks of a sequence made of ``documents`` (``[start, stop)`` spans, each attended
        as its own sequence), keeping only queries at positions ``>= query_start``: a segment
        wholly before it is dropped, one it starts inside keeps all its keys and the queries
        from it on (:attr:`Block.queries`). Cached; the work is O(documents x blocks)."""
        return _document_blocks(self, documents, num_heads, num_kv_heads, query_start)

    def flops(self, seq_len: int, num_heads: int, head_dim: int, causal: bool = False) -> int:
        """Multiply-add FLOPs of the pattern's attention work (``4 * n_q * n_k * D`` a block).

        Counts ``QK^T`` and ``PV`` over the selected pairs only; with ``causal`` only the pairs on
        or below the diagonal. This is the figure benchmarks divide by time.
        """
        total = 0
        for block in self.blocks(seq_len, num_heads, num_heads):
            n = block.selection.count
            pairs = n * (n + 1) // 2 if causal else n * n
            total += 4 * pairs * head_dim * block.heads.num_heads * block.selection.num_segments
        return total


def split_by_kv(first: int, stop: int, group: int) -> list[HeadRun]:
    """Split query heads ``[first, stop)`` so each run maps onto whole key/value heads."""
    runs: list[HeadRun] = []
    h = first
    while h < stop:
        end = h if h % group else h + (stop - h) // group * group  # whole key/value heads
        if end == h:  # a run inside one key/value head: up to the next boundary
            end = min(stop, (h // group + 1) * group)
            runs.append(HeadRun(h, end, h // group, h // group + 1))
        else:
            runs.append(HeadRun(h, end, h // group, end // group))
        h = end
    return runs


@functools.lru_cache(maxsize=64)
def _document_blocks(
    pattern: DilationPattern,
    documents: tuple[tuple[int, int], ...],
    num_heads: int,
    num_kv_heads: int,
    query_start: int,
) -> tuple[Block, ...]:
    blocks: list[Block] = []
    for start, stop in documents:
        if stop <= query_start:
            continue
        for block in _blocks(pattern, stop - start, num_heads, num_kv_heads):
            shifted = attrs.evolve(block.selection, start=block.selection.start + start)
            blocks.extend(from_query(attrs.evolve(block, selection=shifted), query_start))
    return tuple(blocks)


def from_query(block: Block, query_start: int) -> list[Block]:
    """``block`` restricted to queries at positions ``>= query_start``: the segments whose last
    selected position is before it dropped; the one that starts before it keeps all its keys and
    gets :attr:`Block.queries` (so that no query-side view reaches before ``query_start``)."""
    sel = block.selection
    if sel.start >= query_start:
        return [block]
    first_selected = sel.start + sel.offset
    last = (sel.count - 1) * sel.rate  # of a segment's selected positions, from its first
    # The first segment whose last selected position is a query.
    j = max(0, -(-(query_start - first_selected - last) // sel.segment_length))
    if j >= sel.num_segments:
        return []
    segment_start = sel.start + j * sel.segment_length
    if segment_start >= query_start:
        return [attrs.evolve(block, selection=sel.segments(j, sel.num_segments - j))]
    segment_first = segment_start + sel.offset
    skip = max(0, -(-(query_start - segment_first) // sel.rate))  # selected keys before it
    q_start = segment_first + skip * sel.rate
    queries = Selection(q_start, 1, segment_start + sel.segment_length - q_start, sel.rate, 0)
    blocks = [attrs.evolve(block, selection=sel.segments(j, 1), queries=queries)]
    if j + 1 < sel.num_segments:
        rest = sel.segments(j + 1, sel.num_segments - j - 1)
        blocks.append(attrs.evolve(block, selection=rest))
    return blocks


@functools.lru_cache(maxsize=256)
def _blocks(
    pattern: DilationPattern, seq_len: int, num_heads: int, num_kv_heads: int
) -> tuple[Block, ...]:
    if seq_len < 1:
        raise ValueError(f"sequence length must be positive, got {seq_len}")
    pattern.check_heads(num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    blocks: list[Block] = []
    for index, offset, first, stop in pattern.head_offsets(num_heads):
        w, r = pattern.segment_lengths[index], pattern.dilation_rates[index]
        full, tail = divmod(seq_len, w)
        selections = []
        if full:
            selections.append(Selection(0, full, w, r, offset))
        if tail > offset:
            selections.append(Selection(full * w, 1, tail, r, offset))
        for run in split_by_kv(first, stop, group):
            blocks.extend(Block(index, run, selection) for selection in selections)
    return tuple(blocks)
