"""Dilated attention over a sequence sharded across ranks (SPEC.md section 3).

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
        for each step: pieces re-received (prefetched one step ahead); their dk, dv go back
        to their owners in the same step; each rank adds what comes back to its own pieces

Memory per rank is O(L / P): inner work is chunked as on one process, and at most two steps'
pieces are alive at a time. Nothing here validates inputs: :mod:`ringdilated.functional` did,
identically on every rank, before any communication.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import torch

from ringdilated.core.accumulator import Accumulator, accumulation_dtype
from ringdilated.core.communicator import Communicator, Pending, TransferStats
from ringdilated.core.driver import (
    BatchLimitedKernel,
    Run,
    lse_gradient,
    run_backward,
    run_forward,
)
from ringdilated.core.kernel import BlockOptions, Kernel, derive_seed
from ringdilated.core.shard import Crossing, Payload, ShardPlan, payload

__all__ = ["ShardedRun", "sharded_backward", "sharded_forward"]


@attrs.frozen
class ShardedRun:
    """A sharded call's fixed parts. ``inner`` is the single-process run of the inner blocks."""

    inner: Run
    plan: ShardPlan
    communicator: Communicator = attrs.field(eq=False)
    group: object = attrs.field(eq=False)
    stats: TransferStats = attrs.field(factory=TransferStats, eq=False)

    @property
    def kernel(self) -> Kernel:
        """The kernel for crossing pieces (one problem per batch row), split to the kernel's
        declared batch limit where the batch exceeds it."""
        return BatchLimitedKernel(self.inner.kernel, self.inner.batch_limit)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return sharded_forward(self, q, k, v)

    def backward(
        self,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return sharded_backward(self, dout, dlse, q, k, v, out, lse)

    def options(self, seed_index: int, own: bool) -> BlockOptions:
        """A crossing partial's options: the diagonal for a rank's own piece under causal; no
        mask for another rank's (only earlier ranks send under causal, and all their keys are
        visible)."""
        return BlockOptions(
            scale=self.inner.scale,
            causal_offset=0 if (own and self.inner.causal) else None,
            dropout_p=self.inner.dropout_p,
            dropout_seed=derive_seed(self.inner.dropout_seed, "crossing", seed_index),
        )


def _q_heads(crossing: Crossing) -> slice:
    return slice(crossing.block.heads.q_start, crossing.block.heads.q_stop)


def _kv_heads(crossing: Crossing) -> slice:
    return slice(crossing.block.heads.kv_start, crossing.block.heads.kv_stop)


def _piece(x: torch.Tensor, crossing: Crossing, rank: int, heads: slice) -> torch.Tensor:
    """``(B, heads, count, D)`` kernel-layout view of ``rank``'s piece of a local tensor."""
    piece = crossing.piece(rank)
    assert piece is not None
    return piece.selection.view(x)[:, 0, :, heads].transpose(1, 2)


def _lse_piece(lse: torch.Tensor, crossing: Crossing, rank: int) -> torch.Tensor:
    piece = crossing.piece(rank)
    assert piece is not None
    return piece.selection.view(lse, dim=2)[:, _q_heads(crossing), 0]


def _numel(payload: Payload, batch: int, head_dim: int) -> int:
    return 2 * batch * head_dim * payload.positions_count


def _pack(payload: Payload, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[k_h, v_h for each head]`` at the payload's positions, flat. ``k``, ``v``: ``(B, S, H, D)``
    local tensors, or per-head ``(B, n_h, D)`` lists when sending gradients back."""
    parts = []
    for h, pos in zip(payload.heads, payload.positions, strict=True):
        index = torch.tensor(pos, device=k.device)
        parts += [k[:, index, h].reshape(-1), v[:, index, h].reshape(-1)]
    return torch.cat(parts)


def _unpack(flat: torch.Tensor, payload: Payload, batch: int, head_dim: int) -> list[torch.Tensor]:
    """Per head ``h`` of the payload: its keys then its values, each ``(B, n_h, D)``."""
    sizes = [batch * len(pos) * head_dim for pos in payload.positions for _ in range(2)]
    shapes = [(batch, len(pos), head_dim) for pos in payload.positions for _ in range(2)]
    parts = torch.split(flat, sizes)
    return [part.view(shape) for part, shape in zip(parts, shapes, strict=True)]


def _crossing_kv(
    payload: Payload, i: int, tensors: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Crossing ``i``'s keys and values in kernel layout ``(B, heads, n, D)`` from a payload."""
    c = payload.crossings[i]
    slot = {h: j for j, h in enumerate(payload.heads)}
    ks, vs = [], []
    for j, h in enumerate(range(c.block.heads.kv_start, c.block.heads.kv_stop)):
        index = torch.tensor(payload.index[i][j], device=tensors[0].device)
        ks.append(tensors[2 * slot[h]][:, index])
        vs.append(tensors[2 * slot[h] + 1][:, index])
    return torch.stack(ks, 1), torch.stack(vs, 1)


@attrs.define
class _Step:
    peers: tuple[int, ...]
    pending: Pending
    recvs: dict[int, torch.Tensor]


class _PieceExchange:
    """Streams other ranks' pieces step by step, the next step always in flight (double buffer)."""

    def __init__(self, run: ShardedRun, k: torch.Tensor, v: torch.Tensor) -> None:
        self.run, self.k, self.v = run, k, v
        self.batch, self.head_dim = k.shape[0], k.shape[3]
        plan = run.plan
        self.steps = run.communicator.schedule(plan.rank, plan.world_size)
        self.causal = run.inner.causal
        self._next: _Step | None = None

    def payload(self, src: int, dst: int) -> Payload:
        return payload(self.run.plan, src, dst, self.causal)

    def _start(self, index: int) -> _Step:
        me = self.run.plan.rank
        peers = self.steps[index]
        sends, recvs = {}, {}
        for peer in peers:
            outgoing = self.payload(me, peer)
            if outgoing:
                sends[peer] = _pack(outgoing, self.k, self.v)
            incoming = self.payload(peer, me)
            if incoming:
                numel = _numel(incoming, self.batch, self.head_dim)
                recvs[peer] = torch.empty(numel, dtype=self.k.dtype, device=self.k.device)
        contents = {(p.heads, p.positions) for p in (self.payload(me, x) for x in sends)}
        self.run.stats.record(sends, recvs)
        pending = self.run.communicator.exchange(
            self.run.group, sends, recvs, uniform=len(contents) == 1
        )
        return _Step(peers, pending, recvs)

    def start(self) -> None:
        """Put the first step in flight (call before local work, to overlap it)."""
        if self.steps and self._next is None:
            self._next = self._start(0)

    def __iter__(
        self,
    ) -> Iterator[tuple[int, list[tuple[int, int, Crossing, torch.Tensor, torch.Tensor]]]]:
        """Yield ``(step, [(src, i, crossing, k, v), ...])``: crossing ``i`` of the payload from
        ``src``, ``k`` and ``v`` in kernel layout."""
        self.start()
        me = self.run.plan.rank
        for index in range(len(self.steps)):
            current = self._next
            assert current is not None
            self._next = self._start(index + 1) if index + 1 < len(self.steps) else None
            current.pending.wait()
            received = []
            for src, flat in current.recvs.items():
                incoming = self.payload(src, me)
                tensors = _unpack(flat, incoming, self.batch, self.head_dim)
                for i, c in enumerate(incoming.crossings):
                    k, v = _crossing_kv(incoming, i, tensors)
                    received.append((src, i, c, k, v))
            yield index, received


def _seed_index(run: ShardedRun, crossing_index: int, src: int) -> int:
    return crossing_index * run.plan.world_size + src


def sharded_forward(
    run: ShardedRun, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    me = run.plan.rank
    exchange = _PieceExchange(run, k, v)
    exchange.start()
    out, lse = run_forward(run.inner, q, k, v, keep_state=True)
    index = {c: i for i, c in enumerate(run.plan.crossings)}
    states: dict[Crossing, Accumulator] = {}
    for c in run.plan.crossings:
        qc = _piece(q, c, me, _q_heads(c))
        states[c] = Accumulator(
            torch.empty(qc.shape, dtype=lse.dtype, device=q.device),
            torch.empty(qc.shape[:-1], dtype=lse.dtype, device=q.device),
        )
        o, s = run.kernel.forward(
            qc,
            _piece(k, c, me, _kv_heads(c)),
            _piece(v, c, me, _kv_heads(c)),
            run.options(_seed_index(run, index[c], me), own=True),
        )
        Accumulator.add(states[c].out, states[c].lse, o, s)
    for _, received in exchange:
        for src, _, c, kr, vr in received:
            o, s = run.kernel.forward(
                _piece(q, c, me, _q_heads(c)),
                kr,
                vr,
                run.options(_seed_index(run, index[c], src), own=False),
            )
            Accumulator.add(states[c].out, states[c].lse, o, s)
    for c, state in states.items():
        if run.inner.exclusive:
            _piece(out, c, me, _q_heads(c)).copy_(state.out)
            _lse_piece(lse, c, me).copy_(state.lse)
        else:
            Accumulator.add(
                _piece(out, c, me, _q_heads(c)), _lse_piece(lse, c, me), state.out, state.lse
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    me, plan = run.plan.rank, run.plan
    exchange = _PieceExchange(run, k, v)
    exchange.start()
    acc = accumulation_dtype(q.dtype)
    # run.inner.complete is False, so these are zero-started accumulators in the acc dtype.
    dq, dk, dv = run_backward(run.inner, dout, dlse, q, k, v, out, lse, cast=False)
    index = {c: i for i, c in enumerate(plan.crossings)}

    def views(
        c: Crossing,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        qh = _q_heads(c)
        return (
            _piece(dout, c, me, qh),
            None if dlse is None else _lse_piece(dlse, c, me),
            _piece(q, c, me, qh),
            _piece(out, c, me, qh),
            _lse_piece(lse, c, me),
        )

    for c in plan.crossings:
        do, dl, qc, oc, lc = views(c)
        kh = _kv_heads(c)
        gq, gk, gv = _partial_backward(
            run,
            run.options(_seed_index(run, index[c], me), own=True),
            do,
            dl,
            qc,
            _piece(k, c, me, kh),
            _piece(v, c, me, kh),
            oc,
            lc,
        )
        _piece(dq, c, me, _q_heads(c)).add_(gq)
        _piece(dk, c, me, kh).add_(gk)
        _piece(dv, c, me, kh).add_(gv)
    batch, head_dim = k.shape[0], k.shape[3]
    for step, received in exchange:
        # Gradients of the pieces received, in each sender's payload layout, to send back.
        back: dict[int, list[torch.Tensor]] = {}
        for src, i, c, kr, vr in received:
            do, dl, qc, oc, lc = views(c)
            gq, gk, gv = _partial_backward(
                run,
                run.options(_seed_index(run, index[c], src), own=False),
                do,
                dl,
                qc,
                kr,
                vr,
                oc,
                lc,
            )
            _piece(dq, c, me, _q_heads(c)).add_(gq)
            incoming = exchange.payload(src, me)
            if src not in back:
                back[src] = [
                    torch.zeros(batch, len(pos), head_dim, dtype=acc, device=k.device)
                    for pos in incoming.positions
                    for _ in range(2)
                ]
            slot = {h: j for j, h in enumerate(incoming.heads)}
            for j, h in enumerate(range(c.block.heads.kv_start, c.block.heads.kv_stop)):
                where = torch.tensor(incoming.index[i][j], device=k.device)
                back[src][2 * slot[h]].index_add_(1, where, gk[:, j].to(acc))
                back[src][2 * slot[h] + 1].index_add_(1, where, gv[:, j].to(acc))
        sends = {
            src: torch.cat([g.to(k.dtype).reshape(-1) for g in grads])
            for src, grads in back.items()
        }
        recvs = {}
        for peer in exchange.steps[step]:
            mine = exchange.payload(me, peer)
            if mine:
                recvs[peer] = torch.empty(
                    _numel(mine, batch, head_dim), dtype=k.dtype, device=k.device
                )
        run.stats.record(sends, recvs)
        run.communicator.exchange(run.group, sends, recvs).wait()
        for peer, flat in recvs.items():
            mine = exchange.payload(me, peer)
            returned = _unpack(flat, mine, batch, head_dim)
            for j, (h, pos) in enumerate(zip(mine.heads, mine.positions, strict=True)):
                where = torch.tensor(pos, device=k.device)
                dk[:, :, h].index_add_(1, where, returned[2 * j].to(acc))
                dv[:, :, h].index_add_(1, where, returned[2 * j + 1].to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
