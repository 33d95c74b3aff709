"""Real torch.distributed process groups (gloo, this machine only) for the tests.

A :class:`Workers` pool starts ``world_size`` processes once; each joins a gloo group through a
file store and then runs tasks (functions of this module, by name) sent to every rank alike,
returning each rank's result. Spawning costs seconds, so pools live for the whole test session.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT_S = 120


def _worker(
    rank: int, world_size: int, store: str, inbox: Any, outbox: Any, timeout_s: float
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        while True:
            task = inbox.get()
            if task is None:
                break
            name, payload = task
            try:
                outbox.put((rank, True, globals()[name](payload)))
            except BaseException as exc:
                outbox.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        dist.destroy_process_group()


class Workers:
    """``world_size`` ranks of one gloo group, alive until :meth:`close`."""

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory()
        store = os.path.join(self._dir.name, "store")
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store, self._inboxes[r], self._outbox, timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, name: str, payload: Any) -> list[tuple[bool, Any]]:
        """Run task ``name`` on every rank; ``[(ok, result or (type, message, traceback))]``."""
        for inbox in self._inboxes:
            inbox.put((name, payload))
        results: dict[int, tuple[bool, Any]] = {}
        while len(results) < self.world_size:
            try:
                rank, ok, value = self._outbox.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(
                    f"task {name!r}: ranks {sorted(set(range(self.world_size)) - set(results))} "
                    "did not answer"
                ) from None
            results[rank] = (ok, value)
        return [results[r] for r in range(self.world_size)]

    def results(self, name: str, payload: Any) -> list[Any]:
        """Like :meth:`run`, raising if any rank failed."""
        out = []
        for rank, (ok, value) in enumerate(self.run(name, payload)):
            if not ok:
                raise AssertionError(f"rank {rank} failed: {value[0]}: {value[1]}\n{value[2]}")
            out.append(value)
        return out

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for p in self._procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        self._dir.cleanup()


def full_inputs(case: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, dout, dlse)`` of the whole sequence, drawn from ``case['seed']``."""
    g = torch.Generator().manual_seed(case["seed"])
    B, L, H, Hkv, D = (case[n] for n in ("batch", "seq_len", "heads", "kv_heads", "head_dim"))
    dtype = getattr(torch, case["dtype"])
    q, k, v = (
        torch.randn(B, L, h, D, generator=g, dtype=torch.float64).to(dtype) for h in (H, Hkv, Hkv)
    )
    dout = torch.randn(B, L, H, D, generator=g, dtype=torch.float64).to(dtype)
    dlse = torch.randn(B, H, L, generator=g, dtype=torch.float64).float()
    return q, k, v, dout, dlse


# ---- tasks (run on every rank) -------------------------------------------------------------


def sharded_case(case: dict[str, Any]) -> dict[str, Any]:
    """Each rank takes its shard of the full inputs drawn from ``case['seed']`` and runs."""
    import ringdilated
    from ringdilated.functional import default_resolver

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(case["seed"])
    B, L, H, Hkv, D = (
        case["batch"],
        case["seq_len"],
        case["heads"],
        case["kv_heads"],
        case["head_dim"],
    )
    dtype = getattr(torch, case["dtype"])
    full = [
        torch.randn(B, L, h, D, generator=g, dtype=torch.float64).to(dtype) for h in (H, Hkv, Hkv)
    ]
    dout = torch.randn(B, L, H, D, generator=g, dtype=torch.float64).to(dtype)
    dlse = torch.randn(B, H, L, generator=g, dtype=torch.float64).float()
    shard = L // world
    sl = slice(rank * shard, (rank + 1) * shard)
    q, k, v = (x[:, sl].clone().requires_grad_() for x in full)
    comm = default_resolver().communicator_for(world, case["causal"], case["communicator"])
    comm.stats.reset()
    out, lse = ringdilated.dilated_attention(
        q,
        k,
        v,
        case["segments"],
        case["rates"],
        mode=case["mode"],
        causal=case["causal"],
        scale=case["scale"],
        kernel=case["kernel"],
        return_lse=True,
        process_group=dist.group.WORLD,
        communicator=case["communicator"],
    )
    forward_bytes = comm.stats.bytes_sent
    loss = (out.double() * dout[:, sl].double()).sum()
    if case.get("lse_grad", True):
        loss = (
            loss
            + (lse.masked_fill(torch.isneginf(lse), 0).double() * dlse[:, :, sl].double()).sum()
        )
    loss.backward()
    return {
        "out": out.detach(),
        "lse": lse.detach(),
        "dq": q.grad,
        "dk": k.grad,
        "dv": v.grad,
        "forward_bytes_sent": forward_bytes,
        "total_bytes_sent": comm.stats.bytes_sent,
    }


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


def rank_dies(payload: dict[str, Any]) -> str:
    """Rank 1 exits before the exchange; the others must raise, not hang."""
    import time

    import ringdilated

    if dist.get_rank() == 1:
        os._exit(0)
    q = torch.randn(1, 8, 2, 4)
    start = time.monotonic()
    try:
        # Skip the metadata agreement so the failure happens inside the ring exchange itself.
        os.environ["RINGDILATED_RANK_CHECK"] = "0"
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


def dropout_directional_derivative(payload: dict[str, Any]) -> dict[str, float]:
    """With each call's dropout masks fixed by seeding, the sharded function is deterministic:
    its analytic directional derivative must match central finite differences of the global loss."""
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
    analytic = torch.tensor(
        sum(float((x.grad * d[:, sl]).sum()) for x, d in zip(inputs, direction, strict=True))
    )
    dist.all_reduce(analytic)
    eps = 1e-6
    with torch.no_grad():
        _, plus = loss([x[:, sl] + eps * d[:, sl] for x, d in zip(full, direction, strict=True)])
        _, minus = loss([x[:, sl] - eps * d[:, sl] for x, d in zip(full, direction, strict=True)])
    numeric = float(plus - minus) / (2 * eps)
    return {"analytic": float(analytic), "numeric": numeric}
