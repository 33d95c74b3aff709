"""``SequenceLayout``: how the tokens of one batch sit, made once per batch, used by every layer.

Everything about a call that depends only on the batch (its packed documents, its padding, the
process layout and which positions each rank holds) is read, checked and agreed here once, on
the host, instead of in every layer call::

    layout = ringdilated.SequenceLayout(cu_seqlens=cu, process_group=group)   # once per batch
    for block in model.blocks:
        x = block(x, layout=layout)             # each layer: kernels and the data exchange only

Construction on a process group is **collective**: every rank of the group builds its layout
together (one ``all_gather`` of three integers; two when shard lengths differ). That is where the
ranks agree on the documents, the padding and every rank's shard length, and where a bad value
raises on every rank. A layout then plans each distinct call signature (pattern, mode, heads,
dims, dtype, kernel, communicator) once, at its first call, which the ranks also agree on; later
calls with that signature read nothing from the device and make no collective but the data
exchange. A later call that contradicts its layout (another shard length, or another query length
where its first call passed a query suffix) raises at once on its own rank; its peers are released
by the backend's timeout.

A layout is a value of the batch: build a new one for the next batch. Its plans are cached
inside it (and dropped with it).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Hashable

import attrs
import torch
import torch.distributed as dist

from ringdilated.core.call import grid
from ringdilated.core.call.agreement import LayoutSignature, agree, safe_repr
from ringdilated.core.call.validation import brief, check_shard_lengths
from ringdilated.core.plan.documents import (
    DocumentLayout,
    Documents,
    Rows,
    read_documents,
    read_padding,
)
from ringdilated.core.support.env import env_flag
from ringdilated.core.support.opaque import OpaqueBase, register

__all__ = ["AGREE_EVERY_CALL_ENV", "SequenceLayout"]

AGREE_EVERY_CALL_ENV = "RINGDILATED_AGREE_EVERY_CALL"
"""``1`` (or ``true``, ``yes``, ``on``) makes every layout check and agree every call."""

#: Plans kept per layout (distinct call signatures: patterns, dtypes, devices...).
PLANS_KEPT = 64


def agree_every_call_default() -> bool:
    """``RINGDILATED_AGREE_EVERY_CALL`` read strictly
    (:func:`~ringdilated.core.support.env.env_flag`: raises ``ValueError`` naming it)."""
    return env_flag(AGREE_EVERY_CALL_ENV)


class _Plans:
    """A bounded cache of a layout's planned calls, least recently used dropped first."""

    def __init__(self) -> None:
        self._plans: collections.OrderedDict[Hashable, object] = collections.OrderedDict()

    def get(self, key: Hashable) -> object | None:
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
        return plan

    def put(self, key: Hashable, plan: object) -> None:
        self._plans[key] = plan
        if len(self._plans) > PLANS_KEPT:
            self._plans.popitem(last=False)

    def __len__(self) -> int:
        return len(self._plans)


@attrs.define(eq=False)
class _State:
    """A layout's mutable inside: its planned calls, the shard lengths a layout of equal shards
    learns at its first call, the query lengths every rank passed there, and its rotary positions
    per device."""

    plans: _Plans = attrs.field(factory=_Plans)
    lengths: tuple[int, ...] | None = None
    query_lengths: tuple[int, ...] | None = None
    positions: dict[tuple[torch.device, int], torch.Tensor] = attrs.field(factory=dict)


