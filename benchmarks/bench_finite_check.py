"""What the finiteness check costs: forward+backward time with and without it, side by side.

    python benchmarks/bench_finite_check.py            # 7 rounds of each configuration
    python benchmarks/bench_finite_check.py --rounds 3

The driver sums a call's inputs once (forward: q, k, v; backward: also dout) to decide whether
they hold NaN or infinity, and hands the answer to every kernel call (which then runs the exact
dense math if they do; see ``ringdilated.backends._dense``). This runs B=1, H=8, D=64, float32,
head_groups, ``sdpa`` on CPU, forward+backward, for long segments (L=65536, segments [2048, 4096,
8192]) and short ones (L=1024, segments [16, 32, 64]; many small kernel calls), rates [1, 2, 4],
alternately with the check as shipped and with it replaced by ``True``, ``--rounds`` times each,
interleaved so both see the same machine load; it prints the best and median time of each and
the overhead of the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch

import ringdilated
from ringdilated.core import driver

CONFIGS = ((65536, [2048, 4096, 8192]), (1024, [16, 32, 64]))
RATES = [1, 2, 4]


def _time(q: torch.Tensor, segments: list[int]) -> float:
    leaf = q.detach().requires_grad_()
    start = time.perf_counter()
    out = ringdilated.dilated_attention(leaf, leaf, leaf, segments, RATES, kernel="sdpa")
    out.sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    checked = driver.all_finite
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        "| L | segments | with check: best / median (s) | without: best / median (s) | overhead |"
    )
    print("|---|---|---|---|---|")
    for length, segments in CONFIGS:
        q = torch.randn(1, length, 8, 64)
        times: dict[bool, list[float]] = {True: [], False: []}
        _time(q, segments)  # warm-up
        for _ in range(args.rounds):
            for on in (True, False):
                driver.all_finite = checked if on else (lambda *tensors: True)
                times[on].append(_time(q, segments))
        driver.all_finite = checked
        with_, without = (statistics.median(times[on]) for on in (True, False))
        print(
            f"| {length} | {segments} | {min(times[True]):.4f} / {with_:.4f} | "
            f"{min(times[False]):.4f} / {without:.4f} | {100 * (with_ / without - 1):+.1f}% |"
        )


if __name__ == "__main__":
    main()
