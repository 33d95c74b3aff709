"""Runs a dilation pattern on a kernel, forward and backward, on one process.

Call flow::

    run = pattern_run(kernel, pattern, q, k, layout=..., causal=..., scale=..., ...)
    out, lse = DilatedAttentionFunction.apply(q, k, v, run)
        forward:  for each block chunk: strided views of q, k, v -> kernel.forward -> (out_b, lse_b)
                  head_groups: each (position, head) has one block, so out_b is copied in place;
                  longnet: partials are merged by the Accumulator (float32 log-sum-exp)
        backward: for each block chunk: kernel.backward(dout, q, k, v, out, lse) with the FINAL
                  merged out and lse, gradients added into dq, dk, dv (float32 or float64)

Blocks are split into chunks of whole segments so that no kernel call's scratch exceeds
``Run.chunk_elements`` elements: peak memory beyond the inputs and outputs stays bounded whatever
the sequence length. Nothing here checks capabilities or catches exceptions: the resolver and the
input validation ran before.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Protocol

import attrs
import torch

from ringdilated.core.accumulator import Accumulator, accumulation_dtype
from ringdilated.core.capabilities import UNLIMITED, BatchLimit
from ringdilated.core.dtypes import autocast_off
from ringdilated.core.kernel import BlockOptions, Kernel, all_finite, derive_seed
from ringdilated.core.kernel_guard import CheckedKernel
from ringdilated.core.layout import SequenceLayout
from ringdilated.core.pattern import Block, DilationPattern, Selection

__all__ = [
    "HIGHER_ORDER_MESSAGE",
    "BatchLimitedKernel",
    "DilatedAttentionFunction",
    "Executor",
    "RowBlocks",
    "Run",
    "lse_gradient",
    "pattern_run",
    "run_backward",
    "run_forward",
]

DEFAULT_CHUNK_ELEMENTS = 1 << 23


@attrs.frozen
class RowBlocks:
    """The blocks of batch rows ``batches`` (``None``: every row)."""

    batches: slice | None
    blocks: tuple[Block, ...]


@attrs.frozen
class Run:
    """One dilated-attention call's fixed parts: the kernel, the blocks and the options.

    ``exclusive``: every (position, head) is covered by at most one block (``head_groups``),
    so results are copied rather than merged. ``causal`` selects the diagonal mask in every block.
    ``complete``: the blocks are the whole computation; ``False`` when other contributions (a
    sharded run's crossing segments) are added afterwards, so gradient buffers start at zero.
    ``batch_limit``: how many problems one kernel call may hold (the kernel's declared grid
    limit, :class:`~ringdilated.core.capabilities.BatchLimit`).

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
    causal: bool = False
    dropout_p: float = 0.0
    dropout_seed: int = 0
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
    complete: bool = True
    batch_limit: BatchLimit = UNLIMITED
    query_start: int = 0
    covers_queries: bool = True
    covers_keys: bool = True

    @property
    def blocks(self) -> tuple[Block, ...]:
        """Every row's blocks."""
        return tuple(block for rows in self.rows for block in rows.blocks)

    def chunks(
        self, batch: int, seq_len: int, head_dim: int, finite: bool | None = None
    ) -> Iterator[_Chunk]:
        """Every kernel call of the pattern, in a fixed order (backward replays the same one).
        ``seq_len`` is the key length; ``finite`` is what the caller knows of the inputs'
        finiteness (``BlockOptions.finite``)."""
        index = 0
        for rows in self.rows:
            batches = rows.batches or slice(0, batch)
            for block in rows.blocks:
                per_segment = block.selection.count * block.heads.num_heads * head_dim
                offset = block.selection.count - block.query_selection.count
                for chunk_batches, selection in _split(
                    block.selection,
                    batches,
                    seq_len if self.query_start == 0 else None,
                    per_segment,
                    self.chunk_elements,
                    self.batch_limit.per_call(block.heads.num_kv_heads),
                ):
                    options = BlockOptions(
                        scale=self.scale,
                        causal_offset=offset if self.causal else None,
                        dropout_p=self.dropout_p,
                        dropout_seed=derive_seed(self.dropout_seed, index),
                        finite=finite,
                    )
                    yield _Chunk(block, chunk_batches, selection, options, self.query_start)
                    index += 1

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, finite: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return run_forward(self, q, k, v, finite=finite)

    def backward(
        self,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        finite: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return run_backward(self, dout, dlse, q, k, v, out, lse, finite=finite)


def _split(
    selection: Selection,
    batches: slice,
    seq_len: int | None,
    per_segment: int,
    budget: int,
    max_batch: int | None = None,
) -> Iterator[tuple[slice, Selection]]:
    """Pieces of ``selection`` x batch whose kernel-layout views need no copy, within budget,
    each holding at most ``max_batch`` problems (batch rows times segments).

    Batch and segment dimensions merge into one kernel batch dimension as a view only when the
    segments tile the whole sequence of ``seq_len`` (or there is one segment); otherwise go one
    batch row at a time. ``seq_len`` is ``None`` when the query-side tensors are shorter than the
    keys (a query suffix), which no multi-segment selection tiles. ``batches``: the rows.
    """
    segments = max(1, budget // max(1, per_segment))
    if max_batch is not None:
        segments = min(segments, max_batch)
    tiles = selection.num_segments == 1 or (
        seq_len is not None and selection.start == 0 and selection.stop == seq_len
    )
    first, stop = batches.start, batches.stop
    if tiles and selection.num_segments <= segments:
        step = max(1, segments // selection.num_segments)
        for b in range(first, stop, step):
            yield slice(b, min(stop, b + step)), selection
        return
    for b in range(first, stop):
        for s in range(0, selection.num_segments, segments):
            yield slice(b, b + 1), selection.segments(s, min(segments, selection.num_segments - s))


@attrs.frozen
class _Chunk:
    """One kernel call: ``selection`` (keys) of ``block`` for rows ``batches``; ``origin``: the
    position of row 0 of the query-side tensors (``q``, ``out``, ``lse``, their gradients)."""

    block: Block
    batches: slice
    selection: Selection
    options: BlockOptions
    origin: int = 0

    @property
    def queries(self) -> Selection:
        """The query positions: the selection's, or the block's suffix of its one segment."""
        return self.selection if self.block.queries is None else self.block.queries

    def view(self, x: torch.Tensor, kv: bool = False) -> torch.Tensor:
        """``(B', segments, heads, count, D)``: this chunk's part of ``(B, L, H, D)`` (keys and
        values, ``kv``) or of ``(B, Lq, H, D)`` (the query side), no copy."""
        run = self.block.heads
        if kv:
            view = self.selection.view(x)[self.batches, :, :, run.kv_start : run.kv_stop]
        else:
            view = self.queries.view(x, origin=self.origin)
            view = view[self.batches, :, :, run.q_start : run.q_stop]
        return view.permute(0, 1, 3, 2, 4)

    def lse_view(self, lse: torch.Tensor) -> torch.Tensor:
        """``(B', segments, heads, count)``: this chunk's part of an ``lse`` of ``(B, H, Lq)``."""
        heads = slice(self.block.heads.q_start, self.block.heads.q_stop)
        view = self.queries.view(lse, dim=2, origin=self.origin)
        return view[self.batches, heads].permute(0, 2, 1, 3)

    def kernel_input(self, x: torch.Tensor, kv: bool = False) -> torch.Tensor:
        """``(N, heads, count, D)`` for the kernel; a view (``_split`` made the merge legal)."""
        return self.view(x, kv).flatten(0, 1)


def run_forward(
    run: Run,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep_state: bool = False,
    finite: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``; with ``keep_state`` a merging run returns its float32/float64 state.

    Whether the inputs are finite is checked once here (``finite``, if the caller has not) and
    handed to every kernel call, rather than each call summing its own strided views."""
    B, Lq, H, D = q.shape
    L = k.shape[1]
    if finite is None:
        finite = all_finite(q, k, v)
    lse = torch.full((B, H, Lq), float("-inf"), dtype=accumulation_dtype(q.dtype), device=q.device)
    if run.exclusive:
        out = _result_buffer(q.shape, q.dtype, q.device, run.blocks, exclusive=run.covers_queries)
    else:
        state = Accumulator(torch.empty(q.shape, dtype=lse.dtype, device=q.device), lse)
    for chunk in run.chunks(B, L, D, finite):
        out_b, lse_b = run.kernel.forward(
            chunk.kernel_input(q),
            chunk.kernel_input(k, True),
            chunk.kernel_input(v, True),
            chunk.options,
        )
        shape = (-1, chunk.selection.num_segments)
        if run.exclusive:
            chunk.view(out).copy_(torch.unflatten(out_b, 0, shape))
            chunk.lse_view(lse).copy_(torch.unflatten(lse_b, 0, shape))
        else:
            Accumulator.add(
                chunk.view(state.out),
                chunk.lse_view(lse),
                torch.unflatten(out_b, 0, shape),
                torch.unflatten(lse_b, 0, shape),
            )
    if not run.exclusive:
        out = state.out if keep_state else state.out.to(q.dtype)
    return out, lse


def _kv_exclusive(blocks: tuple[Block, ...]) -> bool:
    """Whether each key/value head is read by one pattern only (its gradient is written once)."""
    owner: dict[int, int] = {}
    return all(
        owner.setdefault(h, block.index) == block.index
        for block in blocks
        for h in range(block.heads.kv_start, block.heads.kv_stop)
    )


def _result_buffer(
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    blocks: tuple[Block, ...],
    *,
    exclusive: bool,
    kv: bool = False,
) -> torch.Tensor:
    """A ``(B, L, heads, D)`` buffer for results written by the blocks.

    Written once per element, every position in a document (``exclusive``): uninitialised, except
    heads that some position of is never written (no rate-1 block covers them), which are zeroed.
    Otherwise zeros (to add into, or left where no block writes).
    """
    if not exclusive:
        return torch.zeros(shape, dtype=dtype, device=device)
    covered = [False] * shape[2]
    for block in blocks:
        if block.selection.rate == 1:
            first = block.heads.kv_start if kv else block.heads.q_start
            stop = block.heads.kv_stop if kv else block.heads.q_stop
            covered[first:stop] = [True] * (stop - first)
    buffer = torch.empty(shape, dtype=dtype, device=device)
    h = 0
    while h < shape[2]:
        if covered[h]:
            h += 1
            continue
        stop = h
        while stop < shape[2] and not covered[stop]:
            stop += 1
        buffer[:, :, h:stop].zero_()
        h = stop
    return buffer


def run_backward(
    run: Run,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cast: bool = True,
    finite: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the input dtype; with ``cast=False`` in whatever the buffers hold.
    ``finite``: as for :func:`run_forward`, of ``q``, ``k``, ``v``, ``dout`` and ``dlse``."""
    B, L, D = k.shape[0], k.shape[1], k.shape[3]
    if finite is None:
        finite = all_finite(q, k, v, dout, *(() if dlse is None else (dlse,)))
    # A gradient written once per element is written in the input dtype (the kernel's result,
    # no second rounding); one that sums several contributions accumulates in float32/float64.
    kv_once = run.exclusive and _kv_exclusive(run.blocks)
    q_once = run.exclusive and run.complete and dlse is None
    k_once = kv_once and run.complete and dlse is None
    v_once = kv_once and run.complete

    def buffer(like: torch.Tensor, once: bool, kv: bool) -> torch.Tensor:
        dtype = like.dtype if once else accumulation_dtype(like.dtype)
        covered = run.covers_keys if kv else run.covers_queries
        return _result_buffer(
            like.shape, dtype, like.device, run.blocks, exclusive=once and covered, kv=kv
        )

    dq, dk, dv = buffer(q, q_once, False), buffer(k, k_once, True), buffer(v, v_once, True)
    for chunk in run.chunks(B, L, D, finite):
        qc, kc, vc = chunk.kernel_input(q), chunk.kernel_input(k, True), chunk.kernel_input(v, True)
        lse_c = chunk.lse_view(lse).flatten(0, 1)
        dq_b, dk_b, dv_b = run.kernel.backward(
            chunk.kernel_input(dout), qc, kc, vc, chunk.kernel_input(out), lse_c, chunk.options
        )
        shape = (-1, chunk.selection.num_segments)
        _write(chunk.view(dq), torch.unflatten(dq_b, 0, shape), run.exclusive)
        _write(chunk.view(dk, True), torch.unflatten(dk_b, 0, shape), kv_once)
        _write(chunk.view(dv, True), torch.unflatten(dv_b, 0, shape), kv_once)
        if dlse is not None:
            dlse_c = chunk.lse_view(dlse).flatten(0, 1)
            dq_l, dk_l = lse_gradient(run.kernel, chunk.options, dlse_c, qc, kc, vc, lse_c)
            chunk.view(dq).add_(torch.unflatten(dq_l, 0, shape))
            chunk.view(dk, True).add_(torch.unflatten(dk_l, 0, shape))
    if not cast:
        return dq, dk, dv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _write(target: torch.Tensor, value: torch.Tensor, once: bool) -> None:
    if once:
        target.copy_(value)
    else:
        target.add_(value)


def lse_gradient(
    kernel: Kernel,
    options: BlockOptions,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)`` of ``sum(dlse * lse)`` through one block, from the kernel's own backward.

    ``d lse_i / d s_ij = P_ij``. A kernel backward computes ``dS = P * (dout . v_j - D_i)`` with
    ``D_i = rowsum(dout * out)``; passing ``v_j = e_0``, ``dout_i = dlse_i e_0`` and ``out = 0``
    makes that ``P_ij * dlse_i``, so any kernel that meets the contract gives it exactly. The lse
    does not depend on dropout, so the call runs without it. ``dlse`` is ``(N, H, Lq)``.
    """
    e0 = torch.zeros_like(v)
    e0[..., 0] = 1
    grad = torch.zeros_like(q)
    grad[..., 0] = dlse.to(q.dtype)
    dq, dk, _ = kernel.backward(
        grad, q, k, e0, torch.zeros_like(q), lse, attrs.evolve(options, dropout_p=0.0)
    )
    return dq, dk


class BatchLimitedKernel:
    """``kernel`` with every call split along the problem dimension ``N`` to its
    :class:`~ringdilated.core.capabilities.BatchLimit`, results concatenated: for calls the driver
    cannot split by segments (a sharded run's crossing pieces hold one problem per batch row)."""

    def __init__(self, kernel: Kernel, limit: BatchLimit) -> None:
        self.kernel, self.limit = kernel, limit

    def _pieces(self, n: int, kv_heads: int) -> list[slice] | None:
        """Slices of at most the limit, or ``None`` when one call may take all ``n``."""
        step = self.limit.per_call(kv_heads)
        if step is None or n <= step:
            return None
        return [slice(i, i + step) for i in range(0, n, step)]

    @staticmethod
    def _options(options: BlockOptions, piece: int) -> BlockOptions:
        """Piece ``piece``'s options: its own dropout seed (pieces of one shape would otherwise
        draw the same mask); forward and backward split alike, so they agree."""
        if piece == 0 or options.dropout_p == 0.0:
            return options
        return attrs.evolve(options, dropout_seed=derive_seed(options.dropout_seed, "piece", piece))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = self._pieces(q.shape[0], k.shape[1])
        if pieces is None:
            return self.kernel.forward(q, k, v, options)
        parts = [
            self.kernel.forward(q[p], k[p], v[p], self._options(options, i))
            for i, p in enumerate(pieces)
        ]
        return torch.cat([o for o, _ in parts]), torch.cat([s for _, s in parts])

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pieces = self._pieces(q.shape[0], k.shape[1])
        if pieces is None:
            return self.kernel.backward(dout, q, k, v, out, lse, options)
        parts = [
            self.kernel.backward(
                dout[p], q[p], k[p], v[p], out[p], lse[p], self._options(options, i)
            )
            for i, p in enumerate(pieces)
        ]
        dq, dk, dv = (torch.cat([part[i] for part in parts]) for i in range(3))
        return dq, dk, dv


class Executor(Protocol):
    """Runs one attention call's forward and backward: :class:`Run` on one process,
    :class:`~ringdilated.core.sharded_run.ShardedRun` on a shard. ``finite``: whether the inputs
    (and ``dout``, ``dlse`` in backward) hold no NaN or infinity, when the caller knows."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, finite: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        finite: bool | None = None,
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
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """``grads`` as they are, unless a backward is building a graph (``create_graph=True``):
    then tied to every one of ``inputs`` (``q``, ``k``, ``v``) through :class:`_FirstOrderOnly`,
    so differentiating any of them again raises a clear error."""
    if not torch.is_grad_enabled():
        return grads
    return _FirstOrderOnly.apply(*inputs, *grads)  # type: ignore[no-untyped-call,no-any-return]


class DilatedAttentionFunction(torch.autograd.Function):
    """``(q, k, v, executor) -> (out, lse)`` with exact gradients for ``q``, ``k``, ``v``.

    ``q``, ``k``, ``v`` are contiguous ``(B, L, H, D)``/``(B, L, Hkv, D)`` (a shard of them for a
    sharded executor). ``lse`` is ``(B, H, L)`` in the accumulation dtype; gradients flow through
    it too. No autograd runs through in-place state: backward recomputes from the saved inputs
    and the final ``out`` and ``lse``.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        executor: Executor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        finite = all_finite(q, k, v)  # once per call; backward then checks dout alone
        with autocast_off(q.device.type):
            out, lse = executor.forward(q, k, v, finite=finite)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.finite = finite  # type: ignore[attr-defined]
        ctx.executor = executor  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        dout: torch.Tensor | None,
        dlse: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout.contiguous()
        dlse = None if dlse is None else dlse.to(lse.dtype).contiguous()
        grads_finite = all_finite(dout, *(() if dlse is None else (dlse,)))
        with torch.no_grad(), autocast_off(q.device.type):
            grads = ctx.executor.backward(  # type: ignore[attr-defined]
                dout,
                dlse,
                q,
                k,
                v,
                out,
                lse,
                finite=ctx.finite and grads_finite,  # type: ignore[attr-defined]
            )
        return (*first_order_only(grads, (q, k, v)), None)


def pattern_run(
    kernel: Kernel,
    pattern: DilationPattern,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    dropout_seed: int,
    complete: bool = True,
    blocks: tuple[Block, ...] | None = None,
    batch_limit: BatchLimit = UNLIMITED,
    kernel_name: str | None = None,
    layout: SequenceLayout | None = None,
) -> Run:
    """The :class:`Run` of one call: ``kernel`` over ``pattern``'s blocks for ``q``, ``k``
    (``blocks`` replaces them, e.g. a shard's inner blocks; ``layout`` places documents, padding
    and a query suffix), scale defaulting to ``1/sqrt(D)``, no kernel call holding more problems
    than ``batch_limit`` allows, and every call's results and inputs checked
    (:class:`~ringdilated.core.kernel_guard.CheckedKernel`, errors naming ``kernel_name``)."""
    batch, length, kv_heads = k.shape[0], k.shape[1], k.shape[2]
    heads, dim = q.shape[2], q.shape[3]
    layout = layout or SequenceLayout.whole(batch, length, q.shape[1])
    rows: tuple[RowBlocks, ...]
    if blocks is not None:
        rows = (RowBlocks(None, blocks),)
    elif layout.is_whole:
        rows = (RowBlocks(None, pattern.blocks(length, heads, kv_heads)),)
    else:
        rows = tuple(
            RowBlocks(
                r.batches,
                pattern.document_blocks(r.documents, heads, kv_heads, layout.query_start),
            )
            for r in layout.rows
        )
    covers = layout.covers_all
    return Run(
        kernel=CheckedKernel(kernel, kernel_name or type(kernel).__name__),
        rows=rows,
        query_start=layout.query_start,
        covers_queries=covers,
        covers_keys=covers and layout.query_start == 0,
        exclusive=pattern.mode == "head_groups",
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(dim),
        causal=causal,
        dropout_p=float(dropout_p),
        dropout_seed=dropout_seed,
        complete=complete,
        batch_limit=batch_limit,
    )
