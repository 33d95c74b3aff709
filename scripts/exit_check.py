"""Exit statuses of short 4-rank gloo jobs that train with a sharded communicator and FSDP2.

Each run starts ``--world`` fresh Python processes the way ``torchrun`` does (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment, ``init_method="env://"``);
each rank trains two :class:`ringdilated.DilatedTransformerBlock` layers sharded with
``fully_shard`` for a few steps, the sequence split over every rank with the named
communicator, checks that its loss is finite, and returns from ``main`` as most training
scripts do: without ``destroy_process_group`` (``--destroy`` calls it). Every rank's exit
status is recorded; the job passes when all are 0. Issue 21, item 3: a rank could die with
SIGABRT (-6, "terminate called without an active exception") at interpreter exit after correct
results. Not part of the test run (it takes minutes)::

    .venv/bin/python scripts/exit_check.py --runs 20                 # ulysses and allgather
    .venv/bin/python scripts/exit_check.py --runs 5 --cases ringpass --destroy
    git worktree add /tmp/old d886749                                 # before the fix
    .venv/bin/python scripts/exit_check.py --runs 60 --cases ulysses --world 2 --bare \
        --src /tmp/old/src                                            # 10 of 60 aborted here

``--bare``: each rank makes ``max(--steps, 3)`` sharded calls, forward and backward, with no
model (the pattern that aborted most often); ``--src``: the ranks import ringdilated from that
tree (each rank checks it did).

Prints one line per run and a summary per case; exits 1 if any rank's status was not 0.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import time

CASES = ("ulysses", "allgather")


def rank_main(
    case: str, steps: int, destroy: bool, switch_interval: float, one_cpu: bool, bare: bool
) -> None:
    """One rank of a job (run with the torchrun environment set)."""
    if one_cpu:  # every rank on one core: threads wait longer to be scheduled
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    if switch_interval > 0:  # a thread waiting for the GIL waits this long
        sys.setswitchinterval(switch_interval)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ringdilated

    wanted = os.environ.get("EXIT_CHECK_SRC")
    if wanted and not os.path.abspath(ringdilated.__file__).startswith(os.path.abspath(wanted)):
        raise SystemExit(f"--src {wanted}: ringdilated was imported from {ringdilated.__file__}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if bare:  # the call alone, forward and backward, no model around it
        g = torch.Generator().manual_seed(0)
        q, k, v = (
            torch.randn(1, 16 * world, 2 * world, 8, generator=g, dtype=torch.float64)[
                :, 16 * rank : 16 * (rank + 1)
            ]
            .contiguous()
            .requires_grad_()
            for _ in range(3)
        )
        for _ in range(max(steps, 3)):
            out = ringdilated.dilated_attention(
                q, k, v, [8, 16], [1, 2], process_group=dist.group.WORLD, communicator=case
            )
            out.sum().backward()
        if destroy:
            dist.destroy_process_group()
        return
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    seq, width = 8 * world, 16
    model = torch.nn.Sequential(
        *(
            ringdilated.DilatedTransformerBlock(
                width, world, segment_lengths=[8, 16], dilation_rates=[1, 2], causal=True,
                dtype=torch.float64, process_group=dist.group.WORLD, communicator=case,
            )
            for _ in range(2)
        )
    )  # fmt: skip
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    shard = slice(rank * seq // world, (rank + 1) * seq // world)
    for _ in range(steps):
        x = torch.randn(2, seq, width, generator=g, dtype=torch.float64)
        loss = model(x[:, shard]).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if not torch.isfinite(loss):
            raise SystemExit(f"rank {rank}: loss {float(loss)}")
    if rank == 0:
        print(f"{case}: loss {float(loss):.6f}", flush=True)
    if destroy:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(case: str, world: int, args: argparse.Namespace) -> list[int]:
    """Start ``world`` ranks of one job; every rank's exit status (-9: killed at the timeout)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env["WORLD_SIZE"] = str(world)
    timeout_s = args.timeout
    argv = [sys.executable, __file__, "--rank-of", case, "--steps", str(args.steps)]
    argv += ["--switch-interval", str(args.switch_interval)]
    argv += ["--destroy"] if args.destroy else []
    argv += ["--one-cpu"] if args.one_cpu else []
    argv += ["--bare"] if args.bare else []
    if args.src:  # the ranks import ringdilated from this source tree (an older commit's)
        if not os.path.isfile(os.path.join(args.src, "ringdilated", "__init__.py")):
            raise SystemExit(f"--src {args.src}: no ringdilated/__init__.py there (pass its src/)")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.src, env.get("PYTHONPATH")]))
        env["EXIT_CHECK_SRC"] = args.src  # each rank checks where it imported ringdilated from
    procs = [
        subprocess.Popen(
            argv,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    statuses = []
    deadline = time.monotonic() + timeout_s
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        statuses.append(p.returncode)
        if p.returncode != 0:
            tail = "\n".join(out.strip().splitlines()[-6:])
            print(f"  rank {r} exited {p.returncode}:\n    " + tail.replace("\n", "\n    "))
    return statuses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="jobs per case (default 20)")
    parser.add_argument("--cases", default=",".join(CASES), help="communicators, comma-separated")
    parser.add_argument("--world", type=int, default=4, help="ranks per job (default 4)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per job")
    parser.add_argument("--destroy", action="store_true", help="call destroy_process_group")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=0.0,
        help="sys.setswitchinterval in each rank (e.g. 1.0: a thread waits longer for the GIL, "
        "which widens the window in which exit used to abort); 0 leaves Python's default",
    )
    parser.add_argument("--one-cpu", action="store_true", help="pin every rank to one core")
    parser.add_argument(
        "--bare",
        action="store_true",
        help="each rank makes max(--steps, 3) sharded calls, forward and backward, with no model "
        "or FSDP",
    )
    parser.add_argument(
        "--src",
        help="a source tree the ranks import ringdilated from (PYTHONPATH), e.g. a worktree of "
        "an older commit, for a before/after comparison",
    )
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of:
        rank_main(
            args.rank_of, args.steps, args.destroy, args.switch_interval, args.one_cpu, args.bare
        )
        return 0
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    failed = 0
    summary = {}
    for case in args.cases.split(","):
        counts: collections.Counter[int] = collections.Counter()
        bad_jobs = 0
        for run in range(1, args.runs + 1):
            start = time.monotonic()
            statuses = run_job(case, args.world, args)
            counts.update(statuses)
            bad_jobs += any(s != 0 for s in statuses)
            took = time.monotonic() - start
            print(f"{case} run {run}/{args.runs}: exit statuses {statuses} ({took:.1f} s)")
        failed += bad_jobs
        summary[case] = (bad_jobs, dict(sorted(counts.items())))
    for case, (bad_jobs, counts) in summary.items():
        print(f"{case}: {bad_jobs} of {args.runs} jobs had a non-zero exit; rank statuses {counts}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