@register
@attrs.frozen(init=False, eq=False)
class SequenceLayout(OpaqueBase):
    """How the tokens of one batch sit (see the module docstring); made once per batch.

    - ``cu_seqlens``: packed documents, a 1-D integer tensor ``[0, e_1, ..., L]`` of global
      positions, shared by every batch row (flash-attn's convention).
    - ``key_padding_mask``: ``(B, L)`` bool, ``True`` = padding (``torch.nn.MultiheadAttention``'s
      convention; a Hugging Face ``attention_mask``, 1 = token, is its negation: pass
      ``attention_mask == 0``); each row's valid (``False``) positions one contiguous run, a row
      of padding only allowed. An inverted mask is mostly valid and attends the padding
      instead of the tokens: it raises only where a row's valid positions are not one run. Not
      with ``cu_seqlens``.
    - ``process_group``: ``None`` (one process), a ``ProcessGroup``, a 1-D ``DeviceMesh``,
      ``(mesh, "cp")``, or a 2-D layout for ``communicator="hybrid"`` (``(mesh, ("ring",
      "ulysses"))`` or ``(outer group, inner group)``).
    - ``shard_length``: the positions this rank holds (shards may differ); default: equal
      shards.
    - ``agree_every_call``: check and agree every call, as calls without a layout do (debugging);
      default: the environment variable ``RINGDILATED_AGREE_EVERY_CALL``.

    Both tensors are read to the host here, once (so they must hold data: a ``meta`` tensor
    raises ``ValueError`` naming the argument and its device). A layout without a process
    group in a process that a launcher started as one of several ranks (``WORLD_SIZE > 1``)
    before ``torch.distributed.init_process_group()`` plans one-process calls: the first warns
    (:class:`~ringdilated.DistributedNotInitializedWarning`). On a process group the constructor is
    collective (every rank must build its layout together) and every error raises on every
    rank. Raises ``TypeError``/``ValueError`` naming the value and the rule.

    Attributes: ``group`` (the process layout, ``None`` on one process), ``rank``,
    ``world_size``, :attr:`length`, :attr:`shard_lengths`, ``documents``, ``padding`` (rows of
    equal padding), ``batch`` (the padding mask's rows, else ``None``).
    """

    group: object = attrs.field(repr=False)
    rank: int
    world_size: int
    documents: Documents | None
    padding: tuple[Rows, ...] | None
    batch: int | None
    agree_every_call: bool
    _length: int | None = attrs.field(alias="_length")
    _state: _State = attrs.field(alias="_state", repr=False)

    def __init__(
        self,
        *,
        cu_seqlens: object = None,
        key_padding_mask: object = None,
        process_group: object = None,
        shard_length: int | None = None,
        agree_every_call: bool | None = None,
    ) -> None:
        group = grid.as_process_group(process_group)
        ranks = grid.group_size(group)  # a process layout or None: raises on this rank only
        read: _Read | None = None
        error: Exception | None = None
        try:
            read = _read(cu_seqlens, key_padding_mask, shard_length, agree_every_call)
        except Exception as exc:  # on a group, every rank must hear of it
            error = exc
        lengths: tuple[int, ...] | None = None
        if ranks > 1:
            assert isinstance(group, (dist.ProcessGroup, grid.Grid))
            own = read.shard_length if read is not None and read.shard_length is not None else -1
            signature = None if read is None else read.signature()
            differing = agree(group, error, signature, length=own)
            if differing is not None:  # every rank gave its length and they differ
                agree(group, error, signature)
                lengths = differing.lengths
        elif error is not None:
            raise error
        assert read is not None
        if lengths is None and read.shard_length is not None:
            lengths = (read.shard_length,) * ranks
        # Every value below was agreed: each rank reaches the same verdict, no collective needed.
        self._settle(group, ranks, read, lengths)

    def _settle(
        self, group: object, ranks: int, read: _Read, lengths: tuple[int, ...] | None
    ) -> None:
        """Initialise this layout from what was read, placed on shards of ``lengths``
        (:func:`_place`)."""
        length, placed = _place(read, lengths, ranks)
        self.__attrs_init__(
            group,
            0 if group is None else grid.rank(group),  # type: ignore[arg-type]
            ranks,
            read.documents,
            read.padding,
            read.batch,
            read.agree_every_call,
            _length=length,
            _state=_State(lengths=placed),
        )

    @classmethod
    def for_call(
        cls,
        group: object,
        cu_seqlens: object,
        key_padding_mask: object,
        lengths: tuple[int, ...],
        batch: int,
    ) -> SequenceLayout:
        """The layout of one call of ``batch`` rows made without a layout: read and checked on
        this rank only (the call's own agreement covers it), for shards of ``lengths``. Raises
        ``TypeError``/``ValueError`` naming the value."""
        read = _read(cu_seqlens, key_padding_mask, None, True)
        if read.batch is not None and read.batch != batch:
            raise ValueError(
                f"key_padding_mask must be (batch, seq_len) = ({batch}, {sum(lengths)}), got "
                f"({read.batch}, {read.width})"
            )
        layout = cls.__new__(cls)
        layout._settle(group, len(lengths), read, lengths)
        return layout

    @property
    def length(self) -> int | None:
        """The whole sequence's length (``None`` until a call says it, when nothing else does)."""
        if self._length is not None:
            return self._length
        lengths = self._state.lengths
        return None if lengths is None else sum(lengths)

    @property
    def shard_lengths(self) -> tuple[int, ...] | None:
        """Every rank's shard length (``None``: equal shards of a length the first call says)."""
        return self._state.lengths

    @property
    def shard_start(self) -> int:
        """Where this rank's shard begins in the sequence (``0`` on one process)."""
        lengths = self._state.lengths
        return 0 if lengths is None else sum(lengths[: self.rank])

    @property
    def plans(self) -> _Plans:
        """The calls planned on this layout (see the module docstring)."""
        return self._state.plans

    @property
    def query_lengths(self) -> tuple[int, ...] | None:
        """Every rank's query length (its ``q``'s, the last positions of its shard; docs/spec.md,
        section 3), as the first agreed call on the layout passed them (``None`` before it)."""
        return self._state.query_lengths

    def bind(self, lengths: tuple[int, ...], query_lengths: tuple[int, ...] | None = None) -> None:
        """Record the shard lengths a layout of equal shards learned at its first agreed call,
        and the query lengths every rank passed there: every later call on the layout holds the
        same (so a plan it keeps stands for one split of the queries on every rank)."""
        if self._state.lengths is None:
            self._state.lengths = lengths
        if self._state.query_lengths is None and query_lengths is not None:
            self._state.query_lengths = query_lengths

    def check_queries(self, length: int) -> None:
        """Raise ``ValueError`` unless this rank's ``q`` holds ``length`` positions, where the
        layout's first call bound them (:meth:`bind`)."""
        bound = self._state.query_lengths
        if bound is not None and bound[self.rank] != length:
            raise ValueError(
                f"this call's q holds {length} positions but its SequenceLayout's first call "
                f"held {bound[self.rank]} on rank {self.rank} (query lengths {brief(bound)}): "
                "build a new layout for each batch and each split of a query suffix"
            )

    def check_shard(self, length: int) -> None:
        """Raise ``ValueError`` unless this rank's shard holds ``length`` positions, where known."""
        lengths = self._state.lengths
        if lengths is not None and lengths[self.rank] != length:
            raise ValueError(
                f"this call's shard holds {length} positions but its SequenceLayout holds "
                f"{lengths[self.rank]} on rank {self.rank} (shard lengths {brief(lengths)}): "
                "build a new layout for each batch"
            )

    def check_batch(self, batch: int) -> None:
        """Raise ``ValueError`` unless ``batch`` rows match the layout's padding mask."""
        if self.batch is not None and self.batch != batch:
            raise ValueError(
                f"this call has batch {batch} but its SequenceLayout's key_padding_mask has "
                f"{self.batch} rows"
            )

    def documents_for(self, batch: int, key_length: int, query_length: int) -> DocumentLayout:
        """The documents of a call of ``batch`` rows whose keys are the whole sequence of
        ``key_length`` and whose queries its last ``query_length`` positions."""
        if self.padding is not None:
            return DocumentLayout(key_length, query_length, self.padding)
        if self.documents is not None:
            return DocumentLayout(key_length, query_length, (Rows(0, batch, self.documents),))
        return DocumentLayout.whole(batch, key_length, query_length)

    @property
    def description(self) -> str:
        """The documents and padding, as every rank must hold them (:func:`_described`)."""
        return _described(self.documents, self.padding, f"{len(self.padding or ())} row groups")

    def shard_positions(self, device: torch.device, shard_length: int) -> torch.Tensor:
        """``(B', n)`` int64 on ``device``: each position of this rank's shard of ``shard_length``
        counted from its document's start, 0 in padding (``B' = 1`` unless rows differ), for rotary
        embeddings; made once per device and shard length. A layout of equal shards that no call has
        sized yet takes ``shard_length`` as every rank's (a call then checks that they are)."""
        key = (device, shard_length)
        cached = self._state.positions.get(key)
        if cached is None:
            lengths = self._state.lengths or (shard_length,) * self.world_size
            length, start = sum(lengths), sum(lengths[: self.rank])
            rows = self.documents_for(self.batch or 1, length, length)
            whole = rows.positions(device)
            cached = self._state.positions[key] = whole[:, start : start + shard_length]
        return cached


