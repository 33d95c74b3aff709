"""The reference kernel: plain PyTorch math, any device, any floating dtype, dropout included.

Slow (it materialises the ``Lq x Lk`` score matrix) and obviously right: every step is the
textbook formula, computed in float32 (float64 for float64 inputs). It is the fallback for
requests no faster kernel serves (dropout on CPU, float64) and the kernel conformance tests
trust second only to the dense oracle.
"""

from __future__ import annotations

import torch

from ringdilated.backends._heads import repeat_kv, sum_kv
from ringdilated.core.accumulator import accumulation_dtype
from ringdilated.core.capabilities import Capabilities, KernelSpec, Target
from ringdilated.core.kernel import BlockOptions

__all__ = ["REFERENCE_SPEC", "ReferenceKernel"]

_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


class ReferenceKernel:
    """Dense softmax attention per block, as the kernel contract defines it."""

    def _probabilities(
        self, q: torch.Tensor, k: torch.Tensor, options: BlockOptions, lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P, lse)`` with ``P = exp(scale * q k^T - lse)`` (masked entries 0)."""
        dtype = accumulation_dtype(q.dtype)
        scores = torch.matmul(q.to(dtype), repeat_kv(k, q.shape[1]).to(dtype).transpose(-1, -2))
        scores = scores * options.scale
        if options.causal_offset is not None:
            lq, lk = scores.shape[-2:]
            rows = torch.arange(lq, device=q.device).unsqueeze(1)
            cols = torch.arange(lk, device=q.device)
            scores = scores.masked_fill(cols > rows + options.causal_offset, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse.to(dtype))
        return torch.exp(scores - finite.unsqueeze(-1)), lse

    def _dropout_scale(self, p: torch.Tensor, options: BlockOptions) -> torch.Tensor | None:
        if options.dropout_p == 0.0:
            return None
        generator = torch.Generator(device=p.device).manual_seed(options.dropout_seed)
        keep = torch.rand(p.shape, generator=generator, device=p.device, dtype=p.dtype)
        return (keep >= options.dropout_p).to(p.dtype) / (1.0 - options.dropout_p)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p, lse = self._probabilities(q, k, options, None)
        drop = self._dropout_scale(p, options)
        if drop is not None:
            p = p * drop
        out = torch.matmul(p, repeat_kv(v, q.shape[1]).to(p.dtype))
        return out.to(q.dtype), lse

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p, _ = self._probabilities(q, k, options, lse)
        dtype = p.dtype
        do = dout.to(dtype)
        dp = torch.matmul(do, repeat_kv(v, q.shape[1]).to(dtype).transpose(-1, -2))
        drop = self._dropout_scale(p, options)
        p_used = p if drop is None else p * drop
        if drop is not None:
            dp = dp * drop
        delta = (do * out.to(dtype)).sum(-1, keepdim=True)
        ds = p * (dp - delta) * options.scale
        dq = torch.matmul(ds, repeat_kv(k, q.shape[1]).to(dtype))
        dk = sum_kv(torch.matmul(ds.transpose(-1, -2), q.to(dtype)), k.shape[1])
        dv = sum_kv(torch.matmul(p_used.transpose(-1, -2), do), v.shape[1])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


REFERENCE_SPEC = KernelSpec(
    name="reference",
    factory=ReferenceKernel,
    capabilities=Capabilities(
        targets=(Target("cpu", _FLOATS), Target("cuda", _FLOATS), Target("rocm", _FLOATS)),
        causal=True,
        backward=True,
        dropout=True,
        gqa=True,
    ),
    priority=0,
    description="plain PyTorch math; O(L^2) memory per block; CPU, CUDA, ROCm; any dtype; dropout",
)
