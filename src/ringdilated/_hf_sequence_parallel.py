"""Sequence parallelism for the Hugging Face adapter: :func:`sequence_parallel` (re-exported as
``ringdilated.hf.sequence_parallel``) and what each model forward under it checks.

Under ``with sequence_parallel(layout):`` every ``attn_implementation="ringdilated"`` layer of a
model forward runs on ``layout``, the batch's :class:`~ringdilated.SequenceLayout`
(:attr:`BatchShard.layout <ringdilated.BatchShard.layout>`): its process layout, every rank's
shard length, and the batch's documents and padding in global positions. Each rank passes its
shard of ``input_ids`` and the batch's global ``position_ids`` (:attr:`BatchShard.position_ids
<ringdilated.BatchShard.position_ids>`) and gets its slice of the logits; the loss over the shards
is :func:`ringdilated.sharded_cross_entropy` of them and :attr:`BatchShard.labels
<ringdilated.BatchShard.labels>`.

What the adapter reads, and what it refuses (a rank's own ``attention_mask`` and
``position_ids`` describe its shard only, never the other ranks'):

- **documents and padding**: the layout's only. transformers' own signals are not read for
  them: the packed documents it finds in a shard's ``position_ids``, and a shard's
  ``attention_mask`` (which may be left out). A given ``attention_mask`` must be this shard's
  columns of the batch's (``1`` = token, ``0`` = padding), and say what the layout says at
  every position; ``cu_seq_lens_k`` (flash-attention kwargs of packed batches) must be the
  layout's documents, global ``[0, e_1, ..., L]``. Otherwise a ``ValueError`` names the row,
  the global position and both values.
- **positions**: ``position_ids`` reach the model's position embeddings as given, as on one
  process. The adapter reads them for one mistake only: a rank whose shard begins inside a
  document that started on an earlier rank, passing ``0, 1, ..., n - 1`` for that row (its
  shard counted from 0: transformers' count when ``position_ids`` are left out). That raises,
  naming the row, the shard's first global position and its position in its document. (A shard
  of one position is not read: a count from 0 and a restart cannot be told apart there.)
- **a cache**: a forward whose queries are not the whole shard (a decode step over
  transformers' cache) is refused; an empty cache (``use_cache=True`` in training) is fine.
- ``labels=`` passed to the model would make transformers shift each shard on its own (it
  cannot be seen from here): pass none and use :func:`ringdilated.sharded_cross_entropy`.

When each check runs: the mask function's, once per model forward (transformers calls it before
the first layer); the position and ``cu_seq_lens_k`` checks at the forward's first attention
call, which reads ``position_ids`` once (one host read of a bool). A failure is raised at that
first attention call, after whatever the layer did before it (FSDP2's all-gather of its
parameters), and before the call's agreement: on a layout that has planned no call yet (a new
layout per batch, as :func:`ringdilated.shard_batch` makes) the failing rank reports it there,
so every rank raises (its peers a :class:`~ringdilated.PeerRejectedError` naming it); on a
layout reused after planning, on its own rank only, its peers waiting until the group's
timeout.

Under ``torch.compile`` the sharded path runs eagerly, behind graph breaks (the mask function's
part, and each attention call); a compiled one-process forward with no block open anywhere is
traced as before.

Checkpointed layers recompute under the same mask object (transformers passes it to each layer,
and checkpointing keeps the layer's arguments), so a backward outside the ``with`` block, on
autograd's threads, runs on the same layout and checks nothing again.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Mapping
from typing import NoReturn

import attrs
import torch

from ringdilated.core import Communicator
from ringdilated.core.call import SequenceLayout, agree, agreed, safe_repr

__all__ = ["SequenceParallel", "ShardedForward", "active", "sequence_parallel"]

NAME = "ringdilated"
_CONVENTION = "(1 = token, 0 = padding)"


@attrs.frozen
class SequenceParallel:
    """What :func:`sequence_parallel` sets for the forwards inside it: the batch's ``layout`` and
    the ``communicator`` every sharded layer call takes (``"auto"``, a name such as
    ``"ringpass"``, ``"allgather"``, ``"ulysses"``, ``"hybrid"`` on a 2-D layout, or an
    instance)."""

    layout: SequenceLayout = attrs.field(repr=False)
    communicator: str | Communicator = "auto"


_ACTIVE: contextvars.ContextVar[SequenceParallel | None] = contextvars.ContextVar(
    "ringdilated_hf_sequence_parallel", default=None
)


_open = 0
"""How many :func:`sequence_parallel` blocks are open, in any thread: what compiled code reads
(a constant to ``torch.compile``, guarded, which cannot read a context variable)."""
_opening = threading.Lock()


def active() -> SequenceParallel | None:
    """The innermost :func:`sequence_parallel` setting of this context, else ``None``. Traced by
    ``torch.compile`` while no block is open anywhere; while one is, a graph break."""
    if not _open:
        return None
    setting: SequenceParallel | None = _current()
    return setting


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _current() -> SequenceParallel | None:
    return _ACTIVE.get()


@contextlib.contextmanager
def sequence_parallel(
    layout: SequenceLayout, *, communicator: str | Communicator = "auto"
) -> Iterator[SequenceParallel]:
    """Run the ``attn_implementation="ringdilated"`` layers of every model forward inside the
    block on ``layout`` (see the module docstring)::

        shard = ringdilated.shard_batch(
            batch["input_ids"], attention_mask=batch["attention_mask"], process_group=cp
        ).to(device)
        with ringdilated.hf.sequence_parallel(shard.layout):
            logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
        loss = ringdilated.sharded_cross_entropy(logits, shard.labels, cp)
        loss.backward()  # then sum the gradients over cp (or averaged_over= under FSDP2)

    ``layout``: a :class:`~ringdilated.SequenceLayout` on the sequence-parallel process layout
    (a layout without one runs on one process, its documents and padding read as above);
    ``communicator``: see :class:`SequenceParallel`, checked by the first layer call on every
    rank. Blocks nest (the innermost wins) and hold per thread and task (a context variable).
    Raises ``TypeError`` naming the value for anything else, before any forward.
    """
    if not isinstance(layout, SequenceLayout):
        hint = ": pass its .layout" if hasattr(layout, "layout") else ""
        raise TypeError(
            f"sequence_parallel takes the batch's ringdilated.SequenceLayout (BatchShard.layout), "
            f"got {type(layout).__name__}{hint}"
        )
    if not isinstance(communicator, (str, Communicator)):
        raise TypeError(
            f"communicator must be a name ('auto', 'ringpass', 'allgather', 'ulysses', "
            f"'hybrid') or a Communicator, got {safe_repr(communicator)}"
        )
    global _open
    setting = SequenceParallel(layout, communicator)
    token = _ACTIVE.set(setting)
    with _opening:
        _open += 1
    try:
        yield setting
    finally:
        with _opening:
            _open -= 1
        _ACTIVE.reset(token)


@attrs.define(eq=False)
class ShardedForward:
    """One model forward under :func:`sequence_parallel`, as its mask function saw it: the
    setting, the first problem found there (raised at the first attention call, see the module
    docstring) and whether that call's checks have run."""

    setting: SequenceParallel
    problem: Exception | None = None
    checked: bool = False

    @classmethod
    def begin(
        cls,
        setting: SequenceParallel,
        *,
        batch_size: int,
        q_length: int,
        kv_length: int,
        q_offset: int,
        kv_offset: int,
        attention_mask: torch.Tensor | None,
    ) -> ShardedForward:
        """The forward's record, made by the mask function (transformers' arguments; the mask
        as it passes it, bool, ``True`` = token)."""
        try:
            _check_mask_arguments(
                setting.layout, batch_size, q_length, kv_length, q_offset, kv_offset,
                attention_mask,
            )  # fmt: skip
        except ValueError as error:
            return cls(setting, error)
        return cls(setting)

    def layout_for_call(self, overlay: str | None, kwargs: Mapping[str, object]) -> SequenceLayout:
        """The layout of this attention call; at the forward's first call, raise (see the module
        docstring) the problem the mask function found, a mask function the adapter does not
        serve (``overlay``, how transformers built it), a ``cu_seq_lens_k`` that is not the
        layout's documents, or ``position_ids`` that count the shard from 0."""
        layout = self.setting.layout
        if self.checked:
            return layout
        self.checked = True
        problem = self.problem
        if problem is None and overlay is not None:
            problem = ValueError(
                f"attn_implementation={NAME!r} serves transformers' causal_mask_function or "
                f"bidirectional_mask_function; transformers asked for {overlay}"
            )
        if problem is None:
            try:
                _check_documents(layout, kwargs.get("cu_seq_lens_k"))
                _check_positions(layout, kwargs.get("position_ids"))
            except ValueError as error:
                problem = error
        if problem is not None:
            _reject(problem, layout)
        return layout


