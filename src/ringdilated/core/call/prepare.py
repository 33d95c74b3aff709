"""One call's plan: everything a dilated-attention call needs besides its tensors.

:func:`plan_for` finds a call's plan on its :class:`SequenceLayout` (by :func:`plan_key`), or has
:func:`prepare_call` make it, on every rank, before any work: it validates every argument (the
pattern included), resolves the kernel for the tensors actually passed, and, on a process group,
plans every rank's shard and resolves the communicator (one process: only its name is checked); then
the ranks agree (:mod:`ringdilated.core.call.agreement`), so bad input raises on every rank. The
plan builds its executors once (:meth:`CallPlan.with_executors`); every call then runs::

    plan = plan_for(pattern, q, k, v, arguments, resolver, process_group, layout)
    out, lse = execute(plan, q, k, v, stats)          # kernels and exchanges only
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
from collections.abc import Callable, Iterator

import attrs
import torch
import torch.distributed as dist

from ringdilated.core.call import grid
from ringdilated.core.call.agreement import CallSignature, Split, agree, agreed, safe_repr
from ringdilated.core.call.grid import Grid, as_process_group, group_size
from ringdilated.core.call.nccl_device import check_current_device
from ringdilated.core.call.sequence_layout import SequenceLayout
from ringdilated.core.call.validation import (
    as_softcap,
    check_bool,
    check_inputs,
    check_options,
    check_query_split,
    check_shards,
    check_sinks,
    check_window,
)
from ringdilated.core.contract.communicator import Communicator, TransferStats, mask_argument
from ringdilated.core.plan.documents import DocumentLayout, Rows
from ringdilated.core.plan.heads import deal_heads, share_blocks, share_plan
from ringdilated.core.plan.pattern import Block, DilationPattern
from ringdilated.core.plan.shards import ShardPlan, shard_plan
from ringdilated.core.plan.window import KeyWindow
from ringdilated.core.run.head_parallel import HeadParallelRun
from ringdilated.core.run.local import (
    BackwardInputs,
    CallState,
    DilatedAttentionFunction,
    Executor,
    LocalRun,
    as_lse_layout,
    draw_seed,
    effective_scale,
    forward_with_sinks,
    pattern_run,
)
from ringdilated.core.run.sharded import ShardedRun
from ringdilated.core.run.sinks import sinks_gradient
from ringdilated.core.select.capabilities import Request, deterministic_algorithms
from ringdilated.core.select.communicator_spec import SUFFIX_REFUSED, CommunicatorChoice
from ringdilated.core.select.cost import PieceSize, link_for
from ringdilated.core.select.dtypes import autocast_off, warn_if_slow
from ringdilated.core.select.feature_cost import warn_if_slow_features
from ringdilated.core.select.resolver import KERNEL_ENV_VAR, KernelChoice, ResolutionError, Resolver

__all__ = [
    "WHOLE_SEQUENCES",
    "CallOptions",
    "CallPlan",
    "PatternArgs",
    "call_layout",
    "call_state",
    "execute",
    "execute_backward",
    "operands",
    "plan_for",
    "plan_key",
    "prepare_call",
    "rejected",
    "wants_gradients",
]

PatternArgs = tuple[object, object, object]
"""``(segment_lengths, dilation_rates, mode)``, not yet validated."""


def wants_gradients(*tensors: object) -> bool:
    """Whether a call on ``tensors`` (``q``, ``k``, ``v``, the sinks; ``None`` and anything not
    a tensor count as not requiring one) builds a backward: grad mode is on and one of them
    requires a gradient."""
    wants = any(bool(getattr(x, "requires_grad", False)) for x in tensors)
    return wants and torch.is_grad_enabled()


@attrs.frozen
class CallOptions:
    """A call's arguments besides its tensors and pattern, as the caller passed them: checked by
    :func:`prepare_call`, inside the ranks' agreement, never on construction."""

    causal: object = False
    window: object = None
    scale: object = None
    dropout_p: object = 0.0
    return_lse: object = False
    kernel: object = "auto"
    communicator: object = "auto"
    transfer_stats: object = attrs.field(default=None, eq=False)
    cu_seqlens: object = attrs.field(default=None, eq=False)
    key_padding_mask: object = attrs.field(default=None, eq=False)
    softcap: object = None
    sinks: object = attrs.field(default=None, eq=False)


RowPlan = tuple[Rows, tuple[ShardPlan, ...], CommunicatorChoice]
"""Batch rows sharing one padding, every rank's shard plan for them, and their communicator."""


