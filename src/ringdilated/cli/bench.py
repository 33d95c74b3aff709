"""Run the benchmark grid: time, GFLOP/s and peak memory against sequence length.

Every row is one sequence length: the best of ``--repeats`` warm runs of the forward (and,
with ``--backward``, forward+backward), GFLOP/s of the pattern's own work
(``DilationPattern.flops``; backward counted 2.5x forward), and the peak resident memory the
call added (Linux ``VmHWM``, reset before the call). ``--world-size N`` spawns N local gloo
ranks, each holding ``L / N`` of the sequence; times and memory are then the slowest rank's.
``--dense`` adds dense ``scaled_dot_product_attention`` over the whole sequence (forward: its
time and peak memory) for comparison; ``--device cuda`` measures on a GPU (CUDA-synchronised
times, allocator peaks). Every flag is checked before any work, the memory the largest row
needs included (:func:`ringdilated.cli.memory.bench_bytes`).

Outputs: the table; ``--json`` writes ``{"config", "environment", "rows"}``, the environment
being what the figures depend on (:func:`environment`: versions, the device, the machine);
``--csv`` writes the table's rows; ``--plot`` draws every timed series (forward, with
``--backward`` forward+backward, with ``--dense`` dense SDPA) and every measured peak against
the sequence length.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from ringdilated.cli import flags, memory
from ringdilated.cli.progress import progress, table

__all__ = ["add_arguments", "environment", "measure", "run"]

DEFAULT_LENGTHS = [2048, 4096, 8192, 16384, 32768]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ints = flags.int_list()
    parser.add_argument("--lengths", type=ints, default=DEFAULT_LENGTHS, help="e.g. 4096,8192")
    parser.add_argument("--segments", type=ints, default=[2048, 4096, 8192])
    parser.add_argument("--rates", type=ints, default=[1, 2, 4])
    parser.add_argument("--heads", type=flags.positive_int, default=8)
    parser.add_argument("--head-dim", type=flags.positive_int, default=64)
    parser.add_argument(
        "--dtype", type=flags.dtype_name, default="float32", help="float32/fp32, bf16, fp16, fp64"
    )
    parser.add_argument(
        "--device", type=flags.cpu_or_cuda, default="cpu", help="cpu or cuda (one process)"
    )
    parser.add_argument(
        "--dense", action="store_true", help="also time dense SDPA (causal if --causal) at each L"
    )
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true", help="also time forward+backward")
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--repeats", type=flags.positive_int, default=3)
    parser.add_argument(
        "--world-size", type=flags.positive_int, default=1, help="spawn N local gloo ranks"
    )
    parser.add_argument("--json", type=flags.output_file, metavar="FILE", help="write rows as JSON")
    parser.add_argument("--csv", type=flags.output_file, metavar="FILE", help="write rows as CSV")
    parser.add_argument(
        "--plot", type=flags.output_file, metavar="FILE.png", help="plot time and memory"
    )
    parser.add_argument("--no-progress", action="store_true")


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _best(fn: Callable[[], object], repeats: int, device: str = "cpu") -> float:
    fn()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _peak_extra(fn: Callable[[], object], device: str = "cpu") -> int:
    """Bytes a cold call of ``fn`` added at its peak: CUDA allocator peak, or Linux VmHWM."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    from ringdilated.cli.procstat import reset_peak, status_bytes

    before = status_bytes("VmRSS")
    reset_peak()
    fn()
    return max(0, status_bytes("VmHWM") - before)


def measure(config: dict[str, Any], process_group: Any = None) -> dict[str, Any]:
    """One row for ``config`` on this process (its shard when ``process_group`` is given)."""
    import torch.distributed as dist

    import ringdilated

    world = dist.get_world_size(process_group) if process_group is not None else 1
    length = config["length"]
    local = length // world
    dtype = flags.to_dtype(config["dtype"])
    g = torch.Generator().manual_seed(0)
    device = config.get("device", "cpu")
    q, k, v = (
        torch.randn(1, local, config["heads"], config["head_dim"], generator=g).to(device, dtype)
        for _ in range(3)
    )

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ringdilated.dilated_attention(
            q,
            k,
            v,
            config["segments"],
            config["rates"],
            causal=config["causal"],
            kernel=config["kernel"],
            process_group=process_group,
        )

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return attend(q, k, v)

    def forward_backward() -> None:
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = attend(leaves[0], leaves[1], leaves[2])
        torch.autograd.backward(out, torch.ones_like(out))

    def dense() -> torch.Tensor:
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=config["causal"]
            )

    calls: dict[str, Callable[[], object]] = {"forward": forward}
    if config["backward"]:
        calls["fwd_bwd"] = forward_backward
    if config.get("dense"):
        calls["dense"] = dense
    # Peaks first: a cold call, before timing loops leave freed memory resident.
    peaks = {f"{name}_peak_mib": _peak_extra(call, device) / 2**20 for name, call in calls.items()}
    times = {f"{name}_s": _best(call, config["repeats"], device) for name, call in calls.items()}
    return peaks | times


