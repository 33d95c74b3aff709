"""``torch.compile`` against eager: forward+backward of ``DilatedAttention``, side by side.

    python benchmarks/bench_compile.py                  # L = 8192, 7 rounds
    python benchmarks/bench_compile.py --length 16384 --rounds 3

Configuration (issue 12): B=1, H=8, D=64, causal, 4 patterns (segments [1024, 2048, 4096, 8192],
rates [1, 2, 4, 8]), float32, a loss on ``out`` only (so the lse's gradient is zero). The
compiled module is ``torch.compile(attn, fullgraph=True)`` with the default (inductor) backend;
eager and compiled runs alternate, ``--rounds`` times each after a warm-up, and the table gives
the best and median of each and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch

import ringdilated

SEGMENTS, RATES = [1024, 2048, 4096, 8192], [1, 2, 4, 8]


def _step(attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    start = time.perf_counter()
    out = attn(*leaves)
    out.square().sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    attn = ringdilated.DilatedAttention(SEGMENTS, RATES, causal=True)
    compiled = torch.compile(attn, fullgraph=True, backend=args.backend)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.length, 8, 64, generator=g) for _ in range(3))
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for module in (attn, compiled):  # warm-up (and compile)
        _step(module, q, k, v)
    for _ in range(args.rounds):
        times["eager"].append(_step(attn, q, k, v))
        times["compiled"].append(_step(compiled, q, k, v))
    eager, comp = (statistics.median(times[name]) for name in ("eager", "compiled"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, L={args.length}")
    print("| eager: best / median (s) | compiled: best / median (s) | compiled / eager |")
    print("|---|---|---|")
    print(
        f"| {min(times['eager']):.3f} / {eager:.3f} | {min(times['compiled']):.3f} / "
        f"{comp:.3f} | {comp / eager:.2f}x |"
    )


if __name__ == "__main__":
    main()
