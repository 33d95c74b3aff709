"""Dilated attention over a sequence sharded across ranks (docs/spec.md, section 3): the run.

Three parts: the plan (:mod:`ringdilated.core.plan.shards`: what each rank computes and what
moves), the wire format (:mod:`ringdilated.core.run.wire`) and this, the run, which moves pieces
through one :class:`~ringdilated.core.run.exchange.PieceExchange` forward and backward.

Call flow on rank ``r`` (every rank runs the same steps)::

    forward:
        exchange step 1 starts                  pieces of crossing segments, straight to the
                                                ranks whose queries see them (shard plan)
        inner blocks -> out, lse                local, exactly the single-process LocalRun
        own piece of each crossing -> partial   merged by the Accumulator (float32)
        for each step: start step + 1; wait step; each received piece -> partial -> merge
        crossing results written into out / merged into the longnet state
    backward:
        inner blocks -> dq, dk, dv              the single-process backward
        own pieces -> gradients                 with the final out and lse
        for each step: pieces re-received (prefetched one step ahead); their dk, dv start back
        to their owners (asynchronously, while the next step computes); each rank adds what
        comes back to its own pieces

With a query suffix (docs/spec.md, section 3), ``q``, ``out``, ``lse`` and their gradients hold
only this rank's query rows, the last of its shard from
:attr:`~ringdilated.core.plan.shards.ShardPlan.query_origin` on: the inner run starts its queries
there, and a crossing computes only its piece's query rows
(:func:`~ringdilated.core.run.wire.queries`), none where the piece holds no query (its keys
still go to the ranks whose queries see them).

Memory per rank is O(L / P): inner work is chunked as on one process, at most two steps' pieces
and one step's returned gradients are alive at a time. Nothing here validates inputs:
:func:`ringdilated.core.call.prepare.prepare_call` did, identically on every rank, before any
communication.
"""

from __future__ import annotations

import itertools

import attrs
import torch

from ringdilated.core.contract.accumulator import Accumulator, accumulation_dtype
from ringdilated.core.contract.communicator import Communicator, TransferStats
from ringdilated.core.contract.kernel import BlockOptions, Kernel, derive_seed
from ringdilated.core.contract.lse import backward_with_lse
from ringdilated.core.plan.shards import Crossing, ShardPlan
from ringdilated.core.run import wire as wire
from ringdilated.core.run.exchange import PieceExchange
from ringdilated.core.run.limited import BatchLimitedKernel
from ringdilated.core.run.local import BackwardInputs, CallState, LocalRun

__all__ = ["ShardedRun"]


