"""xformers' memory-efficient attention (its CUTLASS operators) behind the kernel contract.

Forward is ``xformers.ops.fmha.memory_efficient_attention_forward_requires_grad`` (``(out,
lse)``), backward ``memory_efficient_attention_backward`` fed the final merged ``out`` and
``lse``; both with the CUTLASS operators forced, so what this kernel declares is what those
operators declare: CUDA compute capability 5.0 to 9.0, float16 and float32 (bfloat16 from 8.0),
head dims that are multiples of 8. The CUTLASS operators have no "partial" mode, which is why
``memory_efficient_attention_partial`` is not used: the lse from ``forward_requires_grad`` is the
same quantity. Causal offsets use ``LowerTriangularFromBottomRightMask`` in at most two calls
(:mod:`ringdilated.core.causal`). Key/value heads are repeated for grouped-query attention.

Not yet verified on GPU hardware in this project's CI; the wrapper is tested on CPU against a
stand-in module with xformers' documented semantics (``tests/standins``).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ringdilated.backends._heads import repeat_kv, sum_kv
from ringdilated.core.capabilities import Capabilities, KernelSpec, PriorityRule, Target
from ringdilated.core.causal import BottomRightKernel
from ringdilated.plugins.hookspecs import hookimpl

__all__ = ["XFORMERS_SPEC", "XformersKernel"]


def _bmhk(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


class XformersKernel(BottomRightKernel):
    """xformers CUTLASS kernels. Construction imports ``xformers.ops.fmha``."""

    def __init__(self) -> None:
        self._fmha: Any = importlib.import_module("xformers.ops.fmha")
        self._cutlass: Any = importlib.import_module("xformers.ops.fmha.cutlass")

    def _bias(self, causal: bool) -> object:
        return self._fmha.attn_bias.LowerTriangularFromBottomRightMask() if causal else None

    def native_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = q.shape[1]
        out, lse = self._fmha.memory_efficient_attention_forward_requires_grad(
            _bmhk(q),
            _bmhk(repeat_kv(k, h)),
            _bmhk(repeat_kv(v, h)),
            attn_bias=self._bias(causal),
            scale=scale,
            op=self._cutlass.FwOp,
        )
        return _bmhk(out), lse[..., : q.shape[-2]]

    def native_backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, q_len = q.shape[1], q.shape[-2]
        # The CUTLASS operators keep the lse padded to 32 rows; give them that layout.
        padded = torch.zeros(*lse.shape[:-1], -(-q_len // 32) * 32, device=q.device)
        padded[..., :q_len] = lse
        dq, dk, dv = self._fmha.memory_efficient_attention_backward(
            _bmhk(dout),
            _bmhk(out),
            padded,
            _bmhk(q),
            _bmhk(repeat_kv(k, h)),
            _bmhk(repeat_kv(v, h)),
            attn_bias=self._bias(causal),
            scale=scale,
            op=self._cutlass.BwOp,
        )
        return _bmhk(dq), sum_kv(_bmhk(dk), k.shape[1]), sum_kv(_bmhk(dv), v.shape[1])


XFORMERS_SPEC = KernelSpec(
    name="xformers",
    factory=XformersKernel,
    capabilities=Capabilities(
        targets=(
            Target(
                "cuda",
                frozenset({torch.float16, torch.float32}),
                min_capability=(5, 0),
                max_capability=(9, 0),
                head_dim_multiple=8,
                note="xformers CUTLASS operators",
            ),
            Target(
                "cuda",
                frozenset({torch.bfloat16}),
                min_capability=(8, 0),
                max_capability=(9, 0),
                head_dim_multiple=8,
                note="xformers CUTLASS operators, bfloat16",
            ),
        ),
        causal=True,
        backward=True,
        dropout=False,
        gqa=True,
        requires=("xformers",),
    ),
    priority=50,
    priority_rules=(PriorityRule(150, "cuda", min_capability=(7, 0), max_capability=(7, 5)),),
    description="xformers memory-efficient attention (CUTLASS): Maxwell to Hopper",
)


@hookimpl
def ringdilated_kernels() -> list[KernelSpec]:
    return [XFORMERS_SPEC]