def rank_task(config: dict[str, Any]) -> dict[str, Any]:
    """A :class:`~ringdilated.pool.Workers` task: :func:`measure` on this rank."""
    import torch.distributed as dist

    torch.set_num_threads(max(1, config["threads"]))
    return measure(config, dist.group.WORLD)


def _row(config: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    from ringdilated.core.plan.pattern import DilationPattern

    pattern = DilationPattern(config["segments"], config["rates"])
    flops = pattern.flops(config["length"], config["heads"], config["head_dim"], config["causal"])
    row: dict[str, Any] = {"length": config["length"], "ranks": len(results)}
    for key in results[0]:
        row[key] = max(r[key] for r in results)
    row["forward_gflops"] = flops / row["forward_s"] / 1e9
    if "dense_s" in row:
        length, width = config["length"], config["heads"] * config["head_dim"]
        pairs = length * (length + 1) // 2 if config["causal"] else length * length
        row["dense_gflops"] = 4 * pairs * width / row["dense_s"] / 1e9
    if "fwd_bwd_s" in row:
        row["fwd_bwd_gflops"] = 3.5 * flops / row["fwd_bwd_s"] / 1e9
    return row


def _check_ranks(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` when ``--world-size`` conflicts with the other flags."""
    uneven = [n for n in args.lengths if n % args.world_size]
    if uneven:
        raise ValueError(f"lengths {uneven} are not divisible by --world-size {args.world_size}")
    if args.world_size > 1 and args.device != "cpu":
        raise ValueError(
            f"--world-size spawns gloo ranks on CPU; for --device {args.device} run under torchrun"
        )
    if args.dense and args.world_size > 1:
        raise ValueError("--dense times one process; drop --world-size")


def _check_kernel(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming ``--kernel`` unless it can serve the benchmarked call."""
    from ringdilated.core import Request
    from ringdilated.registry import default_resolver

    resolver = default_resolver()
    device = torch.device(args.device)
    request = Request(
        resolver.env.device_type(device),
        flags.to_dtype(args.dtype),
        args.head_dim,
        resolver.env.capability(device),
        window=args.causal,
        backward=args.backward,
    )
    try:
        resolver.resolve(request, args.kernel)
    except ValueError as exc:  # ResolutionError is a ValueError
        raise ValueError(f"--kernel {args.kernel}: {exc}") from None


def _check_memory(args: argparse.Namespace) -> None:
    """Raise ``MemoryError`` when the largest row cannot fit (see :func:`memory.bench_bytes`)."""
    longest = max(args.lengths)
    need = memory.bench_bytes(
        longest,
        args.heads,
        args.head_dim,
        flags.to_dtype(args.dtype),
        world_size=args.world_size,
        backward=args.backward,
        dense=args.dense,
    )
    what = f"--lengths {longest} with --heads {args.heads}, --head-dim {args.head_dim}, "
    what += f"--dtype {args.dtype}"
    what += ", --backward" if args.backward else ""
    what += ", --dense" if args.dense else ""
    what += f", --world-size {args.world_size}" if args.world_size > 1 else ""
    reduce = "--lengths, --heads or --head-dim"
    drop = [flag for flag, on in (("--backward", args.backward), ("--dense", args.dense)) if on]
    reduce += f", or drop {' and '.join(drop)}" if drop else ""
    reduce += ", or lower --world-size" if args.world_size > 1 else ""
    memory.require_fits("bench", need, args.device, what, reduce)


def _check(args: argparse.Namespace) -> None:
    """Every check that needs more than one flag or this machine; all before any work."""
    flags.check_pattern(args.segments, args.rates, args.heads)
    _check_ranks(args)
    flags.require_device(args.device)
    _check_kernel(args)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError:
            raise ValueError(
                "--plot needs matplotlib: pip install -e '.[plot]' (in the ringdilated clone)"
            ) from None
    _check_memory(args)


def run(args: argparse.Namespace) -> int:
    _check(args)
    names = ["segments", "rates", "heads", "head_dim", "dtype", "causal", "backward", "kernel"]
    names += ["repeats", "device", "dense"]
    base = {name: getattr(args, name) for name in names}  # every rank's measure() reads them
    base["threads"] = torch.get_num_threads() // args.world_size
    pool = None
    if args.world_size > 1:
        from ringdilated.pool import Workers

        pool = Workers(args.world_size)
    rows = []
    try:
        for length in progress(args.lengths, "bench", enabled=not args.no_progress):
            config = {**base, "length": length}
            if pool is None:
                results = [measure(config)]
            else:
                results = pool.results(f"{__name__}:rank_task", config)
            rows.append(_row(config, results))
    finally:
        if pool is not None:
            pool.close()
    _report(rows, args)
    return 0


def _report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    columns = ["length", "ranks", "forward_s", "forward_gflops", "forward_peak_mib"]
    if args.backward:
        columns += ["fwd_bwd_s", "fwd_bwd_gflops", "fwd_bwd_peak_mib"]
    if args.dense:
        columns += ["dense_s", "dense_gflops", "dense_peak_mib"]
    fmt = {"s": "{:.4f}", "gflops": "{:.1f}", "mib": "{:.1f}"}

    def cell(key: str, value: Any) -> str:
        suffix = key.rsplit("_", 1)[-1]
        return fmt[suffix].format(value) if suffix in fmt else str(value)

    print(table([[cell(c, r[c]) for c in columns] for r in rows], columns))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": vars(args) | {"run": None},
                    "environment": environment(args.device, args.world_size),
                    "rows": rows,
                },
                f,
                indent=2,
                default=str,
            )
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    if args.plot:
        _plot(rows, args.plot)


#: The plotted series: (time column, peak memory column, legend label).
SERIES = (
    ("forward_s", "forward_peak_mib", "forward"),
    ("fwd_bwd_s", "fwd_bwd_peak_mib", "forward+backward"),
    ("dense_s", "dense_peak_mib", "dense SDPA"),
)


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    """Time (left) and peak extra memory (right) against sequence length: one line for each
    series in :data:`SERIES` that the rows hold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r["length"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for time_key, peak_key, label in SERIES:
        if time_key in rows[0]:
            left.plot(lengths, [r[time_key] for r in rows], marker="o", label=label)
        if peak_key in rows[0]:
            right.plot(lengths, [r[peak_key] for r in rows], marker="o", label=label)
    for axis, label in ((left, "time (s)"), (right, "peak extra memory (MiB)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    fig.suptitle(f"ringdilated, {rows[0]['ranks']} rank(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(device: str, world_size: int = 1) -> dict[str, Any]:
    """What a benchmark's figures depend on besides its flags, for the JSON output: the
    ringdilated, torch and Python versions, the device measured (type, name, and for CUDA the
    compute capability, memory and CUDA version), the machine (architecture, OS, CPU model,
    logical CPUs, memory, the threads each rank ran with) and the UTC time of the run."""
    import ringdilated

    where = torch.device(device)
    total = _proc_field("/proc/meminfo", "MemTotal")
    measured: dict[str, Any] = {"type": where.type, "name": _cpu_model()}
    if where.type == "cuda":
        index = where.index if where.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        measured = {
            "type": "cuda",
            "index": index,
            "name": properties.name,
            "compute_capability": f"{properties.major}.{properties.minor}",
            "memory_gib": properties.total_memory / 2**30,
            "cuda": torch.version.cuda,
        }
    return {
        "ringdilated": ringdilated.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": measured,
        "machine": {
            "architecture": platform.machine(),
            "system": platform.platform(),
            "cpu": _cpu_model(),
            "logical_cpus": os.cpu_count(),
            "memory_gib": None if total is None else int(total.split()[0]) * 1024 / 2**30,
            "threads_per_rank": max(1, torch.get_num_threads() // world_size),
            "ranks": world_size,
        },
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _proc_field(path: str, name: str) -> str | None:
    """What follows the ``:`` on the first line of ``path`` that starts with ``name``; ``None``
    where there is none, or no such file (Linux ``/proc`` only)."""
    try:
        with open(path) as lines:
            return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(name)), None)
    except OSError:
        return None


def _cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else what :mod:`platform` says."""
    model = _proc_field("/proc/cpuinfo", "model name")
    return model if model is not None else platform.processor() or platform.machine() or "unknown"