@attrs.frozen
class _Read:
    """What one rank passed, checked on its own."""

    shard_length: int | None
    agree_every_call: bool
    documents: Documents | None = None
    padding: tuple[Rows, ...] | None = None
    batch: int | None = None
    width: int | None = None  # the length the documents or the padding mask say

    def signature(self) -> LayoutSignature:
        return LayoutSignature(
            documents=_described(self.documents, self.padding, f"{self.batch} rows"),
            shape=f"length {self.width}, batch {self.batch}",
            shard_length="given" if self.shard_length is not None else "equal shards",
            agree_every_call=str(self.agree_every_call),
        )


def _read(
    cu_seqlens: object, key_padding_mask: object, shard_length: object, every_call: object
) -> _Read:
    if cu_seqlens is not None and key_padding_mask is not None:
        raise ValueError(
            "pass cu_seqlens (packed documents) or key_padding_mask (one padded document per "
            "row), not both"
        )
    if shard_length is not None and (
        isinstance(shard_length, bool) or not isinstance(shard_length, int) or shard_length < 1
    ):
        raise ValueError(
            f"shard_length must be a positive int (this rank's positions) or None, got "
            f"{safe_repr(shard_length)}"
        )
    length: int | None = shard_length
    if every_call is None:
        every_call = agree_every_call_default()
    elif not isinstance(every_call, bool):
        raise TypeError(f"agree_every_call must be a bool or None, got {safe_repr(every_call)}")
    if cu_seqlens is not None:
        documents = read_documents(cu_seqlens, None)
        return _Read(length, every_call, documents, width=documents[-1][1])
    if key_padding_mask is not None:
        padding = read_padding(key_padding_mask, None, None)
        assert isinstance(key_padding_mask, torch.Tensor)
        batch, width = key_padding_mask.shape
        return _Read(length, every_call, padding=padding, batch=batch, width=width)
    return _Read(length, every_call)


