"""PyTorch's own fused attention kernels, called through their aten ops so the lse comes back.

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (float16, bfloat16,
  float32, float64; any head dim; grouped-query heads natively; no dropout). A fully masked row
  comes back with ``lse = 0``; this kernel reports ``-inf`` as the contract says.
- CUDA: ``aten._scaled_dot_product_efficient_attention`` and its backward (float32 and float16 from
  compute capability 5.0, bfloat16 from 8.0; head dims that are multiples of 8). Its lse is padded
  to a multiple of 32 rows; the pad is cut off forward and restored for backward. Key/value heads
  are repeated for grouped-query attention. Not yet verified on GPU hardware in this project's CI.

Causal blocks use the op's own diagonal mask when the offset is 0 and an additive mask otherwise.
"""

from __future__ import annotations

import torch

from ringdilated.backends._heads import repeat_kv, sum_kv
from ringdilated.core.accumulator import accumulation_dtype
from ringdilated.core.capabilities import Capabilities, KernelSpec, Target
from ringdilated.core.kernel import BlockOptions
from ringdilated.plugins.hookspecs import hookimpl

__all__ = ["SdpaKernel"]

_aten = torch.ops.aten
_NEG_INF = float("-inf")


def _additive_mask(
    q_len: int, k_len: int, offset: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    cols = torch.arange(k_len, device=device)
    mask = torch.zeros(q_len, k_len, dtype=dtype, device=device)
    return mask.masked_fill_(cols > rows + offset, _NEG_INF)


def _mask_args(
    q: torch.Tensor, k: torch.Tensor, options: BlockOptions
) -> tuple[bool, torch.Tensor | None]:
    """``(is_causal, additive mask)`` for the block."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    if not options.needs_mask(q_len, k_len):
        return False, None
    if options.causal_offset == 0:
        return True, None
    assert options.causal_offset is not None
    return False, _additive_mask(q_len, k_len, options.causal_offset, q.dtype, q.device)


def _without_neg_inf(lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ops recompute ``P = exp(s - lse)``; an empty row has every ``s = -inf``, so any finite
    stand-in gives ``P = 0`` where ``-inf`` would give NaN."""
    lse = lse.to(dtype)
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


class SdpaKernel:
    """PyTorch's fused attention kernels behind the kernel contract."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        is_causal, mask = _mask_args(q, k, options)
        if q.device.type == "cpu":
            out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, is_causal, attn_mask=mask, scale=options.scale
            )
        else:
            out, lse = _cuda_forward(q, k, v, is_causal, mask, options.scale)
        empty_rows = options.visible_rows_start()
        if empty_rows:
            lse[..., :empty_rows] = _NEG_INF
        return out, lse

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
        is_causal, mask = _mask_args(q, k, options)
        lse = _without_neg_inf(lse, accumulation_dtype(q.dtype))
        if q.device.type == "cpu":
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=options.scale
            )
            return dq, dk, dv
        return _cuda_backward(dout, q, k, v, out, lse, is_causal, mask, options.scale)


def _cuda_bias(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    if mask is None:
        return None
    q_len, k_len = mask.shape
    # The efficient kernel wants the bias's last dim 16-aligned in memory.
    aligned = torch.empty(q_len, -(-k_len // 16) * 16, dtype=mask.dtype, device=mask.device)
    bias = aligned[:, :k_len].copy_(mask)
    return bias.expand(q.shape[0], q.shape[1], q_len, k_len)


def _cuda_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    h = q.shape[1]
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        q,
        repeat_kv(k, h),
        repeat_kv(v, h),
        _cuda_bias(mask, q),
        True,
        0.0,
        is_causal,
        scale=scale,
    )
    return out, lse[..., : q.shape[-2]]


def _cuda_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, q_len = q.shape[1], q.shape[-2]
    padded = torch.zeros(
        *lse.shape[:-1], -(-q_len // 32) * 32, dtype=torch.float32, device=q.device
    )
    padded[..., :q_len] = lse
    seed = torch.empty((), dtype=torch.long)
    offset = torch.empty((), dtype=torch.long)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout,
        q,
        repeat_kv(k, h),
        repeat_kv(v, h),
        _cuda_bias(mask, q),
        out,
        padded,
        seed,
        offset,
        0.0,
        [True, True, True, False],
        is_causal,
        scale=scale,
    )
    return dq, sum_kv(dk, k.shape[1]), sum_kv(dv, v.shape[1])


SDPA_SPEC = KernelSpec(
    name="sdpa",
    factory=SdpaKernel,
    capabilities=Capabilities(
        targets=(
            Target(
                "cpu",
                frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
                note="flash attention for CPU",
            ),
            Target(
                "cuda",
                frozenset({torch.float16, torch.float32}),
                min_capability=(5, 0),
                head_dim_multiple=8,
                note="memory-efficient attention",
            ),
            Target(
                "cuda",
                frozenset({torch.bfloat16}),
                min_capability=(8, 0),
                head_dim_multiple=8,
                note="memory-efficient attention, bfloat16",
            ),
        ),
        causal=True,
        backward=True,
        dropout=False,
        gqa=True,
    ),
    priority=100,
    description="PyTorch's fused attention ops (flash for CPU; memory-efficient on CUDA)",
)


@hookimpl
def ringdilated_kernels() -> list[KernelSpec]:
    return [SDPA_SPEC]
