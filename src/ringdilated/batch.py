"""Shard a training batch for sequence parallelism: :func:`shard_batch` and :class:`BatchShard`.

Every rank of a sequence-parallel group loads the same batch; each keeps its contiguous slice,
in rank order, as the sharded attention requires (docs/spec.md, section 3)::

    shard = ringdilated.shard_batch(
        batch["input_ids"], labels=batch.get("labels"), attention_mask=batch.get("attention_mask"),
        process_group=cp_group,
    ).to(device)
    logits = model(shard.input_ids, position_ids=shard.position_ids, layout=shard.layout)
    loss = ringdilated.sharded_cross_entropy(logits, shard.labels, cp_group)
    loss.backward()  # then sum the gradients over cp_group (see ringdilated.loss)

What it gets right that is easy to get wrong by hand:

- **Labels are shifted before sharding.** ``labels[t]`` of the result is the token to predict at
  position ``t``: the input's ``labels[t + 1]`` (Hugging Face's convention: labels aligned with
  ``input_ids``, the model shifts them), else ``input_ids[t + 1]``. Shifting each shard on its
  own would drop the target of every shard's last position and misalign the others. The last
  position, the last position of each packed document (its target would be the next
  document's first token, as transformers' ``DataCollatorWithFlattening`` also arranges) and
  every position that is padding or is followed by padding get ``ignore_index``.
- **Positions stay global.** ``position_ids`` are the batch's: given ones as they are, else each
  position counted from its document's start (packed documents restart at 0; a padded row
  counts from its first token, as transformers' ``attention_mask.cumsum(-1) - 1`` does for left
  padding; padding itself gets 0, where transformers puts 1: either is ignored), else
  ``0 .. L - 1``. Computed ones are the positions the library's own rotary embeddings use
  (:meth:`SequenceLayout.shard_positions`), which read the layout, not ``position_ids``: given
  positions that differ from them (an offset start, a reset without ``cu_seqlens``) reach a
  model that reads ``position_ids`` (a Hugging Face model) but not the library's modules.
- **Documents and padding keep global coordinates**, in the batch's
  :class:`~ringdilated.SequenceLayout`, made here for every layer.
- **Uneven lengths.** By default a sequence of ``L`` positions is dealt to ``P`` ranks as
  ``L // P`` each, one more on the first ``L % P`` ranks (the sharded attention takes shards of
  any positive lengths). ``pad_to_multiple_of=m`` first pads the sequence on the right to a
  multiple of ``m`` (e.g. ``P``, for equal shards) with ``pad_token_id``, ``ignore_index`` labels
  and position 0; the padding is masked from every token (with an ``attention_mask``, as
  padding; otherwise as one more document at the end, which attends only itself).
- **Every rank holds the same batch.** The ranks compare a digest of the batch (a data loader
  sharded over every rank instead of the data-parallel ones gives each rank of a group its own
  batch, and training goes on silently wrong); bad input on any rank raises on every rank.
"""

from __future__ import annotations

import ctypes
import hashlib

import attrs
import torch
import torch.distributed as dist
from torch.nn import functional as F

from ringdilated.core.call import BatchSignature, SequenceLayout, agree, grid, safe_repr
from ringdilated.core.plan import Documents, check_readable, read_documents

__all__ = ["BatchShard", "shard_batch"]


