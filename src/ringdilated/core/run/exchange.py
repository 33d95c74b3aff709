"""The exchanger of a sharded call: one object moves, step by step, the pieces a rank's queries
need (forward and backward alike) and, in backward, the gradients of received pieces back to
their owners.

Call flow on every rank (the same steps in the same order)::

    exchange = PieceExchange(plans, rank, communicator, group, window, k, v, stats,
                             broadcast=spec_says_broadcast)
    exchange.start()                              # step 1 in flight before any local work
    for step, received in exchange:               # step t+1 already in flight while t computes
        ... compute with received pieces ...
        exchange.return_gradients(step, grads, dk, dv)  # backward: send them back (async)
    exchange.finish(dk, dv)                       # backward: wait, add what came back

At most two steps of pieces and one step of returned gradients are alive at a time, so memory per
rank stays O(L / P) with a pairwise communicator. A broadcast one (its spec's
``delivery="broadcast"``, see :mod:`ringdilated.core.contract.communicator`; the caller passes
``broadcast=True``) receives every peer of a step at once: each rank's broadcast payload, padded
to the group's largest, from which a receiver extracts its own. The bytes of every exchange are
added to the call's ``TransferStats`` when it has one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs
import torch

from ringdilated.core.contract.communicator import Pending, TransferStats
from ringdilated.core.plan.shards import Crossing, Payload, broadcast_payload, payload
from ringdilated.core.run import wire as wire

if TYPE_CHECKING:
    from ringdilated.core.contract.communicator import Communicator
    from ringdilated.core.plan.shards import ShardPlan
    from ringdilated.core.plan.window import KeyWindow

__all__ = ["PieceExchange", "Received"]

Received = tuple[int, int, Crossing, torch.Tensor, torch.Tensor]
"""``(src, i, crossing, k, v)``: crossing ``i`` of the payload from ``src``, kernel layout."""


class _Done:
    """The pending exchange of a step with nothing to move."""

    def wait(self) -> None:
        return None


@attrs.define
class _InFlight:
    """One exchange started: a step's pieces, or the gradients sent back at one step; the
    receives to wait for."""

    pending: Pending
    recvs: dict[int, torch.Tensor]


class PieceExchange:
    """Streams other ranks' pieces step by step, the next step always in flight (double buffer),
    and returns the gradients of received pieces, overlapped with the next step's compute."""

    def __init__(
        self,
        plans: tuple[ShardPlan, ...],
        rank: int,
        communicator: Communicator,
        group: object,
        window: KeyWindow,
        k: torch.Tensor,
        v: torch.Tensor,
        stats: TransferStats | None,
        *,
        broadcast: bool,
    ) -> None:
        """``plans``: every rank's shard plan; ``rank``: this rank's index in them; the pieces
        move through ``communicator`` on ``group`` by ``window``'s send rule; ``k``, ``v``: this
        rank's shard (kernel layout); ``stats`` counts the bytes moved (``None``: not counted);
        ``broadcast``: its delivery is broadcast (else pairwise)."""
        self.plans, self.rank, self.communicator, self.group = plans, rank, communicator, group
        self.plan = plans[rank]
        self.k, self.v, self.stats = k, v, stats
        self.batch, self.head_dim = k.shape[0], k.shape[3]
        self.steps = communicator.schedule(rank, len(plans))
        self.window, self.broadcast = window, broadcast
        self._next: _InFlight | None = None
        self._returning: _InFlight | None = None

    def payload(self, src: int, dst: int) -> Payload:
        return payload(self.plan, src, dst, self.window)

    def _exchange(
        self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], uniform: bool
    ) -> Pending:
        if self.stats is not None:
            self.stats.record(sends, recvs)
        return self.communicator.exchange(self.group, sends, recvs, uniform=uniform)

    def _numel(self, payload: Payload) -> int:
        """Elements of ``payload``'s flat tensor (its keys and values, or their gradients)."""
        return wire.numel(payload, self.batch, self.head_dim)

    def _broadcast(self, src: int) -> Payload:
        return broadcast_payload(self.plans[src], self.window)

    def _start_broadcast(self, peers: tuple[int, ...]) -> _InFlight:
        """Send this rank's broadcast payload to every peer; receive theirs. All are padded to
        the group's largest, so a collective of equal sizes can move them."""
        sizes = [self._numel(self._broadcast(r)) for r in range(len(self.plans))]
        width = max(sizes)
        if width == 0:
            return _InFlight(_Done(), {})
        mine = self._broadcast(self.rank)
        padding = self.k.new_zeros(width - sizes[self.rank])
        flat = torch.cat([wire.pack(mine, self.k, self.v), padding]) if mine else padding
        sends = dict.fromkeys(peers, flat)
        recvs = {p: self.k.new_empty(width) for p in peers}
        return _InFlight(self._exchange(sends, recvs, uniform=True), recvs)

    def _start(self, index: int) -> _InFlight:
        me = self.rank
        peers = self.steps[index]
        if self.broadcast:
            return self._start_broadcast(peers)
        outgoing = {peer: self.payload(me, peer) for peer in peers}
        incoming = {peer: self.payload(peer, me) for peer in peers}
        sends = {peer: wire.pack(p, self.k, self.v) for peer, p in outgoing.items() if p}
        recvs = {peer: self.k.new_empty(self._numel(p)) for peer, p in incoming.items() if p}
        contents = {(outgoing[x].heads, outgoing[x].positions) for x in sends}
        return _InFlight(self._exchange(sends, recvs, uniform=len(contents) == 1), recvs)

    def start(self) -> None:
        """Put the first step in flight (call before local work, to overlap it)."""
        if self.steps and self._next is None:
            self._next = self._start(0)

    def __iter__(self) -> Iterator[tuple[int, list[Received]]]:
        """Yield ``(step, received)`` for every step of the schedule."""
        self.start()
        for index in range(len(self.steps)):
            current = self._next
            assert current is not None
            self._next = self._start(index + 1) if index + 1 < len(self.steps) else None
            current.pending.wait()
            received = []
            for src, flat in current.recvs.items():
                incoming = self.payload(src, self.rank)
                if self.broadcast:
                    if not incoming:
                        continue  # a piece for other peers
                    flat = wire.extract(
                        flat, self._broadcast(src), incoming, self.batch, self.head_dim
                    )
                tensors = wire.unpack(flat, incoming, self.batch, self.head_dim)
                for i, c in enumerate(incoming.crossings):
                    k, v = wire.crossing_kv(incoming, i, tensors)
                    received.append((src, i, c, k, v))
            yield index, received

    def return_gradients(
        self, step: int, grads: dict[int, list[torch.Tensor]], dk: torch.Tensor, dv: torch.Tensor
    ) -> None:
        """Start sending ``grads[src]`` (the gradient buffers of ``src``'s payload) back, and
        receiving the gradients of this rank's own pieces from ``step``'s peers. The previous
        step's return is completed first (added into ``dk``, ``dv``), so one is in flight."""
        self._complete(dk, dv)
        sends = {
            src: torch.cat([g.to(self.k.dtype).reshape(-1) for g in buffers])
            for src, buffers in grads.items()
        }
        mine = {peer: self.payload(self.rank, peer) for peer in self.steps[step]}
        recvs = {peer: self.k.new_empty(self._numel(p)) for peer, p in mine.items() if p}
        self._returning = _InFlight(self._exchange(sends, recvs, uniform=False), recvs)

    def _complete(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        if self._returning is None:
            return
        returning, self._returning = self._returning, None
        returning.pending.wait()
        for peer, flat in returning.recvs.items():
            mine = self.payload(self.rank, peer)
            returned = wire.unpack(flat, mine, self.batch, self.head_dim)
            wire.scatter_add_returned(dk, dv, mine, returned)

    def finish(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Wait for the last returned gradients and add them into ``dk``, ``dv``."""
        self._complete(dk, dv)
