"""Runs a dilation pattern on a kernel, forward and backward, on one process; and what every
executor shares: the :class:`Executor` protocol (:class:`LocalRun` here; the sharded and
head-parallel runs and the call's plan), :class:`BackwardInputs`, :class:`CallState` and
:class:`DilatedAttentionFunction`, which runs any executor under one autograd node.

Call flow::

    run = pattern_run(kernel, pattern, q, k, layout=..., window=..., scale=..., ...)
    out, lse = DilatedAttentionFunction.apply(q, k, v, executor, CallState(seed, ...), sinks)
        forward:  for each kernel call: its steps' strided views of q, k, v (several small
                  steps of one shape gathered into one call) -> kernel.forward -> (out_c, lse_c)
                  head_groups: each (position, head) has one block, so out is copied in place;
                  longnet: partials are merged by the Accumulator (float32 log-sum-exp)
        backward: for each kernel call: kernel.backward(dout, q, k, v, out, lse) with the FINAL
                  merged out and lse (when the lse's gradient dlse flows too,
                  contract.lse.backward_with_lse: one call where the kernel takes dlse, else
                  two); a gradient with one contribution per element is written in the input
                  dtype, others are added in float32 or float64

A :class:`LocalRun` is built once per planned call and reused by every call of that plan: its
*steps* (one block's chunk each: the ``as_strided`` views of every tensor it reads or writes,
and its :class:`~ringdilated.core.contract.kernel.BlockOptions`) and its *kernel calls* (one step,
or small steps of one shape fused: :class:`_KernelCall`) are computed once per input geometry and
cached in it, so a call issues kernels and copies only, with no host read and no Python work
proportional to anything but the number of kernel calls.

Steps are chunks of whole segments so that no kernel call holds more query elements than
:attr:`LocalRun.query_budget` (the kernel's ``BatchLimit.query_elements``, or
``LocalRun.chunk_elements`` when set; steps gathered into one call stay within it too): for a kernel
that materialises scores, peak memory beyond the inputs and outputs stays bounded whatever the
sequence length; a fused kernel (linear memory) declares a bound 32 times larger, which keeps the
float32 temporaries around a call at 1 GiB. A segment larger than the bound is split further,
along its query rows (:func:`~ringdilated.core.run.limited.row_chunks`): each chunk is a step of
its own, with every key of the segment, the window shifted to its first row and, with dropout, a
seed of its own (its step number), so a block's mask is a function of the call's seed and the
chunking (:mod:`ringdilated.core.run.limited`). A call holds at least one query row of one
problem. Nothing here checks capabilities or catches exceptions: the resolver and the input
validation ran before.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import attrgetter
from typing import Any, NamedTuple, Protocol

import attrs
import torch

from ringdilated.core.contract.accumulator import Accumulator, accumulation_dtype
from ringdilated.core.contract.communicator import TransferStats
from ringdilated.core.contract.guard import CheckedKernel
from ringdilated.core.contract.kernel import BlockOptions, Kernel, derive_seed
from ringdilated.core.contract.lse import backward_with_lse, lse_gradient
from ringdilated.core.plan.documents import DocumentLayout
from ringdilated.core.plan.heads import consecutive_runs
from ringdilated.core.plan.pattern import Block, DilationPattern, Selection
from ringdilated.core.plan.window import FULL, KeyWindow
from ringdilated.core.run.limited import BatchLimitedKernel, row_chunks
from ringdilated.core.run.sinks import merge_sinks, sinks_gradient
from ringdilated.core.select.capabilities import DEFAULT_QUERY_ELEMENTS, UNLIMITED, BatchLimit
from ringdilated.core.select.dtypes import autocast_off

__all__ = [
    "HIGHER_ORDER_MESSAGE",
    "BackwardInputs",
    "BatchLimitedKernel",
    "CallState",
    "DilatedAttentionFunction",
    "Executor",
    "LocalRun",
    "RowBlocks",
    "StridedView",
    "as_lse_layout",
    "draw_seed",
    "effective_scale",
    "forward_with_sinks",
    "lse_buffer",
    "lse_gradient",
    "pattern_run",
]

DEFAULT_CHUNK_ELEMENTS = DEFAULT_QUERY_ELEMENTS
"""0.1's name for :data:`~ringdilated.core.select.capabilities.DEFAULT_QUERY_ELEMENTS`."""


@attrs.frozen
class CallState:
    """What differs between calls of one plan: ``seed`` seeds the call's dropout masks (``0``:
    no dropout, seeds unused); ``stats`` collects the bytes a sharded call moves (``None``: not
    counted); ``lse_used``: whether the caller may differentiate through ``lse`` (when
    ``False``, ``lse`` comes back without a gradient, so every rank knows no ``dlse`` will
    arrive: the same on every rank, from the agreed call signature); ``lse_needed``: whether
    anyone reads ``lse`` at all (``False``: no backward and the caller discards it, so a run
    that need not merge may return ``None`` for it and save writing it)."""

    seed: int = 0
    stats: TransferStats | None = None
    lse_used: bool = True
    lse_needed: bool = True

    def with_lse(self) -> CallState:
        """This call with ``lse_needed``: for a run whose lse another merges or sends."""
        return self if self.lse_needed else attrs.evolve(self, lse_needed=True)

    def derive(self, *path: int | str) -> CallState:
        """This call with the seed of its part ``path`` (:func:`derive_seed`; unchanged without
        dropout)."""
        if self.seed == 0:
            return self
        return attrs.evolve(self, seed=derive_seed(self.seed, *path))


