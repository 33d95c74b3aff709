"""What the Hugging Face adapter checks under ``sequence_parallel``: a rank's transformers
arguments against the batch's :class:`~ringdilated.SequenceLayout` (the module docstring of
``ringdilated._hf_sequence_parallel`` says what each check reads and when it raises).

Three kinds, by when they are raised:

- :func:`refuse_now`: what transformers' mask function is asked for that the sharded path never
  serves (a decode step, a cache layout, cross attention): raised by the mask function itself;
- :func:`mask_problem`: the ``attention_mask`` and the shard's length against the layout,
  found by the mask function and raised at the forward's first attention call;
- :func:`call_problem`: ``cu_seq_lens_k`` and ``position_ids``, at that first call.

What a check compares with on the device (the layout's tokens of this shard, its document
bounds, the rows whose shard begins inside a document) is built on the host once per layout,
device and shape, copied there once and kept beside the layout (weakly: dropped with it); a
forward then reads one bool per check that runs, and copies nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable

import attrs
import torch

from ringdilated.core.call import SequenceLayout, safe_repr

__all__ = ["call_problem", "mask_problem", "refuse_now", "shard"]

NAME = "ringdilated"
CONVENTION = "(1 = token, 0 = padding)"

_KEPT: weakref.WeakKeyDictionary[SequenceLayout, dict[Hashable, object]] = (
    weakref.WeakKeyDictionary()
)


def _kept(layout: SequenceLayout, key: Hashable, make: Callable[[], object]) -> object:
    """``make()``, made once per ``layout`` and ``key`` and kept while the layout lives."""
    kept = _KEPT.setdefault(layout, {})
    if key not in kept:
        kept[key] = make()
    return kept[key]


def shard(layout: SequenceLayout, length: int) -> tuple[int, int | None]:
    """``(start, the layout's length of this rank's shard)``: a layout of equal shards no call
    has sized yet takes ``length`` as every rank's (its first call checks that they are)."""
    lengths = layout.shard_lengths
    if lengths is None:
        return layout.rank * length, None
    return sum(lengths[: layout.rank]), lengths[layout.rank]