def _reject(error: Exception, layout: SequenceLayout) -> NoReturn:
    """Raise ``error`` on every rank where its peers can hear of it: on a layout that has planned
    no call (or agrees every call) they are in the first call's agreement, which this rank
    joins with its error (each then raises); otherwise on this rank only (as
    :meth:`ringdilated.DilatedAttention.reject`)."""
    steady = not layout.agree_every_call and len(layout.plans) > 0
    if layout.world_size > 1 and not agreed(error) and not steady:
        agree(layout.group, error, None)  # type: ignore[arg-type]
    raise error


def _shard(layout: SequenceLayout, length: int) -> tuple[int, int | None]:
    """``(start, the layout's length of this rank's shard)``: a layout of equal shards no call
    has sized yet takes ``length`` as every rank's (its first call checks that they are)."""
    lengths = layout.shard_lengths
    if lengths is None:
        return layout.rank * length, None
    return sum(lengths[: layout.rank]), lengths[layout.rank]


def _check_mask_arguments(
    layout: SequenceLayout,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
    mask: torch.Tensor | None,
) -> None:
    """The cache, the ``attention_mask``'s shape and the shard's length against the layout, then
    the mask's values (without a cache transformers counts the keys from the mask's columns)."""
    decoding = ValueError(
        f"attn_implementation={NAME!r} under sequence_parallel runs forwards whose queries are "
        f"the whole shard (training, or a prefill without cached positions); got {q_length} "
        f"queries from position {q_offset} of {kv_length} keys (a decode step over "
        "transformers' cache: decode on one process)"
    )
    if q_offset != 0 or kv_offset != 0:
        raise decoding
    if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (batch_size, q_length)):
        raise ValueError(
            f"attn_implementation={NAME!r} under sequence_parallel takes this shard's columns of "
            f"the batch's attention_mask {_CONVENTION}, ({batch_size}, {q_length}), or none (the "
            f"layout holds the padding); got shape {tuple(mask.shape)}"
        )
    if kv_length != q_length:  # a static cache's length, with no mask
        raise decoding
    rank = layout.rank
    _, expected = _shard(layout, q_length)
    if expected is not None and expected != q_length:
        raise ValueError(
            f"attn_implementation={NAME!r} under sequence_parallel: this rank's input holds "
            f"{q_length} positions but its SequenceLayout's shard on rank {rank} holds "
            f"{expected} (shard lengths {layout.shard_lengths}): pass the shard that "
            "ringdilated.shard_batch made with this layout"
        )
    if mask is not None:
        _check_padding(layout, mask)


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


