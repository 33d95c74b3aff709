"""Dilated attention over a sequence sharded across ranks (docs/spec.md, section 3): the run.

Three parts: the plan (:mod:`ringdilated.core.plan.shards`: what each rank computes and what
moves), the wire format (:mod:`ringdilated.core.run.wire`) and this, the run, which moves pieces
through one :class:`~ringdilated.core.run.exchange.PieceExchange` forward and backward.

Call flow on rank ``r`` (every rank runs the same steps)::

    forward:
        exchange step 1 starts                  pieces of crossing segments, straight to the
                                                ranks whose queries see them (shard plan)
        inner blocks -> out, lse                local, exactly the single-process driver
        own piece of each crossing -> partial   merged by the Accumulator (float32)
        for each step: start step + 1; wait step; each received piece -> partial -> merge
        crossing results written into out / merged into the longnet state
    backward:
        inner blocks -> dq, dk, dv              the single-process backward
        own pieces -> gradients                 with the final out and lse
        for each step: pieces re-received (prefetched one step ahead); their dk, dv start back
        to their owners (asynchronously, while the next step computes); each rank adds what
        comes back to its own pieces

Memory per rank is O(L / P): inner work is chunked as on one process, at most two steps' pieces
and one step's returned gradients are alive at a time. Nothing here validates inputs:
:func:`ringdilated.core.call.prepare.prepare_call` did, identically on every rank, before any
communication.
"""

from __future__ import annotations

import attrs
import torch

from ringdilated.core.contract.accumulator import Accumulator, accumulation_dtype
from ringdilated.core.contract.communicator import Communicator, TransferStats
from ringdilated.core.contract.kernel import BlockOptions, Kernel, derive_seed
from ringdilated.core.plan.shards import Crossing, ShardPlan
from ringdilated.core.run import wire as wire
from ringdilated.core.run.exchange import PieceExchange
from ringdilated.core.run.local import BatchLimitedKernel, CallState, Run, lse_gradient

__all__ = ["ShardedRun", "sharded_backward", "sharded_forward"]


