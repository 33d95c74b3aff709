"""What the ranks' agreement costs a sharded call, at a small L where it matters most.

    python benchmarks/bench_agreement.py                 # 2 gloo ranks, 200 calls per variant
    python benchmarks/bench_agreement.py --calls 500 --rounds 5

Every sharded call checks, before any data moves, that no rank rejected its input and that the
ranks' calls agree (``ringdilated.core.call.agreement``). This times one small forward call
(per rank B=1, L=128, H=4, D=32; segments [64, 128, 256], rates [1, 2, 4], ``ringpass``) on 2 gloo
ranks, one thread each, with the agreement as shipped (``digest``: one ``all_gather`` of three
integers), as it was before (``full``: an ``all_gather_object`` of every rank's signature, which
pickles and makes two collectives) and with no agreement at all (``none``, unsafe: the floor).
The variants alternate within each round, so all see the same machine load; it prints, per
variant, the best and median of the rounds' mean per-call times, and the agreement's cost over
``none``.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

VARIANTS = ("digest", "full", "none")


def _rank(rank: int, world: int, store: str, calls: int, rounds: int, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    import ringdilated
    from ringdilated.core.call import agreement
    from ringdilated.core.call import prepare as call

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    agreements = {
        "digest": agreement.agree,
        "full": lambda group, error, signature, **kw: agreement.compare_reports(
            group, error, signature
        ),
        "none": lambda group, error, signature, **kw: None,
    }
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 128, 4, 32, generator=g) for _ in range(3))

    def one() -> None:
        ringdilated.dilated_attention(
            q, k, v, [64, 128, 256], [1, 2, 4], process_group=dist.group.WORLD,
            communicator="ringpass",
        )  # fmt: skip

    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            call.agree = agreements[name]  # type: ignore[assignment]
            one()  # warm-up
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                one()
            times[name].append((time.perf_counter() - start) / calls)
    call.agree = agreements["digest"]  # type: ignore[assignment]
    out.put((rank, times))
    dist.destroy_process_group()


def run(calls: int, rounds: int, world: int = 2) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank, args=(r, world, store, calls, rounds, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    return results[0]  # rank 0's view (the ranks wait for each other every call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import torch

    times = run(args.calls, args.rounds)
    floor = statistics.median(times["none"])
    print(f"torch {torch.__version__}, 2 gloo ranks, 1 thread each, {args.rounds} rounds")
    print("| agreement | per call: best / median (ms) | cost over none (median, ms) |")
    print("|---|---|---|")
    for name in VARIANTS:
        best, median = min(times[name]) * 1e3, statistics.median(times[name]) * 1e3
        print(f"| {name} | {best:.3f} / {median:.3f} | {median - floor * 1e3:+.3f} |")


if __name__ == "__main__":
    main()
