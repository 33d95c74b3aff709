"""Tasks for the distributed tests, run on every rank of a
:class:`ringdilated.pool.Workers` pool (``Workers(n, tasks=__name__)``)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ringdilated.core import FULL
from ringdilated.pool import Workers
from ringdilated.testing.communicators import case_inputs as full_inputs
from ringdilated.testing.communicators import sharded_run as sharded_case

__all__ = ["TASKS", "Workers", "full_inputs", "sharded_case"]

TASKS = __name__


def bad_input_on_one_rank(payload: dict[str, Any]) -> str:
    """Rank ``payload['bad_rank']`` passes a mismatched head dim; every rank must raise."""
    import ringdilated

    rank = dist.get_rank()
    d = 4 if rank == payload["bad_rank"] else 8
    q = torch.randn(1, 8, 2, 8)
    k = torch.randn(1, 8, 2, d)
    try:
        ringdilated.dilated_attention(q, k, k, [8], [1], process_group=dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return "no error"


def mismatched_config(payload: dict[str, Any]) -> str:
    """Ranks disagree on ``causal``; every rank must raise naming the field."""
    import ringdilated

    q = torch.randn(1, 8, 2, 8)
    try:
        ringdilated.dilated_attention(
            q, q, q, [8], [1], causal=dist.get_rank() == 1, process_group=dist.group.WORLD
        )
    except ValueError as exc:
        return str(exc)
    return "no error"


def mismatched_features(payload: dict[str, Any]) -> str:
    """Rank 1 alone passes a logit cap and attention sinks; every rank must raise naming
    both fields."""
    import ringdilated

    q = torch.randn(1, 8, 2, 8)
    one = dist.get_rank() == 1
    try:
        ringdilated.dilated_attention(
            q, q, q, [8], [1], process_group=dist.group.WORLD, kernel="reference",
            softcap=2.0 if one else None, sinks=torch.zeros(2) if one else None,
        )  # fmt: skip
    except ValueError as exc:
        return str(exc)
    return "no error"


def mismatched_window(payload: dict[str, Any]) -> str:
    """Ranks disagree on ``window``; every rank must raise naming the field."""
    import ringdilated

    q = torch.randn(1, 8, 2, 8)
    window = (3 + dist.get_rank(), 0)
    try:
        ringdilated.dilated_attention(
            q, q, q, [16], [1], window=window, process_group=dist.group.WORLD
        )
    except ValueError as exc:
        return str(exc)
    return "no error"


def rank_dies(payload: dict[str, Any]) -> str:
    """Rank 1 exits before the call; the others must raise (in the agreement), not hang."""
    import time

    import ringdilated

    if dist.get_rank() == 1:
        os._exit(0)
    q = torch.randn(1, 8, 2, 4)
    start = time.monotonic()
    try:
        ringdilated.dilated_attention(q, q, q, [16], [1], process_group=dist.group.WORLD)
    except Exception as exc:
        return f"raised {type(exc).__name__} after {time.monotonic() - start:.1f}s"
    return "no error"


def module_on_shards(payload: dict[str, Any]) -> dict[str, Any]:
    """DilatedAttention with a process group gives the same shard as the functional form."""
    import ringdilated

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = torch.randn(1, 32, 4, 8, dtype=torch.float64)
    local = full[:, rank * 32 // world : (rank + 1) * 32 // world]
    attn = ringdilated.DilatedAttention(
        [8, 32], [1, 4], causal=True, process_group=dist.group.WORLD
    )
    out = attn(local, local, local)
    expected = ringdilated.dilated_attention(
        local, local, local, [8, 32], [1, 4], causal=True, process_group=dist.group.WORLD
    )
    return {"equal": bool(torch.equal(out, expected)), "explain": attn.explain(), "out": out}


def module_on_a_grid(payload: dict[str, Any]) -> dict[str, Any]:
    """DilatedAttention on a 2 x 2 CPU mesh (communicator auto: hybrid, the only one for a 2-D
    layout): this rank's output, the full inputs and the module's explanation."""
    from torch.distributed.device_mesh import init_device_mesh

    import ringdilated

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    g = torch.Generator().manual_seed(4)
    full = torch.randn(3, 1, 32, 4, 8, generator=g, dtype=torch.float64)
    local = [x[:, 8 * rank : 8 * (rank + 1)] for x in full]
    attn = ringdilated.DilatedAttention(
        [8, 32], [1, 4], causal=True, process_group=(mesh, ("ring", "ulysses"))
    )
    before = attn.explain()
    out = attn(*local)
    return {"out": out, "full": full, "before": before, "after": attn.explain()}


def rotary_module_on_uneven_shards(payload: dict[str, Any]) -> dict[str, Any]:
    """A causal MultiheadDilatedAttention with rotary embeddings on shards of
    ``payload['lengths']``: this rank's output and the same module's on one process, whole."""
    import ringdilated
    from ringdilated.rotary import rotary_embedding

    rank = dist.get_rank()
    lengths = payload["lengths"]
    kw: dict[str, Any] = {
        "segment_lengths": [8, 32], "dilation_rates": [1, 4], "num_kv_heads": 2,
        "causal": True, "dtype": torch.float64, "rotary": rotary_embedding,
    }  # fmt: skip
    torch.manual_seed(0)
    whole = ringdilated.MultiheadDilatedAttention(16, 4, **kw)
    sharded = ringdilated.MultiheadDilatedAttention(16, 4, process_group=dist.group.WORLD, **kw)
    sharded.load_state_dict(whole.state_dict())
    x = torch.randn(2, sum(lengths), 16, generator=torch.Generator().manual_seed(1)).double()
    start = sum(lengths[:rank])
    local = x[:, start : start + lengths[rank]]
    out = sharded(local, local, local)[0]
    expected = whole(x, x, x)[0][:, start : start + lengths[rank]]
    return {"out": out.detach(), "expected": expected.detach()}


def dropout_directional_derivative(payload: dict[str, Any]) -> dict[str, float]:
    """With each call's dropout masks fixed by seeding, the sharded function is deterministic:
    its analytic directional derivative must match central finite differences of the global loss.

    Returned both whole (``analytic``, ``numeric``: all-reduced, the same on every rank) and per
    rank (``own_analytic``: this rank's gradients along its slice of the direction, before any
    all-reduce; ``own_numeric``: the global loss's finite difference when only this rank's slice
    moves), so a gradient that reaches the wrong rank fails even if the totals agree."""
    import ringdilated

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    L = 8 * world
    full = [torch.randn(1, L, 4, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    weight = torch.randn(1, L, 4, 4, generator=g, dtype=torch.float64)
    direction = [torch.randn(1, L, 4, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    sl = slice(rank * 8, (rank + 1) * 8)

    def loss(inputs: list[torch.Tensor]) -> torch.Tensor:
        torch.manual_seed(100 + rank)  # the same masks on every evaluation
        out = ringdilated.dilated_attention(
            *inputs,
            [4, 16],
            [1, 2],
            mode=payload["mode"],
            causal=payload["causal"],
            dropout_p=0.3,
            process_group=dist.group.WORLD,
        )
        local = (out * weight[:, sl]).sum()
        total = local.detach().clone()
        dist.all_reduce(total)
        return local, total

    inputs = [x[:, sl].clone().requires_grad_() for x in full]
    local, _ = loss(inputs)
    local.backward()
    own_analytic = sum(
        float((x.grad * d[:, sl]).sum()) for x, d in zip(inputs, direction, strict=True)
    )
    analytic = torch.tensor(own_analytic, dtype=torch.float64)
    dist.all_reduce(analytic)
    eps = 1e-6
    with torch.no_grad():
        _, plus = loss([x[:, sl] + eps * d[:, sl] for x, d in zip(full, direction, strict=True)])
        _, minus = loss([x[:, sl] - eps * d[:, sl] for x, d in zip(full, direction, strict=True)])
    numeric = float(plus - minus) / (2 * eps)
    own_numeric = 0.0
    for mover in range(world):  # every rank joins each call; only ``mover``'s slice moves
        step = eps if mover == rank else 0.0
        with torch.no_grad():
            _, plus = loss(
                [x[:, sl] + step * d[:, sl] for x, d in zip(full, direction, strict=True)]
            )
            _, minus = loss(
                [x[:, sl] - step * d[:, sl] for x, d in zip(full, direction, strict=True)]
            )
        if mover == rank:
            own_numeric = float(plus - minus) / (2 * eps)
    return {
        "analytic": float(analytic),
        "numeric": numeric,
        "own_analytic": own_analytic,
        "own_numeric": own_numeric,
    }


def train_tiny(payload: dict[str, Any]) -> dict[str, Any]:
    """examples/train_tiny.py's training loop, sequence-sharded over this pool's ranks: the
    all-reduced loss curve and this rank's own per-position losses at each step."""
    positions: list[torch.Tensor] = []
    curve = _train_tiny_module().train(
        payload["steps"], dist.group.WORLD, torch.float64, position_losses=positions
    )
    return {"curve": curve, "positions": torch.stack(positions)}