def _check_padding(layout: SequenceLayout, mask: torch.Tensor) -> None:
    """Raise unless ``mask`` (bool, ``True`` = token) says what the layout says on this shard."""
    batch, length = mask.shape
    if layout.batch is not None and layout.batch != batch:
        raise ValueError(
            f"attn_implementation={NAME!r} under sequence_parallel: the model's batch has "
            f"{batch} rows but the layout's padding mask {layout.batch}"
        )
    start, _ = _shard(layout, length)
    expected = _shard_tokens(layout, batch, start, length).to(mask.device)
    differ = mask != expected
    if not bool(differ.any()):  # one read of a bool
        return
    row, column = (int(i) for i in differ.nonzero()[0])
    given, wanted = "padding (0)", "a token"
    if bool(mask[row, column]):
        given, wanted = "a token (1)", "padding"
    raise ValueError(
        f"attn_implementation={NAME!r} under sequence_parallel reads the padding from the "
        f"layout: this rank's attention_mask {_CONVENTION} has {given} at row {row}, column "
        f"{column} (global position {start + column}), where the layout has {wanted}. Pass "
        "this shard's columns of the mask given to ringdilated.shard_batch, or none"
    )


def _check_documents(layout: SequenceLayout, cu_seq_lens: object) -> None:
    """Raise unless ``cu_seq_lens`` (transformers' ``cu_seq_lens_k``) is absent or the layout's
    documents: ``[0, e_1, ..., L]`` in global positions."""
    if cu_seq_lens is None:
        return
    length = layout.length
    if layout.documents is not None:
        documents: list[int] | None = [0, *(stop for _, stop in layout.documents)]
    elif layout.padding is None and length is not None:
        documents = [0, length]
    else:
        documents = None  # padding, or a length no call has said yet
    given = cu_seq_lens.tolist() if isinstance(cu_seq_lens, torch.Tensor) else cu_seq_lens
    if documents is None or given != documents:
        has = "padding" if layout.padding is not None else f"documents {documents}"
        raise ValueError(
            f"attn_implementation={NAME!r} under sequence_parallel reads the documents from the "
            f"layout, which has {has}; got cu_seq_lens_k {safe_repr(given)}. Pass the "
            "batch's cu_seqlens to ringdilated.shard_batch and leave the flash-attention "
            "kwargs out"
        )


