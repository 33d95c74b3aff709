"""What the pattern costs over the kernel: the forward against the same kernel calls on
contiguous copies of the same blocks, side by side.

    python benchmarks/bench_pattern_overhead.py              # L = 65536, 7 rounds
    python benchmarks/bench_pattern_overhead.py --rounds 11 --length 32768

Configuration (issue 12): B=1, H=8, D=64, float32, ``segment_lengths=[2048, 4096, 8192]``,
``dilation_rates=[1, 2, 4]``, ``head_groups``, not causal, the ``sdpa`` kernel on CPU (PyTorch's
flash op, ``aten._scaled_dot_product_flash_attention_for_cpu``). Each round times, interleaved:

- ``dilated``: ``ringdilated.dilated_attention`` forward, without autograd;
- ``op, contiguous``: the op called directly on every kernel call of the same run (the driver's
  own chunks), on contiguous copies made before timing: the kernel's own speed on these blocks;
- ``op, strided``: the op on the driver's strided views, no driver around it: what reading
  dilated, head-interleaved memory costs the op itself.

It prints best and median of each, wall-clock and process CPU time (both threads; steadier than
wall-clock on a shared machine), and ``op, contiguous`` over each (target for ``dilated``: at
least 0.95).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch

import ringdilated
from ringdilated.core.call.prepare import CallOptions, prepare_call
from ringdilated.registry import default_resolver

H, D = 8, 64
SEGMENTS, RATES = [2048, 4096, 8192], [1, 2, 4]
_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _kernel_calls(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    plan = prepare_call((SEGMENTS, RATES, "head_groups"), q, k, v, CallOptions(kernel="sdpa"),
                        default_resolver())  # fmt: skip
    run = plan.run(q, k)
    B, L, _, _ = q.shape
    return [
        (c.kernel_input(q), c.kernel_input(k, True), c.kernel_input(v, True), c.options.scale)
        for c in run.chunks(B, L, D, True)
    ]


def _ops(calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]) -> None:
    for q, k, v, scale in calls:
        _op(q, k, v, 0.0, False, scale=scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.length, H, D, generator=g) for _ in range(3))
    strided = _kernel_calls(q, k, v)
    contiguous = [(a.contiguous(), b.contiguous(), c.contiguous(), s) for a, b, c, s in strided]

    def dilated() -> None:
        ringdilated.dilated_attention(q, k, v, SEGMENTS, RATES, kernel="sdpa")

    variants = {
        "dilated": dilated,
        "op, contiguous": lambda: _ops(contiguous),
        "op, strided": lambda: _ops(strided),
    }
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        for fn in variants.values():
            fn()  # warm-up
        for _ in range(args.rounds):
            for name, fn in variants.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                fn()
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, L={args.length}, "
        f"{len(strided)} kernel calls, {args.rounds} rounds; the ratio is op, contiguous / "
        "variant (1.0 = as fast as the op on contiguous blocks)"
    )
    print("| variant | wall best / median (s) | ratio | CPU best / median (s) | ratio |")
    print("|---|---|---|---|---|")
    for name in variants:
        cells = []
        for times in (wall, cpu):
            ts, base = times[name], times["op, contiguous"]
            best, median = min(ts), statistics.median(ts)
            ratio = f"{min(base) / best:.3f}, {statistics.median(base) / median:.3f}"
            cells += [f"{best:.4f} / {median:.4f}", ratio]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