@attrs.frozen(eq=False)
class BatchShard:
    """This rank's part of a batch (see the module docstring); every tensor ``(B, n)``, ``n``
    this rank's shard length, contiguous.

    - ``input_ids``: the inputs' positions ``[start, start + n)``, their dtype;
    - ``labels``: int64, the target at each of those positions, shifted before sharding;
      ``ignore_index`` where nothing is to be predicted;
    - ``position_ids``: int64, global positions (the module docstring says which);
    - ``layout``: the batch's :class:`~ringdilated.SequenceLayout` (documents, padding, every
      rank's shard length), to pass to every layer;
    - ``start``: where the shard begins in the (padded) sequence; ``length``: that sequence's
      length;
    - ``token_count``: labels of this shard that are not ``ignore_index``;
      ``batch_token_count``: those of the whole batch (the same on every rank);
    - ``ignore_index``: the value of ignored labels.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    layout: SequenceLayout = attrs.field(repr=False)
    start: int
    length: int
    token_count: int
    batch_token_count: int
    ignore_index: int

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> BatchShard:
        """This shard with its tensors on ``device`` (the layout is device-agnostic)."""
        return attrs.evolve(
            self,
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            position_ids=self.position_ids.to(device, non_blocking=non_blocking),
        )


def shard_batch(
    input_ids: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    process_group: object = None,
    ignore_index: int = -100,
    pad_to_multiple_of: int | None = None,
    pad_token_id: int = 0,
    check_same_batch: bool = True,
) -> BatchShard:
    """This rank's :class:`BatchShard` of a batch that every rank of ``process_group`` holds.

    - ``input_ids``: ``(B, L)`` integer tensor, the whole batch.
    - ``labels``: ``(B, L)`` integer, aligned with ``input_ids`` as transformers' models take them
      (not shifted: ``labels[t]`` is the token at ``t``, ``ignore_index`` where no loss is
      wanted); default: ``input_ids``. Already shifted labels would be shifted twice.
    - ``attention_mask``: ``(B, L)`` bool or integer, transformers' convention: ``1`` = token,
      ``0`` = padding; each row's tokens one contiguous run (left or right padding). A mask
      without padding is dropped. With ``cu_seqlens`` only a mask without padding is taken.
    - ``position_ids``: ``(B, L)``, ``(1, L)`` or ``(L,)`` integer, taken as they are. Packed
      documents come from ``cu_seqlens`` only: without it, position ids that do not grow by 1
      from one token to the next in a row (where transformers would start a packed document)
      raise; pass the documents' ``cu_seqlens`` (e.g. ``DataCollatorWithFlattening(
      return_flash_attn_kwargs=True)``'s ``cu_seq_lens_q``), or ``cu_seqlens=torch.tensor([0,
      L])`` to attend across them.
    - ``cu_seqlens``: packed documents ``[0, e_1, ..., L]``, global, shared by every row.
    - ``process_group``: ``None`` (one process: the whole batch, shifted), a ``ProcessGroup``, a
      1-D ``DeviceMesh``, ``(mesh, "cp")``, or a 2-D layout (flat rank order), as
      :class:`~ringdilated.SequenceLayout` takes it.
    - ``pad_to_multiple_of``: pad the sequence to a multiple of this first (default: deal
      uneven shards); ``pad_token_id``: the input id of padding positions.
    - ``check_same_batch``: compare a digest of every tensor between the ranks (one read of the
      batch to the host; the shapes, dtypes and options are compared always).

    Collective on a process group of several ranks: every rank calls it with the same batch;
    one ``all_gather`` of three integers, then the layout's (two when shards differ). Bad
    input on any rank, or ranks whose batches differ, raise on every rank (``TypeError`` or
    ``ValueError`` naming the value and the rule on the rank that passed it, a
    :class:`~ringdilated.PeerRejectedError` or :class:`~ringdilated.CallMismatchError`, both
    ``ValueError``, on the others). Reads the labels, the mask, ``cu_seqlens`` and the counts
    on the host: pass the data loader's CPU tensors and move the shard with :meth:`BatchShard.to`.
    """
    group = grid.as_process_group(process_group)
    ranks = grid.group_size(group)  # a bad process layout raises on this rank only
    rank = 0 if group is None else grid.rank(group)  # type: ignore[arg-type]
    batch: _Batch | None = None
    error: Exception | None = None
    try:
        batch = _read(
            input_ids, labels, attention_mask, position_ids, cu_seqlens, ignore_index,
            pad_to_multiple_of, pad_token_id, check_same_batch, ranks,
        )  # fmt: skip
    except Exception as exc:  # on a group, every rank must hear of it
        error = exc
    if ranks > 1:
        assert isinstance(group, (dist.ProcessGroup, grid.Grid))
        agree(group, error, None if batch is None else batch.signature)
    elif error is not None:
        raise error
    assert batch is not None
    lengths = deal(batch.length, ranks)
    start, stop = sum(lengths[:rank]), sum(lengths[: rank + 1])
    layout = SequenceLayout(
        cu_seqlens=batch.cu_seqlens,
        key_padding_mask=batch.padding,
        process_group=group,
        shard_length=lengths[rank],
    )
    positions = batch.position_ids
    if positions is None:
        rows, length = batch.input_ids.shape
        positions = layout.documents_for(rows, length, length).positions(batch.input_ids.device)
        positions[:, batch.width :] = 0  # padding added here, if it is a document of its own
    shard = slice(start, stop)
    labels_shard = batch.labels[:, shard].contiguous()
    return BatchShard(
        input_ids=batch.input_ids[:, shard].contiguous(),
        labels=labels_shard,
        position_ids=positions.expand(batch.input_ids.shape)[:, shard].contiguous(),
        layout=layout,
        start=start,
        length=batch.length,
        token_count=int(labels_shard.ne(ignore_index).sum()),
        batch_token_count=int(batch.labels.ne(ignore_index).sum()),
        ignore_index=ignore_index,
    )


def deal(length: int, ranks: int) -> tuple[int, ...]:
    """Every rank's shard length: ``length // ranks``, one more on the first ``length % ranks``."""
    base, extra = divmod(length, ranks)
    return tuple(base + (r < extra) for r in range(ranks))


