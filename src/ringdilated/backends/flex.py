"""FlexAttention (``torch.nn.attention.flex_attention``) behind the kernel contract.

The causal offset is a ``mask_mod`` turned into a block mask (cached per shape and offset), so
blocks wholly above the diagonal are skipped by the kernel rather than masked. Forward asks for
the lse with ``return_aux=AuxRequest(lse=True)`` (on a torch without it the factory fails and
the resolver moves on, with the reason). Backward differentiates a recomputed forward: with
``w = exp(lse_block - lse_final)`` per row, the gradients of ``(out_block, lse_block)`` fed
``(w * dout, w * (rowsum(dout * out_block) - rowsum(dout * out_final)))`` are exactly this
block's share of the merged gradient, which is the contract's backward rule.

Declared, not discovered:

- CUDA (compute capability 8.0+, float16/bfloat16/float32, head dims multiples of 16 up to 256):
  the compiled kernel, forward and backward. Not yet verified on GPU hardware in this project.
- CPU: forward only, unfused eager mode (FlexAttention on CPU has no backward, and no lse under
  ``torch.compile``). Its priority is below the reference kernel; it exists so that inference can
  force it and so its forward is tested here against the oracle.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ringdilated.core.accumulator import accumulation_dtype
from ringdilated.core.capabilities import Capabilities, KernelSpec, PriorityRule, Target
from ringdilated.core.kernel import BlockOptions
from ringdilated.plugins.hookspecs import hookimpl

__all__ = ["FLEX_SPEC", "FlexKernel"]

Attention = Callable[..., tuple[torch.Tensor, Any]]


@functools.lru_cache(maxsize=256)
def _block_mask(q_len: int, k_len: int, offset: int, device: str) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx <= q_idx + offset

    return create_block_mask(visible, None, None, q_len, k_len, device=device)


class FlexKernel:
    """FlexAttention per block. ``attention`` replaces ``flex_attention`` (tests pass a
    differentiable stand-in with the same signature to check the backward rule on CPU)."""

    def __init__(self, attention: Attention | None = None) -> None:
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        self._aux = AuxRequest(lse=True)
        self._eager: Attention = attention or flex_attention
        self._compiled: Attention | None = attention

    def _attention(self, device: torch.device) -> Attention:
        if device.type == "cpu":
            return self._eager
        if self._compiled is None:
            self._compiled = torch.compile(self._eager, dynamic=False)
        return self._compiled

    def _run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q_len, k_len = q.shape[-2], k.shape[-2]
        mask = None
        if options.needs_mask(q_len, k_len):
            assert options.causal_offset is not None
            mask = _block_mask(q_len, k_len, options.causal_offset, str(q.device))
        with warnings.catch_warnings():
            # Eager CPU FlexAttention warns that it is unfused; the CPU target declares as much.
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch")
            out, aux = self._attention(q.device)(
                q,
                k,
                v,
                block_mask=mask,
                scale=options.scale,
                enable_gqa=q.shape[1] != k.shape[1],
                return_aux=self._aux,
            )
        return out, aux.lse

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = self._run(q, k, v, options)
        empty = options.visible_rows_start()
        if empty:
            out[..., :empty, :] = 0
            lse[..., :empty] = float("-inf")
        return out, lse.to(accumulation_dtype(q.dtype))

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
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        with torch.enable_grad():
            block_out, block_lse = self._run(qg, kg, vg, options)
        dtype = lse.dtype
        block_lse_d = block_lse.detach().to(dtype)
        live = torch.isfinite(lse) & torch.isfinite(block_lse_d)
        weight = torch.where(live, torch.exp(block_lse_d - torch.where(live, lse, 0.0)), 0.0)
        d = dout.to(dtype)
        grad_out = (weight.unsqueeze(-1) * d).to(block_out.dtype)
        own = (d * block_out.detach().to(dtype)).sum(-1)
        grad_lse = weight * (own - (d * out.to(dtype)).sum(-1))
        grads = torch.autograd.grad(
            (block_out, block_lse), (qg, kg, vg), (grad_out, grad_lse.to(block_lse.dtype))
        )
        return grads[0], grads[1], grads[2]


FLEX_SPEC = KernelSpec(
    name="flex",
    factory=FlexKernel,
    capabilities=Capabilities(
        targets=(
            Target(
                "cuda",
                frozenset({torch.float16, torch.bfloat16, torch.float32}),
                min_capability=(8, 0),
                max_head_dim=256,
                head_dim_multiple=16,
                note="compiled FlexAttention",
            ),
            Target(
                "cpu",
                frozenset({torch.float32, torch.float64}),
                backward=False,
                note="eager FlexAttention: forward only, unfused",
            ),
        ),
        causal=True,
        backward=True,
        dropout=False,
        gqa=True,
    ),
    priority=-10,
    priority_rules=(PriorityRule(20, "cuda"),),
    description="FlexAttention with the causal offset as a block mask",
)


@hookimpl
def ringdilated_kernels() -> list[KernelSpec]:
    return [FLEX_SPEC]
