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
  document that started on an earlier rank, passing ``0, 1, ..., n - 1`` for such a row (every
  row is read; its shard counted from 0 is transformers' count when ``position_ids`` are left
  out). That raises, naming the row, the shard's first global position and its position in its
  document. (A shard of one position is not read: a count from 0 and a restart cannot be told
  apart there.)
- **what the sharded path never serves**, refused by transformers' mask function itself, at
  once: a decode step (queries after cached positions: decode on one process), a static or
  sliding-window cache layout (``generate(cache_implementation="static")``: its keys are the
  cache's slots, not the shard), and cross attention (an encoder-decoder model's config, or a
  bidirectional mask over other keys than the queries). An empty dynamic cache
  (``use_cache=True`` in training) is fine.
- ``labels=`` passed to the model, on a process group: transformers' registered losses
  (``transformers.loss.loss_utils.LOSS_MAPPING``, which a model's ``self.loss_function``
  reads) raise while a block is open in the calling context, after the layers ran: a causal
  LM's would shift each shard's labels on its own and average per shard. Pass none and use
  :func:`ringdilated.sharded_cross_entropy`. (A model that computes its loss without that
  registry is not seen.)
- a checkpointed region that holds the model's mask creation (``torch.utils.checkpoint`` around
  the whole model): its recompute in the backward runs with no block open (autograd runs the
  backward outside it, on CUDA on its own threads), so it would run on one process, unsharded;
  transformers' mask function raises ``RuntimeError`` there, while a layout that a sharded
  forward ran on is alive. Checkpoint the layers instead
  (``model.activation_checkpointing_enable()``, transformers 5.23's name for
  ``gradient_checkpointing_enable``): they recompute under the same mask object (transformers
  passes it to each layer, and checkpointing keeps the layer's arguments), so on the same
  layout, checking nothing again.

When each check runs, and its cost per forward (not per layer): the mask function's, once per
model forward (transformers calls it before the first layer), one host read of a bool when an
``attention_mask`` is passed; the ``cu_seq_lens_k`` and position checks at the forward's first
attention call, one host read of a bool each, the latter only on a rank whose shard begins
inside a document. What they compare with on the device is built once per layout and device
(one copy each; ``ringdilated._hf_shard_checks``). A check's failure is raised at that first
attention call, after whatever the layer did before it (FSDP2's all-gather of its
parameters), where its peers can hear of it: if this call's plan is not on the layout yet (a
new layout per batch, as :func:`ringdilated.shard_batch` makes, or a new kind of call on a
reused one: an ``eval()`` forward under ``no_grad`` after training) the failing rank reports it
in the call's agreement, so every rank raises (its peers a
:class:`~ringdilated.PeerRejectedError` naming it); a call planned before raises on its own
rank only, its peers waiting until the group's timeout
(:func:`~ringdilated.core.call.prepare.rejected`).

Under ``torch.compile`` the sharded path runs eagerly, behind graph breaks (the mask function's
part, and each attention call); a compiled one-process forward with no block open anywhere is
traced as before.