@attrs.frozen
class CallPlan:
    """A validated call. ``scale`` is resolved (``1 / sqrt(D)`` by default); ``layout`` places
    documents, padding and a query suffix; ``shards`` holds every rank's shard plan (empty on
    one process) and ``communicator`` moves their pieces (``None`` on one process): the
    resolver's choice, its spec (which says how the run uses it) beside its instance;
    ``lse_used``: whether the caller differentiates through ``lse`` (agreed by every rank).
    ``softcap``: the call's logit cap (``None``: none), in every block's options.
    ``parts``: what runs each group of batch rows (built by :func:`prepare_call`, reused by
    every call of the plan). The plan is itself an
    :class:`~ringdilated.core.run.local.Executor` over them (:meth:`forward`, :meth:`backward`)."""

    pattern: DilationPattern
    kernel: KernelChoice
    window: KeyWindow
    scale: float
    dropout_p: float
    layout: DocumentLayout
    rank: int = 0
    shards: tuple[ShardPlan, ...] = ()
    communicator: CommunicatorChoice | None = attrs.field(default=None, eq=False)
    group: object = attrs.field(default=None, eq=False)
    row_plans: tuple[RowPlan, ...] = attrs.field(default=(), eq=False)
    size: PieceSize | None = None
    lse_used: bool = True
    parts: tuple[tuple[slice | None, Executor], ...] = attrs.field(default=(), eq=False)
    softcap: float | None = attrs.field(default=None, kw_only=True)
    padding_rows: dict[torch.device, torch.Tensor | None] = attrs.field(
        factory=dict, init=False, eq=False, repr=False
    )  # query_padding's memo

    def explain_communicator(self, resolver: Resolver, name: str | Communicator) -> str:
        """The communicator choice for this call's shards (the first group of padded rows'),
        with what each communicator would move; on one process, that none is needed."""
        ranks = max(1, len(self.shards))
        grid_shape = self.group.shape if isinstance(self.group, Grid) else None
        return resolver.explain_communicator(
            ranks, self.window, name, self.shards, self.size, grid_shape
        )

    def row_parts(self) -> list[tuple[slice | None, CallPlan]]:
        """The call as independent parts over batch rows: ``[(None, self)]``, unless a sharded
        call's rows differ in padding, whose rows then run one group at a time (each group with
        its own shard plans and communicator, and its own dropout seed)."""
        if not self.row_plans:
            return [(None, self)]
        parts: list[tuple[slice | None, CallPlan]] = []
        for rows, shards, chosen in self.row_plans:
            local = attrs.evolve(rows, start=0, stop=rows.stop - rows.start)
            docs = DocumentLayout(self.layout.length, self.layout.query_length, (local,))
            part = attrs.evolve(self, layout=docs, shards=shards, communicator=chosen, row_plans=())
            parts.append((rows.batches, part))
        return parts

    def with_executors(self, q: torch.Tensor, k: torch.Tensor) -> CallPlan:
        """This plan with its :meth:`executor` built for each group of rows, for tensors shaped like
        ``q`` and ``k`` (once per plan: it prepares the communicators)."""
        parts = tuple((rows, part.executor(q, k)) for rows, part in self.row_parts())
        return attrs.evolve(self, parts=parts)

    def check_shard(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise ``ValueError`` at once, on this rank, if a later call's shard contradicts the
        planned one, its query suffix included (its peers, which do not hear of it, are released
        by the backend's timeout). One process: nothing to check (the plan's key holds the
        sequence length)."""
        shard = self.shard
        if shard is None:
            return
        if not (k.shape[1] == v.shape[1] == shard.shard_len and q.shape[1] == shard.query_length):
            raise ValueError(
                f"this call's shard is q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                f"{tuple(v.shape)}, but its SequenceLayout holds {shard.shard_len} positions on "
                f"rank {self.rank}, of which its q holds the last {shard.query_length}: build a "
                "new layout for each batch and each split of a query suffix"
            )

    def apply(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        call: CallState,
        sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of one call under one autograd node (none when no gradient can flow):
        ``q`` contiguous; ``k``, ``v`` any strides whose last is 1 (see :func:`operands`);
        ``sinks``: the call's attention sinks (``None``: none), merged into the final results
        (:func:`~ringdilated.core.run.local.forward_with_sinks`)."""
        padding = None if sinks is None else self.query_padding(q.device)
        if not wants_gradients(q, k, v, sinks):  # no autograd node to build (microseconds)
            with autocast_off(q.device.type):
                return forward_with_sinks(self, q, k, v, call, sinks, padding)
        return DilatedAttentionFunction.apply(q, k, v, self, call.with_lse(), sinks, padding)  # type: ignore[no-untyped-call,no-any-return]

    def query_padding(self, device: torch.device) -> torch.Tensor | None:
        """``(B or 1, Lq)`` bool on ``device``, ``True`` at this rank's query positions that are
        padding (no query: no attention sink there), or ``None`` when none is. Built from the
        layout on the host once per plan and device, then reused (no copy per call)."""
        if device in self.padding_rows:
            return self.padding_rows[device]
        layout = self.layout
        shards = self.shards or (self.row_plans[0][1] if self.row_plans else ())
        if shards:
            starts = shards[self.rank].starts
            lo, hi = starts[self.rank] + shards[self.rank].query_origin, starts[self.rank + 1]
        else:
            lo, hi = layout.query_start, layout.length
        mask = torch.ones(layout.rows[-1].stop if len(layout.rows) > 1 else 1, hi - lo)
        mask = mask.to(torch.bool)
        for rows in layout.rows:
            batches = rows.batches if len(layout.rows) > 1 else slice(0, 1)
            for start, stop in rows.documents:
                a, b = max(start, lo), min(stop, hi)
                if a < b:
                    mask[batches, a - lo : b - lo] = False
        found = mask.to(device) if bool(mask.any()) else None
        self.padding_rows[device] = found
        return found

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: CallState, cast: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` without autograd: this plan as an
        :class:`~ringdilated.core.run.local.Executor` (its parts, one group of batch rows each, in
        batch order; each part its own dropout seed)."""
        if len(self.parts) == 1 and self.parts[0][0] is None:
            return self.parts[0][1].forward(q, k, v, call, cast)
        results = [
            executor.forward(q[rows].contiguous(), k[rows], v[rows], call.derive("rows", i), cast)
            for i, (rows, executor) in enumerate(self.parts)
        ]
        return torch.cat([o for o, _ in results]), torch.cat([s for _, s in results])

    def backward(
        self, inputs: BackwardInputs, call: CallState, cast: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` without autograd (see :meth:`forward`)."""
        if len(self.parts) == 1 and self.parts[0][0] is None:
            return self.parts[0][1].backward(inputs, call, cast)
        grads = [
            executor.backward(inputs.rows(rows), call.derive("rows", i), cast)  # type: ignore[arg-type]
            for i, (rows, executor) in enumerate(self.parts)
        ]
        dq, dk, dv = (torch.cat([g[i] for g in grads]) for i in range(3))
        return dq, dk, dv

    @property
    def shard(self) -> ShardPlan | None:
        """This rank's shard plan (``None`` on one process)."""
        return self.shards[self.rank] if self.shards else None

    def local_run(self, q: torch.Tensor, k: torch.Tensor) -> LocalRun:
        """The :class:`LocalRun` of a one-process call: the whole pattern."""
        return self._blocks_run(q, k, None, complete=True)

    def executor(self, q: torch.Tensor, k: torch.Tensor) -> Executor:
        """What runs the call, by its communicator's spec: the :class:`LocalRun`, a
        :class:`ShardedRun` over it, or a :class:`HeadParallelRun`; every communicator it runs
        is prepared here, on the group it exchanges on (call it once per plan)."""
        shard, chosen = self.shard, self.communicator
        if shard is None:
            return self.local_run(q, k)
        assert chosen is not None
        if chosen.parallelism == "heads":
            return self._head_parallel(q, k, shard, chosen)
        if chosen.parallelism == "hybrid":
            return self._hybrid(q, k, shard, chosen)
        inner = self._blocks_run(q, k, shard.inner, complete=False, query_start=shard.query_origin)
        return ShardedRun(
            inner=inner,
            plans=self.shards,
            rank=self.rank,
            communicator=_prepared(chosen, self.group, self.shards, self.window),
            group=self.group,
            broadcast=chosen.broadcast,
        )

    def _documents(self) -> tuple[tuple[int, int], ...] | None:
        return None if self.layout.is_whole else self.layout.rows[0].documents

    def _blocks_run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        blocks: tuple[Block, ...] | None,
        *,
        complete: bool,
        query_start: int | None = None,
    ) -> LocalRun:
        """A :class:`LocalRun` of ``blocks`` (``None``: the layout's), with this call's options
        (``deterministic``: the request's, as the plan was made under torch's switch);
        ``query_start``: ``q``'s first row in ``k`` (a shard's; default: the layout's)."""
        return pattern_run(
            self.kernel.kernel,
            self.pattern,
            q,
            k,
            window=self.window,
            scale=self.scale,
            dropout_p=self.dropout_p,
            complete=complete,
            blocks=blocks,
            batch_limit=self.kernel.batch_limit,
            kernel_name=self.kernel.kernel_name,
            layout=self.layout,
            deterministic=self.kernel.request.deterministic,
            softcap=self.softcap,
            query_start=query_start,
        )

    def _head_parallel(
        self, q: torch.Tensor, k: torch.Tensor, shard: ShardPlan, chosen: CommunicatorChoice
    ) -> HeadParallelRun:
        """The head-parallel run: this rank's share of the heads over the whole sequence."""
        length, heads, kv_heads = shard.starts[-1], q.shape[2], k.shape[2]
        shares = deal_heads(self.pattern, length, heads, kv_heads, len(self.shards))
        documents = self._documents()
        blocks = (
            self.pattern.blocks(length, heads, kv_heads)
            if documents is None
            else self.pattern.document_blocks(documents, heads, kv_heads)
        )
        local = share_blocks(blocks, shares[self.rank], heads, kv_heads)
        return HeadParallelRun(
            inner=self._blocks_run(q, k, local, complete=True),
            shares=shares,
            starts=shard.starts,
            rank=self.rank,
            communicator=_prepared(chosen, self.group, self.shards, self.window),
            group=self.group,
        )

    def _hybrid(
        self, q: torch.Tensor, k: torch.Tensor, shard: ShardPlan, chosen: CommunicatorChoice
    ) -> HeadParallelRun:
        """The 2-D run: head parallelism within this rank's inner group, whose shards make one
        chunk of the sequence, by the hybrid's heads part, and sequence pieces between chunks
        across its outer group, by its sequence part."""
        assert isinstance(self.group, Grid)
        heads_part, sequence_part = chosen.parts
        (outer, inner), (o, i) = self.group.shape, self.group.coordinates
        starts, heads, kv_heads = shard.starts, q.shape[2], k.shape[2]
        chunks = tuple(starts[c * inner + inner] - starts[c * inner] for c in range(outer))
        shares = deal_heads(self.pattern, starts[-1], heads, kv_heads, inner)
        plans = tuple(
            share_plan(
                shard_plan(
                    self.pattern, starts[-1], heads, kv_heads, c, outer, self._documents(), chunks
                ),
                shares[i],
            )
            for c in range(outer)
        )
        across = ShardedRun(
            inner=self._blocks_run(q, k, plans[o].inner, complete=False),
            plans=plans,
            rank=o,
            communicator=_prepared(sequence_part, self.group.outer, plans, self.window),
            group=self.group.outer,
            broadcast=sequence_part.broadcast,
        )
        first = starts[o * inner]
        ranks = self.shards[o * inner : (o + 1) * inner]  # the inner group's, in its rank order
        return HeadParallelRun(
            inner=across,
            shares=shares,
            starts=tuple(s - first for s in starts[o * inner : (o + 1) * inner + 1]),
            rank=i,
            communicator=_prepared(heads_part, self.group.inner, ranks, self.window),
            group=self.group.inner,
        )