def _place(
    read: _Read, lengths: tuple[int, ...] | None, ranks: int
) -> tuple[int | None, tuple[int, ...] | None]:
    """``(length, shard lengths)`` from what the documents, the padding and the shard lengths
    say, which must agree; equal shards of a known length; ``(None, None)`` when nothing says."""
    width = read.width
    if lengths is not None:
        check_shard_lengths(lengths)
        total = sum(lengths)
        shards = "" if ranks == 1 else f" (every rank's shard: {brief(lengths)})"
        if read.documents is not None and width != total:
            raise ValueError(
                f"cu_seqlens must run from 0 to the sequence length {total}{shards}, got "
                f"{[0, *(stop for _, stop in read.documents)]}"
            )
        if read.padding is not None and width != total:
            raise ValueError(
                f"key_padding_mask must be (batch, seq_len) = ({read.batch}, {total}){shards}, "
                f"got ({read.batch}, {width})"
            )
        return total, lengths
    if width is None:
        return None, None
    if width % ranks:
        raise ValueError(
            f"the sequence length {width} must be a multiple of the {ranks} ranks for equal "
            "shards (or pass every rank's shard_length)"
        )
    return width, (width // ranks,) * ranks


def _described(documents: Documents | None, padding: tuple[Rows, ...] | None, rows: str) -> str:
    """The documents or the padding (of ``rows``): a digest (they may be long), or ``"none"``."""
    if padding is not None:
        what, text = f"padding of {rows}", repr([(r.start, r.stop, r.documents) for r in padding])
    elif documents is not None:
        what, text = f"{len(documents)} documents", repr(documents)
    else:
        return "none"
    return f"{what}, digest {hashlib.blake2b(text.encode(), digest_size=8).hexdigest()}"
