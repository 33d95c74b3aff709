"""Where a call's documents lie and which positions are queries (docs/spec.md, sections 1-2).

A :class:`DocumentLayout` is a frozen value for one call, from the batch's documents or padding
(read once per batch into a :class:`~ringdilated.core.call.sequence_layout.SequenceLayout`, or once
per call from the caller's ``cu_seqlens`` or ``key_padding_mask``) and the length of ``q``:

- **documents**: each ``[start, stop)`` is attended as its own sequence (positions counted from
  ``start``, segments restarting there, a partial last segment); no query sees another document.
  ``cu_seqlens`` gives every batch row the same documents; a padding mask gives each row one
  document, its valid run, and leaves its padded positions in none.
- **query suffix**: ``q`` holds the last ``query_length`` of the ``length`` positions.

:func:`read_documents` and :func:`read_padding` check the tensors and read them to the host (one
device-to-host copy each: the pattern's blocks are planned on the host); every error names the
value and the rule. :func:`read_layout` does both for one call.
"""

from __future__ import annotations

import itertools
import warnings

import attrs
import torch

from ringdilated.core.support.caller import user_stacklevel
from ringdilated.core.support.errors import PaddingMaskWarning

__all__ = [
    "DocumentLayout",
    "Documents",
    "PaddingMaskWarning",
    "Rows",
    "check_readable",
    "read_documents",
    "read_layout",
    "read_padding",
]


Documents = tuple[tuple[int, int], ...]
"""``[start, stop)`` spans, increasing, disjoint."""


@attrs.frozen
class Rows:
    """Batch rows ``[start, stop)``, which share ``documents``."""

    start: int
    stop: int
    documents: Documents

    @property
    def batches(self) -> slice:
        return slice(self.start, self.stop)