def _check(
    pattern_args: DilationPattern | PatternArgs,
    q: object,
    k: object,
    v: object,
    options: CallOptions,
    resolver: Resolver,
    sequence: SequenceLayout | None,
    group: object,
    wants_backward: Callable[[], bool],
    lengths: tuple[int, ...] | None = None,
    query_lengths: tuple[int, ...] | None = None,
) -> tuple[CallPlan, SequenceLayout]:
    """The call's plan (its executors not built yet) and its sequence layout, checked on this
    rank (:func:`prepare_call`'s contract); on a process group, every rank's shard plans and
    the communicator, per group of batch rows when rows differ in padding. ``lengths``: every
    rank's shard length where they differ; ``query_lengths``: every rank's query length where
    some rank passed a query suffix (``-1``: its whole shard); both as the agreement gathered
    them (:class:`~ringdilated.core.call.agreement.Split`)."""
    ranks = group_size(group)
    pattern = pattern_args
    if not isinstance(pattern, DilationPattern):
        pattern = DilationPattern(*pattern)  # type: ignore[arg-type]
    if ranks > 1:  # an empty shard: one message on every rank, naming it
        check_shards(lengths, None if lengths is not None else grid.rank(group), q, k)  # type: ignore[arg-type]
    q, k, v = check_inputs(q, k, v, pattern, empty_queries=ranks > 1)
    if ranks > 1:  # NCCL: this rank's GPU current before any exchange (host-only, per plan)
        check_current_device(group, q.device)  # type: ignore[arg-type]
    if sequence is None:  # a call without a layout: its own, read here, on this rank
        equal = (k.shape[1],) * ranks
        cu_seqlens, mask = options.cu_seqlens, options.key_padding_mask
        sequence = SequenceLayout.for_call(group, cu_seqlens, mask, lengths or equal, k.shape[0])
    else:
        if lengths is not None and sequence.shard_lengths is None:
            raise ValueError(
                f"this SequenceLayout holds equal shards (it was given no shard_length), but the "
                f"ranks' shards hold {list(lengths)} positions: pass shard_length= to "
                "SequenceLayout on every rank"
            )
        sequence.check_shard(k.shape[1])
        sequence.check_batch(k.shape[0])
        if ranks > 1:
            sequence.check_queries(q.shape[1])
    # With a process group, cu_seqlens holds global positions: the length is every shard's.
    total = sequence.length if sequence.length is not None else k.shape[1] * ranks
    shard_lengths = sequence.shard_lengths or lengths  # None: equal shards
    if ranks > 1:
        every = shard_lengths or (k.shape[1],) * ranks
        query_length = _suffix_length(q, k, every, query_lengths or sequence.query_lengths)
    else:
        query_length = total - (k.shape[1] - q.shape[1])
    layout = sequence.documents_for(k.shape[0], total, query_length)
    check_options(options.scale, options.dropout_p)
    dropout_p = float(options.dropout_p)  # type: ignore[arg-type]
    softcap = as_softcap(options.softcap)
    check_sinks(options.sinks, q)
    window = check_window(options.window, options.causal)  # the call's one mask value
    check_bool("return_lse", options.return_lse)
    if options.transfer_stats is not None and not isinstance(options.transfer_stats, TransferStats):
        raise TypeError(
            "transfer_stats must be a ringdilated.TransferStats or None, got "
            f"{safe_repr(options.transfer_stats)}"
        )
    # wants_backward() after check_inputs: q, k, v are tensors.
    request = Request.for_tensors(
        q,
        k,
        window=window,
        dropout=dropout_p > 0,
        backward=wants_backward(),
        env=resolver.env,
        softcap=softcap,
    )
    kernel = resolver.resolve(request, options.kernel)  # type: ignore[arg-type]
    warn_if_slow(request)
    warn_if_slow_features(kernel.feature_cost)
    scale = effective_scale(options.scale, q.shape[-1])  # type: ignore[arg-type]
    rank = 0 if ranks == 1 else grid.rank(group)  # type: ignore[arg-type]
    lse_used = bool(options.return_lse)
    plan = CallPlan(
        pattern,
        kernel,
        window,
        scale,
        dropout_p,
        layout,
        rank,
        group=group,
        lse_used=lse_used,
        softcap=softcap,
    )
    if ranks == 1:
        resolver.check_communicator_name(options.communicator)  # named, though nothing moves
        return plan, sequence
    heads, grid_shape = q.shape[2], group.shape if isinstance(group, Grid) else None
    if grid_shape is not None and heads < grid_shape[1]:
        raise ResolutionError(
            f"no communicator can serve this 2-D layout: it deals query heads within its inner "
            f"groups of {grid_shape[1]} ranks and needs at least {grid_shape[1]} query heads, "
            f"got {heads}"
        )
    choice: str | Communicator = options.communicator  # type: ignore[assignment]

    def size(rows: Rows) -> PieceSize:
        batch = rows.stop - rows.start
        return PieceSize(batch, k.shape[3], k.element_size(), link_for(k.device.type))

    def row_plan(rows: Rows, documents: tuple[tuple[int, int], ...] | None) -> RowPlan:
        shards = tuple(
            shard_plan(
                pattern, total, heads, k.shape[2], rank, ranks, documents, shard_lengths,
                layout.query_start,
            )
            for rank in range(ranks)
        )  # fmt: skip
        chosen = resolver.choose_communicator(ranks, window, choice, shards, size(rows), grid_shape)
        if layout.query_start > 0 and chosen.parallelism != "sequence":
            raise ValueError(
                f"communicator {chosen.name!r} ({chosen.parallelism} parallelism) {SUFFIX_REFUSED}"
            )
        return rows, shards, chosen

    if sequence.padding is None:  # one group of rows
        whole = layout.rows[0]
        row_plans: tuple[RowPlan, ...] = ()
        rows, shards, chosen = row_plan(whole, None if layout.is_whole else whole.documents)
    else:
        row_plans = tuple(row_plan(rows, rows.documents) for rows in layout.rows)
        rows, shards, chosen = row_plans[0]
    plan = attrs.evolve(
        plan, shards=shards, communicator=chosen, row_plans=row_plans, size=size(rows)
    )
    return plan, sequence


