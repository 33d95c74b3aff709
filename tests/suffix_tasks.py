"""Tasks for tests/test_sharded_suffix.py, run on every rank of a gloo pool
(``workers.results("tests.suffix_tasks:<name>", payload)``): a query suffix on a process group
(docs/spec.md, sections 1 and 3)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from ringdilated.testing.communicators import case_inputs, case_layout, case_sinks, shard_slice


def query_rows(case: dict[str, Any], rank: int, world: int) -> slice:
    """Rank ``rank``'s query positions: the suffix of ``case['query_length']`` positions of the
    whole sequence within its shard (global positions)."""
    shard = shard_slice(case, rank, world)
    first = max(shard.start, case["seq_len"] - case["query_length"])
    return slice(min(first, shard.stop), shard.stop)


def _keywords(case: dict[str, Any], documents: bool = True) -> dict[str, Any]:
    """The call's keywords; its documents or padding too unless a layout holds them."""
    return {
        "segment_lengths": case["segments"],
        "dilation_rates": case["rates"],
        "mode": case["mode"],
        "causal": case["causal"],
        "window": case.get("window"),
        "scale": case["scale"],
        "softcap": case.get("softcap"),
        **(case_layout(case) if documents else {}),
    }


def _process_layout(name: str, world: int) -> object:
    if name != "hybrid":
        return dist.group.WORLD
    from ringdilated.testing.communicators import _layout

    return _layout(name, world)


def suffix_run(case: dict[str, Any]) -> dict[str, Any]:
    """This rank's shard of ``case_inputs(case)``: its keys and values, and as ``q`` the
    suffix positions in its shard (``case['q_lengths']`` overrides how many, to build invalid
    splits); out, lse, gradients and bytes, or ``{"error": (type, message)}``."""
    import ringdilated
    from ringdilated.core.support.errors import PaddingMaskWarning

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout, dlse = case_inputs(case)
    shard, rows = shard_slice(case, rank, world), query_rows(case, rank, world)
    if case.get("q_lengths") is not None:
        n = case["q_lengths"][rank]
        rows = slice(shard.stop - n, shard.stop)
    q = q[:, rows].clone().requires_grad_()
    k, v = (x[:, shard].clone().requires_grad_() for x in (k, v))
    sinks = case_sinks(case)
    stats = ringdilated.TransferStats()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PaddingMaskWarning)
            out, lse = ringdilated.dilated_attention(
                q, k, v, **_keywords(case), return_lse=True, sinks=sinks, transfer_stats=stats,
                process_group=_process_layout(case["communicator"], world),
                communicator=case["communicator"], kernel=case.get("kernel", "auto"),
            )  # fmt: skip
    except ValueError as exc:
        return {"error": (type(exc).__name__, str(exc))}
    forward_sent, forward_received = stats.bytes_sent, stats.bytes_received
    loss = (out.double() * dout[:, rows].double()).sum()
    loss = loss + (lse.masked_fill(torch.isneginf(lse), 0).double() * dlse[:, :, rows]).sum()
    loss.backward()
    return {
        "out": out.detach(),
        "lse": lse.detach(),
        "dq": q.grad,
        "dk": k.grad,
        "dv": v.grad,
        "dsinks": None if sinks is None else sinks.grad,
        "forward_bytes_sent": forward_sent,
        "forward_bytes_received": forward_received,
        "total_bytes_sent": stats.bytes_sent,
    }


def _call(
    case: dict[str, Any], query_length: int, layout: object, kernel: str = "reference"
) -> torch.Tensor:
    """This rank's out for the suffix of ``query_length`` (no gradients), on ``layout``."""
    import ringdilated

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, _, _ = case_inputs(case)
    shard = shard_slice(case, rank, world)
    rows = query_rows({**case, "query_length": query_length}, rank, world)
    keywords = _keywords(case, documents=layout is None)
    return ringdilated.dilated_attention(
        q[:, rows], k[:, shard], v[:, shard], **keywords, kernel=kernel,
        process_group=dist.group.WORLD if layout is None else None, layout=layout,
    )  # fmt: skip


def changing_suffix(payload: dict[str, Any]) -> dict[str, Any]:
    """Two calls of one signature whose global suffix differs (``payload['lengths']``) while
    rank 0's own shapes do not (it holds no query in either): without a layout, both calls are
    planned and agreed anew; on one :class:`~ringdilated.SequenceLayout`, its first call binds
    the split, and the second raises at once on the ranks whose ``q`` differs (rank 0, whose
    ``q`` does not, is not called a second time: it would wait on its peers in the exchange of
    the plan its layout holds, until the backend's timeout)."""
    import ringdilated

    case, (first, second) = payload["case"], payload["lengths"]
    results: dict[str, Any] = {"plain": [_call(case, n, None) for n in (first, second)]}
    layout = ringdilated.SequenceLayout(process_group=dist.group.WORLD)
    results["layout_first"] = _call(case, first, layout)
    rows = query_rows({**case, "query_length": second}, dist.get_rank(), dist.get_world_size())
    same = rows.stop - rows.start == results["layout_first"].shape[1]
    if same:
        results["layout_second"] = "not called"
    else:
        try:
            _call(case, second, layout)
            results["layout_second"] = "no error"
        except ValueError as exc:
            results["layout_second"] = str(exc)
    # A call of another signature on the layout plans anew: every rank raises in its agreement.
    try:
        _call(case, second, layout, kernel="auto")
        results["layout_other"] = "no error"
    except ValueError as exc:
        results["layout_other"] = str(exc)
    return results


def compiled_suffix(case: dict[str, Any]) -> dict[str, Any]:
    """``DilatedAttention`` on the world group compiled with ``fullgraph=True`` (the custom op
    path), called with this rank's share of the suffix: its out and gradients (no lse)."""
    import ringdilated

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout, _ = case_inputs(case)
    shard, rows = shard_slice(case, rank, world), query_rows(case, rank, world)
    q = q[:, rows].clone().requires_grad_()
    k, v = (x[:, shard].clone().requires_grad_() for x in (k, v))
    attn = ringdilated.DilatedAttention(
        case["segments"], case["rates"], causal=case["causal"], process_group=dist.group.WORLD,
        communicator=case["communicator"], kernel="reference",
    )  # fmt: skip
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    dq, dk, dv = torch.autograd.grad((out * dout[:, rows]).sum(), (q, k, v))
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def suffix_on_a_layout(case: dict[str, Any]) -> dict[str, Any]:
    """Two calls on one :class:`~ringdilated.SequenceLayout` given every rank's shard length
    (``case['shard_lengths']``) and the case's documents: the first plans (and agrees on the
    split), the second runs the plan the layout keeps, counted (``HotPathCounter``: host
    reads, host copies, control collectives). This rank's out of each, and the counts."""
    import ringdilated
    from ringdilated.testing.hot_path import HotPathCounter

    rank = dist.get_rank()
    layout = ringdilated.SequenceLayout(
        process_group=dist.group.WORLD, shard_length=case["shard_lengths"][rank],
        agree_every_call=False, **case_layout(case),
    )  # fmt: skip
    first = _call(case, case["query_length"], layout)
    with HotPathCounter() as counts:
        second = _call(case, case["query_length"], layout)
    assert layout.query_lengths is not None
    return {
        "outs": [first, second],
        "counts": (counts.host_reads, counts.host_copies, counts.control_collectives),
        "events": counts.events,
    }
