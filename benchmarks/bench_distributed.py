"""Sharded dilated attention: per-rank memory, bytes against the minimum, time against compute.

    python benchmarks/bench_distributed.py                   # world 1, 2, 4; L = 65536, 262144
    python benchmarks/bench_distributed.py --lengths 65536 --worlds 1 2

Configuration (issue 3): fp32, B=1, H=8, D=64, gloo on this machine, one thread per rank,
``segment_lengths=[2048, 8192, L]``, ``dilation_rates=[1, 4, L/2048]`` (the largest segment spans
every rank; every block has 2048 selected positions), ``head_groups``, not causal.

Per rank: peak resident memory of the call (inputs included, measured from just before the
inputs were made), bytes sent against the shard plan's minimum, and time against the same rank
running the same computation with a communicator that moves nothing ("compute only": the same
steps and kernel calls on unfilled receive buffers). Ranks run as separate processes started
here; with more ranks than cores they share cores, in both columns alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from ringdilated.cli.procstat import reset_peak, status_bytes

H, D = 8, 64


class _Done:
    def wait(self) -> None:
        return None


class ComputeOnly:
    """The ringpass schedule, moving nothing: receive buffers are left as allocated."""

    def __init__(self) -> None:
        from ringdilated.backends.ringpass import RingPassCommunicator

        self._ring = RingPassCommunicator()

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        return self._ring.schedule(rank, world_size)

    def prepare(self, group: object, plans: Any, causal: bool) -> None:
        return None

    def exchange(
        self,
        group: object,
        sends: Mapping[int, Any],
        recvs: Mapping[int, Any],
        uniform: bool = False,
    ) -> _Done:
        for buffer in recvs.values():
            buffer.zero_()
        return _Done()


def _rank(rank: int, world: int, store: str, length: int, backward: bool, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    import ringdilated
    from ringdilated.core.shard_plan import payload, shard_plan

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),
        )
    group = dist.group.WORLD if world > 1 else None
    segments, rates = [2048, 8192, length], [1, 4, length // 2048]
    shard = length // world
    before = status_bytes("VmRSS")
    reset_peak()
    q, k, v = (torch.randn(1, shard, H, D, requires_grad=backward) for _ in range(3))
    dout = torch.randn(1, shard, H, D) if backward else None
    results: dict[str, Any] = {}
    for communicator in ("ringpass", "allgather", "compute-only") if world > 1 else ("local",):
        stats = ringdilated.TransferStats()
        chosen = ComputeOnly() if communicator == "compute-only" else communicator

        def call(chosen: Any = chosen, stats: Any = stats) -> None:
            o = ringdilated.dilated_attention(
                q, k, v, segments, rates, process_group=group, communicator=chosen,
                transfer_stats=stats,
            )  # fmt: skip
            if backward:
                o.backward(dout)
                q.grad = k.grad = v.grad = None

        call()  # warm-up; its peak is the one reported
        if communicator in ("ringpass", "local"):
            results["peak_bytes"] = status_bytes("VmHWM") - before
        stats.reset()
        repeats = 2 if length <= 65536 else 1
        times = []
        for _ in range(repeats):
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        results[f"{communicator}_seconds"] = min(times)
        if communicator in ("ringpass", "allgather"):
            results[f"{communicator}_bytes_sent"] = stats.bytes_sent // repeats
    pattern = ringdilated.DilationPattern(segments, rates)
    plan = shard_plan(pattern, length, H, H, rank, world)
    results["minimum_sent"] = plan.elements_sent(D, 1, causal=False) * 4
    results["minimum_received"] = 4 * sum(
        2 * D * payload(plan, src, rank, False).positions_count
        for src in range(world)
        if src != rank
    )
    out.put((rank, results))
    if world > 1:
        dist.destroy_process_group()


def run(world: int, length: int, backward: bool) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank, args=(r, world, store, length, backward, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=1800) for _ in range(world))
        for p in procs:
            p.join()
    return [results[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[65536, 262144])
    parser.add_argument("--worlds", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    rows = []
    print(
        "| L | pass | P | rank | peak MiB | peak / P=1 | minimum bytes | ringpass bytes "
        "| allgather bytes | compute only (s) | ringpass (s) | ratio | allgather (s) | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        for backward in (False, True):
            single_peak = None
            for world in args.worlds:
                for rank, r in enumerate(run(world, length, backward)):
                    if world == 1:
                        single_peak = r["peak_bytes"]
                    compute = r.get("compute-only_seconds", r.get("local_seconds"))
                    # Backward re-sends a rank's pieces and returns the gradients of those it got.
                    minimum = r["minimum_sent"] * (2 if backward else 1)
                    minimum += r["minimum_received"] if backward else 0
                    row = {
                        "L": length,
                        "pass": "fwd+bwd" if backward else "fwd",
                        "P": world,
                        "rank": rank,
                        **r,
                    }
                    rows.append(row)
                    ratio = f"{r['peak_bytes'] / single_peak:.2f}" if single_peak else "-"
                    peak = r["peak_bytes"] / 2**20
                    cells = []
                    for name in ("ringpass", "allgather"):
                        seconds = r.get(f"{name}_seconds", r.get("local_seconds"))
                        cells.append(f"{seconds:.3f} | {seconds / compute:.2f}")
                    print(
                        f"| {length} | {row['pass']} | {world} | {rank} | {peak:.0f} | {ratio} | "
                        f"{minimum if world > 1 else 0} | {r.get('ringpass_bytes_sent', 0)} | "
                        f"{r.get('allgather_bytes_sent', 0)} | {compute:.3f} | "
                        f"{' | '.join(cells)} |",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