def _suffix_length(
    q: torch.Tensor,
    k: torch.Tensor,
    lengths: tuple[int, ...],
    query_lengths: tuple[int, ...] | None,
) -> int:
    """The query length ``Lq`` of a call on a process group whose ranks hold shards of
    ``lengths``: their sum without a query suffix, else the sum of every rank's query length
    (``query_lengths``, ``-1`` for a whole shard), checked to be one suffix of the sequence
    (:func:`~ringdilated.core.call.validation.check_query_split`: every rank raises alike).
    A suffix on this rank before the ranks have said theirs raises ``ValueError`` (the
    agreement then tells every rank the split, and the call is checked again)."""
    if query_lengths is None:
        if q.shape[1] != k.shape[1]:
            raise ValueError(
                f"q holds {q.shape[1]} of its shard's {k.shape[1]} positions (a query suffix), but "
                "the ranks have not said how the suffix is split"
            )
        return sum(lengths)
    resolved = tuple(n if m < 0 else m for n, m in zip(lengths, query_lengths, strict=True))
    return check_query_split(lengths, resolved)


def _own_lengths(q: object, k: object, known: bool, bound: bool) -> tuple[int, int]:
    """This rank's shard length (``-1`` when its layout ``known`` the ranks') and query length
    (``-1`` unless its ``q`` is a suffix of its shard, or when its layout has ``bound`` the
    ranks'), for the agreement; ``-1`` each where ``q`` or ``k`` is not a dense 4-D tensor
    (reading them never raises: the peers would be left waiting)."""

    def length(x: object) -> int:
        if not isinstance(x, torch.Tensor) or x.is_nested or x.layout != torch.strided:
            return -1
        return int(x.shape[1]) if x.dim() == 4 else -1

    n = length(k)
    if n < 0:
        return -1, -1
    queries = -1 if bound else length(q)
    return -1 if known else n, queries if 0 <= queries < n else -1


