"""The main job: a 2-process gloo run checked against one process, with the plan and figures.

Defaults: L=8192, 8 heads of 64, segments [2048, 4096, 8192], rates [1, 2, 4], causal, float32.
One process computes the result and its gradients; two local gloo ranks compute their halves
with the ring-pass communicator; both are compared with the same computation in float64 under
the tolerance rule of docs/spec.md, section 4 (twice the single process's own float32 error
plus the floor; :func:`ringdilated.testing.allowed_error`). Prints the resolver's plan, times
(best of 3 warm runs), GFLOP/s, bytes each rank sent, and the verdict. Every flag is checked
before any work, the memory the run needs included (:func:`ringdilated.cli.memory.demo_bytes`).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from ringdilated.cli import flags, memory
from ringdilated.core.contract.communicator import TransferStats

__all__ = ["add_arguments", "run"]

REPEATS = 3  # times are the best of this many warm runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--length", type=flags.positive_int, default=8192)
    parser.add_argument("--heads", type=flags.positive_int, default=8)
    parser.add_argument("--head-dim", type=flags.positive_int, default=64)
    parser.add_argument("--segments", type=flags.int_list(), default=[2048, 4096, 8192])
    parser.add_argument("--rates", type=flags.int_list(), default=[1, 2, 4])
    parser.add_argument(
        "--world-size", type=flags.at_least(2), default=2, help="local gloo ranks (at least 2)"
    )


def _check(args: argparse.Namespace) -> None:
    """Every check that needs more than one flag or this machine; all before any work."""
    flags.check_pattern(args.segments, args.rates, args.heads)
    if args.length % args.world_size:
        raise ValueError(f"--world-size {args.world_size} must divide --length {args.length}")
    need = memory.demo_bytes(args.length, args.heads, args.head_dim, args.world_size)
    what = (
        f"--length {args.length} with --heads {args.heads}, --head-dim {args.head_dim}, "
        f"--world-size {args.world_size}"
    )
    reduce = "--length, --heads, --head-dim or --world-size"
    memory.require_fits("demo", need, "cpu", what, reduce)


def _inputs(config: dict[str, Any], dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (1, config["length"], config["heads"], config["head_dim"])
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(4)]


def _run_once(config: dict[str, Any], dtype: torch.dtype, group: Any = None) -> dict[str, Any]:
    import torch.distributed as dist

    import ringdilated

    q, k, v, dout = _inputs(config, dtype)
    stats = TransferStats()
    kw: dict[str, Any] = {}
    if group is not None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        shard = slice(rank * config["length"] // world, (rank + 1) * config["length"] // world)
        q, k, v, dout = (x[:, shard] for x in (q, k, v, dout))
        kw = {"process_group": group, "communicator": "ringpass", "transfer_stats": stats}
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    start = time.perf_counter()
    out = ringdilated.dilated_attention(
        leaves[0], leaves[1], leaves[2], config["segments"], config["rates"], causal=True, **kw
    )
    forward_s = time.perf_counter() - start
    torch.autograd.backward(out, dout)
    total_s = time.perf_counter() - start
    result = {"out": out.detach(), "forward_s": forward_s, "total_s": total_s}
    result.update({f"d{n}": x.grad for n, x in zip("qkv", leaves, strict=True)})
    return result | {"bytes_sent": stats.bytes_sent}  # 0 in one process


def rank_task(config: dict[str, Any]) -> dict[str, Any]:
    """A :class:`~ringdilated.pool.Workers` task: this rank's half, timed."""
    import torch.distributed as dist

    torch.set_num_threads(config["threads"])
    _run_once(config, torch.float32, dist.group.WORLD)  # warm-up
    runs = [_run_once(config, torch.float32, dist.group.WORLD) for _ in range(REPEATS)]
    return _fastest(runs)


def _fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the shortest forward+backward, with the shortest forward time of all."""
    best = min(runs, key=lambda r: r["total_s"])
    return {**best, "forward_s": min(r["forward_s"] for r in runs)}


def run(args: argparse.Namespace) -> int:
    import ringdilated
    from ringdilated.core.plan.pattern import DilationPattern
    from ringdilated.core.select.capabilities import Request
    from ringdilated.pool import Workers
    from ringdilated.testing import allowed_error, max_error

    _check(args)
    config = {
        name: getattr(args, name) for name in ("length", "heads", "head_dim", "segments", "rates")
    }
    config["threads"] = max(1, torch.get_num_threads() // args.world_size)
    pattern = DilationPattern(config["segments"], config["rates"])
    print(
        f"dilated attention, L={args.length}, {args.heads} heads of {args.head_dim}, segments "
        f"{config['segments']}, rates {config['rates']}, causal, float32\n"
    )
    request = Request(head_dim=args.head_dim, window=True, backward=True)
    print(ringdilated.default_resolver().resolve(request).explain())
    print(ringdilated.default_resolver().explain_communicator(args.world_size, True, "ringpass"))
    _run_once(config, torch.float32)  # warm-up
    single = _fastest([_run_once(config, torch.float32) for _ in range(REPEATS)])
    exact = _run_once(config, torch.float64)
    pool = Workers(args.world_size)  # started after the timings above, so it cannot disturb them
    try:
        ranks = pool.results(f"{__name__}:rank_task", config)
    finally:
        pool.close()
    flops = pattern.flops(args.length, args.heads, args.head_dim, causal=True)
    print(
        f"\none process: forward {single['forward_s']:.3f} s "
        f"({flops / single['forward_s'] / 1e9:.1f} GFLOP/s), "
        f"forward+backward {single['total_s']:.3f} s"
    )
    for rank, r in enumerate(ranks):
        print(
            f"rank {rank} of {args.world_size}: forward {r['forward_s']:.3f} s, "
            f"forward+backward {r['total_s']:.3f} s, sent {r['bytes_sent'] / 2**20:.2f} MiB"
        )
    verdict = True
    for name in ("out", "dq", "dk", "dv"):
        sharded = torch.cat([r[name] for r in ranks], 1)
        allowed = allowed_error(exact[name], single[name], torch.float32)
        error = max_error(sharded, exact[name])
        ok = error <= allowed
        verdict &= ok
        print(
            f"{name}: sharded vs float64 {error:.2e}, one process vs float64 "
            f"{max_error(single[name], exact[name]):.2e}, allowed {allowed:.2e}  "
            f"{'ok' if ok else 'FAIL'}"
        )
    print(f"\n{'PASS' if verdict else 'FAIL'}: {args.world_size} ranks reproduce one process")
    return 0 if verdict else 1