def refuse_now(
    config: object,
    bidirectional: bool,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
    mask: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` for a forward the sharded path never serves, whatever the layout: a
    decode step (queries after cached positions), a cache layout (transformers sizes the keys by
    a static or sliding-window cache, not by the shard), cross attention (an encoder-decoder
    model's config, or a bidirectional mask over other keys than the queries). A mask of
    another shape is left to :func:`mask_problem`."""
    if q_offset != 0 or kv_offset != 0:
        raise ValueError(
            f"attn_implementation={NAME!r} under sequence_parallel runs forwards whose queries "
            f"are the whole shard (training, or a prefill without cached positions); got "
            f"{q_length} queries from position {q_offset} of {kv_length} keys (a decode step "
            "over transformers' cache: decode on one process)"
        )
    cross = [f for f in ("is_encoder_decoder", "add_cross_attention") if getattr(config, f, False)]
    if cross:
        raise ValueError(
            f"attn_implementation={NAME!r} under sequence_parallel shards self-attention only: "
            f"{type(config).__name__} has {cross[0]}=True, and cross attention reads the "
            "encoder's whole output, which no rank's shard holds (run encoder-decoder models "
            "on one process)"
        )
    if mask is not None and (mask.dim() != 2 or mask.shape[-1] != q_length):
        return  # a mask of other columns sets kv_length too: mask_problem names it
    if kv_length == q_length:
        return
    if bidirectional:
        raise ValueError(
            f"attn_implementation={NAME!r} under sequence_parallel shards self-attention only: "
            f"transformers asked for a bidirectional mask over {kv_length} keys for this "
            f"shard's {q_length} queries, without a cache: cross attention over an encoder's "
            "states (encoder_hidden_states), which no rank's shard holds (run encoder-decoder "
            "models on one process)"
        )
    raise ValueError(
        f"attn_implementation={NAME!r} under sequence_parallel runs forwards whose keys are "
        f"this shard's positions; transformers sized this forward's keys by its cache, "
        f"{kv_length} for {q_length} queries: a static or sliding-window cache layout "
        "(generate(cache_implementation='static'), a StaticCache in past_key_values). Pass "
        "use_cache=False or keep transformers' default dynamic cache, and decode on one process"
    )


def mask_problem(
    layout: SequenceLayout, batch_size: int, q_length: int, mask: torch.Tensor | None
) -> ValueError | None:
    """What is wrong with the ``attention_mask`` (bool, ``True`` = token) or the shard's length
    against ``layout``, else ``None``."""
    if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (batch_size, q_length)):
        return ValueError(
            f"attn_implementation={NAME!r} under sequence_parallel takes this shard's columns of "
            f"the batch's attention_mask {CONVENTION}, ({batch_size}, {q_length}), or none (the "
            f"layout holds the padding); got shape {tuple(mask.shape)}"
        )
    _, expected = shard(layout, q_length)
    if expected is not None and expected != q_length:
        return ValueError(
            f"attn_implementation={NAME!r} under sequence_parallel: this rank's input holds "
            f"{q_length} positions but its SequenceLayout's shard on rank {layout.rank} holds "
            f"{expected} (shard lengths {layout.shard_lengths}): pass the shard that "
            "ringdilated.shard_batch made with this layout"
        )
    if mask is None:
        return None
    if layout.batch is not None and layout.batch != batch_size:
        return ValueError(
            f"attn_implementation={NAME!r} under sequence_parallel: the model's batch has "
            f"{batch_size} rows but the layout's padding mask has {layout.batch} rows"
        )
    return _padding_problem(layout, mask)


def _shard_tokens(layout: SequenceLayout, batch: int, start: int, length: int) -> torch.Tensor:
    """``(batch, length)`` bool on the host, ``True`` where the layout has a token in this rank's
    shard ``[start, start + length)``: everywhere, but outside the runs of a padding mask."""
    if layout.padding is None:
        return torch.ones(batch, length, dtype=torch.bool)
    tokens = torch.zeros(batch, length, dtype=torch.bool)
    for rows in layout.padding:
        for first, stop in rows.documents:
            lo, hi = max(first, start), min(stop, start + length)
            if lo < hi:
                tokens[rows.batches, lo - start : hi - start] = True
    return tokens


def _padding_problem(layout: SequenceLayout, mask: torch.Tensor) -> ValueError | None:
    """Unless ``mask`` says what the layout says on this shard, the first position where not."""
    batch, length = mask.shape
    start, _ = shard(layout, length)
    expected = _kept(
        layout,
        ("tokens", mask.device, batch, start, length),
        lambda: _shard_tokens(layout, batch, start, length).to(mask.device),
    )
    assert isinstance(expected, torch.Tensor)
    differ = mask != expected
    if not bool(differ.any()):  # one read of a bool
        return None
    row, column = (int(i) for i in differ.nonzero()[0])
    given, wanted = "padding (0)", "a token"
    if bool(mask[row, column]):
        given, wanted = "a token (1)", "padding"
    return ValueError(
        f"attn_implementation={NAME!r} under sequence_parallel reads the padding from the "
        f"layout: this rank's attention_mask {CONVENTION} has {given} at row {row}, column "
        f"{column} (global position {start + column}), where the layout has {wanted}. Pass "
        "this shard's columns of the mask given to ringdilated.shard_batch, or none"
    )


def call_problem(
    layout: SequenceLayout, kwargs: dict[str, object], length: int
) -> ValueError | None:
    """What the first attention call's ``cu_seq_lens_k`` and ``position_ids`` (transformers'
    keyword arguments) contradict in ``layout``, on a shard of ``length`` positions; else
    ``None``."""
    try:
        _check_documents(layout, kwargs.get("cu_seq_lens_k"), length)
        _check_positions(layout, kwargs.get("position_ids"))
    except ValueError as error:
        return error
    return None


def _bounds(layout: SequenceLayout, length: int) -> list[int] | None:
    """The layout's documents as ``cu_seqlens``, ``[0, e_1, ..., L]`` (``L`` from the shard's
    ``length`` on equal shards no call has sized yet); ``None`` with padding (no shared ones)."""
    if layout.padding is not None:
        return None
    if layout.documents is not None:
        return [0, *(stop for _, stop in layout.documents)]
    total = layout.length
    return [0, layout.world_size * length if total is None else total]


def _check_documents(layout: SequenceLayout, cu_seq_lens: object, length: int) -> None:
    """Raise unless ``cu_seq_lens`` (transformers' ``cu_seq_lens_k``) is absent or the layout's
    documents: ``[0, e_1, ..., L]`` in global positions."""
    if cu_seq_lens is None:
        return
    bounds = _bounds(layout, length)
    if bounds is not None and isinstance(cu_seq_lens, torch.Tensor):
        device = cu_seq_lens.device
        expected = _kept(
            layout, ("bounds", device, bounds[-1]), lambda: torch.tensor(bounds, device=device)
        )
        assert isinstance(expected, torch.Tensor)
        if cu_seq_lens.shape == expected.shape and bool((cu_seq_lens == expected).all()):
            return  # one read of a bool
    elif isinstance(cu_seq_lens, (list, tuple)) and list(cu_seq_lens) == bounds:
        return
    given = cu_seq_lens.tolist() if isinstance(cu_seq_lens, torch.Tensor) else cu_seq_lens
    has = (
        "padding (each row's tokens its one document: no cu_seqlens)"
        if bounds is None
        else f"documents {bounds}"
    )
    raise ValueError(
        f"attn_implementation={NAME!r} under sequence_parallel reads the documents from the "
        f"layout, which has {has}; got cu_seq_lens_k {safe_repr(given)}. Pass the batch's "
        "cu_seqlens to ringdilated.shard_batch and leave the flash-attention kwargs out"
    )


@attrs.frozen
class _Inside:
    """The rows of ``position_ids`` whose shard begins inside a document that started on an
    earlier rank: ``rows`` on the device (bool, one per row), and for each such row the batch
    row, the document's start and how far into it the shard begins (for the error)."""

    rows: torch.Tensor
    where: dict[int, tuple[int, int, int]]


def _inside(
    layout: SequenceLayout, rows: int, start: int, length: int, device: torch.device
) -> _Inside | None:
    """:class:`_Inside` for ``position_ids`` of ``rows`` rows (one per batch row, or one for
    all), or ``None`` when no row's shard begins inside a document."""
    batch = layout.batch or 1
    whole = layout.documents_for(batch, start + length, start + length)
    where: dict[int, tuple[int, int, int]] = {}
    for group in whole.rows:
        for first, stop in group.documents:
            if not first < start < stop:
                continue
            # Without padding every row shares the documents: every row of position_ids.
            batch_rows = range(group.start, group.stop) if layout.padding else range(rows)
            for batch_row in batch_rows:
                row = batch_row if rows > 1 else 0
                if row < rows:
                    where.setdefault(row, (batch_row, first, start - first))
    if not where:
        return None
    flags = torch.tensor([row in where for row in range(rows)], device=device)
    return _Inside(flags, where)


def _check_positions(layout: SequenceLayout, position_ids: object) -> None:
    """Raise if a row whose shard begins inside a document that began on an earlier rank has
    ``position_ids`` ``0, 1, ..., n - 1`` (see the module docstring)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        return  # not passed to the attention by this model (or not as transformers does)
    rows, length = position_ids.shape
    if length < 2:
        return
    start, _ = shard(layout, length)
    if start == 0:
        return
    device = position_ids.device
    inside = _kept(
        layout,
        ("inside", device, rows, start, length),
        lambda: _inside(layout, rows, start, length, device),
    )
    if inside is None:
        return
    assert isinstance(inside, _Inside)
    count = torch.arange(length, device=device, dtype=position_ids.dtype)
    from_zero = (position_ids == count).all(dim=1) & inside.rows
    if not bool(from_zero.any()):  # one read of a bool
        return
    batch_row, first, offset = inside.where[int(from_zero.nonzero()[0])]
    raise ValueError(
        f"attn_implementation={NAME!r} under sequence_parallel: position_ids of row {batch_row} on "
        f"rank {layout.rank} count this shard from 0 (0, 1, ..., {length - 1}), but the shard "
        f"begins at global position {start}, {offset} positions into a document that starts at "
        f"{first}: pass the batch's global position_ids (BatchShard.position_ids; transformers "
        "counts each shard from 0 when position_ids are left out)"
    )