def prepare_call(
    pattern_args: DilationPattern | PatternArgs,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: CallOptions,
    resolver: Resolver | Callable[[], Resolver],
    group: object = None,
    *,
    layout: SequenceLayout | None = None,
    backward: bool | None = None,
    failure: Exception | None = None,
) -> CallPlan:
    """Validate the call (on every rank of ``group``, which must all agree) and plan it.

    ``layout``: the batch's :class:`~ringdilated.core.call.sequence_layout.SequenceLayout` (its
    group is the call's; its documents, padding and shard lengths were agreed when it was
    built), or ``None``: the call reads ``options.cu_seqlens`` and ``options.key_padding_mask``
    itself and the ranks agree on them with everything else. ``resolver`` may be a callable
    making one (such as :func:`~ringdilated.registry.default_resolver`), so that a failure to
    load the plugins is reported on every rank too. ``backward`` says whether gradients will be
    asked for (default: whether any input requires them with grad mode on; the compiled op
    passes it, as it runs without autograd). ``failure``: an error the caller already found (a
    module's own checks), raised here as if validation had found it, so that on a process group
    it too reaches every rank.

    Raises ``TypeError``/``ValueError`` (a :class:`~ringdilated.core.ResolutionError` for a kernel
    or communicator that cannot serve) naming the offending value, before any work; on a process
    group, on every rank (:func:`~ringdilated.core.call.agreement.agree`).
    """
    if layout is not None:
        group = layout.group
    ranks = group_size(group)

    def wants_backward() -> bool:
        return wants_gradients(q, k, v, options.sinks) if backward is None else backward

    def check(split: Split | None = None) -> tuple[CallPlan, SequenceLayout]:
        if failure is not None:
            raise failure
        chosen = resolver if isinstance(resolver, Resolver) else resolver()
        lengths = None if split is None else split.uneven
        queries = split.query_lengths if split is not None and split.suffix else None
        return _check(
            pattern_args, q, k, v, options, chosen, layout, group, wants_backward, lengths, queries
        )

    if ranks == 1:
        plan, _ = check()
        if group is None:  # one process: say so if a launcher started several (once)
            grid.warn_if_launched_alone()
    else:
        # Nothing a caller passed may raise on one rank outside this guard: the peers would be
        # left waiting in the agreement's collective.
        assert isinstance(group, (dist.ProcessGroup, Grid))
        split: Split | None = None  # equal shards, no suffix, until the agreement says not
        known = layout is not None and layout.shard_lengths is not None
        bound = layout is not None and layout.query_lengths is not None
        while True:
            checked: tuple[CallPlan, SequenceLayout] | None = None
            error: Exception | None = None
            signature: CallSignature | None = None
            try:
                checked = check(split)
            except Exception as exc:  # any failure here must reach every rank, not strand them
                error = exc
            try:
                signature = _signature(pattern_args, q, k, options, checked, wants_backward())
            except Exception as exc:  # a caller's object that cannot even be described
                error = error or exc
            own, own_queries = (-1, -1) if split is not None else _own_lengths(q, k, known, bound)
            split = agree(group, error, signature, length=own, query_length=own_queries)
            if split is None:  # agreed (agree() raised otherwise)
                break
            # Shards of different lengths, or a query suffix: check again knowing every rank's
            # (a second agreement).
        assert checked is not None
        plan = checked[0]
        if layout is not None and plan.shards:
            shards = plan.shards
            lengths = tuple(b - a for a, b in itertools.pairwise(shards[0].starts))
            layout.bind(lengths, tuple(shard.query_length for shard in shards))
    return plan.with_executors(q, k)


