"""Packed documents against a padded batch, at equal real tokens.

    python benchmarks/bench_packed.py
    python benchmarks/bench_packed.py --documents 16 --rounds 5

The same documents (lengths drawn uniformly from [256, 4096], seeded) run three ways, forward
and backward, float32, H=8, D=64, segments [512, 1024, 2048], rates [1, 2, 4], causal, the
``sdpa`` kernel on CPU:

- ``packed``: one row, ``cu_seqlens``;
- ``padded, masked``: one row per document, right-padded to the longest, ``key_padding_mask``;
- ``padded, whole rows``: the same padded batch without a mask (what a padded batch costs when
  padding is computed; the results differ, this is the cost reference).

It prints best and median seconds and real tokens per second (padding not counted).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import ringdilated

H, D = 8, 64
SEGMENTS, RATES = [512, 1024, 2048], [1, 2, 4]


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> None:
    out = ringdilated.dilated_attention(
        q,
        k,
        v,
        SEGMENTS,
        RATES,
        causal=True,
        kernel="sdpa",
        **kwargs,  # type: ignore[arg-type]
    )
    out.sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(256, 4097, (args.documents,), generator=g).tolist()
    total, longest = sum(lengths), max(lengths)
    packed = [torch.randn(1, total, H, D, generator=g).requires_grad_() for _ in range(3)]
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    padded = [torch.zeros(len(lengths), longest, H, D) for _ in range(3)]
    mask = torch.ones(len(lengths), longest, dtype=torch.bool)
    for row, (start, n) in enumerate(zip(bounds[:-1].tolist(), lengths, strict=True)):
        for target, source in zip(padded, packed, strict=True):
            target[row, :n] = source[0, start : start + n].detach()
        mask[row, :n] = False
    padded = [x.requires_grad_() for x in padded]
    variants: dict[str, Callable[[], None]] = {
        "packed": lambda: _step(*packed, cu_seqlens=bounds),
        "padded, masked": lambda: _step(*padded, key_padding_mask=mask),
        "padded, whole rows": lambda: _step(*padded),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up
    for _ in range(args.rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(lengths)} documents, "
        f"{total} tokens (padded batch {len(lengths)} x {longest} = {len(lengths) * longest}); "
        f"forward+backward, {args.rounds} rounds"
    )
    print("| variant | best / median (s) | real tokens/s (best) |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.3f} / {statistics.median(ts):.3f} | {total / min(ts):,.0f} |")


if __name__ == "__main__":
    main()