class BackwardInputs(NamedTuple):
    """What an executor's backward reads: the gradient of ``out`` (``dout``) and of ``lse``
    (``dlse``; ``None``: none flows), the forward's inputs and its final ``out`` and ``lse``.
    ``dout`` and ``out`` are shaped and strided like ``q`` (contiguous); ``k`` and ``v`` have
    any strides whose last is 1; ``lse`` and ``dlse`` are laid out by :func:`lse_buffer`."""

    dout: torch.Tensor
    dlse: torch.Tensor | None
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor

    def rows(self, rows: slice) -> BackwardInputs:
        """These inputs' batch rows ``rows``, in the layouts above."""
        dlse = None if self.dlse is None else as_lse_layout(self.dlse[rows])
        q, k, v = self.q[rows].contiguous(), self.k[rows], self.v[rows]
        dout, out = self.dout[rows].contiguous(), self.out[rows].contiguous()
        return BackwardInputs(dout, dlse, q, k, v, out, as_lse_layout(self.lse[rows]))


def draw_seed(dropout_p: float) -> int:
    """A call's dropout seed from torch's CPU generator (so ``torch.manual_seed`` and activation
    checkpointing's RNG replay reproduce it), in ``[1, 2**62)``; ``0`` without dropout. Reads
    one CPU scalar, never a device value."""
    if dropout_p == 0.0:
        return 0
    return int(torch.randint(1, 2**62, (), dtype=torch.int64).item())


@attrs.frozen
class RowBlocks:
    """The blocks of batch rows ``batches`` (``None``: every row)."""

    batches: slice | None
    blocks: tuple[Block, ...]


@attrs.frozen
class StridedView:
    """An ``as_strided`` view: ``size`` and ``stride``, ``offset`` elements past the tensor's own
    storage offset. Computed once from a tensor's geometry; applied to any tensor of that
    geometry with :meth:`of`."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def of(self, x: torch.Tensor) -> torch.Tensor:
        return x.as_strided(self.size, self.stride, x.storage_offset() + self.offset)

    def rows(self, start: int, stop: int) -> StridedView:
        """This view's rows ``[start, stop)`` (its third dimension: a query view's or an lse's
        query rows)."""
        if (start, stop) == (0, self.size[2]):
            return self
        size = (*self.size[:2], stop - start, *self.size[3:])
        return StridedView(size, self.stride, self.offset + start * self.stride[2])


def selection_view(
    selection: Selection,
    strides: Sequence[int],
    batches: slice,
    heads: tuple[int, int],
    head_dim: int | None,
    origin: int = 0,
) -> StridedView:
    """The kernel-layout view ``(N = rows x segments, heads, count, D)`` of ``selection`` in a
    ``(B, T, H, D)`` tensor of ``strides`` (``T`` counting from position ``origin``), rows
    ``batches``, heads ``[heads[0], heads[1])``; with no ``head_dim``, ``(N, heads, count)`` of
    an lse whose ``(B, T, H)`` strides are ``strides``. The caller checked that rows and segments
    merge (:func:`mergeable`). The arithmetic of :meth:`Selection.view`, done once instead of per
    call."""
    sb, st, sh = strides[:3]
    rows, segments = batches.stop - batches.start, selection.num_segments
    span = selection.segment_length - selection.offset
    step = min(selection.rate, max(1, span))  # never a stride of rate * st (int64 overflow)
    n_stride = sb if segments == 1 else selection.segment_length * st
    offset = batches.start * sb + (selection.start - origin + selection.offset) * st + heads[0] * sh
    size = (rows * segments, heads[1] - heads[0], selection.count)
    if head_dim is None:
        return StridedView(size, (n_stride, sh, step * st), offset)
    return StridedView((*size, head_dim), (n_stride, sh, step * st, strides[3]), offset)


def mergeable(selection: Selection, strides: Sequence[int]) -> bool:
    """Whether batch rows and the selection's segments of a ``(B, T, ...)`` tensor of
    ``strides`` form one problem dimension (one stride): one segment, or segments that tile the
    rows (``stride_B == segments x segment_length x stride_T``). One row always does."""
    return (
        selection.num_segments == 1
        or strides[0] == selection.num_segments * selection.segment_length * strides[1]
    )


def lse_buffer(
    batch: int, heads: int, length: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An lse ``(B, H, L)`` stored position-major (``(B, L, H)`` in memory, transposed), filled
    with ``-inf``: in that layout the batch rows and the segments of a selection that tiles the
    sequence form one problem dimension, as they do in ``q``, so the kernels read it as a view."""
    empty = torch.empty((batch, length, heads), dtype=dtype, device=device)
    return empty.fill_(float("-inf")).transpose(1, 2)