def plan_key(
    pattern_args: DilationPattern | PatternArgs,
    q: object,
    k: object,
    v: object,
    options: dict[str, object],
    resolver: Resolver,
    layout: SequenceLayout,
    backward: bool | None = None,
) -> tuple[object, ...] | None:
    """What a plan on ``layout`` depends on, as a hashable key: every argument
    :func:`prepare_call` reads (shapes, dtypes and devices of plain tensors; the options, given
    as :class:`CallOptions`' fields, with their types: ``1`` is no valid ``causal`` though it
    equals ``True``; the resolver; whether a backward will run; whether
    ``torch.use_deterministic_algorithms`` is on; the sinks' shape, dtype, device and layout,
    not their values, which each call passes), so that a call with the key of
    a planned one is valid and planned alike (``backward`` by default: grad mode and the inputs
    say). On a process group the shards' lengths and the query lengths are left out: the layout
    holds them (it binds both at its first agreed call, so every plan it keeps stands for one
    split of the sequence and of a query suffix on every rank: no rank finds a plan while a peer
    plans anew), and :meth:`CallPlan.check_shard` compares them at once. ``None`` for anything
    not simply a dense tensor or not hashable (such a call is planned, and checked, anew)."""
    if not (type(q) is type(k) is type(v) is torch.Tensor):
        return None
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    assert isinstance(v, torch.Tensor)
    if q.is_nested or k.is_nested or v.is_nested:
        return None
    if not (q.layout == k.layout == v.layout == torch.strided):
        return None
    stats = options["transfer_stats"]
    if stats is not None and not isinstance(stats, TransferStats):
        return None
    shapes: tuple[object, ...] = (q.shape, k.shape, v.shape)
    if layout.world_size > 1:
        shapes = tuple((x[0], *x[2:]) for x in shapes)  # type: ignore[index]
    pattern: object = pattern_args
    if not isinstance(pattern_args, DilationPattern):
        # Values and their types: (8, True) equals (8, 1), but only one of them is valid.
        pattern = tuple(
            (tuple(x), tuple(map(type, x))) if isinstance(x, (list, tuple)) else (type(x), x)
            for x in pattern_args
        )
    causal, scale, dropout_p = options["causal"], options["scale"], options["dropout_p"]
    return_lse, softcap, sinks = options["return_lse"], options["softcap"], options["sinks"]
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.is_nested:
            return None
        sinks = (sinks.shape, sinks.dtype, sinks.device, sinks.layout)  # values: per call
    window = options.get("window")
    if isinstance(window, list):  # a list is as good as a tuple (and unhashable)
        window = tuple(window)
    if isinstance(window, tuple):  # bounds and their types: (4, 0) is valid, (4.0, 0) is not
        window = (window, tuple(map(type, window)))
    if backward is None:
        backward = wants_gradients(q, k, v, options["sinks"])
    key = (
        pattern,
        shapes,
        (q.dtype, k.dtype, v.dtype, q.device, k.device, v.device),
        backward,
        (type(causal), causal, type(scale), scale, type(dropout_p), dropout_p),
        (type(window), window),
        (type(return_lse), return_lse),
        (type(softcap), softcap),
        sinks,
        options["kernel"],
        os.environ.get(KERNEL_ENV_VAR),  # what "auto" resolves to, read per call
        deterministic_algorithms(),  # the request's, read per call
        options["communicator"],
        resolver,
    )
    try:
        hash(key)
    except TypeError:  # an unhashable argument: plan (and validate) this call anew
        return None
    return key


WHOLE_SEQUENCES = SequenceLayout(agree_every_call=False)
"""The layout of one-process calls made without documents, padding or a layout: every call's
plan is kept in it, keyed by the call's signature (shapes included)."""


def call_layout(
    layout: object, process_group: object, cu_seqlens: object, key_padding_mask: object
) -> SequenceLayout | None:
    """The layout a call runs on: ``layout`` (which nothing else the call passes may
    contradict), the process-wide one of whole sequences for a plain one-process call, or
    ``None``: the call builds its own (and agrees on it with its signature). Raises
    ``TypeError``/``ValueError`` naming what contradicts the layout."""
    if layout is None:
        if process_group is None and cu_seqlens is None and key_padding_mask is None:
            return WHOLE_SEQUENCES
        return None
    if not isinstance(layout, SequenceLayout):
        raise TypeError(
            f"layout must be a ringdilated.SequenceLayout or None, got {type(layout).__name__}"
        )
    for name, value in (("cu_seqlens", cu_seqlens), ("key_padding_mask", key_padding_mask)):
        if value is not None:
            raise ValueError(
                f"pass {name} to the SequenceLayout, not with layout= (the layout holds the "
                "batch's documents and padding)"
            )
    if process_group is not None and as_process_group(process_group) != layout.group:
        raise ValueError(
            f"process_group {process_group!r} contradicts the layout's process group "
            f"{layout.group!r}: build the SequenceLayout on the call's process group"
        )
    return layout


