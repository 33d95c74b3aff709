"""Dilated attention by head parallelism (``ulysses``): the run (docs/spec.md, section 3).

Rank ``r`` holds a sequence shard ``[S_r, S_r + n_r)`` of every head, as in every sharded call.
One exchange with every peer turns the shards into heads: each rank receives every position of
its share of the query heads, and of the key/value heads they read
(:func:`~ringdilated.core.plan.heads.deal_heads`), attends them over the whole sequence exactly as
one process would (the single-process :class:`~ringdilated.core.run.local.LocalRun` on the share's
blocks, with no crossing segments at all), and a second exchange returns each rank's positions of
``out`` and ``lse``. Backward exchanges ``q``, ``k``, ``v``, ``out``, ``lse``, ``dout`` and ``dlse``
the same way, runs the single-process backward, and returns ``dq``, ``dk`` and ``dv``; a key/value
head shared by several ranks (fewer key/value heads than ranks) gets the sum of their
gradients, added in the accumulation dtype.

Each exchange sends every peer one flat tensor, through the communicator's ``exchange`` (all
peers in one step; ``ulysses`` runs one ``all_to_all_single``). ``out`` and ``lse`` travel as
bytes, each in its own dtype. Memory per rank is that of one process attending its heads:
``O(L * H / P)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs
import torch

from ringdilated.core.contract.communicator import Communicator, TransferStats
from ringdilated.core.plan.heads import HeadShare
from ringdilated.core.run.local import BackwardInputs, CallState, Executor

__all__ = ["HeadParallelRun"]


@attrs.frozen
class HeadParallelRun:
    """A head-parallel call's fixed parts: ``inner``, an
    :class:`~ringdilated.core.run.local.Executor`, attends this rank's share of the heads over the
    whole sequence (a :class:`~ringdilated.core.run.local.LocalRun`), or over the chunk of the
    group's shards, with pieces from other chunks (a
    :class:`~ringdilated.core.run.sharded.ShardedRun` across a grid's outer group: ``hybrid``);
    ``shares`` every rank's heads; ``starts`` where each rank's shard begins in the (whole or chunk)
    sequence, then its length. Built once per plan (its index tensors once per device). A call's
    dropout seed is its part ``("heads", rank)``: local head 0 of every rank is another head."""

    inner: Executor
    shares: tuple[HeadShare, ...]
    starts: tuple[int, ...]
    rank: int
    communicator: Communicator = attrs.field(eq=False)
    group: object = attrs.field(eq=False)
    _indices: dict[tuple[int, str, torch.device], torch.Tensor] = attrs.field(
        factory=dict, eq=False, repr=False, init=False
    )

    @property
    def share(self) -> HeadShare:
        return self.shares[self.rank]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: CallState, cast: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qh, kh, vh = self._to_heads([(q, "q"), (k, "kv"), (v, "kv")], call.stats)
        inner_call = call.derive("heads", self.rank).with_lse()
        out_h, lse_h = self.inner.forward(qh, kh, vh, inner_call, cast)
        out, lse = self._to_sequence([(out_h, "q", 1), (lse_h, "q", 2)], q.shape[2], call.stats)
        return out, lse

    def backward(
        self, inputs: BackwardInputs, call: CallState, cast: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # lse and dlse as (B, n, H): the sequence in dimension 1, as for q. Whether dlse travels
        # is the agreed call's (call.lse_used), never this rank's: every rank must send the same
        # parts. A dlse of None (this rank's loss does not use lse) then travels as zeros, and the
        # lse term runs (exact for zeros too: reading the host to skip it would stall the GPU).
        dout, dlse, q, k, v, out, lse = inputs
        parts = [(q, "q"), (k, "kv"), (v, "kv"), (out, "q"), (lse.transpose(1, 2), "q")]
        parts.append((dout, "q"))
        if call.lse_used:
            moved = torch.zeros_like(lse) if dlse is None else dlse
            parts.append((moved.transpose(1, 2), "q"))
        received = self._to_heads(parts, call.stats)
        qh, kh, vh, out_h, lse_h, dout_h = received[:6]
        dlse_h = received[6].transpose(1, 2) if call.lse_used else None
        held = BackwardInputs(dout_h, dlse_h, qh, kh, vh, out_h, lse_h.transpose(1, 2))
        dq_h, dk_h, dv_h = self.inner.backward(held, call.derive("heads", self.rank), cast=False)
        dq = self._to_sequence([(dq_h.to(q.dtype), "q", 1)], q.shape[2], call.stats)[0]
        if not self.shared_kv:
            dk_h, dv_h = dk_h.to(k.dtype), dv_h.to(v.dtype)
        # A key/value head held by several ranks gets the sum of their gradients, added in the
        # accumulation dtype and cast once.
        dk, dv = self._to_sequence(
            [(dk_h, "kv", 1), (dv_h, "kv", 1)], k.shape[2], call.stats, summed=self.shared_kv
        )
        return (dq, dk.to(k.dtype), dv.to(v.dtype)) if cast else (dq, dk, dv)

    def _index(self, rank: int, kind: str, device: torch.device) -> torch.Tensor:
        """The heads ``rank`` holds of ``kind`` (``"q"`` or ``"kv"``) as an index tensor on
        ``device``: made once, reused by every call."""
        key = (rank, kind, device)
        index = self._indices.get(key)
        if index is None:
            index = self._indices[key] = torch.tensor(self._heads(rank, kind), device=device)
        return index

    @property
    def shared_kv(self) -> bool:
        """Whether some key/value head is held by more than one rank."""
        held = [h for share in self.shares for h in share.kv_heads]
        return len(held) != len(set(held))

    def _heads(self, rank: int, kind: str) -> tuple[int, ...]:
        share = self.shares[rank]
        return share.q_heads if kind == "q" else share.kv_heads

    def _swap(
        self,
        send: Callable[[int], list[torch.Tensor]],
        layout: Callable[[int], list[tuple[tuple[int, ...], torch.dtype]]],
        device: torch.device,
        stats: TransferStats | None,
    ) -> list[list[torch.Tensor]]:
        """Every rank's tensors for this one, in rank order: its own ``send(rank)``, and from each
        peer tensors of ``layout(peer)``'s shapes and dtypes, for ``send(peer)`` sent to it: one
        exchange of bytes, every tensor in its own dtype. Within a buffer the tensors go widest
        dtype first, so each starts at a multiple of its item size (a float32 after an odd number
        of float16 values could not be viewed); both ends order alike."""

        def widest_first(dtypes: Sequence[torch.dtype]) -> list[int]:
            return sorted(range(len(dtypes)), key=lambda j: (-dtypes[j].itemsize, j))

        def as_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
            order = widest_first([t.dtype for t in tensors])
            return torch.cat([tensors[j].contiguous().view(-1).view(torch.uint8) for j in order])

        me, world = self.rank, len(self.shares)
        flat = {y: as_bytes(send(y)) for y in range(world) if y != me}
        layouts = {src: layout(src) for src in flat}
        orders = {src: widest_first([d for _, d in shapes]) for src, shapes in layouts.items()}
        sizes = {
            src: [math.prod(shapes[j][0]) * shapes[j][1].itemsize for j in orders[src]]
            for src, shapes in layouts.items()
        }
        recvs = {
            src: torch.empty(sum(n), dtype=torch.uint8, device=device) for src, n in sizes.items()
        }
        if stats is not None:
            stats.record(flat, recvs)
        self.communicator.exchange(self.group, flat, recvs, uniform=False).wait()
        received = {me: send(me)}
        for src, shapes in layouts.items():
            raws = dict(zip(orders[src], torch.split(recvs[src], sizes[src]), strict=True))
            received[src] = [
                raws[j].view(dtype).view(shape) for j, (shape, dtype) in enumerate(shapes)
            ]
        return [received[y] for y in range(world)]

    def _to_heads(
        self, parts: Sequence[tuple[torch.Tensor, str]], stats: TransferStats | None
    ) -> list[torch.Tensor]:
        """Sequence shards ``(B, n_r, heads, ...)`` to this rank's heads at every position
        ``(B, L, share, ...)``: one exchange for every part."""
        device = parts[0][0].device

        def pieces(rank: int) -> list[torch.Tensor]:
            return [x.index_select(2, self._index(rank, kind, device)) for x, kind in parts]

        def layout(src: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
            n = self.starts[src + 1] - self.starts[src]
            return [
                ((x.shape[0], n, len(self._heads(self.rank, kind)), *x.shape[3:]), x.dtype)
                for x, kind in parts
            ]

        received = self._swap(pieces, layout, device, stats)
        return [torch.cat(column, 1) for column in zip(*received, strict=True)]

    def _to_sequence(
        self,
        parts: Sequence[tuple[torch.Tensor, str, int]],
        num_heads: int,
        stats: TransferStats | None,
        summed: bool = False,
    ) -> list[torch.Tensor]:
        """This rank's heads at every position back to sequence shards of every head: each part
        is ``(tensor, kind, dim)`` with the sequence in ``dim`` (1, or 2 for an lse) and its
        heads in the other of dims 1 and 2. ``summed``: a head held by several ranks gets the sum
        of theirs (else each head is held by one rank)."""
        device, starts = parts[0][0].device, self.starts
        n = starts[self.rank + 1] - starts[self.rank]

        def windows(rank: int) -> list[torch.Tensor]:
            return [
                x.narrow(dim, starts[rank], starts[rank + 1] - starts[rank]) for x, _, dim in parts
            ]

        def shape(x: torch.Tensor, dim: int, heads: int) -> tuple[int, ...]:
            size = list(x.shape)
            size[dim], size[3 - dim] = n, heads
            return tuple(size)

        def layout(src: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
            return [(shape(x, dim, len(self._heads(src, kind))), x.dtype) for x, kind, dim in parts]

        received = self._swap(windows, layout, device, stats)
        results = []
        for i, (x, kind, dim) in enumerate(parts):
            fill = torch.zeros if summed else torch.empty
            result = fill(shape(x, dim, num_heads), dtype=x.dtype, device=device)
            for src, tensors in enumerate(received):
                index = self._index(src, kind, device)
                if summed:
                    result.index_add_(3 - dim, index, tensors[i])
                else:
                    result.index_copy_(3 - dim, index, tensors[i])
            results.append(result)
        return results