@attrs.frozen
class _Step:
    """One block's chunk, the unit of a kernel call: the views of the query side (``q``, ``out``,
    ``dout``, ``dq``, all of ``q``'s strides), of ``k`` and of ``v`` (their own strides), of the
    key/value gradients (contiguous), of the lse (:func:`lse_buffer`), and the options. ``index``
    numbers the step (its dropout seed derives from it). ``shares_keys``: the step holds some of
    its problems' query rows, other steps the rest
    (:func:`~ringdilated.core.run.limited.row_chunks`), so its key and value gradients are
    added, never written."""

    q: StridedView
    k: StridedView
    v: StridedView
    kv_grad: StridedView
    lse: StridedView
    options: BlockOptions
    index: int
    shares_keys: bool = False


#: A kernel call fuses steps of one shape (every size but ``N``) and options, without dropout,
#: while their ``q``, ``k`` and ``v`` views hold at most this many elements together (a step
#: holding more than half of it runs alone: it would leave room for little) and the kernel's
#: limits allow (problems, and query elements: :attr:`LocalRun.query_budget`). Below it, gathering
#: the steps' views into one call's inputs costs less than the calls it saves (each a kernel
#: launch, its non-finite repair and the driver's Python); above it, each step reads its views in
#: place. Read when a plan's calls are first made.
FUSE_ELEMENTS = 1 << 15


