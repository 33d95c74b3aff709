"""Hypothesis strategies for dilated-attention cases (small shapes: the oracle is O(L^2))."""

from __future__ import annotations

import attrs
import torch
from hypothesis import strategies as st

DTYPES = (torch.float64, torch.float32, torch.bfloat16)


@attrs.frozen
class Case:
    batch: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    mode: str
    causal: bool
    scale: float | None
    dtype: torch.dtype
    seed: int

    def tensors(self, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(self.seed)
        shape_q = (self.batch, self.seq_len, self.num_heads, self.head_dim)
        shape_kv = (self.batch, self.seq_len, self.num_kv_heads, self.head_dim)
        q, k, v = (
            torch.randn(s, generator=g, dtype=torch.float64).to(self.dtype)
            for s in (shape_q, shape_kv, shape_kv)
        )
        return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))

    def kwargs(self) -> dict[str, object]:
        return {"mode": self.mode, "causal": self.causal, "scale": self.scale}


@st.composite
def patterns(draw: st.DrawFn, max_segment: int = 16) -> tuple[tuple[int, ...], tuple[int, ...]]:
    count = draw(st.integers(1, 3))
    segments = tuple(draw(st.integers(1, max_segment)) for _ in range(count))
    rates = tuple(draw(st.integers(1, min(4, w))) for w in segments)
    return segments, rates


@st.composite
def cases(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = DTYPES, max_len: int = 40) -> Case:
    segments, rates = draw(patterns())
    mode = draw(st.sampled_from(["head_groups", "longnet"]))
    min_heads = len(segments) if mode == "head_groups" else 1
    num_heads = draw(st.integers(min_heads, 6))
    num_kv_heads = draw(st.sampled_from([d for d in range(1, num_heads + 1) if num_heads % d == 0]))
    return Case(
        batch=draw(st.integers(1, 2)),
        seq_len=draw(st.integers(1, max_len)),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from([1, 4, 8, 16])),
        segment_lengths=segments,
        dilation_rates=rates,
        mode=mode,
        causal=draw(st.booleans()),
        scale=draw(st.none() | st.floats(0.05, 2.0)),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