def _kv_operand(x: torch.Tensor, query_suffix: bool) -> torch.Tensor:
    """``k`` or ``v`` as the driver reads it: as it is when contiguous, when a query suffix reads a
    few segments of it (decoding from a cache: copying it would cost O(L) per token), or when it has
    one batch row; else contiguous (so batch rows and segments merge into one kernel call)."""
    keep = query_suffix or x.shape[0] == 1
    return x if keep and x.stride(-1) == 1 else x.contiguous()


def operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q``, ``k``, ``v`` as the executors read them: ``q`` contiguous; ``k``, ``v`` see
    :func:`_kv_operand`."""
    suffix = q.shape[1] != k.shape[1]
    return q.contiguous(), _kv_operand(k, suffix), _kv_operand(v, suffix)


def execute(
    plan: CallPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stats: object = None,
    *,
    lse_needed: bool = True,
    seed: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one call of ``plan`` (:func:`plan_for`'s, for these tensors): how every
    face runs a planned call. ``q``, ``k``, ``v`` as the caller passed them (:func:`operands` makes
    them what the executors read), the call's state added (:func:`call_state`: ``stats`` counts
    its bytes; ``lse_needed=False``: the caller discards ``lse``), then kernels and the data
    exchange only. Eager (``seed=None``): the dropout seed is drawn now and the call is one
    autograd node (:meth:`CallPlan.apply`). Inside a custom op, ``seed`` is the op's seed tensor
    (read on the host only with dropout): no autograd node (the op's backward runs
    :func:`execute_backward`), autocast off, and ``lse`` always returned, laid out by
    :func:`~ringdilated.core.run.local.lse_buffer`. ``sinks``: the call's attention sinks
    (``None``: none; checked with the plan), merged into the final ``out`` and ``lse``."""
    q, k, v = operands(q, k, v)
    if seed is None:
        return plan.apply(q, k, v, call_state(plan, stats, lse_needed), sinks)
    padding = None if sinks is None else plan.query_padding(q.device)
    with autocast_off(q.device.type):
        state = call_state(plan, stats, seed=seed)
        out, lse = forward_with_sinks(plan, q, k, v, state, sinks, padding)
    return out, as_lse_layout(lse)


