"""What the device-side non-finite repair costs: PyTorch's CPU flash op with and without it.

    python benchmarks/bench_non_finite.py              # 7 rounds of each configuration
    python benchmarks/bench_non_finite.py --rounds 3 --no-call

The ``sdpa`` kernel always calls the op and then repairs its results on the device, with no host
read (docs/spec.md, section 4; ``ringdilated.backends.sdpa``): forward, a sum of ``q - q`` over
each row and of ``k - k`` over each problem, added to ``out`` and ``lse``; backward, nothing
beyond the one pass over the merged ``lse`` that the op needs anyway (``-inf`` to 0), which also
turns ``+inf`` into NaN. The bare variant keeps the contract's parts (rows that see no key; the
lse the op takes) and drops the rest.
This times, on finite inputs, one thread:

- ``kernel``: forward+backward of ``CpuFlashAttention`` on the very blocks the driver hands it
  (strided views of ``(B, L, H, D)`` tensors, one call per pattern: ``head_groups``, 3+3+2
  heads, not causal), with the repair as shipped and without it (the bare op);
- ``call`` (unless ``--no-call``): ``ringdilated.dilated_attention(..., kernel="sdpa")``
  forward+backward, the same two ways, so the share of a whole call shows.

Configurations: B=1, H=8, D=64, float32, rates [1, 2, 4]; L=65536 with segments [2048, 4096,
8192] (the issue's sizes) and L=1024 with segments [16, 32, 64] (many small problems per call).
Rounds are interleaved (repaired, bare, repaired, ...) so both see the same machine load; it
prints the best and median of each and the overhead of the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch

import ringdilated
from ringdilated.backends import sdpa
from ringdilated.core.contract.kernel import BlockOptions

B, H, D = 1, 8, 64
CONFIGS = ((65536, [2048, 4096, 8192]), (1024, [16, 32, 64]))
RATES = [1, 2, 4]
HEADS = ((0, 3), (3, 6), (6, 8))  # head_groups: 8 heads over 3 patterns


def _blocks(x: torch.Tensor, segments: list[int]) -> list[torch.Tensor]:
    """Pattern ``i``'s kernel input: segments of ``w`` as problems, every ``r``-th position from
    offset ``i % r``, the group's heads, in kernel layout (a strided view, as the driver's)."""
    length = x.shape[1]
    views = []
    for i, (w, r) in enumerate(zip(segments, RATES, strict=True)):
        first, last = HEADS[i]
        segmented = x.view(B * length // w, w, H, D)
        views.append(segmented[:, i % r :: r, first:last].transpose(1, 2))
    return views


def _kernel_step(q: torch.Tensor, segments: list[int]) -> Callable[[], None]:
    kernel = sdpa.CpuFlashAttention()
    options = BlockOptions(scale=D**-0.5)
    blocks = _blocks(q, segments)
    douts = [torch.randn(b.shape) for b in blocks]

    def step() -> None:
        for block, dout in zip(blocks, douts, strict=True):
            out, lse = kernel.forward(block, block, block, options)
            kernel.backward(dout, block, block, block, out, lse, options)

    return step


def _call_step(q: torch.Tensor, segments: list[int]) -> Callable[[], None]:
    def step() -> None:
        leaf = q.detach().requires_grad_()
        out = ringdilated.dilated_attention(leaf, leaf, leaf, segments, RATES, kernel="sdpa")
        out.sum().backward()

    return step


def _timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def _bare() -> Callable[[], None]:
    """Replace the forward's repair with the contract's part alone; returns the undo. (The
    backward's lse pass stays: the op needs ``-inf`` turned into 0 with or without the repair.)"""
    saved = sdpa._mark_rows_seeing_non_finite

    def rows(out, lse, q, k, options):  # type: ignore[no-untyped-def]
        options.mark_empty_rows(out, lse)  # the contract's part, not the repair's

    sdpa._mark_rows_seeing_non_finite = rows

    def undo() -> None:
        sdpa._mark_rows_seeing_non_finite = saved

    return undo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-call", action="store_true", help="time the kernel level only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, {args.rounds} rounds")
    print("| level | L | segments | repaired: best / median (s) | bare op: best / median (s) "
          "| overhead (medians) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    levels = [("kernel", _kernel_step)] + ([] if args.no_call else [("call", _call_step)])
    for length, segments in CONFIGS:
        q = torch.randn(B, length, H, D)
        for level, make in levels:
            step = make(q, segments)
            step()  # warm-up
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.rounds):
                for repaired in (True, False):
                    undo = (lambda: None) if repaired else _bare()
                    try:
                        times[repaired].append(_timed(step))
                    finally:
                        undo()
            on, off = (statistics.median(times[r]) for r in (True, False))
            print(
                f"| {level} | {length} | {segments} | {min(times[True]):.4f} / {on:.4f} | "
                f"{min(times[False]):.4f} / {off:.4f} | {100 * (on / off - 1):+.1f}% |"
            )


if __name__ == "__main__":
    main()
