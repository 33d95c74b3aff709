"""Tasks for the hot-path tests, run on every rank of a gloo pool (``Workers``): a planned
layer call on a ``SequenceLayout``, counted by ``HotPathCounter``, checked against the oracle."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["counted_layer_calls"]


def _process_layout(kind: str) -> object:
    if kind == "grid":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
        return (mesh, ("ring", "ulysses"))
    return dist.group.WORLD


def counted_layer_calls(payload: dict[str, Any]) -> dict[str, Any]:
    """Build a layout (``payload['layout']``: ``"equal"``, ``"uneven"``, ``"documents"`` or
    ``"padding"``), make one call with ``payload['communicator']`` to plan it, then count a
    second and a third call (forward and backward) with new inputs (``payload['sinks']``: with
    attention sinks, new values each call, their gradient returned too). Returns the counts,
    this rank's outputs and gradients of the third call, and everything the oracle needs."""
    import ringdilated
    from ringdilated.testing.hot_path import HotPathCounter

    rank = dist.get_rank()
    lengths = payload["lengths"]
    total = sum(lengths)
    start = sum(lengths[:rank])
    shard = slice(start, start + lengths[rank])
    # Pinned: the counts are of the steady state, whatever RINGDILATED_AGREE_EVERY_CALL says.
    layout_kw: dict[str, Any] = {
        "process_group": _process_layout(payload["process"]),
        "agree_every_call": False,
    }
    if payload["layout"] != "equal":
        layout_kw["shard_length"] = lengths[rank]
    if payload["layout"] == "documents":
        layout_kw["cu_seqlens"] = torch.tensor(payload["cu_seqlens"])
    if payload["layout"] == "padding":
        layout_kw["key_padding_mask"] = torch.tensor(payload["padding"])
    layout = ringdilated.SequenceLayout(**layout_kw)
    batch = len(payload["padding"]) if payload["layout"] == "padding" else 2
    heads, kv_heads, dim = 4, 2, 8
    kw = {
        "mode": payload["mode"],
        "causal": payload["causal"],
        "window": payload.get("window"),
        "communicator": payload["communicator"],
        "layout": layout,
        "return_lse": payload["return_lse"],
    }

    def call(seed: int) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(seed)
        full = [
            torch.randn(batch, total, h, dim, generator=g, dtype=torch.float64)
            for h in (heads, kv_heads, kv_heads)
        ]
        dout = torch.randn(batch, total, heads, dim, generator=g, dtype=torch.float64)
        dlse = torch.randn(batch, heads, total, generator=g, dtype=torch.float64)
        q, k, v = (x[:, shard].clone().requires_grad_() for x in full)
        sinks = None
        if payload.get("sinks"):
            sinks = torch.randn(heads, generator=g, dtype=torch.float64).requires_grad_()
        result = ringdilated.dilated_attention(
            q, k, v, payload["segments"], payload["rates"], sinks=sinks, **kw
        )
        out, lse = result if payload["return_lse"] else (result, None)
        loss = (out * dout[:, shard]).sum()
        if lse is not None:
            loss = loss + (lse.double() * dlse[:, :, shard]).sum()
        loss.backward()
        return out.detach(), (q.grad, k.grad, v.grad), sinks, full, dout, dlse

    call(0)  # plans the call (and agrees on it)
    with HotPathCounter() as counts:
        call(1)
    second = (counts.host_reads, counts.host_copies, counts.control_collectives, counts.events)
    stats = ringdilated.TransferStats()
    kw["transfer_stats"] = stats
    call(2)  # a new plan key (transfer_stats is not a key; it is per call), still planned
    with HotPathCounter() as counts:
        out, grads, sinks, full, dout, dlse = call(3)
    return {
        "second": second,
        "third": (counts.host_reads, counts.host_copies, counts.control_collectives),
        "exchanges": counts.exchanges,
        "events": counts.events,
        "out": out,
        "grads": list(grads),
        "sinks": None if sinks is None else sinks.detach(),
        "dsinks": None if sinks is None else sinks.grad,
        "full": full,
        "dout": dout,
        "dlse": dlse,
        "shard": (shard.start, shard.stop),
    }