@attrs.frozen(eq=False)
class _Batch:
    """The whole batch, checked, shifted and padded on this rank, before the ranks agree."""

    input_ids: torch.Tensor  # (B, length)
    labels: torch.Tensor  # (B, length) int64, shifted
    position_ids: torch.Tensor | None  # (B or 1, length) given ones, else None: the layout's
    cu_seqlens: torch.Tensor | None  # host int64, for the layout
    padding: torch.Tensor | None  # host bool (B, length), True = padding, for the layout
    width: int  # the length passed
    length: int  # after padding
    signature: BatchSignature


def _read(
    input_ids: object,
    labels: object,
    attention_mask: object,
    position_ids: object,
    cu_seqlens: object,
    ignore_index: object,
    pad_to_multiple_of: object,
    pad_token_id: object,
    check_same_batch: object,
    ranks: int,
) -> _Batch:
    ignore = _int("ignore_index", ignore_index)
    pad_id = _int("pad_token_id", pad_token_id)
    multiple = (
        None if pad_to_multiple_of is None else _int("pad_to_multiple_of", pad_to_multiple_of)
    )
    if multiple is not None and multiple < 1:
        raise ValueError(f"pad_to_multiple_of must be a positive int or None, got {multiple}")
    if not isinstance(check_same_batch, bool):
        raise TypeError(f"check_same_batch must be a bool, got {safe_repr(check_same_batch)}")
    ids = _integers("input_ids", input_ids)
    if ids.dim() != 2 or 0 in ids.shape:
        raise ValueError(
            f"input_ids must be (batch, seq_len) with both at least 1, got shape {tuple(ids.shape)}"
        )
    width = ids.shape[1]
    source = ids if labels is None else _like("labels", _integers("labels", labels), ids)
    valid = None if attention_mask is None else _valid(attention_mask, ids)
    documents = None if cu_seqlens is None else read_documents(cu_seqlens, width)
    if valid is not None and bool(valid.all()):
        valid = None  # no padding: the same as no mask
    if valid is not None and documents is not None:
        raise ValueError(
            "pass cu_seqlens (packed documents) or an attention_mask with padding (one padded "
            "document per row), not both"
        )
    given = None if position_ids is None else _positions(position_ids, ids, valid, documents)
    length = width if multiple is None else -(-width // multiple) * multiple
    if length < ranks:
        raise ValueError(
            f"the sequence length {length} must be at least the {ranks} ranks (every shard holds "
            "a position): pad it with pad_to_multiple_of"
        )
    shifted = _shifted(source, valid, documents, ignore)
    extra = length - width
    padding = None if valid is None else F.pad(valid.logical_not().cpu(), (0, extra), value=True)
    bounds = None if documents is None else [0, *(stop for _, stop in documents)]
    if bounds is None and valid is None and extra:
        bounds = [0, width]  # the padding: one more document, which only attends itself
    if bounds is not None and extra:
        bounds.append(length)
    signature = BatchSignature(
        input_ids=_described(ids, check_same_batch),
        labels=_described(labels, check_same_batch),
        attention_mask=_described(attention_mask, check_same_batch),
        position_ids=_described(position_ids, check_same_batch),
        cu_seqlens=_described(cu_seqlens, True),
        options=(
            f"ignore_index {ignore}, pad_to_multiple_of {multiple}, pad_token_id {pad_id}, "
            f"check_same_batch {check_same_batch}"
        ),
    )
    return _Batch(
        input_ids=F.pad(ids, (0, extra), value=pad_id),
        labels=F.pad(shifted, (0, extra), value=ignore),
        position_ids=None if given is None else F.pad(given, (0, extra), value=0),
        cu_seqlens=None if bounds is None else torch.tensor(bounds, dtype=torch.int64),
        padding=padding,
        width=width,
        length=length,
        signature=signature,
    )


def _shifted(
    source: torch.Tensor, valid: torch.Tensor | None, documents: Documents | None, ignore: int
) -> torch.Tensor:
    """int64 ``(B, L)``: ``source[:, t + 1]`` at ``t``, ``ignore`` at the last position, at each
    document's last position and wherever ``t`` or ``t + 1`` is padding."""
    shifted = torch.full(source.shape, ignore, dtype=torch.int64, device=source.device)
    shifted[:, :-1] = source[:, 1:]
    if documents is not None:
        shifted[:, [stop - 1 for _, stop in documents]] = ignore
    if valid is not None:
        both = valid[:, :-1] & valid[:, 1:]
        shifted[:, :-1].masked_fill_(both.logical_not(), ignore)
    return shifted


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {safe_repr(value)}")
    return value


def _integers(name: str, value: object) -> torch.Tensor:
    """``value`` as a tensor of integers (not bool), readable on the host."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    check_readable(name, value)
    return value.detach()


def _like(name: str, value: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``value``, which must have the shape and device of ``input_ids``."""
    if value.shape != ids.shape:
        raise ValueError(
            f"{name} must have input_ids' shape {tuple(ids.shape)}, got {tuple(value.shape)}"
        )
    if value.device != ids.device:
        raise ValueError(f"{name} must be on input_ids' device {ids.device}, got {value.device}")
    return value


def _valid(mask: object, ids: torch.Tensor) -> torch.Tensor:
    """Bool ``(B, L)``, ``True`` = token, from transformers' ``attention_mask`` (1 = token)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"attention_mask must be a (batch, seq_len) torch.Tensor, 1 = token and 0 = padding, "
            f"got {type(mask).__name__}"
        )
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(
            f"attention_mask must be bool or integer, 1 = token and 0 = padding, got {mask.dtype}"
        )
    check_readable("attention_mask", mask)
    _like("attention_mask", mask, ids)
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        values = sorted({int(v) for v in mask.flatten().tolist()} - {0, 1})
        raise ValueError(
            f"attention_mask must hold 1 (token) and 0 (padding) only, got also {values[:8]}"
        )
    valid = mask.detach() != 0
    _check_one_run(valid)
    return valid


def _check_one_run(valid: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the first row of ``attention_mask`` whose tokens (``1``) are
    not one contiguous run (left or right padding only), in transformers' convention."""
    width = valid.shape[1]
    index = torch.arange(width, device=valid.device).expand_as(valid)
    count = valid.sum(dim=1)
    first = torch.where(valid, index, width).amin(dim=1)
    last = torch.where(valid, index, -1).amax(dim=1)
    broken = (count > 0) & (last - first + 1 != count)
    if bool(broken.any()):
        row = int(broken.nonzero()[0, 0])
        raise ValueError(
            f"attention_mask row {row} must hold its tokens (1) as one contiguous run, with "
            f"padding (0) only before or after them, got {int(count[row])} tokens between "
            f"positions {int(first[row])} and {int(last[row])}"
        )


def _positions(
    value: object, ids: torch.Tensor, valid: torch.Tensor | None, documents: Documents | None
) -> torch.Tensor:
    """The given position ids as ``(B or 1, L)`` int64; without documents, raise where one
    token's does not follow the previous token's by 1 (packed documents no ``cu_seqlens`` names:
    transformers starts one wherever they do not, ``find_packed_sequence_indices``)."""
    positions = _integers("position_ids", value)
    rows, width = ids.shape
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if positions.dim() != 2 or positions.shape[0] not in (1, rows) or positions.shape[1] != width:
        raise ValueError(
            f"position_ids must be ({rows}, {width}), (1, {width}) or ({width},) like input_ids "
            f"{tuple(ids.shape)}, got {tuple(value.shape)}"  # type: ignore[attr-defined]
        )
    if positions.device != ids.device:
        raise ValueError(
            f"position_ids must be on input_ids' device {ids.device}, got {positions.device}"
        )
    positions = positions.to(torch.int64)
    if documents is None and width > 1:
        tokens = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid
        steps = positions[:, 1:] - positions[:, :-1]
        jumps = (steps != 1) & tokens[:, 1:] & tokens[:, :-1]
        if bool(jumps.any()):
            row, t = (int(i) for i in jumps.nonzero()[0])
            before, after = (int(p) for p in positions[row % positions.shape[0], t : t + 2])
            raise ValueError(
                f"position_ids go from {before} to {after} at position {t + 1} of row {row} "
                "between two tokens, where a packed document starts (as transformers reads "
                "them), but no cu_seqlens says where documents start: pass their cu_seqlens "
                f"(or cu_seqlens=torch.tensor([0, {width}]) to attend across them)"
            )
    return positions


def _described(value: object, digest: bool) -> str:
    """A tensor's shape and dtype, and with ``digest`` a digest of its values; ``"none"``."""
    if not isinstance(value, torch.Tensor):
        return "none"
    text = f"{tuple(value.shape)} {value.dtype}"
    if not digest:
        return text
    host = value.detach().to("cpu").contiguous()
    size = host.numel() * host.element_size()
    data = ctypes.string_at(host.data_ptr(), size) if size else b""
    return f"{text}, digest {hashlib.blake2b(data, digest_size=8).hexdigest()}"
