"""Stand-ins for torch 2.13's flash attention ops, on CPU, in float64.

:func:`flash_attention` is ``aten._scaled_dot_product_flash_attention`` and
:func:`flash_attention_backward` its backward; :func:`bshd_flash_attention` and
:func:`bshd_flash_attention_backward` are the ops they call, ``aten._flash_attention_forward``
and ``_flash_attention_backward`` (dense path), which take the key window
(``window_size_left``/``_right``, ``None`` as ``-1``). All with the schemas' signatures and return
tuples (checked against the wheel's ``torch.ops.aten`` schemas by
tests/test_fake_cuda_torch_ops.py and tests/test_gpu_windows_softcap.py) and the checks of what
they call, read from pytorch/pytorch:

- ``attention.cu`` ``_scaled_dot_product_flash_attention_cuda``: key and value share a sequence
  length; the ``(B, H, L, D)`` arguments go to ``_flash_attention_forward`` as ``(B, L, H, D)``
  views, and the output comes back the same way.
- ``flash_attn/flash_api.cpp`` ``mha_fwd``/``mha_bwd``: fp16 or bf16, one dtype, contiguous last
  dimension, head dim a multiple of 8 and at most 256, ``Hq % Hkv == 0``, ``k`` and ``v`` of one
  shape; ``is_causal`` and the window bottom-right, rewritten as flash-attn 2 rewrites them
  (:func:`tests.standins.flash_windows.fa2_visible`; torch's vendored ``flash_api.cpp`` at
  03b7c19d has flash-attn 2.6+'s lines); ``lse`` float32 ``(B, H, Lq)``,
  ``+inf`` for a row whose scores are all ``-inf`` (and ``out`` 0 there, FA2's ``softmax.h``);
  the backward reads ``softmax_lse`` by address as dense float32 ``(B, H, Lq)``, and
  ``_flash_attention_backward`` makes ``grad_out`` and ``out`` contiguous; ``dk``, ``dv`` summed
  over each group of query heads.
- Dropout: the forward takes ``(seed, offset)`` from the device's default generator (modelled by
  :mod:`tests.standins.philox`, ``B * H * 32`` numbers a call) and returns them as ``rng_state``,
  ``uint64[2]``, with an ``unused`` ``uint64`` scalar; a probability is kept when an 8-bit draw is
  at most ``floor((1 - p) * 255)`` and scaled by ``1 / (1 - p)``. The backward reads
  ``philox_seed.data_ptr<uint64_t>()`` (a ``uint64`` tensor, else the op raises) as that state
  and regenerates the mask from it: handed the wrong state, it computes wrong gradients.

Sources read (pytorch/pytorch): the 2.13.0 wheel (git cf30153c): ``torch.ops.aten`` schemas,
``torch/_meta_registrations.py``, ``include/ATen/native/transformers/cuda/flash_attn/flash_api.h``,
``include/ATen/native/transformers/sdp_utils_cpp.h``, ``include/ATen/Context.h``,
``torch/nn/attention/_fa3.py``, ``_fa4.py``;
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` at 001f694a (2026: the sm121 bounds and
the cuDNN preference of 2.13); ``attention.cu``, ``attention_backward.cu`` and
``flash_attn/flash_api.cpp`` as a late-2025 snapshot of ``main`` holds them (the v2.13.0 tag's
copies were not available to read; the facts coded to are the ones the 2.13 wheel's headers and
meta kernels confirm).
"""

from __future__ import annotations

import math

import torch

from tests.standins import philox
from tests.standins.flash_windows import fa2_visible
from tests.standins.math import attend, grads
from tests.standins.memory import read_as

__all__ = [
    "bshd_flash_attention",
    "bshd_flash_attention_backward",
    "flash_attention",
    "flash_attention_backward",
]

_HALF = (torch.float16, torch.bfloat16)


def _op_generator(device: torch.device) -> torch.Generator:
    """The generator the op draws from, as upstream picks it (``getDefaultCUDAGenerator()`` of
    the device the op's guard sets; the CPU generator for a stand-in run on the CPU)."""
    if device.type == "cpu":
        return torch.default_generator
    return torch.cuda.default_generators[device.index or 0]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)  # TORCH_CHECK raises RuntimeError


def _check_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``mha_fwd``/``mha_bwd`` on ``(B, L, H, D)`` views."""
    _check(q.dtype in _HALF, "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    for x in (q, k, v):
        _check(x.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    b, _, h, d = q.shape
    _check(d % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!")
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(h % k.shape[2] == 0, "Number of heads in key/value must divide number of heads in query")
    _check(k.dim() == 4 and (k.shape[0], k.shape[3]) == (b, d), "k must have shape (b, sk, hk, d)")
    _check(v.shape == k.shape, "v must have shape (batch_size, seqlen_k, num_heads_k, head_size)")


def _keep(seed: int, offset: int, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """FA2's dropout multiplier: 8-bit draws against ``floor((1 - p) * 255)``."""
    return philox.keep_mask(seed, offset, shape, p).double() / (1 - p)


def _scale(scale: float | None, head_dim: int) -> float:
    return 1 / math.sqrt(head_dim) if scale is None else scale


