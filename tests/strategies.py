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
    window: tuple[int | None, int | None] | None = None

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
        kw: dict[str, object] = {"mode": self.mode, "causal": self.causal, "scale": self.scale}
        if self.window is not None:
            kw["window"] = self.window
        return kw


@st.composite
def patterns(draw: st.DrawFn, max_segment: int = 16) -> tuple[tuple[int, ...], tuple[int, ...]]:
    count = draw(st.integers(1, 3))
    segments = tuple(draw(st.integers(1, max_segment)) for _ in range(count))
    rates = tuple(draw(st.integers(1, min(4, w))) for w in segments)
    return segments, rates


@st.composite
def key_windows(
    draw: st.DrawFn, seq_len: int, causal: bool
) -> tuple[int | None, int | None] | None:
    """A call's key window ``(left, right)`` (docs/spec.md, section 5), or ``None`` one time in
    four: each bound ``None`` or an int from 0 (the query's own position) past the sequence,
    mostly short (a few positions: with dilation rates above 1 a bound reaches ``bound // rate``
    selected keys, often 0); with ``causal``, the right bound ``None`` or ``0``."""
    if draw(st.integers(0, 3)) == 0:
        return None
    bound = st.none() | st.integers(0, 4) | st.integers(0, seq_len + 1)
    right = draw(st.sampled_from([None, 0]) if causal else bound)
    return draw(bound), right


@st.composite
def cases(
    draw: st.DrawFn,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    max_len: int = 40,
    windows: bool = False,
) -> Case:
    """A whole problem; ``windows``: with a key window (:func:`key_windows`) most of the time."""
    segments, rates = draw(patterns())
    mode = draw(st.sampled_from(["head_groups", "longnet"]))
    min_heads = len(segments) if mode == "head_groups" else 1
    num_heads = draw(st.integers(min_heads, 6))
    num_kv_heads = draw(st.sampled_from([d for d in range(1, num_heads + 1) if num_heads % d == 0]))
    # Drawn in the order they always were (a window last), so the examples drawn without
    # windows stay the same.
    batch, seq_len = draw(st.integers(1, 2)), draw(st.integers(1, max_len))
    head_dim = draw(st.sampled_from([1, 4, 8, 16]))
    causal = draw(st.booleans())
    scale = draw(st.none() | st.floats(0.05, 2.0))
    dtype, seed = draw(st.sampled_from(dtypes)), draw(st.integers(0, 2**31 - 1))
    return Case(
        batch=batch,
        seq_len=seq_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        segment_lengths=segments,
        dilation_rates=rates,
        mode=mode,
        causal=causal,
        scale=scale,
        dtype=dtype,
        seed=seed,
        window=draw(key_windows(seq_len, causal)) if windows else None,
    )


@attrs.frozen
class LayoutCase:
    """Documents (``cu_seqlens``), padding (each row's valid run) and a query suffix."""

    seq_len: int
    query_length: int
    cu_seqlens: tuple[int, ...] | None = None
    valid_runs: tuple[tuple[int, int], ...] | None = None

    def kwargs(self) -> dict[str, torch.Tensor]:
        """``cu_seqlens`` and ``key_padding_mask`` as the functional API takes them."""
        if self.cu_seqlens is not None:
            return {"cu_seqlens": torch.tensor(self.cu_seqlens, dtype=torch.int32)}
        if self.valid_runs is not None:
            p = torch.arange(self.seq_len)
            mask = torch.stack([(p < s) | (p >= e) for s, e in self.valid_runs])
            return {"key_padding_mask": mask}
        return {}

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """The last ``query_length`` positions of a full-length ``q``."""
        return q[:, self.seq_len - self.query_length :]


@st.composite
def layouts(draw: st.DrawFn, batch: int, seq_len: int) -> LayoutCase:
    """A whole sequence, packed documents or padded rows (the valid run anywhere: left, right
    or both sides padded; empty rows included), with a query suffix half the time."""
    query_length = draw(st.integers(1, seq_len)) if draw(st.booleans()) else seq_len
    kind = draw(st.sampled_from(["whole", "documents", "padding"]))
    if kind == "documents":
        cuts = draw(st.sets(st.integers(1, max(1, seq_len - 1)), max_size=4))
        bounds = (0, *sorted(c for c in cuts if c < seq_len), seq_len)
        return LayoutCase(seq_len, query_length, cu_seqlens=bounds)
    if kind == "padding":
        runs = []
        for _ in range(batch):
            valid = draw(st.integers(0, seq_len))
            start = draw(st.integers(0, seq_len - valid))
            runs.append((start, start + valid))
        return LayoutCase(seq_len, query_length, valid_runs=tuple(runs))
    return LayoutCase(seq_len, query_length)


def upstream(seed: int, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random output and lse cotangents; lse's are float32-exact (it is a float32 tensor), and 0
    where the lse is -inf."""
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64).float().double()
    return dout, dlse.masked_fill(torch.isneginf(lse), 0.0)


def loss_of(
    out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor
) -> torch.Tensor:
    """``<out, dout> + <lse, dlse>`` in float64, ``-inf`` lse entries left out."""
    finite_lse = lse.masked_fill(torch.isneginf(lse), 0.0)
    return (out.double() * dout).sum() + (finite_lse.double() * dlse).sum()
