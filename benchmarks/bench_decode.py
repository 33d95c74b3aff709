"""Decoding with DilatedKVCache: memory and time per token as the decoded length grows.

    python benchmarks/bench_decode.py                       # to 1M positions
    python benchmarks/bench_decode.py --length 100000 --steps 10
    python benchmarks/bench_decode.py --overhead --rounds 15  # a block's step against SDPA

B=1, H=8, D=64, float32, segments [2048, 4096, 8192], rates [1, 2, 4], causal, ``head_groups``,
the ``sdpa`` kernel on CPU. The cache is filled by chunked prefill (``--chunk`` tokens a call,
the same exact computation), and at each checkpoint ``--steps`` single tokens are decoded and
timed. It prints, per checkpoint: the cache's bytes and positions held, what a full key/value
cache of that length would hold, and the best and median time per decoded token.

``--overhead`` (issue 20) instead times, side by side on one thread, one decode step of a
:class:`~ringdilated.DilatedTransformerBlock` (E=512, 8 heads, segments [256, 512, 1024], rates
[1, 2, 4], causal, float32, after a 1000-token prompt, no autograd) in both modes against
:class:`MinimalCachedLayer`, a pre-norm layer of the same width written here: LayerNorm, one qkv
projection, a preallocated key/value cache written in place, one
``F.scaled_dot_product_attention`` over the 1001 cached positions, the output projection, the
residual, LayerNorm, a 4x feed-forward network with GELU and the residual. Each of ``--rounds``
rounds times ``--steps`` consecutive steps of every contender, in alternating order; it prints
the best and median of the rounds' mean step times, wall-clock and the thread's CPU time, and
each one's ratio to the minimal layer (target: within 1.3x). :func:`decode_step_rows` returns
the same table for other benchmarks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ringdilated import DilatedKVCache, DilatedTransformerBlock

H, D = 8, 64
SEGMENTS, RATES = [2048, 4096, 8192], [1, 2, 4]
EMBED, PROMPT = 512, 1000
STEP_SEGMENTS, STEP_RATES = [256, 512, 1024], [1, 2, 4]


class MinimalCachedLayer(nn.Module):
    """The floor a decode step is measured against: a pre-norm layer with a preallocated
    key/value cache and one SDPA call over the cached positions (no sub-layer norms)."""

    def __init__(self, embed_dim: int, num_heads: int, capacity: int) -> None:
        super().__init__()
        self.heads, self.head_dim = num_heads, embed_dim // num_heads
        self.norm1, self.norm2 = nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim)
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)
        self.up, self.down = (
            nn.Linear(embed_dim, 4 * embed_dim),
            nn.Linear(4 * embed_dim, embed_dim),
        )
        shape = (1, num_heads, capacity, self.head_dim)
        self.register_buffer("keys", torch.zeros(shape), persistent=False)
        self.register_buffer("values", torch.zeros(shape), persistent=False)

    def step(self, x: torch.Tensor, position: int) -> torch.Tensor:
        """One token ``x`` ``(1, 1, E)`` at ``position``, attending positions ``[0, position]``."""
        q, k, v = self.qkv(self.norm1(x)).view(1, 1, 3, self.heads, self.head_dim).unbind(2)
        self.keys[:, :, position].copy_(k[:, 0])
        self.values[:, :, position].copy_(v[:, 0])
        end = position + 1
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), self.keys[:, :, :end], self.values[:, :, :end]
        )
        x = x + self.out(attended.transpose(1, 2).reshape(x.shape))
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.norm2(x))))
        return out


def decode_step_rows(rounds: int, steps: int = 50) -> list[dict[str, object]]:
    """Per contender (``step``): best and median of the rounds' mean decode-step time in
    microseconds, wall-clock (``wall_best_us``, ``wall_median_us``) and the thread's CPU time
    (``cpu_...``: steadier on a shared machine), and their ratios to the minimal cached layer's
    (``wall_best_ratio``, ``wall_median_ratio``, ``cpu_...``). One thread; see the module
    docstring."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _decode_step_rows(rounds, steps)
    finally:
        torch.set_num_threads(threads)


def _decode_step_rows(rounds: int, steps: int) -> list[dict[str, object]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randn(1, PROMPT, EMBED, generator=g)
    tokens = torch.randn(steps, 1, 1, EMBED, generator=g)
    contenders: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    minimal = MinimalCachedLayer(EMBED, H, PROMPT + 1).eval()
    minimal.keys.normal_(generator=g)
    minimal.values.normal_(generator=g)
    contenders["minimal pre-norm layer, one SDPA over 1001 cached positions"] = lambda x: (
        minimal.step(x, PROMPT)
    )
    for mode in ("head_groups", "longnet"):
        block = DilatedTransformerBlock(
            EMBED, H, segment_lengths=STEP_SEGMENTS, dilation_rates=STEP_RATES, mode=mode,
            causal=True, dtype=torch.float32,
        ).eval()  # fmt: skip
        cache = block.make_cache()
        with torch.no_grad():
            block(prompt, cache=cache)

        def step(
            x: torch.Tensor, block: nn.Module = block, cache: DilatedKVCache = cache
        ) -> torch.Tensor:
            out: torch.Tensor = block(x, cache=cache)
            return out

        contenders[f"DilatedTransformerBlock, {mode}, cached step"] = step
    names = list(contenders)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for name in names:  # warm-up
            for x in tokens[:5]:
                contenders[name](x)
        for i in range(rounds):
            for name in names if i % 2 == 0 else names[::-1]:
                one = contenders[name]
                start, start_cpu = time.perf_counter(), time.thread_time()
                for x in tokens:
                    one(x)
                cpu[name].append((time.thread_time() - start_cpu) / steps)
                wall[name].append((time.perf_counter() - start) / steps)
    rows: list[dict[str, object]] = []
    for name in names:
        row: dict[str, object] = {"step": name}
        for clock, times in (("wall", wall), ("cpu", cpu)):
            floor = times[names[0]]
            best, median = min(times[name]), statistics.median(times[name])
            row[f"{clock}_best_us"], row[f"{clock}_median_us"] = best * 1e6, median * 1e6
            row[f"{clock}_best_ratio"] = best / min(floor)
            row[f"{clock}_median_ratio"] = median / statistics.median(floor)
        rows.append(row)
    return rows


def _print_overhead(rounds: int, steps: int) -> None:
    rows = decode_step_rows(rounds, steps)
    print(
        f"torch {torch.__version__}, 1 thread; E={EMBED}, H={H}, float32, segments "
        f"{STEP_SEGMENTS}, rates {STEP_RATES}, causal, {PROMPT}-token prompt; {rounds} rounds "
        f"of {steps} steps; wall-clock and the thread's CPU time"
    )
    print(
        "| decode step | wall best / median (us) | over the minimal layer | "
        "CPU best / median (us) | over the minimal layer |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        cells = [str(row["step"])]
        for clock in ("wall", "cpu"):
            cells.append(f"{row[f'{clock}_best_us']:.0f} / {row[f'{clock}_median_us']:.0f}")
            cells.append(f"{row[f'{clock}_best_ratio']:.2f}x / {row[f'{clock}_median_ratio']:.2f}x")
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=None, help="default 20 (50 with --overhead)")
    parser.add_argument("--overhead", action="store_true", help="a block's step against SDPA")
    parser.add_argument("--rounds", type=int, default=11, help="with --overhead")
    args = parser.parse_args()
    if args.overhead:
        _print_overhead(args.rounds, args.steps or 50)
        return
    args.steps = args.steps or 20
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