@attrs.frozen
class _KernelCall:
    """One kernel call: a single step, reading and writing its views in place, or several small
    steps (:data:`FUSE_ELEMENTS`) gathered along ``N`` into one call's inputs and written back.

    A fused call reads whole rows of ``D`` elements (the last dimension is contiguous in every
    view) through an index of the rows' storage offsets, one indexing op per tensor, and writes
    its results into the driver's own contiguous buffers with one ``index_put_`` each (allowed
    under ``torch.use_deterministic_algorithms``); the lse, which has no contiguous dimension,
    element by element. The indexes are built once per device on first use, with device ops
    only (no host data is copied), and hold one entry per row."""

    steps: tuple[_Step, ...]
    sizes: tuple[int, ...] = attrs.field(init=False)
    shares_keys: bool = attrs.field(init=False)
    _indices: dict[tuple[object, str, torch.device], tuple[torch.Tensor, int]] = attrs.field(
        factory=dict, eq=False, repr=False, init=False
    )

    @sizes.default
    def _sizes(self) -> tuple[int, ...]:
        return tuple(step.q.size[0] for step in self.steps)

    @shares_keys.default
    def _shares_keys(self) -> bool:
        return any(step.shares_keys for step in self.steps)

    def options(self, seed: int) -> BlockOptions:
        """The call's options (a fused call's steps have equal ones, without dropout), with
        this call's dropout seed (the same for forward and backward)."""
        first = self.steps[0]
        if first.options.dropout_p == 0.0:
            return first.options
        assert len(self.steps) == 1, "steps with dropout are never fused"
        return attrs.evolve(first.options, dropout_seed=derive_seed(seed, first.index))

    def gather(self, x: torch.Tensor, side: Callable[[_Step], StridedView]) -> torch.Tensor:
        """The call's input read from ``x`` through each step's ``side`` view (:data:`_Q`, ...)."""
        if len(self.steps) == 1:
            return side(self.steps[0]).of(x)
        index, extent = self._index(side, "read", x.device)
        width = x.shape[-1] if side is not _LSE else None
        return _span(x, extent, width)[index]

    def write(
        self, target: torch.Tensor, side: Callable[[_Step], StridedView], value: torch.Tensor
    ) -> None:
        """Copy the call's result ``value`` into ``target`` (a contiguous buffer of the driver's,
        or the lse buffer) through each step's ``side`` view (converting its dtype, as
        ``copy_`` does)."""
        if len(self.steps) == 1:
            side(self.steps[0]).of(target).copy_(value)
            return
        value = value.to(target.dtype)
        if side is _LSE:
            index, extent = self._index(side, "read", target.device)
            _span(target, extent, None).index_put_((index,), value)
        else:
            index, _ = self._index(side, "write", target.device)
            target.view(-1, target.shape[-1]).index_put_((index,), value)

    def split(self, *results: torch.Tensor) -> Iterable[tuple[Any, ...]]:
        """``(step, its part of each of results...)`` for each step: for results added into
        their targets step by step, in a fixed order."""
        if len(self.steps) == 1:
            return ((self.steps[0], *results),)
        sizes = list(self.sizes)
        return zip(self.steps, *(r.split_with_sizes(sizes) for r in results), strict=True)

    def _index(
        self, side: Callable[[_Step], StridedView], use: str, device: torch.device
    ) -> tuple[torch.Tensor, int]:
        """The steps' ``side`` views, in the call's order, as an index: for ``"read"``, each
        row's (the lse: each element's) storage offset from the tensor's own, and how many
        offsets from there they span; for ``"write"``, each row's number in a contiguous
        tensor of rows."""
        key = (side, use, device)
        found = self._indices.get(key)
        if found is None and use == "write":
            offsets, extent = self._index(side, "read", device)
            found = self._indices[key] = (offsets // side(self.steps[0]).size[-1], extent)
        elif found is None:
            views = [side(step) for step in self.steps]
            # A view's rows are numbered by its first three dimensions: (N, H, L) of a (N, H, L, D)
            # view (its last is a contiguous row), all three of an lse's.
            extent = 1 + max(
                v.offset + sum((v.size[d] - 1) * v.stride[d] for d in range(3)) for v in views
            )
            found = self._indices[key] = (_row_offsets(views, device), extent)
        return found


def _row_offsets(views: list[StridedView], device: torch.device) -> torch.Tensor:
    """The storage offset of each row of ``views`` (of one shape but ``N``), in order, shaped
    ``(sum of N, H, L)``: each problem's first offset (one ``arange`` per view), plus one
    ``(H, L)`` grid of offsets per run of views with equal head and row strides, broadcast."""
    heads, length = views[0].size[1:3]
    parts = []
    for (head_stride, row_stride), run in itertools.groupby(views, key=lambda v: v.stride[1:3]):
        firsts = []
        for view in run:
            n, step = view.size[0], max(view.stride[0], 1)
            firsts.append(torch.arange(view.offset, view.offset + n * step, step, device=device))
        grid = (
            torch.arange(heads, device=device).unsqueeze(-1) * head_stride
            + torch.arange(length, device=device) * row_stride
        )
        parts.append(torch.cat(firsts).view(-1, 1, 1) + grid)
    return torch.cat(parts)


def _span(x: torch.Tensor, extent: int, width: int | None) -> torch.Tensor:
    """``x``'s storage from its first element: ``extent`` overlapping rows of ``width``
    elements, row ``i`` starting ``i`` elements in (for reading rows by their offsets), or,
    with no ``width``, ``extent`` single elements."""
    if width is None:
        return x.as_strided((extent,), (1,), x.storage_offset())
    return x.as_strided((extent, width), (1, 1), x.storage_offset())


_Q, _K, _V, _LSE, _KV_GRAD = (attrgetter(side) for side in ("q", "k", "v", "lse", "kv_grad"))


def _kernel_calls(
    steps: tuple[_Step, ...], limit: BatchLimit, budget: int | None
) -> tuple[_KernelCall, ...]:
    """``steps`` as kernel calls, fused by the rule of :data:`FUSE_ELEMENTS` while their problems
    fit the kernel's batch ``limit`` and their query elements the ``budget`` (``None``: any);
    calls keep the order of their first steps."""
    # Per open call: its steps; its elements of q, k and v, its problems, its query elements.
    open_calls: dict[object, tuple[list[_Step], list[int]]] = {}
    groups: list[list[_Step]] = []
    for step in steps:
        elements = sum(math.prod(view.size) for view in (step.q, step.k, step.v))
        if step.options.dropout_p > 0.0 or elements > FUSE_ELEMENTS // 2:
            groups.append([step])
            continue
        key = (step.q.size[1:], step.k.size[1:], step.v.size[1:], step.options)
        sizes = [elements, step.q.size[0], math.prod(step.q.size)]
        found = open_calls.get(key)
        if found is not None:
            group, totals = found
            most = limit.per_call(step.k.size[1])
            fused = [total + size for total, size in zip(totals, sizes, strict=True)]
            if (
                fused[0] <= FUSE_ELEMENTS
                and (most is None or fused[1] <= most)
                and (budget is None or fused[2] <= budget)
            ):
                group.append(step)
                totals[:] = fused
                continue
        group = [step]
        open_calls[key] = (group, sizes)
        groups.append(group)
    return tuple(_KernelCall(tuple(group)) for group in groups)


@attrs.frozen
class LocalRun:
    """One dilated-attention plan's fixed parts: the kernel, the blocks and the options.

    ``exclusive``: every (position, head) is covered by at most one block (``head_groups``),
    so results are copied rather than merged. ``window``: the call's key window, counted in
    positions; each block's is :meth:`~ringdilated.core.plan.window.KeyWindow.dilated` by its
    rate and shifted to its queries (a causal call's is the diagonal mask in every block; a
    sliding window's, a band of ``window // rate`` keys, which the steps cut into row chunks
    holding only the keys their rows see: :func:`~ringdilated.core.run.limited.row_chunks`).
    ``complete``: the blocks are the whole computation; ``False`` when other contributions (a
    sharded run's crossing segments) are added afterwards, so gradient buffers start at zero.
    ``batch_limit``: how many problems and query elements one kernel call may hold (the
    kernel's declared limits, :class:`~ringdilated.core.select.capabilities.BatchLimit`);
    ``chunk_elements`` replaces its ``query_elements`` when not ``None``. ``deterministic``: the
    plan's ``Request.deterministic``, handed to every kernel call (``BlockOptions.deterministic``);
    ``softcap``: the call's logit cap (``None``: none), likewise (``BlockOptions.softcap``).

    ``rows``: the blocks of each run of batch rows (documents and padding differ by row).
    ``query_start``: the position of ``q``'s first row (a query suffix; keys start at 0).
    ``covers_queries``: every query position of every row lies in a document (no padding), so
    results need no zero fill where a rate-1 block writes; ``covers_keys``: the same for keys,
    which also needs every key to be a query's (no suffix).
    """

    kernel: Kernel = attrs.field(eq=False)
    rows: tuple[RowBlocks, ...]
    exclusive: bool
    scale: float
    window: KeyWindow = FULL
    dropout_p: float = 0.0
    chunk_elements: int | None = None
    complete: bool = True
    batch_limit: BatchLimit = UNLIMITED
    query_start: int = 0
    covers_queries: bool = True
    covers_keys: bool = True
    deterministic: bool = False
    softcap: float | None = None
    _calls: dict[tuple[object, ...], tuple[_KernelCall, ...]] = attrs.field(
        factory=dict, eq=False, repr=False, init=False
    )
    _zero_ranges: dict[tuple[int, bool], tuple[tuple[int, int], ...]] = attrs.field(
        factory=dict, eq=False, repr=False, init=False
    )

    @property
    def blocks(self) -> tuple[Block, ...]:
        """Every row's blocks."""
        return tuple(block for rows in self.rows for block in rows.blocks)

    def calls(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[_KernelCall, ...]:
        """Every kernel call of the plan for these tensors, in a fixed order (backward replays
        it): its steps, small ones of one shape fused (:func:`_kernel_calls`). ``q`` must be
        contiguous; ``k`` and ``v`` may have any strides whose last is 1."""
        geometry = (q.shape, k.shape, k.stride(), v.stride())
        calls = self._calls.get(geometry)
        if calls is None:
            steps = tuple(self._make_steps(q, k, v))
            calls = _kernel_calls(steps, self.batch_limit, self.query_budget)
            self._calls[geometry] = calls
        return calls

    @property
    def query_budget(self) -> int | None:
        """The most query elements one kernel call may hold (``None``: any):
        ``chunk_elements`` when set, else the kernel's ``batch_limit.query_elements``."""
        if self.chunk_elements is not None:
            return self.chunk_elements
        return self.batch_limit.query_elements

    @property
    def call_limit(self) -> BatchLimit:
        """What one kernel call may hold: ``batch_limit`` with :attr:`query_budget` as its query
        elements (for :class:`~ringdilated.core.run.limited.BatchLimitedKernel`)."""
        if self.chunk_elements is None:
            return self.batch_limit
        return attrs.evolve(self.batch_limit, query_elements=self.chunk_elements)

    def _make_steps(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Iterator[_Step]:
        B, Lq, H, D = q.shape
        L, Hkv = k.shape[1], k.shape[2]
        q_strides = (Lq * H * D, H * D, D, 1)
        kv_grad_strides = (L * Hkv * D, Hkv * D, D, 1)
        lse_strides = (Lq * H, H, 1)  # (B, T, H): lse_buffer's memory order
        origin, budget = self.query_start, self.query_budget
        index = 0
        for rows in self.rows:
            batches = rows.batches or slice(0, B)
            for block in rows.blocks:
                sel, run, queries = block.selection, block.heads, block.query_selection
                # In selected keys; a query suffix ends where the block's keys end.
                window = self.window.dilated(sel.rate).shifted(sel.count - queries.count)
                options = BlockOptions(
                    self.scale,
                    window,
                    self.dropout_p,
                    deterministic=self.deterministic,
                    softcap=self.softcap,
                )
                # lse_buffer's layout merges exactly when q's does.
                tiles = mergeable(queries, q_strides) and all(
                    mergeable(sel, s) for s in (k.stride(), v.stride(), kv_grad_strides)
                )
                hq, hkv = (run.q_start, run.q_stop), (run.kv_start, run.kv_stop)
                most = self.batch_limit.per_call(run.num_kv_heads)
                per_segment = sel.count * run.num_heads * D
                chunks = _split(sel, batches, tiles, per_segment, budget, most)
                for chunk_rows, selection in chunks:
                    qs = selection if block.queries is None else block.queries
                    q_view = selection_view(qs, q_strides, chunk_rows, hq, D, origin)
                    lse_view = selection_view(qs, lse_strides, chunk_rows, hq, None, origin)
                    k_view = selection_view(selection, k.stride(), chunk_rows, hkv, D)
                    v_view = selection_view(selection, v.stride(), chunk_rows, hkv, D)
                    kv_grad = selection_view(selection, kv_grad_strides, chunk_rows, hkv, D)
                    # A problem larger than the budget: its query rows in chunks (each a step).
                    n, heads, q_rows = q_view.size[:3]
                    # A window's band, or a problem larger than the budget: its query rows in
                    # chunks (each a step), each with the keys its rows see; a chunk whose rows
                    # see none is no step (its rows keep out = 0, lse = -inf).
                    k_len = k_view.size[2]
                    bands = not self.batch_limit.skips_hidden_keys
                    parts = tuple(row_chunks(q_rows, n * heads * D, budget, options, k_len, bands))
                    for part in parts:
                        if not part.sees_keys:
                            continue
                        keys = (part.key_start, k_len if part.key_stop is None else part.key_stop)
                        yield _Step(
                            q=q_view.rows(part.start, part.stop),
                            k=k_view.rows(*keys),
                            v=v_view.rows(*keys),
                            kv_grad=kv_grad.rows(*keys),
                            lse=lse_view.rows(part.start, part.stop),
                            options=part.options,
                            index=index,
                            shares_keys=len(parts) > 1 or part.key_stop is not None,
                        )
                        index += 1

    def zero_heads(self, heads: int, kv: bool) -> tuple[tuple[int, int], ...]:
        """Head ranges of a result buffer written by no rate-1 block (so some position of them
        is never written, and must start at zero); see :meth:`_result_buffer`. Cached."""
        ranges = self._zero_ranges.get((heads, kv))
        if ranges is None:
            covered: set[int] = set()
            for block in self.blocks:
                if block.selection.rate == 1:
                    run = block.heads
                    first, stop = (run.kv_start, run.kv_stop) if kv else (run.q_start, run.q_stop)
                    covered.update(range(first, stop))
            zero = consecutive_runs([h for h in range(heads) if h not in covered])
            ranges = self._zero_ranges[heads, kv] = tuple(zero)
        return ranges

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: CallState, cast: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``; with ``cast=False`` a merging run returns its float32/float64 state.
        ``q`` is contiguous (see :meth:`calls`)."""
        B, Lq, H, _ = q.shape
        acc = accumulation_dtype(q.dtype)
        kernel, seed = self.kernel, call.seed
        # Each (position, head) is one block's when exclusive: results are copied, the lse only
        # if read; otherwise partial results are merged in float32/64.
        lse = lse_buffer(B, H, Lq, acc, q.device) if call.lse_needed or not self.exclusive else None
        out = self._result_buffer(q, once=self.exclusive)
        for kernel_call in self.calls(q, k, v):
            qc, kc, vc = (kernel_call.gather(x, side) for x, side in ((q, _Q), (k, _K), (v, _V)))
            out_c, lse_c = kernel.forward(qc, kc, vc, kernel_call.options(seed))
            if self.exclusive:
                kernel_call.write(out, _Q, out_c)
                if lse is not None:
                    kernel_call.write(lse, _LSE, lse_c)
            else:
                for step, out_b, lse_b in kernel_call.split(out_c, lse_c):
                    Accumulator.add(step.q.of(out), step.lse.of(lse), out_b, lse_b)
        if self.exclusive:
            return out, lse  # type: ignore[return-value]
        return (out.to(q.dtype) if cast else out), lse  # type: ignore[return-value]

    def _result_buffer(self, like: torch.Tensor, once: bool, kv: bool = False) -> torch.Tensor:
        """A contiguous buffer shaped like ``like`` for results written by the blocks: in
        ``like``'s dtype when each element is written ``once``, else in its accumulation dtype.

        Written ``once`` per element, every position in a document (``covers_keys`` for ``kv``,
        else ``covers_queries``): uninitialised, except heads some position of which no block
        writes (no rate-1 block covers them), which are zeroed. Otherwise zeros (to add into, or
        left where no block writes)."""
        dtype = like.dtype if once else accumulation_dtype(like.dtype)
        if not (once and (self.covers_keys if kv else self.covers_queries)):
            return torch.zeros(like.shape, dtype=dtype, device=like.device)
        buffer = torch.empty(like.shape, dtype=dtype, device=like.device)
        for first, stop in self.zero_heads(like.shape[2], kv):
            buffer.narrow(2, first, stop - first).zero_()
        return buffer

    def backward(
        self, inputs: BackwardInputs, call: CallState, cast: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` in the input dtype; with ``cast=False`` in whatever the buffers hold."""
        dout, dlse, q, k, v, out, lse = inputs
        calls = self.calls(q, k, v)
        # A gradient written once per element is written in the input dtype (the kernel's result,
        # no second rounding; with dlse, the lse's share is in that one result: see
        # backward_with_lse); one that sums several contributions accumulates in float32/64.
        kv_once = (
            self.exclusive
            and _kv_exclusive(self.blocks)
            and not any(kernel_call.shares_keys for kernel_call in calls)
        )
        dq = self._result_buffer(q, self.exclusive and self.complete)
        dk, dv = (self._result_buffer(x, kv_once and self.complete, kv=True) for x in (k, v))
        kernel, seed = self.kernel, call.seed
        for kernel_call in calls:
            options = kernel_call.options(seed)
            qc, kc, vc = (kernel_call.gather(x, side) for x, side in ((q, _Q), (k, _K), (v, _V)))
            dout_c, out_c = kernel_call.gather(dout, _Q), kernel_call.gather(out, _Q)
            lse_c = kernel_call.gather(lse, _LSE)
            if dlse is None:
                grads = kernel.backward(dout_c, qc, kc, vc, out_c, lse_c, options)
            else:  # the lse's share too: one kernel call where it can, else two
                dlse_c = kernel_call.gather(dlse, _LSE)
                grads = backward_with_lse(kernel, dout_c, dlse_c, qc, kc, vc, out_c, lse_c, options)
            for target, side, grad, once in (
                (dq, _Q, grads[0], self.exclusive),
                (dk, _KV_GRAD, grads[1], kv_once),
                (dv, _KV_GRAD, grads[2], kv_once),
            ):
                if once:
                    kernel_call.write(target, side, grad)
                else:
                    for step, part in kernel_call.split(grad):
                        side(step).of(target).add_(part)
        if not cast:
            return dq, dk, dv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _split(
    selection: Selection,
    batches: slice,
    tiles: bool,
    per_segment: int,
    budget: int | None,
    max_batch: int | None = None,
) -> Iterator[tuple[slice, Selection]]:
    """Pieces of ``selection`` x batch whose kernel-layout views need no copy, each within
    ``budget`` query elements (``None``: any) and holding at most ``max_batch`` problems (batch
    rows times segments; ``None``: any).

    Batch and segment dimensions merge into one kernel batch dimension as a view only when every
    tensor's segments tile its rows (``tiles``, see :func:`mergeable`); otherwise go one batch
    row at a time."""
    limits = [] if budget is None else [max(1, budget // max(1, per_segment))]
    if max_batch is not None:
        limits.append(max_batch)
    segments = min(limits, default=max(1, selection.num_segments * (batches.stop - batches.start)))
    first, stop = batches.start, batches.stop
    if tiles and selection.num_segments <= segments:
        step = max(1, segments // selection.num_segments)
        for b in range(first, stop, step):
            yield slice(b, min(stop, b + step)), selection
        return
    for b in range(first, stop):
        for s in range(0, selection.num_segments, segments):
            yield slice(b, b + 1), selection.segments(s, min(segments, selection.num_segments - s))


def _kv_exclusive(blocks: tuple[Block, ...]) -> bool:
    """Whether each key/value head is read by one pattern only (its gradient is written once)."""
    owner: dict[int, int] = {}
    return all(
        owner.setdefault(h, block.index) == block.index
        for block in blocks
        for h in range(block.heads.kv_start, block.heads.kv_stop)
    )


class Executor(Protocol):
    """Runs one planned attention call's forward and backward: :class:`LocalRun` on one process,
    :class:`~ringdilated.core.run.sharded.ShardedRun` on a shard,
    :class:`~ringdilated.core.run.head_parallel.HeadParallelRun` by heads (over either of them),
    :class:`~ringdilated.core.call.prepare.CallPlan` over one per group of batch rows. Built
    once per plan and reused; what differs per call comes in ``call``. ``q`` is contiguous;
    the backward reads :class:`BackwardInputs`. Results are in the input dtypes; with
    ``cast=False``, an executor that merges or adds them may leave them in the accumulation
    dtype (for a caller that adds more to them: a sharded run's inner run, a head-parallel
    run's inner one). Every executor takes exactly these arguments, so none is told apart from
    another."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: CallState, cast: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self, inputs: BackwardInputs, call: CallState, cast: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


HIGHER_ORDER_MESSAGE = (
    "ringdilated does not support higher-order gradients: the gradients of dilated_attention are "
    "not themselves differentiable (a backward with create_graph=True gives first-order "
    "gradients only)"
)


class _FirstOrderOnly(torch.autograd.Function):
    """Passes gradients through; differentiating them again raises :data:`HIGHER_ORDER_MESSAGE`
    (instead of a silently wrong or an unexplained second derivative)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return tuple(g.clone() for g in tensors[len(tensors) // 2 :])

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *args: torch.Tensor) -> None:
        raise RuntimeError(HIGHER_ORDER_MESSAGE)


def first_order_only(
    grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """``grads`` as they are, unless a backward is building a graph (``create_graph=True``):
    then tied to every one of ``inputs`` (``q``, ``k``, ``v``, and the sinks where they have a
    gradient) through :class:`_FirstOrderOnly`, so differentiating any of them again raises a
    clear error."""
    if not torch.is_grad_enabled():
        return tuple(grads)
    return _FirstOrderOnly.apply(*inputs, *grads)  # type: ignore[no-untyped-call,no-any-return]


def as_lse_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, L)`` in the layout of :func:`lse_buffer` (a copy unless it already is)."""
    if x.stride() == (x.shape[1] * x.shape[2], 1, x.shape[1]):
        return x
    return x.new_empty((x.shape[0], x.shape[2], x.shape[1])).transpose(1, 2).copy_(x)


def forward_with_sinks(
    executor: Executor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: CallState,
    sinks: torch.Tensor | None,
    padding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``executor.forward`` with the call's attention ``sinks`` (``(H,)``; ``None``: none) merged
    into its final ``out`` and ``lse`` (:func:`~ringdilated.core.run.sinks.merge_sinks`), once
    per query, after every block, pattern and piece; ``padding`` (``(B or 1, Lq)`` bool, or
    ``None``): the query rows that are padding, which get no sink."""
    if sinks is None:
        return executor.forward(q, k, v, call)
    out, lse = executor.forward(q, k, v, call.with_lse())
    out, lse = merge_sinks(out, lse, sinks, padding)
    return out, as_lse_layout(lse)  # as the executors' backward reads it


class DilatedAttentionFunction(torch.autograd.Function):
    """``(q, k, v, executor, call[, sinks[, padding]]) -> (out, lse)`` with exact gradients for
    ``q``, ``k``, ``v`` and ``sinks`` (``(H,)``; ``None`` or left out: none; ``padding``, the
    query rows that get no sink: :func:`forward_with_sinks`).

    ``q`` is contiguous ``(B, Lq, H, D)`` (a shard of it for a sharded executor); ``k``, ``v``
    ``(B, L, Hkv, D)`` of any strides whose last is 1. ``lse`` is ``(B, H, Lq)`` in the
    accumulation dtype (laid out by :func:`lse_buffer`); gradients flow through it too unless
    ``call.lse_used`` is ``False``. No autograd runs through in-place state: backward recomputes
    from the saved inputs and the final ``out`` and ``lse`` (with sinks, the merged ones: the
    executor's backward takes them as they are, :mod:`ringdilated.core.run.sinks`).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        executor: Executor,
        call: CallState,
        sinks: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast_off(q.device.type):
            out, lse = forward_with_sinks(executor, q, k, v, call, sinks, padding)
        ctx.save_for_backward(q, k, v, sinks, out, lse)  # type: ignore[arg-type]  # None: no sinks
        ctx.executor = executor  # type: ignore[attr-defined]
        ctx.call = call  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        if not call.lse_used:
            ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        dout: torch.Tensor | None,
        dlse: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, sinks, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        if dlse is not None:
            dlse = as_lse_layout(dlse.to(lse.dtype))
        with torch.no_grad(), autocast_off(q.device.type):
            # Always the whole backward: on a process group every rank must run its exchanges,
            # whichever of its own inputs want gradients.
            grads = ctx.executor.backward(  # type: ignore[attr-defined]
                BackwardInputs(dout, dlse, q, k, v, out, lse),
                ctx.call,  # type: ignore[attr-defined]
            )
            learns = sinks is not None and ctx.needs_input_grad[5]  # type: ignore[attr-defined]
            dsinks = sinks_gradient(dout, dlse, out, lse, sinks) if learns else None
        # Outside no_grad: a backward building a graph ties the gradients to the inputs. (A
        # trailing None for sinks that were left out is dropped by autograd.)
        if dsinks is None:
            return (*first_order_only(grads, (q, k, v)), None, None, None, None)
        *tied, dsinks = first_order_only((*grads, dsinks), (q, k, v, sinks))
        return (*tied, None, None, dsinks, None)


def effective_scale(scale: float | None, head_dim: int) -> float:
    """``scale`` as a float, or the default ``1 / sqrt(head_dim)`` for ``None``: every path's."""
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def pattern_run(
    kernel: Kernel,
    pattern: DilationPattern,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    window: KeyWindow,
    scale: float | None,
    dropout_p: float,
    complete: bool = True,
    blocks: tuple[Block, ...] | None = None,
    batch_limit: BatchLimit = UNLIMITED,
    kernel_name: str | None = None,
    layout: DocumentLayout | None = None,
    deterministic: bool = False,
    softcap: float | None = None,
    query_start: int | None = None,
) -> LocalRun:
    """The :class:`LocalRun` of one plan: ``kernel`` over ``pattern``'s blocks for ``q``, ``k``
    (``blocks`` replaces them, e.g. a shard's inner blocks; ``layout`` places documents, padding
    and a query suffix), scale defaulting by :func:`effective_scale`, no kernel call holding more
    problems than ``batch_limit`` allows, every call's options ``deterministic`` and ``softcap``
    as given (the plan's), and every call's results and inputs checked
    (:class:`~ringdilated.core.contract.guard.CheckedKernel`, errors naming ``kernel_name``).
    ``query_start``: the position of ``q``'s first row in ``k`` when ``blocks`` are given (a
    shard's query suffix: its blocks' queries start there); default: the layout's."""
    batch, length, kv_heads = k.shape[0], k.shape[1], k.shape[2]
    heads, dim = q.shape[2], q.shape[3]
    layout = layout or DocumentLayout.whole(batch, length, q.shape[1])
    rows: tuple[RowBlocks, ...]
    if blocks is None and not layout.is_whole:
        start = layout.query_start
        rows = tuple(
            RowBlocks(r.batches, pattern.document_blocks(r.documents, heads, kv_heads, start))
            for r in layout.rows
        )
    else:
        whole = pattern.blocks(length, heads, kv_heads) if blocks is None else blocks
        rows = (RowBlocks(None, whole),)
    # Every query row is written only where every selected query sees a key (its own
    # position, under any call's window); a window that hides it leaves rows to zero.
    covers = layout.covers_all and window.sees_own_position
    start = layout.query_start if query_start is None else query_start
    return LocalRun(
        kernel=CheckedKernel(kernel, kernel_name or type(kernel).__name__),
        rows=rows,
        query_start=start,
        covers_queries=covers,
        covers_keys=covers and start == 0,
        exclusive=pattern.mode == "head_groups",
        scale=effective_scale(scale, dim),
        window=window,
        dropout_p=float(dropout_p),
        complete=complete,
        batch_limit=batch_limit,
        deterministic=deterministic,
        softcap=softcap,
    )
