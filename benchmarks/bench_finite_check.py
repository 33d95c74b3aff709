"""What the finiteness check costs: forward time with and without it, side by side.

    python benchmarks/bench_finite_check.py            # L = 65536 and 8192, 7 rounds
    python benchmarks/bench_finite_check.py --rounds 3 --lengths 8192

Every fused built-in kernel sums its inputs once per call to decide whether they hold NaN or
infinity (and runs the exact dense math if so; see ``ringdilated.backends._dense``). This runs
the default configuration (B=1, H=8, D=64, segments [2048, 4096, 8192], rates [1, 2, 4], float32,
head_groups, forward, ``sdpa`` on CPU) alternately with the check as shipped and with it replaced
by ``True``, ``--rounds`` times each, interleaved so both see the same machine load, and prints
the best and median time of each and the overhead of the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch

import ringdilated
from ringdilated.backends import _dense

SEGMENTS, RATES = [2048, 4096, 8192], [1, 2, 4]


def _time(q: torch.Tensor) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        ringdilated.dilated_attention(q, q, q, SEGMENTS, RATES, kernel="sdpa")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="65536,8192")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    checked = _dense.all_finite
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| L | with check: best / median (s) | without: best / median (s) | overhead |")
    print("|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        q = torch.randn(1, length, 8, 64)
        times: dict[bool, list[float]] = {True: [], False: []}
        _time(q)  # warm-up
        for _ in range(args.rounds):
            for on in (True, False):
                _dense.all_finite = checked if on else (lambda *tensors: True)
                times[on].append(_time(q))
        _dense.all_finite = checked
        with_, without = (statistics.median(times[on]) for on in (True, False))
        print(
            f"| {length} | {min(times[True]):.4f} / {with_:.4f} | "
            f"{min(times[False]):.4f} / {without:.4f} | {100 * (with_ / without - 1):+.1f}% |"
        )


if __name__ == "__main__":
    main()
