"""What a planned layer call costs the host, side by side with PyTorch's own attention call.

    python benchmarks/bench_overhead.py                 # 7 interleaved rounds
    python benchmarks/bench_overhead.py --rounds 11 --calls 2000
    python benchmarks/bench_overhead.py --no-repair     # the sdpa kernel's non-finite repair off

Configuration (issue 20): one thread, float32, CPU. ``L=64, H=3, D=8`` (compute negligible: what
is timed is Python and dispatch), ``DilatedAttention([16, 32, 64], [1, 2, 4])`` in steady state
(its call planned by an earlier one), against one ``F.scaled_dot_product_attention`` call on the
same tensors in ``(B, H, L, D)``:

- ``forward``: without autograd (inputs need no gradient); target ours <= 5x SDPA;
- ``forward+backward``: inputs that need gradients, ``out.sum().backward()``; target <= 4.5x.

Each round times both, interleaved, each over ``--calls`` calls; the table gives the best and the
median per call and the ratio of the medians (the spread: the ratios' range over rounds). It also
counts, with :class:`ringdilated.testing.hot_path.HotPathCounter`, the host reads, copies from
Python data and control collectives of one steady-state call (target 0), and, where
``benchmarks/bench_decode.py`` provides it, the decode-step comparison (target <= 1.3x).
``--no-repair`` replaces the ``sdpa`` kernel's device-side non-finite repair with no-ops (as
``benchmarks/bench_non_finite.py`` does), to show what it costs at this size; results are then
wrong for non-finite inputs, so it is for measuring only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import ringdilated
from ringdilated.testing.hot_path import HotPathCounter

L, H, D = 64, 3, 8
SEGMENTS, RATES = [16, 32, 64], [1, 2, 4]


def _per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _pairs(calls: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, L, H, D, generator=g) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    attn = ringdilated.DilatedAttention(SEGMENTS, RATES)
    grads = [x.clone().requires_grad_() for x in (q, k, v)]
    grads_t = [x.clone().requires_grad_() for x in (qt, kt, vt)]

    def ours_forward() -> object:
        with torch.no_grad():
            return attn(q, k, v)

    def sdpa_forward() -> object:
        with torch.no_grad():
            return F.scaled_dot_product_attention(qt, kt, vt)

    def ours_both() -> None:
        attn(*grads).sum().backward()

    def sdpa_both() -> None:
        F.scaled_dot_product_attention(*grads_t).sum().backward()

    return {"forward": (ours_forward, sdpa_forward), "forward+backward": (ours_both, sdpa_both)}


def _traffic(step: Callable[[], object]) -> int:
    step()  # plans
    with HotPathCounter() as counts:
        step()
    return counts.host_traffic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--no-decode", action="store_true", help="skip the decode-step rows")
    parser.add_argument(
        "--no-repair", action="store_true", help="time without the sdpa kernel's non-finite repair"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.no_repair:
        sys.path.insert(0, os.path.dirname(__file__))
        from bench_non_finite import _bare  # type: ignore[import-not-found]

        _bare()
        print("the sdpa kernel's non-finite repair is OFF (measuring only)")
    pairs = _pairs(args.calls)
    print(
        f"torch {torch.__version__}, ringdilated {ringdilated.__version__}, one thread, "
        f"L={L} H={H} D={D}, patterns {SEGMENTS}/{RATES}, {args.rounds} rounds x {args.calls} calls"
    )
    print(f"{'call':<18}{'SDPA us (best/med)':>20}{'ours us (best/med)':>20}"
          f"{'ratio (med)':>13}{'range':>14}{'host traffic':>14}")  # fmt: skip
    for name, (ours, sdpa) in pairs.items():
        traffic = _traffic(ours)
        for fn in (ours, sdpa):  # warm up
            _per_call(fn, 50)
        times: dict[str, list[float]] = {"ours": [], "sdpa": []}
        for _ in range(args.rounds):
            times["sdpa"].append(_per_call(sdpa, args.calls))
            times["ours"].append(_per_call(ours, args.calls))
        ratios = [o / s for o, s in zip(times["ours"], times["sdpa"], strict=True)]
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"{name:<18}{min(times['sdpa']):>9.1f} / {med['sdpa']:<8.1f}"
            f"{min(times['ours']):>9.1f} / {med['ours']:<8.1f}"
            f"{med['ours'] / med['sdpa']:>12.2f}x{min(ratios):>7.2f}-{max(ratios):.2f}x"
            f"{traffic:>14}"
        )
    if args.no_decode:
        return
    sys.path.insert(0, os.path.dirname(__file__))
    try:
        from bench_decode import decode_step_rows  # type: ignore[import-not-found]
    except ImportError as exc:
        print(f"decode step: not measured ({exc})")
        return
    for row in decode_step_rows(args.rounds):
        print("decode step: " + ", ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