@attrs.frozen
class DocumentLayout:
    """The documents of every batch row of a call and its query suffix.

    ``rows`` partition the batch into runs of rows with the same documents. ``length`` is the
    key/value length ``L``; queries are the positions ``[query_start, length)``.
    """

    length: int
    query_length: int
    rows: tuple[Rows, ...]

    @classmethod
    def whole(cls, batch: int, length: int, query_length: int | None = None) -> DocumentLayout:
        """Every row one document ``[0, length)``: no ``cu_seqlens`` and no padding."""
        q_len = length if query_length is None else query_length
        return cls(length, q_len, (Rows(0, batch, ((0, length),)),))

    @property
    def query_start(self) -> int:
        """The first query position: ``length - query_length``."""
        return self.length - self.query_length

    @property
    def covers_all(self) -> bool:
        """Whether every position of every row lies in a document (no padding)."""
        return all(_covers(rows.documents, self.length) for rows in self.rows)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``(B', L)`` int64: each position counted from its document's start, 0 outside any
        document (padding); ``B' = 1`` when every row shares its documents."""
        if len(self.rows) == 1:
            shape, groups = (1, self.length), [(slice(0, 1), self.rows[0].documents)]
        else:
            shape = (self.rows[-1].stop, self.length)
            groups = [(rows.batches, rows.documents) for rows in self.rows]
        positions = torch.zeros(shape, dtype=torch.int64, device=device)
        for batches, documents in groups:
            for start, stop in documents:
                positions[batches, start:stop] = torch.arange(stop - start, device=device)
        return positions

    @property
    def is_whole(self) -> bool:
        """Whether every row is one document of every position, and every position a query."""
        return self.query_length == self.length and all(
            rows.documents == ((0, self.length),) for rows in self.rows
        )


def _covers(documents: Documents, length: int) -> bool:
    end = 0
    for start, stop in documents:
        if start != end:
            return False
        end = stop
    return end == length


def read_layout(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: object = None,
    key_padding_mask: object = None,
    length: int | None = None,
) -> DocumentLayout:
    """The layout of a call whose ``q`` ``(B, Lq, H, D)`` and ``k`` ``(B, L, Hkv, D)`` have been
    checked; raise ``TypeError``/``ValueError`` naming the offending value otherwise.
    ``length``: the whole sequence's (a process group's, whose ranks hold shards of it; default
    ``L``), to which ``cu_seqlens`` must run; the query suffix is then the same part of it."""
    batch = k.shape[0]
    length = k.shape[1] if length is None else length
    query_length = length - (k.shape[1] - q.shape[1])
    if cu_seqlens is not None and key_padding_mask is not None:
        raise ValueError(
            "pass cu_seqlens (packed documents) or key_padding_mask (one padded document per "
            "row), not both"
        )
    if cu_seqlens is not None:
        documents = read_documents(cu_seqlens, length)
        return DocumentLayout(length, query_length, (Rows(0, batch, documents),))
    if key_padding_mask is not None:
        return DocumentLayout(length, query_length, read_padding(key_padding_mask, batch, length))
    return DocumentLayout.whole(batch, length, query_length)


def check_readable(name: str, tensor: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` and the device unless ``tensor`` holds data the host
    can read (a ``meta`` tensor has a shape only): documents and padding are read to the host
    once per layout."""
    if tensor.device.type == "meta":
        raise ValueError(
            f"{name} must hold data the host can read (it is read to the host once per layout, "
            f"to plan the call), got a tensor on device {tensor.device}: make it on the CPU or "
            "on the inputs' device"
        )


def read_documents(cu_seqlens: object, length: int | None) -> Documents:
    """The documents of ``cu_seqlens`` ``[0, e_1, ..., L]``, which must run to ``length`` (any
    end when ``None``). One read of the tensor to the host."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(
            f"cu_seqlens must be a 1-D integer torch.Tensor [0, e_1, ..., L], got "
            f"{type(cu_seqlens).__name__}"
        )
    dtype = cu_seqlens.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be a 1-D integer tensor, got {dtype}")
    if cu_seqlens.dim() != 1:
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor, got shape {tuple(cu_seqlens.shape)}"
        )
    check_readable("cu_seqlens", cu_seqlens)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if length is None and len(bounds) >= 2:
        length = bounds[-1]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(
            f"cu_seqlens must run from 0 to the sequence length {length}, got {_brief(bounds)}"
        )
    for i in range(1, len(bounds)):
        if bounds[i] <= bounds[i - 1]:
            raise ValueError(
                f"cu_seqlens must be strictly increasing, got cu_seqlens[{i - 1}] = "
                f"{bounds[i - 1]} and cu_seqlens[{i}] = {bounds[i]} in {_brief(bounds)}"
            )
    return tuple(itertools.pairwise(bounds))


def read_padding(mask: object, batch: int | None, length: int | None) -> tuple[Rows, ...]:
    """The rows of a ``(B, L)`` padding mask (``True`` = padding), grouped by equal documents;
    ``batch`` and ``length``: what ``B`` and ``L`` must be (any when ``None``). One read of the
    mask to the host. A mask that is ``True`` everywhere (no row has a valid position) warns
    :class:`PaddingMaskWarning`: the caller most likely passed transformers' convention."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"key_padding_mask must be a (B, L) bool torch.Tensor, got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(
            "key_padding_mask must be a bool tensor, True = padding (the convention of "
            "torch.nn.MultiheadAttention; a transformers attention_mask, 1 = token, is its "
            f"negation: pass attention_mask == 0), got {mask.dtype}"
        )
    if mask.dim() != 2:
        raise ValueError(
            f"key_padding_mask must be 2-D (batch, seq_len), got shape {tuple(mask.shape)}"
        )
    batch = mask.shape[0] if batch is None else batch
    length = mask.shape[1] if length is None else length
    if tuple(mask.shape) != (batch, length):
        raise ValueError(
            f"key_padding_mask must be (batch, seq_len) = {(batch, length)}, got "
            f"{tuple(mask.shape)}"
        )
    check_readable("key_padding_mask", mask)
    valid = mask.logical_not()
    counts = valid.sum(1)
    positions = torch.arange(length, device=mask.device)
    first = torch.where(valid, positions, length).amin(1)
    last = torch.where(valid, positions, -1).amax(1)
    runs = torch.stack([counts, first, last], 1).tolist()
    rows: list[Rows] = []
    for b, (count, start, end) in enumerate(runs):
        if count and end - start + 1 != count:
            raise ValueError(
                f"key_padding_mask row {b} must hold one contiguous run of valid (False) "
                f"positions (left or right padding; True = padding, the negation of "
                f"transformers' attention_mask), got {count} valid positions between {start} "
                f"and {end}"
            )
        documents: Documents = ((start, end + 1),) if count else ()
        if rows and rows[-1].documents == documents:
            rows[-1] = attrs.evolve(rows[-1], stop=b + 1)
        else:
            rows.append(Rows(b, b + 1, documents))
    if length and runs and not any(count for count, _, _ in runs):
        warnings.warn(
            f"key_padding_mask {tuple(mask.shape)} is True at every position of every row: "
            f"True = padding (the convention of torch.nn.MultiheadAttention), so nothing is "
            f"attended and the output is all zeros (through the Hugging Face adapter: the "
            f"attention_mask is 0 everywhere). A transformers attention_mask (1 = token) is the "
            f"negation of key_padding_mask: pass attention_mask == 0",
            PaddingMaskWarning,
            stacklevel=user_stacklevel(),
        )
    return tuple(rows)


def _brief(values: list[int]) -> str:
    if len(values) <= 8:
        return str(values)
    return f"[{', '.join(map(str, values[:4]))}, ..., {', '.join(map(str, values[-2:]))}]"
