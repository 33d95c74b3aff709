"""The reference kernel: plain PyTorch math, any device, any floating dtype, dropout included.

Slow (it computes every score, a tile of query rows at a time) and obviously right: every step
is the textbook formula, computed in float32 (float64 for float64 inputs), with no host read
(:mod:`ringdilated.backends._dense`; for NaN and infinity it meets the kernel contract's rule
with plain masked math). It is the fallback for requests no faster kernel serves (dropout on
CPU, float64, ROCm) and the kernel the conformance tests trust second only to the dense oracle.
"""

from __future__ import annotations

import torch

from ringdilated.backends import _dense
from ringdilated.core import BlockOptions, Capabilities, KernelSpec, Target, accumulation_dtype

__all__ = ["REFERENCE_SPEC", "ReferenceKernel"]

_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _dropout_scale(q: torch.Tensor, k: torch.Tensor, options: BlockOptions) -> torch.Tensor | None:
    """The keep mask divided by the keep probability: a pure function of the seed, the block's
    shape and device, so backward regenerates forward's mask."""
    if options.dropout_p == 0.0:
        return None
    shape = (*q.shape[:-1], k.shape[-2])
    dtype = accumulation_dtype(q.dtype)
    generator = torch.Generator(device=q.device).manual_seed(options.dropout_seed)
    keep = torch.rand(shape, generator=generator, device=q.device, dtype=dtype)
    return (keep >= options.dropout_p).to(dtype) / (1.0 - options.dropout_p)


class ReferenceKernel:
    """Dense softmax attention per block, as the kernel contract defines it."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _dense.forward(q, k, v, options, _dropout_scale(q, k, options))

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
        return _dense.backward(dout, q, k, v, out, lse, options, _dropout_scale(q, k, options))


REFERENCE_SPEC = KernelSpec(
    name="reference",
    factory=ReferenceKernel,
    capabilities=Capabilities(
        targets=(Target("cpu", _FLOATS), Target("cuda", _FLOATS), Target("rocm", _FLOATS)),
        causal=True,
        sliding_window=True,
        backward=True,
        dropout=True,
        gqa=True,
        softcap=True,
        deterministic=True,  # plain torch ops, each deterministic under torch's switch
    ),
    priority=0,
    description=(
        "plain PyTorch math; O(L^2) memory per block; CPU, CUDA, ROCm; any dtype; dropout; softcap"
    ),
)
