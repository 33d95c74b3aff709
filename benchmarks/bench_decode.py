"""Decoding with DilatedKVCache: memory and time per token as the decoded length grows.

    python benchmarks/bench_decode.py                       # to 1M positions
    python benchmarks/bench_decode.py --length 100000 --steps 10

B=1, H=8, D=64, float32, segments [2048, 4096, 8192], rates [1, 2, 4], causal, ``head_groups``,
the ``sdpa`` kernel on CPU. The cache is filled by chunked prefill (``--chunk`` tokens a call,
the same exact computation), and at each checkpoint ``--steps`` single tokens are decoded and
timed. It prints, per checkpoint: the cache's bytes and positions held, what a full key/value
cache of that length would hold, and the best and median time per decoded token.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ringdilated import DilatedKVCache

H, D = 8, 64
SEGMENTS, RATES = [2048, 4096, 8192], [1, 2, 4]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    cache = DilatedKVCache(SEGMENTS, RATES, num_heads=H, causal=True, kernel="sdpa")
    # Not multiples of the segment lengths, so the current segments are partly filled.
    checkpoints = sorted({c for c in (1000, 10_000, 100_000, args.length) if c <= args.length})
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; B=1, H={H}, D={D}, "
        f"float32, segments {SEGMENTS}, rates {RATES}, causal, sdpa; {args.steps} decoded "
        "tokens per checkpoint"
    )
    print("| position | cache MiB (positions) | full KV cache MiB | per token best / median (ms) |")
    print("|---|---|---|---|")
    with torch.no_grad():
        for checkpoint in checkpoints:
            while cache.length < checkpoint - args.steps:
                m = min(args.chunk, checkpoint - args.steps - cache.length)
                x = torch.randn(1, m, H, D, generator=g)
                cache.attend(x, x, x)
            times = []
            for _ in range(args.steps):
                x = torch.randn(1, 1, H, D, generator=g)
                start = time.perf_counter()
                cache.attend(x, x, x)
                times.append(time.perf_counter() - start)
            full = 2 * cache.length * H * D * 4 / 2**20
            print(
                f"| {cache.length} | {cache.nbytes / 2**20:.2f} ({cache.cached_positions}) | "
                f"{full:.1f} | {min(times) * 1e3:.2f} / {statistics.median(times) * 1e3:.2f} |"
            )


if __name__ == "__main__":
    main()