def _train_tiny_module() -> Any:
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / "train_tiny.py"
    spec = importlib.util.spec_from_file_location("train_tiny", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stats_and_instances(payload: dict[str, Any]) -> dict[str, Any]:
    """Two sharded calls, each with its own TransferStats and a communicator instance, and a
    compiled sharded module (a graph break around the sharded call): bytes per call, errors."""
    import ringdilated
    from ringdilated.backends.ringpass import RingPassCommunicator
    from ringdilated.core.plan.pattern import DilationPattern
    from ringdilated.core.plan.shards import shard_plan
    from ringdilated.testing import oracle

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(1, 32, 2, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    mine = [x[:, 16 * rank : 16 * (rank + 1)].contiguous() for x in full]
    expected = oracle(*full, [32], [2])[:, 16 * rank : 16 * (rank + 1)]
    first, second = ringdilated.TransferStats(), ringdilated.TransferStats()
    errors = []
    for stats, communicator in ((first, RingPassCommunicator()), (second, "ringpass")):
        out = ringdilated.dilated_attention(
            *mine, [32], [2], process_group=dist.group.WORLD, communicator=communicator,
            transfer_stats=stats,
        )  # fmt: skip
        errors.append(float((out - expected).abs().max()))
    module = ringdilated.DilatedAttention([32], [2], process_group=dist.group.WORLD)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="aot_eager")
    errors.append(float((compiled(*mine) - expected).abs().max()))
    plan = shard_plan(DilationPattern([32], [2]), 32, 2, 2, rank, world)
    return {
        "sent": (first.bytes_sent, second.bytes_sent),
        "minimum": plan.elements_sent(8, 1, FULL) * 8,
        "errors": errors,
    }


def lse_loss_on_one_rank(payload: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's loss uses lse, rank 1's does not (its dlse is None): this rank's gradients with
    ``payload['communicator']``, and the full inputs and upstream gradients."""
    import ringdilated

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(8)
    full = torch.randn(3, 1, 8 * world, 4, 8, generator=g, dtype=torch.float64)
    dout = torch.randn(1, 8 * world, 4, 8, generator=g, dtype=torch.float64)
    dlse = torch.randn(1, 4, 8 * world, generator=g, dtype=torch.float64)
    shard = slice(8 * rank, 8 * (rank + 1))
    q, k, v = (x[:, shard].clone().requires_grad_() for x in full)
    out, lse = ringdilated.dilated_attention(
        q, k, v, [8 * world], [2], causal=True, return_lse=True,
        process_group=dist.group.WORLD, communicator=payload["communicator"],
    )  # fmt: skip
    loss = (out * dout[:, shard]).sum()
    if rank == 0:
        loss = loss + (lse.double() * dlse[:, :, shard]).sum()
    loss.backward()
    return {"grads": [q.grad, k.grad, v.grad], "full": full, "dout": dout, "dlse": dlse}


def dropout_on_equal_heads(payload: dict[str, Any]) -> dict[str, Any]:
    """Heads 0 and 2 get identical inputs and the same pattern; with dropout, whether their
    outputs differ (they should: each head its own masks) under ``payload['communicator']``."""
    import ringdilated

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 8, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for x in (q, k, v):
        x[:, :, 2] = x[:, :, 0]
    torch.manual_seed(1)  # the same dropout seed on every rank
    out = ringdilated.dilated_attention(
        q, k, v, [16], [1], dropout_p=0.5, process_group=dist.group.WORLD,
        communicator=payload["communicator"],
    )  # fmt: skip
    return {"rank": rank, "heads_differ": not torch.equal(out[:, :, 0], out[:, :, 2])}


def agreement_error_types(payload: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 passes a bad head dim, then the ranks disagree on ``causal``: what each rank's
    exceptions are (class, bases that matter, the culprit attributes, a pickle round trip)."""
    import pickle

    import ringdilated
    from ringdilated.core import EveryRankError

    rank = dist.get_rank()

    def described(exc: BaseException) -> dict[str, Any]:
        again = pickle.loads(pickle.dumps(exc))
        return {
            "name": type(exc).__name__,
            "every_rank": isinstance(exc, EveryRankError),
            "value_error": isinstance(exc, ValueError),
            "peer": isinstance(exc, ringdilated.PeerRejectedError),
            "mismatch": isinstance(exc, ringdilated.CallMismatchError),
            "rank": getattr(exc, "rank", None),
            "differences": getattr(exc, "differences", None),
            "pickled": (type(again).__name__, str(again), isinstance(again, EveryRankError)),
            "message": str(exc),
        }

    q = torch.randn(1, 8, 2, 8)
    k = torch.randn(1, 8, 2, 4 if rank == 1 else 8)
    result: dict[str, Any] = {}
    try:
        ringdilated.dilated_attention(q, k, k, [8], [1], process_group=dist.group.WORLD)
    except Exception as exc:
        result["bad_input"] = described(exc)
    try:
        ringdilated.dilated_attention(
            q, q, q, [8], [1], causal=rank == 1, process_group=dist.group.WORLD
        )
    except Exception as exc:
        result["mismatch"] = described(exc)
    return result
