"""What the memory-efficient attention kernels (torch's ``mem_eff_attention``, which xformers'
``cutlass`` operators also call) assume about the memory they are handed, and helpers that lay
tensors out that way. Read from torch 2.13's ``kernel_forward.h``, ``kernel_backward.h`` and
``attention_backward.cu``; used by the ``sdpa`` (CUDA) and ``xformers`` kernels. Written with
``narrow`` rather than slicing, so the CUDA path also runs on FakeTensor ``cuda`` tensors in a
CPU-only torch (tests/test_fake_cuda.py).

``q``, ``k`` and ``v`` are read through their own strides (``key_ptr + head_id * k_strideH``),
which need a contiguous last dimension and multiples of the alignment, 0 included; the ops check
equal head counts, and the backward allocates its gradients dense, one per query head. So
grouped heads reach them as stride-0 expansions (:func:`~ringdilated.backends._heads.kv_groups`),
and since the backward's ``out`` row stride is ``head_dim_value * num_heads`` *of the call*, each
call's ``out`` is packed on its own."""

from __future__ import annotations

import torch

__all__ = [
    "BIAS_ALIGNMENT",
    "LSE_ALIGNMENT",
    "finite_lse",
    "packed_bmhk",
    "padded_bias",
    "padded_lse",
]

#: The memory-efficient backward reads the lse in blocks of 32 rows, past the last query, with no
#: bounds check (``kAlignLSE`` in torch's ``mem_eff_attention`` kernels).
LSE_ALIGNMENT = 32
#: Row alignment of an attention bias in elements: the kernels load it 128 bits at a time (8
#: half or 4 float elements); 16 satisfies every dtype (torch 2.13 pads its own masks to 8).
BIAS_ALIGNMENT = 16


def finite_lse(lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ops recompute ``P = exp(s - lse)``; a row with no key has every ``s = -inf``, and the
    kernels themselves store ``lse = 0`` for it (``P = 0``), where ``-inf`` would give NaN."""
    lse = lse.to(dtype)
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def packed_bmhk(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(N, H, L, D)`` with memory laid out as contiguous ``(N, L, H, D)`` (a copy unless
    it already is): the layout the memory-efficient kernels assume where they hard-code a stride."""
    bmhk = x.transpose(1, 2)
    if not bmhk.is_contiguous():
        bmhk = bmhk.clone(memory_format=torch.contiguous_format)
    return bmhk.transpose(1, 2)


def padded_bias(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """A ``(q_len, k_len)`` additive mask as the ops' 4-D bias: rows start ``BIAS_ALIGNMENT``
    elements apart, the pad is zero (the kernels read whole 128-bit vectors past ``k_len``, and
    the backward does not mask what they read, so the pad must hold nothing non-finite), and
    the batch and head dimensions are stride-0 expansions."""
    if mask is None:
        return None
    q_len, k_len = mask.shape
    pad = -(-k_len // BIAS_ALIGNMENT) * BIAS_ALIGNMENT - k_len
    aligned = torch.nn.functional.pad(mask, (0, pad), value=0.0)
    return aligned.narrow(1, 0, k_len).expand(q.shape[0], q.shape[1], q_len, k_len)


def padded_lse(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` ``(N, H, L)`` as the backward reads it: float32, contiguous, ``L`` padded to a
    multiple of ``LSE_ALIGNMENT`` with ``+inf`` (``P = 0`` in pad rows, as the forward writes),
    and ``-inf`` (no key) as ``0``, which is what the forward itself stores for such rows."""
    q_len = lse.shape[-1]
    pad = -(-q_len // LSE_ALIGNMENT) * LSE_ALIGNMENT - q_len
    finite = finite_lse(lse, torch.float32).clone(memory_format=torch.contiguous_format)
    return torch.nn.functional.pad(finite, (0, pad), value=float("inf"))