@attrs.frozen
class ShardedRun:
    """A sharded plan's fixed parts, built once and reused by every call of the plan.
    ``inner`` is the single-process run of the inner blocks; ``plans`` every rank's shard plan,
    ``plan`` this rank's; ``broadcast``: the communicator's spec declares broadcast delivery.
    A call's dropout seed is its part ``("shard", rank)``: every rank's inner blocks count
    from 0."""

    inner: Run
    plans: tuple[ShardPlan, ...]
    rank: int
    communicator: Communicator = attrs.field(eq=False)
    group: object = attrs.field(eq=False)
    broadcast: bool = attrs.field(kw_only=True)
    _options: dict[tuple[int, bool], BlockOptions] = attrs.field(
        factory=dict, eq=False, repr=False, init=False
    )

    @property
    def plan(self) -> ShardPlan:
        return self.plans[self.rank]

    @property
    def kernel(self) -> Kernel:
        """The kernel for crossing pieces (one problem per batch row), split to the kernel's
        declared batch limit where the batch exceeds it."""
        return BatchLimitedKernel(self.inner.kernel, self.inner.batch_limit)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: CallState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return sharded_forward(self, q, k, v, call)

    def backward(
        self,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        call: CallState,
        cast: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return sharded_backward(self, dout, dlse, q, k, v, out, lse, call, cast)

    def options(self, seed_index: int, own: bool, seed: int) -> BlockOptions:
        """A crossing partial's options: the diagonal for a rank's own piece under causal; no
        mask for another rank's (only earlier ranks send under causal, and all their keys are
        visible). ``seed``: the shard's dropout seed (``0``: none; the options are then made
        once and kept)."""
        if seed == 0:
            key = (seed_index, own)
            options = self._options.get(key)
            if options is None:
                options = self._options[key] = self._make_options(own, 0)
            return options
        return self._make_options(own, derive_seed(seed, "crossing", seed_index))

    def _make_options(self, own: bool, seed: int) -> BlockOptions:
        return BlockOptions(
            scale=self.inner.scale,
            causal_offset=0 if (own and self.inner.causal) else None,
            dropout_p=self.inner.dropout_p,
            dropout_seed=seed,
        )


def _seed_index(run: ShardedRun, crossing_index: int, src: int) -> int:
    return crossing_index * run.plan.world_size + src


def sharded_forward(
    run: ShardedRun, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: CallState
) -> tuple[torch.Tensor, torch.Tensor]:
    me = run.plan.rank
    exchange = _exchange(run, k, v, call.stats)
    exchange.start()
    call = call.derive("shard", run.rank).with_lse()
    out, lse = run.inner.forward(q, k, v, call, keep_state=True)
    index = {c: i for i, c in enumerate(run.plan.crossings)}
    states: dict[Crossing, Accumulator] = {}
    for c in run.plan.crossings:
        qc = wire.piece(q, c, me, wire.q_heads(c))
        states[c] = Accumulator(
            torch.empty(qc.shape, dtype=lse.dtype, device=q.device),
            torch.empty(qc.shape[:-1], dtype=lse.dtype, device=q.device),
        )
        o, s = run.kernel.forward(
            qc,
            wire.piece(k, c, me, wire.kv_heads(c)),
            wire.piece(v, c, me, wire.kv_heads(c)),
            run.options(_seed_index(run, index[c], me), own=True, seed=call.seed),
        )
        Accumulator.add(states[c].out, states[c].lse, o, s)
    for _, received in exchange:
        for src, _, c, kr, vr in received:
            o, s = run.kernel.forward(
                wire.piece(q, c, me, wire.q_heads(c)),
                kr,
                vr,
                run.options(_seed_index(run, index[c], src), own=False, seed=call.seed),
            )
            Accumulator.add(states[c].out, states[c].lse, o, s)
    for c, state in states.items():
        if run.inner.exclusive:
            wire.piece(out, c, me, wire.q_heads(c)).copy_(state.out)
            wire.lse_piece(lse, c, me).copy_(state.lse)
        else:
            Accumulator.add(
                wire.piece(out, c, me, wire.q_heads(c)),
                wire.lse_piece(lse, c, me),
                state.out,
                state.lse,
            )
    if not run.inner.exclusive:
        out = out.to(q.dtype)
    return out, lse


def _partial_backward(
    run: ShardedRun,
    options: BlockOptions,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = run.kernel.backward(dout, q, k, v, out, lse, options)
    if dlse is not None:
        dq_l, dk_l = lse_gradient(run.kernel, options, dlse, q, k, v, lse)
        dq, dk = dq.to(lse.dtype) + dq_l, dk.to(lse.dtype) + dk_l
    return dq, dk, dv


def sharded_backward(
    run: ShardedRun,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    call: CallState,
    cast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of this rank's shard, in the input dtypes (``cast=False``: in the
    accumulation dtype, for a caller that adds more to them)."""
    me, plan = run.plan.rank, run.plan
    exchange = _exchange(run, k, v, call.stats)
    exchange.start()
    acc = accumulation_dtype(q.dtype)
    call = call.derive("shard", run.rank)
    # run.inner.complete is False, so these are zero-started accumulators in the acc dtype.
    dq, dk, dv = run.inner.backward(dout, dlse, q, k, v, out, lse, call, cast=False)
    index = {c: i for i, c in enumerate(plan.crossings)}

    def views(
        c: Crossing,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        qh = wire.q_heads(c)
        return (
            wire.piece(dout, c, me, qh),
            None if dlse is None else wire.lse_piece(dlse, c, me),
            wire.piece(q, c, me, qh),
            wire.piece(out, c, me, qh),
            wire.lse_piece(lse, c, me),
        )

    for c in plan.crossings:
        do, dl, qc, oc, lc = views(c)
        kh = wire.kv_heads(c)
        gq, gk, gv = _partial_backward(
            run,
            run.options(_seed_index(run, index[c], me), own=True, seed=call.seed),
            do,
            dl,
            qc,
            wire.piece(k, c, me, kh),
            wire.piece(v, c, me, kh),
            oc,
            lc,
        )
        wire.piece(dq, c, me, wire.q_heads(c)).add_(gq)
        wire.piece(dk, c, me, kh).add_(gk)
        wire.piece(dv, c, me, kh).add_(gv)
    batch, head_dim = k.shape[0], k.shape[3]
    for step, received in exchange:
        # Gradients of the pieces received, in each sender's payload layout, to send back.
        back: dict[int, list[torch.Tensor]] = {}
        for src, i, c, kr, vr in received:
            do, dl, qc, oc, lc = views(c)
            gq, gk, gv = _partial_backward(
                run,
                run.options(_seed_index(run, index[c], src), own=False, seed=call.seed),
                do,
                dl,
                qc,
                kr,
                vr,
                oc,
                lc,
            )
            wire.piece(dq, c, me, wire.q_heads(c)).add_(gq)
            incoming = exchange.payload(src, me)
            if src not in back:
                back[src] = wire.gradient_buffers(incoming, batch, head_dim, acc, k.device)
            wire.scatter_add(back[src], incoming, i, gk, gv)
        exchange.return_gradients(step, back, dk, dv)
    exchange.finish(dk, dv)
    if not cast:
        return dq, dk, dv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _exchange(
    run: ShardedRun, k: torch.Tensor, v: torch.Tensor, stats: TransferStats | None
) -> PieceExchange:
    """The exchange of ``run``'s pieces of ``k``, ``v`` (this rank's shard)."""
    return PieceExchange(
        run.plans, run.rank, run.communicator, run.group, run.inner.causal, k, v, stats,
        broadcast=run.broadcast,
    )  # fmt: skip