@attrs.frozen
class ShardedRun:
    """A sharded plan's fixed parts, built once and reused by every call of the plan.
    ``inner`` is the single-process run of the inner blocks; ``plans`` every rank's shard plan,
    ``plan`` this rank's; ``broadcast``: the communicator's spec declares broadcast delivery.
    A call's dropout seed is its part ``("shard", rank)``: every rank's inner blocks count
    from 0."""

    inner: LocalRun
    plans: tuple[ShardPlan, ...]
    rank: int
    communicator: Communicator = attrs.field(eq=False)
    group: object = attrs.field(eq=False)
    broadcast: bool = attrs.field(kw_only=True)
    _options: dict[tuple[int, int], BlockOptions] = attrs.field(
        factory=dict, eq=False, repr=False, init=False
    )

    @property
    def plan(self) -> ShardPlan:
        return self.plans[self.rank]

    #: The kernel for crossing pieces (one problem per batch row, every row of a segment), each
    #: call split to what one call may hold (the inner run's
    #: :attr:`~ringdilated.core.run.local.LocalRun.call_limit`): by problems, and a problem larger
    #: than the query bound by query rows. Made once, with the run.
    kernel: Kernel = attrs.field(init=False, eq=False, repr=False)

    @kernel.default
    def _limited_kernel(self) -> Kernel:
        return BatchLimitedKernel(self.inner.kernel, self.inner.call_limit)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: CallState, cast: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of this rank's shard, by the module's call flow (``cast=False``: ``out``
        left in the accumulation dtype where it merges)."""
        me, crossings = self.plan.rank, self.plan.crossings
        exchange = self._exchange(k, v, call.stats)
        exchange.start()
        call = call.derive("shard", self.rank).with_lse()
        out, lse = self.inner.forward(q, k, v, call, cast=False)
        index = {c: i for i, c in enumerate(crossings)}
        origin = self.plan.query_origin
        own = (
            (me, c, wire.piece(k, c, me, wire.kv_heads(c)), wire.piece(v, c, me, wire.kv_heads(c)))
            for c in crossings
            if c.has_queries(me)
        )
        arrived = ((src, c, kr, vr) for _, received in exchange for src, _, c, kr, vr in received)
        states: dict[Crossing, Accumulator] = {}
        for src, c, kc, vc in itertools.chain(own, arrived):
            qc = wire.queries(q, c, me, wire.q_heads(c), origin)
            if c not in states:
                states[c] = Accumulator.empty(qc.shape, qc.shape[:-1], q.dtype, q.device)
            o, s = self.kernel.forward(qc, kc, vc, self.options(index[c], src, call.seed))
            Accumulator.add(states[c].out, states[c].lse, o, s)
        for c, state in states.items():
            out_c = wire.queries(out, c, me, wire.q_heads(c), origin)
            lse_c = wire.query_lse(lse, c, me, origin)
            if self.inner.exclusive:
                out_c.copy_(state.out)
                lse_c.copy_(state.lse)
            else:
                Accumulator.add(out_c, lse_c, state.out, state.lse)
        if cast and not self.inner.exclusive:
            out = out.to(q.dtype)
        return out, lse

    def backward(
        self, inputs: BackwardInputs, call: CallState, cast: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of this rank's shard, in the input dtypes (``cast=False``: in the
        accumulation dtype, for a caller that adds more to them)."""
        me, crossings = self.plan.rank, self.plan.crossings
        dout, dlse, q, k, v, out, lse = inputs
        exchange = self._exchange(k, v, call.stats)
        exchange.start()
        acc = accumulation_dtype(q.dtype)
        call = call.derive("shard", self.rank)
        # inner.complete is False, so these are zero-started accumulators in the acc dtype.
        dq, dk, dv = self.inner.backward(inputs, call, cast=False)
        index = {c: i for i, c in enumerate(crossings)}
        origin = self.plan.query_origin

        def partial(
            c: Crossing, src: int, kc: torch.Tensor, vc: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """Crossing ``c``'s partial against ``src``'s piece ``kc``, ``vc``: its ``dq`` (the
            lse's share included where ``dlse`` flows) added into this rank's, its ``dk``, ``dv``
            returned, in the inputs' dtypes (they add into accumulators)."""
            qh, options = wire.q_heads(c), self.options(index[c], src, call.seed)
            qc, lse_c = wire.queries(q, c, me, qh, origin), wire.query_lse(lse, c, me, origin)
            dout_c, out_c = (wire.queries(x, c, me, qh, origin) for x in (dout, out))
            if dlse is None:
                gq, gk, gv = self.kernel.backward(dout_c, qc, kc, vc, out_c, lse_c, options)
            else:
                dlse_c = wire.query_lse(dlse, c, me, origin)
                gq, gk, gv = backward_with_lse(
                    self.kernel, dout_c, dlse_c, qc, kc, vc, out_c, lse_c, options
                )
            wire.queries(dq, c, me, qh, origin).add_(gq)
            return gk, gv

        for c in crossings:
            if not c.has_queries(me):
                continue  # no query here: its keys only travel (and their gradients return)
            kh = wire.kv_heads(c)
            gk, gv = partial(c, me, wire.piece(k, c, me, kh), wire.piece(v, c, me, kh))
            wire.piece(dk, c, me, kh).add_(gk)
            wire.piece(dv, c, me, kh).add_(gv)
        batch, head_dim = k.shape[0], k.shape[3]
        for step, received in exchange:
            # Gradients of the pieces received, in each sender's payload layout, to send back.
            back: dict[int, list[torch.Tensor]] = {}
            for src, i, c, kr, vr in received:
                gk, gv = partial(c, src, kr, vr)
                incoming = exchange.payload(src, me)
                if src not in back:
                    back[src] = wire.gradient_buffers(incoming, batch, head_dim, acc, k.device)
                wire.scatter_add(back[src], incoming, i, gk, gv)
            exchange.return_gradients(step, back, dk, dv)
        exchange.finish(dk, dv)
        if not cast:
            return dq, dk, dv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def options(self, crossing: int, src: int, seed: int) -> BlockOptions:
        """The options of the partial of crossing number ``crossing`` against rank ``src``'s
        piece (this rank's own, or the keys of it that ``src`` sent:
        :meth:`~ringdilated.core.plan.shards.Crossing.sent`): the call's window between this
        rank's queries and those keys, in their coordinates
        (:meth:`~ringdilated.core.plan.shards.Crossing.window`: from this rank's first query row
        of the piece, a query suffix's; shifted to the first key sent).
        ``seed``: the shard's dropout seed (``0``: none; the options are then made once per
        crossing and piece, and kept)."""
        if seed == 0:
            found = self._options.get((crossing, src))
            if found is None:
                found = self._options[crossing, src] = self._make_options(crossing, src, 0)
            return found
        seed_index = crossing * self.plan.world_size + src
        return self._make_options(crossing, src, derive_seed(seed, "crossing", seed_index))

    def _make_options(self, crossing: int, src: int, seed: int) -> BlockOptions:
        c, me, inner = self.plan.crossings[crossing], self.plan.rank, self.inner
        window = c.window(src, me, inner.window)
        if src != me:  # the keys sent start at the first some query here sees
            window = window.shifted(-c.sent(src, me, inner.window)[0])
        return BlockOptions(
            inner.scale,
            window,
            inner.dropout_p,
            seed,
            deterministic=inner.deterministic,
            softcap=inner.softcap,
        )

    def _exchange(
        self, k: torch.Tensor, v: torch.Tensor, stats: TransferStats | None
    ) -> PieceExchange:
        """The exchange of this rank's pieces of ``k``, ``v`` (its shard)."""
        return PieceExchange(
            self.plans, self.rank, self.communicator, self.group, self.inner.window, k, v, stats,
            broadcast=self.broadcast,
        )  # fmt: skip
