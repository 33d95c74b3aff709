"""A key window's block-sparse structure as a FlexAttention ``BlockMask``, with no dense mask.

``create_block_mask`` evaluates the ``mask_mod`` over a dense ``q_len x k_len`` bool tensor, then
sums it per block (torch 2.13, ``torch/nn/attention/flex_attention.py``: ``create_mask``,
``_convert_mask_to_block_mask``): 16 GiB at 128k. For the offset mask (key ``j`` visible to query
``i`` iff ``j <= i + offset``) the structure is arithmetic on block numbers, built here on the
device in a few ``(blocks,)`` vectors and four ``(blocks, blocks)`` int32 index tables.

Terms. Query blocks hold ``bq`` rows, key blocks ``bk`` columns; ``nq = ceil(Lq / bq)``,
``nk = ceil(Lk / bk)``; a *whole* block is not cut by its length (``Lq // bq`` whole query
blocks). Torch pads the dense mask with ``False`` to whole blocks, so a block is *full* (the
kernel skips the ``mask_mod``) iff all ``bq * bk`` of its entries are visible, which a cut block
never is; it is *partial* iff some but not all are. Then, for the offset mask:

- query block ``m`` sees key blocks ``0 .. visible(m) - 1``, its last row
  ``last(m) = min((m + 1) * bq, Lq) - 1`` seeing furthest:
  ``visible(m) = clamp(floor((last(m) + offset) / bk) + 1, 0, nk)``;
- of these, ``0 .. full(m) - 1`` are full, its first row seeing each block's last key:
  ``full(m) = clamp(floor((m * bq + offset + 1) / bk), 0, Lk // bk)`` for a whole ``m``, else 0;
  ``full(m) .. visible(m) - 1`` are partial.

The backward reads the transpose. ``BlockMask.from_kv_blocks`` derives it with
``_transpose_ordered``: a dense block grid filled by a vmapped index assignment, which fake CUDA
tensors refuse on a CPU-only torch. So it is computed here too, and all eight tables go to
``BlockMask``'s own constructor (which ``from_kv_blocks`` ends by calling). Per key block ``n``:

- the first query block that sees it:
  ``first(n) = max(floor((n * bk - offset) / bq), 0)`` if query ``Lq - 1`` sees key ``n * bk``,
  else ``nq``;
- the first whole query block for which it is full:
  ``full_from(n) = clamp(ceil(((n + 1) * bk - offset - 1) / bq), 0, Lq // bq)`` for a whole
  ``n``, else ``Lq // bq``;
- full: ``full_from(n) .. Lq // bq - 1``; partial: ``first(n) .. full_from(n) - 1``, and a cut
  last query block if it sees ``n`` (not contiguous: a cut block is never full).

A left bound (a sliding window: key ``j`` visible iff ``i - left <= j <= i + right``,
:func:`window_block_mask`; ``left`` clamped to ``[-Lk, Lq]``, ``right`` as above, ``Lk`` for
none). No query sees a key when ``left + right < 0``. Otherwise query block ``m`` (rows
``first(m) = m * bq .. last(m)``) sees the contiguous keys ``first(m) - left .. last(m) +
right`` (clamped to the keys; none when that is empty), so the key blocks from
``floor((first(m) - left) / bk)`` to ``floor((last(m) + right) / bk)``, and key block ``n`` is
full for a whole ``m`` and a whole ``n`` iff ``n * bk >= last(m) - left`` and ``(n + 1) * bk - 1
<= first(m) + right``: a range of blocks with partial ones on either side. Per key block ``n``
(keys ``n * bk .. last_key(n)``) the query rows ``n * bk - right .. last_key(n) + left`` see it,
the same way round; the cut last query block is listed after the whole ones when it sees
``n``. Without a left bound these reduce to the formulas above (``left = Lq``).

Index order. Each row lists its blocks ascending, then every other block ascending: what
torch's stable descending ``argsort`` in ``_dense_to_ordered`` gives, so every tensor equals
``create_block_mask``'s (tests/test_flex_block_mask.py). The kernels read a row's first
``num_blocks`` entries but load its first entry even when there are none
(``torch/_inductor/kernel/flex/templates/flex_backwards.py.jinja``:
``q_start = tl.load(q_indices) * SPARSE_Q_BLOCK_SIZE``), so every entry is a valid block number;
they assume every table contiguous (``flex_attention.py.jinja``: "KV_IDX and KV_NUM_BLKS are
always contiguous").

Every step is an elementwise op on tensors made on the device (``arange``, ``where``, ``clamp``),
so the construction also runs on FakeTensor ``cuda`` tensors on a CPU-only torch, which refuses
indexing and ``contiguous()`` copies of fake CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # imported where used: FlexAttention is optional in older torch
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "BlockSize",
    "offset_block_mask",
    "saturated_offset",
    "saturated_window",
    "window_block_mask",
]

#: A block mask's (query rows, key columns) per block.
BlockSize = tuple[int, int]
#: torch's ``_DEFAULT_SPARSE_BLOCK_SIZE`` both ways; the compiled kernel's tiles must divide it.
DEFAULT_BLOCK_SIZE: BlockSize = (128, 128)

Bound = torch.Tensor | int
Range = tuple[Bound, Bound]


def saturated_offset(q_len: int, k_len: int, offset: int) -> int:
    """``offset`` clamped to ``[-q_len, k_len]``: the same mask on a ``q_len x k_len`` block
    (below ``-q_len`` no query sees a key, at ``k_len - 1`` or above every query sees every key),
    with every block number it enters small."""
    return min(max(offset, -q_len), k_len)


def saturated_window(
    q_len: int, k_len: int, left: int | None, right: int | None
) -> tuple[int, int]:
    """``(left, right)`` as ints giving the same mask on a ``q_len x k_len`` block, each small:
    ``right`` by :func:`saturated_offset` (``None``: ``k_len``), ``left`` clamped to
    ``[-k_len, q_len]`` (``None``: ``q_len``; at ``q_len - 1`` or above no key is hidden on the
    left, at ``-k_len`` or below no query sees a key)."""
    right = k_len if right is None else saturated_offset(q_len, k_len, right)
    left = q_len if left is None else min(max(left, -k_len), q_len)
    return left, right


def _floor_div(x: torch.Tensor, d: int) -> torch.Tensor:
    return torch.div(x, d, rounding_mode="floor")


def _listing(
    ranges: Sequence[Range], rows: int, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_blocks, indices)`` of ``rows`` rows of ``width`` blocks, each row listing its blocks
    (``ranges``: per-row ``(start, end)`` vectors or ints, disjoint and ascending) ascending, then
    every other block of ``[0, width)`` ascending."""

    def column(bound: Bound) -> torch.Tensor:
        if isinstance(bound, int):
            return torch.full((rows, 1), bound, dtype=torch.int32, device=device)
        return bound.to(torch.int32).view(rows, 1)

    listed = [(column(start), column(end)) for start, end in ranges]
    edges = [column(0), *(edge for pair in listed for edge in pair), column(width)]
    others = list(zip(edges[::2], edges[1::2], strict=True))  # the gaps between the ranges
    position = torch.arange(width, dtype=torch.int32, device=device).view(1, width)
    indices = position.expand(rows, width)
    before = column(0)
    for start, end in (*listed, *others):
        # Entries from ``before`` on take this range's members, until a later range's turn.
        indices = torch.where(position >= before, start + (position - before), indices)
        before = before + (end - start)
    count = sum((end - start for start, end in listed), column(0))
    return count.view(1, 1, rows), indices.view(1, 1, rows, width)