def bshd_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    return_debug_mask: bool,
    *,
    scale: float | None = None,
    window_size_left: int | None = None,
    window_size_right: int | None = None,
    seqused_k: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """``aten._flash_attention_forward`` on ``(B, L, H, D)`` tensors, dense path: ``(output,
    softmax_logsumexp, rng_state, unused, debug_attn_mask)``. ``attention.cu`` passes the window
    to ``mha_fwd`` as ``window_size_left.value_or(-1)`` (likewise right) with ``softcap = 0.0``;
    ``mha_fwd`` rewrites it as flash-attn 2 does (:func:`.flash_windows.fa2_visible`).
    """
    assert cum_seq_q is None and cum_seq_k is None, "dense inputs: no cumulative lengths"
    assert seqused_k is None and alibi_slopes is None and block_table is None, "not what we call"
    assert not return_debug_mask and num_splits is None, "not what we call"
    q, k, v = query, key, value
    _check_bshd(q, k, v)
    _check(dropout_p < 1.0, "p_dropout < 1")
    b, q_len, h, d = q.shape
    k_len = k.shape[1]
    rng_state = torch.empty(2, dtype=torch.uint64)
    unused = torch.empty((), dtype=torch.uint64)
    drop = None
    if dropout_p > 0.0:
        seed, offset = philox.take(_op_generator(query.device), b * h * 32)
        rng_state = torch.tensor([seed, offset], dtype=torch.uint64)
        drop = _keep(seed, offset, (b, h, q_len, k_len), dropout_p)
    window = _window(window_size_left, window_size_right)
    visible = fa2_visible(q_len, k_len, is_causal, *window, forward=True)
    out, lse = attend(q, k, v, _scale(scale, d), visible, drop=drop)
    no_key = torch.isneginf(lse)  # every score -inf: FA2 stores lse = +inf, out = 0
    out = out.masked_fill(no_key.transpose(1, 2).unsqueeze(-1), 0.0)
    output = torch.empty(b, q_len, h, v.shape[-1], dtype=query.dtype).copy_(out)
    logsumexp = lse.masked_fill(no_key, float("inf")).float()
    return output, logsumexp, rng_state, unused, torch.empty(0, dtype=query.dtype)


def bshd_flash_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    rng_state: torch.Tensor,
    unused: torch.Tensor,
    *,
    scale: float | None = None,
    window_size_left: int | None = None,
    window_size_right: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten._flash_attention_backward`` on ``(B, L, H, D)`` tensors, dense path: ``(dq, dk,
    dv)``; ``attention_backward.cu`` makes ``grad_out`` and ``out`` contiguous and passes the
    window as the forward does (``mha_bwd``: ``is_causal`` first, then the clamps)."""
    assert cum_seq_q is None and cum_seq_k is None, "dense inputs: no cumulative lengths"
    q, k, v = query, key, value
    dout, o = grad_out.contiguous(), out.contiguous()
    _check_bshd(q, k, v)
    _check(o.dtype == q.dtype, "query and out must have the same dtype")
    _check(dout.dtype == q.dtype, "query and dout must have the same dtype")
    b, q_len, h, d = q.shape
    k_len = k.shape[1]
    _check(o.shape == q.shape and dout.shape == q.shape, "out and dout must have q's shape")
    # The dense path ignores max_q and max_k; the wrapper passes the lengths.
    assert (max_q, max_k) == (q_len, k_len), f"max_q, max_k = {max_q}, {max_k}"
    drop = None
    if dropout_p > 0.0:
        _check(rng_state.dtype == torch.uint64, "expected scalar type UInt64 for rng_state")
        _check(rng_state.device == query.device, "rng_state must be on the query's device")
        seed, offset = (int(x) for x in read_as(rng_state, (2,), (1,)).tolist())
        drop = _keep(seed, offset, (b, h, q_len, k_len), dropout_p)
    # mha_bwd: softmax_lse.data_ptr(), read as dense float32 (b, h, seqlen_q), unchecked.
    lse = read_as(logsumexp, (b, h, q_len), (h * q_len, q_len, 1), torch.float32)
    window = _window(window_size_left, window_size_right)
    visible = fa2_visible(q_len, k_len, is_causal, *window, forward=False)
    dq, dk, dv = grads(dout, q, k, v, o, lse, _scale(scale, d), visible, drop=drop)
    return tuple(torch.empty(g.shape, dtype=q.dtype).copy_(g) for g in (dq, dk, dv))  # type: ignore[return-value]


def _window(left: int | None, right: int | None) -> tuple[int, int]:
    """``window_size_left.value_or(-1)``, ``window_size_right.value_or(-1)``."""
    return (-1 if left is None else left, -1 if right is None else right)


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple[object, ...]:
    """``aten._scaled_dot_product_flash_attention``: ``(output, logsumexp, cum_seq_q, cum_seq_k,
    max_q, max_k, rng_state, unused, debug_attn_mask)``; :func:`bshd_flash_attention` on the
    ``(B, L, H, D)`` transposes, as ``attention.cu`` calls it."""
    assert not return_debug_mask, "the wrapper never asks for the debug mask"
    _check(key.shape[2] == value.shape[2], "Key and Value must have the same sequence length")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (B, L, H, D) views
    q_len, k_len = q.shape[1], k.shape[1]
    output, logsumexp, rng_state, unused, debug = bshd_flash_attention(
        q, k, v, None, None, q_len, k_len, dropout_p, is_causal, False, scale=scale
    )
    return output.transpose(1, 2), logsumexp, None, None, q_len, k_len, rng_state, unused, debug


def flash_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    philox_seed: torch.Tensor,
    philox_offset: torch.Tensor,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_flash_attention_backward``: ``(grad_query, grad_key,
    grad_value)``, shaped like ``query``, ``key``, ``value``; :func:`bshd_flash_attention_backward`
    on the transposes."""
    grads_ = bshd_flash_attention_backward(
        *(x.transpose(1, 2) for x in (grad_out, query, key, value, out)), logsumexp, cum_seq_q,
        cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, scale=scale,
    )  # fmt: skip
    return tuple(g.transpose(1, 2) for g in grads_)  # type: ignore[return-value]
