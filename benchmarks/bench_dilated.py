"""Single-process dilated attention benchmark: time, GFLOP/s, fraction of matmul, peak memory.

    python benchmarks/bench_dilated.py                 # the full grid (a few minutes on 2 cores)
    python benchmarks/bench_dilated.py --quick         # L <= 16384
    python benchmarks/bench_dilated.py --json out.json

Configuration (issue 2): B=1, H=8, D=64, segment_lengths=[2048, 4096, 8192],
dilation_rates=[1, 2, 4], head_groups mode, not causal.

- GFLOP/s counts only the pattern's work: ``DilationPattern.flops`` = sum over blocks of
  ``4 * n^2 * D`` per head and segment (QK^T and PV, 2 FLOPs per multiply-add). Forward+backward
  counts 3.5x that (backward = 2.5x forward, FlashAttention's convention: it recomputes QK^T).
- ``matmul``: best of 5 warm runs of a 4096 x 4096 matmul in the same dtype, measured in this run.
- ``dense SDPA``: ``torch.nn.functional.scaled_dot_product_attention`` over the whole sequence
  (forward), where its O(L^2) time is affordable (L <= 16384).
- Peak memory: each configuration runs in a fresh process; Linux's peak-RSS counter is reset just
  before its first call (``/proc/self/clear_refs``) and read after. "extra" is the peak minus
  what was
  resident before the call minus the call's outputs (``out``; with backward also dq, dk, dv), as a
  fraction of the size of q, k, v and out.
- Times are the best of ``--repeats`` warm runs.

PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` (transparent huge pages for its CPU allocations) is set unless
already set: without it every fresh 100 MB+ tensor costs ~30k page faults, which this machine's
kernel serves slowly. Pass ``--no-thp`` to measure without it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from ringdilated.cli.procstat import reset_peak, status_bytes

SEGMENTS = [2048, 4096, 8192]
RATES = [1, 2, 4]
B, H, D = 1, 8, 64
LENGTHS = [4096, 8192, 16384, 32768, 65536, 131072, 262144]
DENSE_MAX = 16384


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(length: int, dtype_name: str, backward: bool, repeats: int) -> dict[str, Any]:
    """One configuration, in this (fresh) process."""
    import torch

    import ringdilated

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, length, H, D, dtype=dtype, requires_grad=backward) for _ in range(3))
    dout = torch.randn(B, length, H, D, dtype=dtype) if backward else None

    def call() -> None:
        out = ringdilated.dilated_attention(q, k, v, SEGMENTS, RATES)
        if backward:
            out.backward(dout)
            q.grad = k.grad = v.grad = None

    # Peak memory of the first call, before any allocator cache exists, outputs kept alive as a
    # user's would be; then the timed warm calls.
    before = status_bytes("VmRSS")
    reset_peak()
    out = ringdilated.dilated_attention(q, k, v, SEGMENTS, RATES)
    if backward:
        out.backward(dout)
    peak = status_bytes("VmHWM")
    del out
    q.grad = k.grad = v.grad = None
    seconds = _best(call, repeats)
    tensor_bytes = q.numel() * q.element_size()
    outputs = tensor_bytes * (4 if backward else 1)
    extra = peak - before - outputs
    flops = ringdilated.DilationPattern(SEGMENTS, RATES).flops(length, H, D) * (
        3.5 if backward else 1
    )
    return {
        "L": length,
        "dtype": dtype_name,
        "pass": "fwd+bwd" if backward else "fwd",
        "seconds": seconds,
        "gflops": flops / seconds / 1e9,
        "extra_bytes": extra,
        "extra_fraction": extra / (4 * tensor_bytes),
        "kernel": ringdilated.default_resolver()
        .resolve(ringdilated.Request(dtype=dtype, head_dim=D, backward=backward))
        .kernel_name,
    }


def matmul_gflops(dtype_name: str) -> float:
    import torch

    a, b = (torch.randn(4096, 4096, dtype=getattr(torch, dtype_name)) for _ in range(2))
    return 2 * 4096**3 / _best(lambda: a @ b, 5) / 1e9


def dense_sdpa_gflops(length: int, dtype_name: str) -> float:
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(B, H, length, D, dtype=getattr(torch, dtype_name)) for _ in range(3))
    seconds = _best(lambda: F.scaled_dot_product_attention(q, k, v), 2)
    return 4 * length * length * D * H / seconds / 1e9


def _child(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, __file__, *args], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="L <= 16384 only")
    parser.add_argument("--lengths", type=int, nargs="*", help="sequence lengths to run")
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--no-thp", action="store_true", help="leave THP_MEM_ALLOC_ENABLE unset")
    parser.add_argument(
        "--child", nargs=4, metavar=("L", "DTYPE", "BACKWARD", "REPEATS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()

    if args.child:
        length, dtype_name, backward, repeats = args.child
        print(json.dumps(measure(int(length), dtype_name, backward == "1", int(repeats))))
        return

    env = dict(os.environ)
    if not args.no_thp:
        env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    lengths = args.lengths or [n for n in LENGTHS if not args.quick or n <= DENSE_MAX]
    import platform

    import torch

    header = (
        f"# ringdilated benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, THP_MEM_ALLOC_ENABLE="
        f"{env.get('THP_MEM_ALLOC_ENABLE', 'unset')}"
    )
    print(header, flush=True)
    matmul = {d: _child(["--child", "0", d, "mm", "0"], env)["gflops"] for d in args.dtypes}
    print(
        "matmul 4096^2 GFLOP/s: " + ", ".join(f"{d} {g:.0f}" for d, g in matmul.items()), flush=True
    )
    rows = []
    print(
        "| L | dtype | pass | kernel | time (s) | GFLOP/s | / matmul | dense SDPA GFLOP/s "
        "| extra peak MiB | extra / (q,k,v,out) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype_name in args.dtypes:
        for length in lengths:
            dense = (
                _child(["--child", str(length), dtype_name, "dense", "0"], env)["gflops"]
                if length <= DENSE_MAX
                else None
            )
            for backward in (False, True):
                repeats = 3 if length <= 65536 else 1
                row = _child(
                    ["--child", str(length), dtype_name, "1" if backward else "0", str(repeats)],
                    env,
                )
                row["matmul_fraction"] = row["gflops"] / matmul[dtype_name]
                row["dense_sdpa_gflops"] = dense if not backward else None
                rows.append(row)
                dense_text = f"{dense:.0f}" if dense is not None and not backward else "-"
                print(
                    f"| {length} | {dtype_name} | {row['pass']} | {row['kernel']} | "
                    f"{row['seconds']:.3f} | "
                    f"{row['gflops']:.0f} | {row['matmul_fraction']:.2f} | {dense_text} | "
                    f"{row['extra_bytes'] / 2**20:.0f} | {row['extra_fraction']:.3f} |",
                    flush=True,
                )
    by_key = {(r["L"], r["dtype"], r["pass"]): r for r in rows}
    print("\nforward+backward / forward time:")
    for (length, dtype_name, kind), row in sorted(by_key.items()):
        if kind == "fwd" and (length, dtype_name, "fwd+bwd") in by_key:
            ratio = by_key[(length, dtype_name, "fwd+bwd")]["seconds"] / row["seconds"]
            print(f"  L={length} {dtype_name}: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            from ringdilated.cli.bench import environment

            machine = environment("cpu")
            json.dump(
                {"header": header, "environment": machine, "matmul_gflops": matmul, "rows": rows},
                f,
                indent=2,
            )


def _child_main() -> None:
    """``--child 0 DTYPE mm 0`` / ``--child L DTYPE dense 0`` run the baselines."""
    _, _, length, dtype_name, what, _ = sys.argv
    if what == "mm":
        print(json.dumps({"gflops": matmul_gflops(dtype_name)}))
    else:
        print(json.dumps({"gflops": dense_sdpa_gflops(int(length), dtype_name)}))


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child" and sys.argv[4] in ("mm", "dense"):
        _child_main()
    else:
        main()