def execute_backward(
    plan: CallPlan,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor,
    stats: object = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dq, dk, dv, dsinks)`` of the call :func:`execute` ran inside a custom op with ``seed``
    (the same plan, so the same dropout masks), from its inputs, ``out``, ``lse`` (with
    ``sinks``, the merged ones it returned) and their gradients (``dlse=None``: none flows
    through ``lse``); ``dsinks`` is ``None`` without sinks; no autograd, no autocast."""
    q, k, v = operands(q, k, v)
    with autocast_off(q.device.type):
        dlse = None if dlse is None else as_lse_layout(dlse.to(lse.dtype))
        lse = as_lse_layout(lse)
        inputs = BackwardInputs(dout.contiguous(), dlse, q, k, v, out.contiguous(), lse)
        dq, dk, dv = plan.backward(inputs, call_state(plan, stats, seed=seed))
        if sinks is None:
            return dq, dk, dv, None
        dsinks = sinks_gradient(inputs.dout, inputs.dlse, inputs.out, inputs.lse, sinks)
        return dq, dk, dv, dsinks


def plan_for(
    pattern: DilationPattern | PatternArgs,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    arguments: dict[str, object],
    resolver: Resolver | Callable[[], Resolver],
    process_group: object,
    layout: object,
    backward: bool | None = None,
) -> CallPlan:
    """The plan of a call: found on its layout by :func:`plan_key` (then only the shard is
    checked, on this rank), or made by :func:`prepare_call` (validated, and agreed on a process
    group) and kept there. ``arguments``: :class:`CallOptions`' fields as the caller passed
    them; ``resolver``: a resolver or a callable making one (a failure to make it is then
    reported inside the agreement, on every rank), called every call: it should return the same
    resolver while nothing changes (as :func:`~ringdilated.registry.default_resolver`, cached,
    does), since plans are kept per resolver; ``backward``: whether a backward will run
    (default: grad mode and the inputs say). Under :func:`rejected`, raises its error instead,
    having joined the agreement only where the call would have agreed."""
    on = call_layout(layout, process_group, arguments["cu_seqlens"], arguments["key_padding_mask"])
    key = None
    chosen: Resolver | None = resolver if isinstance(resolver, Resolver) else None
    if chosen is None:
        try:
            chosen = resolver()  # type: ignore[operator]
        except Exception:  # raised again inside prepare_call's agreement, on every rank
            chosen = None
    rejection = _REJECTION.get()
    if on is not None and not on.agree_every_call and chosen is not None:
        key = plan_key(pattern, q, k, v, arguments, chosen, on, backward)
        if key is not None:
            plan = on.plans.get(key)
            if plan is not None:
                if rejection is not None:  # the peers run this plan: no agreement to join
                    raise rejection
                assert isinstance(plan, CallPlan)
                plan.check_shard(q, k, v)
                return plan
    group = on.group if on is not None else as_process_group(process_group)
    if rejection is not None:
        if isinstance(group, (dist.ProcessGroup, Grid)) and not agreed(rejection):
            agree(group, rejection, None)  # every rank raises (this one, its own error)
        raise rejection
    options = CallOptions(**arguments)
    plan = prepare_call(
        pattern, q, k, v, options, chosen or resolver, group, layout=on, backward=backward
    )
    if key is not None:
        on.plans.put(key, plan)  # type: ignore[union-attr]
    return plan


_REJECTION: contextvars.ContextVar[Exception | None] = contextvars.ContextVar(
    "ringdilated_rejected_call", default=None
)


@contextlib.contextmanager
def rejected(error: Exception) -> Iterator[None]:
    """Within the block, the calls planned on this thread (:func:`plan_for`) raise ``error``
    instead of running, where the peers can hear of it: a call whose plan its layout holds
    raises at once, on this rank only (its peers run that plan, whose data exchange no
    agreement may pair with; they wait until the group's timeout); any other call on a process
    group first joins the agreement its peers are in, with ``error``, so that every rank raises
    (this one ``error``, the others a :class:`~ringdilated.PeerRejectedError` naming it). For a
    check a wrapper makes before its call (``ringdilated.hf``'s): which way it goes is decided
    by the call's own plan key, not by whether its layout has planned anything."""
    token = _REJECTION.set(error)
    try:
        yield
    finally:
        _REJECTION.reset(token)


_NO_DROPOUT = {key: CallState(0, None, *key) for key in itertools.product((False, True), repeat=2)}
"""The calls without dropout or byte counting differ in nothing else: one state per
``(lse_used, lse_needed)``."""


def call_state(
    plan: CallPlan, stats: object, lse_needed: bool = True, seed: torch.Tensor | None = None
) -> CallState:
    """What one call of ``plan`` adds to it: a dropout seed drawn now (or read from ``seed``, an
    op's seed tensor), where its bytes are counted, and whether its lse is read (``lse_needed``,
    or a gradient flows through it)."""
    needed = lse_needed or plan.lse_used
    if plan.dropout_p == 0.0 and stats is None:
        return _NO_DROPOUT[plan.lse_used, needed]
    drawn = draw_seed(plan.dropout_p) if seed is None or not plan.dropout_p else int(seed.item())
    return CallState(drawn, stats, plan.lse_used, needed)  # type: ignore[arg-type]


def _prepared(
    chosen: CommunicatorChoice, group: object, plans: tuple[ShardPlan, ...], window: KeyWindow
) -> Communicator:
    """``chosen``'s instance, prepared on ``group`` for ``plans`` (its ranks') and ``window``."""
    prepare = chosen.instance.prepare
    prepare(group, plans, mask_argument(prepare, window))  # type: ignore[arg-type]
    return chosen.instance


def _communicator_names(plan: CallPlan) -> str:
    """The communicator of every group of rows (one, without padding), by type."""
    chosen: list[CommunicatorChoice | None] = [c for _, _, c in plan.row_plans]
    return ",".join(type(c.instance if c else None).__name__ for c in chosen or [plan.communicator])


def _shape_text(x: object) -> str:
    """``x``'s shape with the sequence dimension left out: ranks may hold shards of different
    lengths (agreed apart, see :func:`~ringdilated.core.call.agreement.agree`)."""
    shape: tuple[object, ...] = tuple(getattr(x, "shape", ()))
    if len(shape) >= 2:
        shape = (shape[0], "n", *shape[2:])
    return safe_repr(shape)


def _documents_text(options: CallOptions, sequence: SequenceLayout | None) -> str:
    """The documents and padding every rank must pass identically: a digest of the checked
    layout (it may be long), or a description of what was passed where validation failed."""
    if sequence is not None:
        return sequence.description
    if options.cu_seqlens is None and options.key_padding_mask is None:
        return "none"
    kinds = (type(options.cu_seqlens).__name__, type(options.key_padding_mask).__name__)
    return f"<cu_seqlens {kinds[0]}, key_padding_mask {kinds[1]}>"


def _signature(
    pattern_args: DilationPattern | PatternArgs,
    q: object,
    k: object,
    options: CallOptions,
    checked: tuple[CallPlan, SequenceLayout] | None,
    backward: bool,
) -> CallSignature:
    """What every rank must pass identically, as strings (raw values where validation failed;
    :func:`safe_repr`, so that any object a caller passed can be sent)."""
    plan, sequence = checked or (None, None)
    fields: object = pattern_args
    if plan is not None:
        fields = (plan.pattern.segment_lengths, plan.pattern.dilation_rates, plan.pattern.mode)
    return CallSignature(
        pattern=safe_repr(fields),
        causal=safe_repr(options.causal),
        # The window as agreed (so (4, None) and (4, 0) under causal=True agree); no window
        # as "None" (a causal flag that differs is named once, as causal).
        window=safe_repr(options.window if plan is None or options.window is None else plan.window),
        scale=safe_repr(options.scale),
        dropout_p=safe_repr(options.dropout_p),
        dtype=safe_repr(getattr(q, "dtype", None)),
        documents=_documents_text(options, sequence),
        device=safe_repr(getattr(getattr(q, "device", None), "type", None)),
        q_shape=_shape_text(q),
        k_shape=_shape_text(k),
        backward=backward,
        kernel=None if plan is None else plan.kernel.kernel_name,
        communicator=None if plan is None else _communicator_names(plan),
        lse_used=options.return_lse is True,
        softcap=safe_repr(options.softcap),
        sinks=_sinks_text(options.sinks),
    )


def _sinks_text(sinks: object) -> str:
    """The sinks every rank must pass alike: none, or a tensor's shape and dtype (their values
    are the caller's to keep equal, as a parameter's are; no rank reads them)."""
    if sinks is None:
        return "None"
    if isinstance(sinks, torch.Tensor):
        return f"tensor {tuple(sinks.shape)} {sinks.dtype}"
    return f"<{type(sinks).__name__}>"
