"""FlashAttention 2 (the ``flash-attn`` package, 2.6 or newer) behind the kernel contract.

Forward is ``flash_attn_func(..., return_attn_probs=True)``, which returns the lse; backward is
``flash_attn.flash_attn_interface._flash_attn_backward`` fed the final merged ``out`` and
``lse``, as the contract asks. flash-attn's causal mask is bottom-right aligned, so any causal
offset runs as at most two calls (:mod:`ringdilated.core.causal`). Declared: CUDA compute
capability 8.0 or newer, float16 and bfloat16, head dims that are multiples of 8 up to 256,
grouped-query heads natively, no dropout (flash-attn draws its own dropout mask, which a backward
cannot regenerate from the contract's seed).

Not yet verified on GPU hardware in this project's CI; the wrapper's layout, causal pieces and
gradient plumbing are tested on CPU against a stand-in module with flash-attn's documented
semantics (``tests/standins``).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ringdilated.core.capabilities import Capabilities, KernelSpec, PriorityRule, Target
from ringdilated.core.causal import BottomRightKernel
from ringdilated.plugins.hookspecs import hookimpl

__all__ = ["FLASH_SPEC", "MIN_VERSION", "FlashKernel"]

MIN_VERSION = (2, 6)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


class FlashKernel(BottomRightKernel):
    """flash-attn 2 kernels. Construction imports the package and checks its version."""

    def __init__(self) -> None:
        package = importlib.import_module("flash_attn")
        version = str(getattr(package, "__version__", "0"))
        if _version(version) < MIN_VERSION:
            wanted = ".".join(map(str, MIN_VERSION))
            raise ImportError(f"flash-attn {version} is older than the {wanted} this kernel needs")
        interface = importlib.import_module("flash_attn.flash_attn_interface")
        self._forward: Any = package.flash_attn_func
        self._backward: Any = interface._flash_attn_backward

    def native_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse, _ = self._forward(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            return_attn_probs=True,
        )
        return out.transpose(1, 2), lse

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
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (qt, kt, vt))
        self._backward(
            dout.transpose(1, 2),
            qt,
            kt,
            vt,
            out.transpose(1, 2),
            lse.to(torch.float32).contiguous(),
            dq,
            dk,
            dv,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            window_size_left=-1,
            window_size_right=-1,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


FLASH_SPEC = KernelSpec(
    name="flash",
    factory=FlashKernel,
    capabilities=Capabilities(
        targets=(
            Target(
                "cuda",
                frozenset({torch.float16, torch.bfloat16}),
                min_capability=(8, 0),
                max_head_dim=256,
                head_dim_multiple=8,
                note="flash-attn 2 needs Ampere or newer",
            ),
        ),
        causal=True,
        backward=True,
        dropout=False,
        gqa=True,
        requires=("flash_attn",),
    ),
    priority=0,
    priority_rules=(PriorityRule(300, "cuda", min_capability=(8, 0)),),
    description="FlashAttention 2 (flash-attn >= 2.6): Ampere and newer, fp16/bf16",
)


@hookimpl
def ringdilated_kernels() -> list[KernelSpec]:
    return [FLASH_SPEC]