The setting is a context variable: it holds in the thread (and asyncio task) that opened the
block. A thread started inside the block does not inherit it (its forwards run on one
process, and under the block's layout they raise nothing): run the thread's work in a copy of
the context, ``threading.Thread(target=contextvars.copy_context().run, args=(work,))``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch

from ringdilated import _hf_shard_checks as checks
from ringdilated.core import Communicator
from ringdilated.core.call import SequenceLayout, agreed, rejected, safe_repr
from ringdilated.functional import dilated_attention
from ringdilated.registry import default_resolver

__all__ = [
    "SequenceParallel",
    "ShardedForward",
    "active",
    "refuse_unsharded_recompute",
    "sequence_parallel",
]

NAME = checks.NAME


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

_SHARDED: weakref.WeakSet[SequenceLayout] = weakref.WeakSet()
"""The layouts a sharded forward's mask function ran on, while they live (their users hold
them through the step): see :func:`refuse_unsharded_recompute`."""


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
    ``communicator``: see :class:`SequenceParallel`; a name is checked here against the
    registered communicators, whether it fits the layout at the first layer call, on every
    rank. Blocks nest (the innermost wins) and hold per thread and task (a context variable,
    which threads started inside do not inherit: see the module docstring). Raises
    ``TypeError`` naming the value for anything else, and ``ValueError`` naming an unknown
    communicator and the known ones, before any forward.
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
    default_resolver().check_communicator_name(communicator)
    global _open
    setting = SequenceParallel(layout, communicator)
    token = _ACTIVE.set(setting)
    with _opening:
        if not _open:
            _guard_losses()
        _open += 1
    try:
        yield setting
    finally:
        with _opening:
            _open -= 1
            if not _open:
                _unguard_losses()
        _ACTIVE.reset(token)


def refuse_unsharded_recompute() -> None:
    """Called by transformers' mask function outside every block: raise ``RuntimeError`` when
    it runs during a backward (autograd's current graph task, as FSDP2's
    ``_fsdp_common.is_bw`` reads it in torch 2.13) while a layout that a sharded forward ran
    on is alive: the recompute of a checkpointed region that holds the model's mask creation
    (see the module docstring), which would otherwise run unsharded, silently."""
    if torch.compiler.is_compiling() or not _SHARDED:
        return
    if torch._C._current_graph_task_id() == -1:
        return
    raise RuntimeError(
        f"attn_implementation={NAME!r}: transformers' mask function ran during a backward with "
        "no sequence_parallel block open, while a layout a sharded forward ran on is alive: a "
        "checkpointed region holds the model's mask creation (torch.utils.checkpoint around "
        "the whole model), and its recompute would run on one process, unsharded. Checkpoint "
        "the decoder layers instead (model.activation_checkpointing_enable()): they recompute on "
        "the layout their mask carries"
    )


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
        config: object,
        bidirectional: bool,
        batch_size: int,
        q_length: int,
        kv_length: int,
        q_offset: int,
        kv_offset: int,
        attention_mask: torch.Tensor | None,
    ) -> ShardedForward:
        """The forward's record, made by the mask function (transformers' arguments; the mask
        as it passes it, bool, ``True`` = token; ``bidirectional``: whether transformers asked
        for its bidirectional mask function). Raises ``ValueError`` at once for a forward the
        sharded path never serves (:func:`~ringdilated._hf_shard_checks.refuse_now`)."""
        checks.refuse_now(
            config, bidirectional, q_length, kv_length, q_offset, kv_offset, attention_mask
        )
        layout = setting.layout
        with _opening:
            _SHARDED.add(layout)
        return cls(setting, checks.mask_problem(layout, batch_size, q_length, attention_mask))

    def attend(
        self,
        overlay: str | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: Any,
        rates: Any,
        pattern: Mapping[str, Any],
        kwargs: Mapping[str, object],
    ) -> torch.Tensor:
        """One layer's attention call (``q``, ``k``, ``v`` ``(B, L, H, D)``) on the forward's
        layout; at the forward's first call, first raise (see the module docstring) the
        problem the mask function found, a mask function the adapter does not serve
        (``overlay``, how transformers built it), a ``cu_seq_lens_k`` that is not the layout's
        documents, or ``position_ids`` that count the shard from 0."""
        layout = self.setting.layout
        call = functools.partial(
            dilated_attention, q, k, v, segments, rates, layout=layout,
            communicator=self.setting.communicator, **pattern,
        )  # fmt: skip
        problem = None if self.checked else self._first_call_problem(overlay, kwargs, q)
        self.checked = True
        if problem is None:
            out: torch.Tensor = call()
            return out
        if layout.world_size > 1 and not agreed(problem):
            with rejected(problem):  # the call's own planning raises it, where peers hear
                call()
        raise problem

    def _first_call_problem(
        self, overlay: str | None, kwargs: Mapping[str, object], q: torch.Tensor
    ) -> Exception | None:
        if self.problem is not None:
            return self.problem
        if overlay is not None:
            return ValueError(
                f"attn_implementation={NAME!r} serves transformers' causal_mask_function or "
                "bidirectional_mask_function, or their sliding windows; transformers asked for "
                f"{overlay}"
            )
        return checks.call_problem(self.setting.layout, dict(kwargs), q.shape[1])


_ORIGINAL_LOSSES: dict[str, Callable[..., Any]] = {}
"""transformers' registered losses, by name, while guarded (:func:`_guard_losses`)."""


def _guarded(name: str, loss: Callable[..., Any]) -> Callable[..., Any]:
    """``loss``, refused under a block on a process group (the module docstring's ``labels=``)."""

    @functools.wraps(loss)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        setting = active()
        if setting is not None and setting.layout.world_size > 1:
            raise ValueError(
                f"attn_implementation={NAME!r} under sequence_parallel on "
                f"{setting.layout.world_size} ranks: the model was given labels= and computes "
                f"its loss ({name}) over this rank's shard alone (a causal LM's shifts each "
                "shard's labels on its own and averages per shard). Pass no labels= to the "
                "model: take ringdilated.sharded_cross_entropy(logits, shard.labels, group)"
            )
        return loss(*args, **kwargs)

    return guarded


def _guard_losses() -> None:
    """Guard every loss in transformers' ``LOSS_MAPPING`` (held by ``_opening``, as the first
    block opens): outside every block each guard only calls its loss."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    losses: dict[str, Any] = LOSS_MAPPING
    for name, loss in list(losses.items()):
        _ORIGINAL_LOSSES[name] = loss
        losses[name] = _guarded(name, loss)


def _unguard_losses() -> None:
    """Put back the losses :func:`_guard_losses` guarded, where the guard is still in place
    (held by ``_opening``, as the last block closes)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    losses: dict[str, Any] = LOSS_MAPPING
    for name, loss in _ORIGINAL_LOSSES.items():
        if getattr(losses.get(name), "__wrapped__", None) is loss:
            losses[name] = loss
    _ORIGINAL_LOSSES.clear()
