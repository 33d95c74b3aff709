"""What fusing small kernel calls buys: packed short documents, fused against separate calls.

    python benchmarks/bench_fused.py                  # L = 8192 and 32768, 3 rounds
    python benchmarks/bench_fused.py --lengths 4096 --rounds 5

Configuration: one thread, float32, CPU, no autograd; B=1, H=4, D=32, documents of 16 tokens
(``cu_seqlens`` every 16 positions, one ``SequenceLayout`` per run), segments [16, 32, 64],
rates [1, 2, 4], ``head_groups``, kernel ``sdpa``. Each variant (``fused``: the shipped
``ringdilated.core.run.local.FUSE_ELEMENTS``; ``separate``: ``FUSE_ELEMENTS = 0``, every step its
own kernel call) times its first call on a fresh layout (planning, and for ``fused`` building the
calls' indexes) and the best of ``--rounds`` steady-state calls, alternating variants. The plugin
registry is loaded before anything is timed.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

import ringdilated
from ringdilated.core.run import local as driver

H, D = 4, 32
SEGMENTS, RATES = [16, 32, 64], [1, 2, 4]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shipped = driver.FUSE_ELEMENTS
    print(f"torch {torch.__version__}, one thread, H={H} D={D}, 16-token documents")
    print("| L | variant | first call (ms) | steady call, best (ms) |")
    print("|---|---|---|---|")
    with torch.no_grad():
        warm = torch.randn(1, 64, H, D)
        ringdilated.dilated_attention(warm, warm, warm, SEGMENTS, RATES)  # loads the registry
        for length in args.lengths:
            q, k, v = (torch.randn(1, length, H, D) for _ in range(3))
            cu = torch.arange(0, length + 1, 16)
            for name, budget in (("fused", shipped), ("separate", 0)):
                driver.FUSE_ELEMENTS = budget
                try:
                    call = functools.partial(
                        ringdilated.dilated_attention, q, k, v, SEGMENTS, RATES,
                        kernel="sdpa", layout=ringdilated.SequenceLayout(cu_seqlens=cu),
                    )  # fmt: skip
                    first = _timed(call)
                    steady = min(_timed(call) for _ in range(args.rounds))
                finally:
                    driver.FUSE_ELEMENTS = shipped
                print(f"| {length} | {name} | {first * 1e3:.0f} | {steady * 1e3:.1f} |")


if __name__ == "__main__":
    main()