def _check_positions(layout: SequenceLayout, position_ids: object) -> None:
    """Raise if a row whose shard begins inside a document that began on an earlier rank has
    ``position_ids`` ``0, 1, ..., n - 1`` (see the module docstring)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        return  # not passed to the attention by this model (or not as transformers does)
    rows, length = position_ids.shape
    if length < 2:
        return
    start, _ = _shard(layout, length)
    if start == 0:
        return
    whole = layout.documents_for(layout.batch or 1, start + length, start + length)
    inside: dict[int, tuple[int, int, int]] = {}  # positions' row -> (batch row, doc start, offset)
    for group in whole.rows:
        for first, stop in group.documents:
            if first < start < stop:
                for batch_row in range(group.start, group.stop):
                    row = batch_row if rows > 1 else 0
                    if row < rows:
                        inside.setdefault(row, (batch_row, first, start - first))
    if not inside:
        return
    count = torch.arange(length, device=position_ids.device, dtype=position_ids.dtype)
    checked = sorted(inside)
    from_zero = (position_ids[checked] == count).all(dim=1)
    if not bool(from_zero.any()):  # one read of a bool
        return
    batch_row, first, offset = inside[checked[int(from_zero.nonzero()[0])]]
    raise ValueError(
        f"attn_implementation={NAME!r} under sequence_parallel: position_ids of row {batch_row} on "
        f"rank {layout.rank} count this shard from 0 (0, 1, ..., {length - 1}), but the shard "
        f"begins at global position {start}, {offset} positions into a document that starts at "
        f"{first}: pass the batch's global position_ids (BatchShard.position_ids; transformers "
        "counts each shard from 0 when position_ids are left out)"
    )