def offset_block_mask(
    q_len: int,
    k_len: int,
    offset: int,
    mask_mod: Callable[..., Any],
    device: torch.device | str,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
) -> BlockMask:
    """The ``BlockMask`` of key ``j`` visible to query ``i`` iff ``j <= i + offset`` on a
    ``q_len x k_len`` block, with ``mask_mod`` (which must compute that mask) for its partial
    blocks and ``block_size = (query rows, key columns)`` per block: equal, tensor by tensor, to
    ``create_block_mask(mask_mod, None, None, q_len, k_len, device, block_size)``, made in
    ``O(nq * nk)`` int32 memory. The arithmetic is in the module docstring."""
    return window_block_mask(q_len, k_len, None, offset, mask_mod, device, block_size)


def window_block_mask(
    q_len: int,
    k_len: int,
    left: int | None,
    right: int | None,
    mask_mod: Callable[..., Any],
    device: torch.device | str,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
) -> BlockMask:
    """The ``BlockMask`` of the key window ``(left, right)``: key ``j`` visible to query ``i``
    iff ``i - left <= j <= i + right`` (``None``: unbounded on that side), with ``mask_mod``
    (which must compute that mask) for its partial blocks: equal, tensor by tensor, to
    ``create_block_mask``'s, in ``O(nq * nk)`` int32 memory. The arithmetic is in the module
    docstring (the sliding window's: its section "A left bound")."""
    from torch.nn.attention.flex_attention import BlockMask

    device = torch.device(device)
    bq, bk = block_size
    lo_bound, c = saturated_window(q_len, k_len, left, right)
    nq, nk = -(-q_len // bq), -(-k_len // bk)
    whole_q, whole_k = q_len // bq, k_len // bk
    seen = lo_bound + c >= 0  # else no query sees any key

    m = torch.arange(nq, device=device)
    first_row, last = m * bq, torch.clamp((m + 1) * bq, max=q_len) - 1
    any_key = (first_row - lo_bound <= k_len - 1) & (last + c >= 0) & seen
    start = torch.clamp(_floor_div(first_row - lo_bound, bk), 0, nk)
    visible = torch.where(any_key, torch.clamp(_floor_div(last + c, bk) + 1, 0, nk), start)
    visible = torch.maximum(visible, start)
    full_lo = torch.clamp(-_floor_div(lo_bound + 1 - (m + 1) * bq, bk), start, visible)
    full_hi = torch.clamp(_floor_div(first_row + c + 1, bk), 0, whole_k)
    full_hi = torch.where(m < whole_q, torch.clamp(full_hi, full_lo, visible), full_lo)

    n = torch.arange(nk, device=device)
    first_key, last_key = n * bk, torch.clamp((n + 1) * bk, max=k_len) - 1
    any_query = (first_key - c <= q_len - 1) & (last_key + lo_bound >= 0) & seen
    q_start = torch.clamp(_floor_div(first_key - c, bq), 0, nq)
    q_stop = torch.where(
        any_query, torch.clamp(_floor_div(last_key + lo_bound, bq) + 1, 0, nq), q_start
    )
    q_stop = torch.maximum(q_stop, q_start)
    whole_start, whole_stop = torch.clamp(q_start, max=whole_q), torch.clamp(q_stop, max=whole_q)
    from_q = torch.clamp(-_floor_div(c + 1 - (n + 1) * bk, bq), whole_start, whole_stop)
    to_q = torch.clamp(_floor_div(first_key + lo_bound + 1, bq), from_q, whole_stop)
    from_q = torch.where(n < whole_k, from_q, whole_stop)
    to_q = torch.where(n < whole_k, to_q, whole_stop)
    cut_start = torch.clamp(q_start, min=whole_q)  # the cut last query block, if it sees n
    cut_row = (cut_start, torch.maximum(q_stop, cut_start))

    kv_num, kv_indices = _listing([(start, full_lo), (full_hi, visible)], nq, nk, device)
    full_kv_num, full_kv_indices = _listing([(full_lo, full_hi)], nq, nk, device)
    q_num, q_indices = _listing(
        [(whole_start, from_q), (to_q, whole_stop), cut_row], nk, nq, device
    )
    full_q_num, full_q_indices = _listing([(from_q, to_q)], nk, nq, device)
    return BlockMask(
        seq_lengths=(q_len, k_len),
        kv_num_blocks=kv_num,
        kv_indices=kv_indices,
        full_kv_num_blocks=full_kv_num,
        full_kv_indices=full_kv_indices,
        q_num_blocks=q_num,
        q_indices=q_indices,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_indices,
        BLOCK_SIZE=(bq, bk),
        mask_mod=mask_mod,
    )
