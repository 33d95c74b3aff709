"""Stand-ins for torch's memory-efficient attention CUDA kernels, on CPU, in float64.

:func:`kernel_forward` and :func:`kernel_backward` are ``aten._efficient_attention_forward`` and
``_efficient_attention_backward`` on ``(B, M, H, K)`` views: they read memory the way the CUDA
kernels do (``kernel_forward.h``, ``kernel_backward.h``, ``attention_backward.cu`` of torch 2.13),
so a wrapper that hands them the wrong layout gets wrong numbers here, as it would on hardware:

- backward, half precision: ``out`` is read with the hard-coded row stride
  ``o_strideM() = head_dim_value * num_heads`` (only its batch and head strides are taken from
  the tensor) when computing ``rowsum(dout * out)``; float32 computes that on the host with the
  real strides.
- backward: ``logsumexp`` is read as float32, with row stride 1 and ``ceil32(M)`` rows
  (``kAlignLSE``) per (batch, head). The last query tile also covers rows past ``M``, whose
  scores the kernel computes from whatever it reads there; only an lse of ``+inf`` makes their
  probabilities exactly 0 whatever those scores are (the forward writes ``+inf`` there, the
  Volta path substitutes it, and xformers forces it on sm75). The stand-in takes the pessimistic
  reading: a pad row that is not ``+inf`` spoils dV (NaN). dQ and dK come from dS, which the
  kernel zeroes outside the block's rows and keys, so they are unaffected.
- the bias is loaded 128 bits at a time, so each row is read up to the next multiple of 8 (half)
  or 4 (float) elements: that memory must exist (a read past the storage raises here). What is
  read past ``k_len`` is masked out by the kernels (``kernel_forward.h``, and dS in
  ``kernel_backward.h``), so its values do not matter; the wrapper zeroes it anyway, as torch's
  own ``pad_bias`` does.
- ``grad_out`` is made contiguous by the host; q, k, v are read from their data pointers through
  their strides (``key_ptr + batch_id * k_strideB + head_id * k_strideH``, rows ``k_strideM``
  apart), which must keep the last dimension contiguous and be multiples of 4 elements; 0 is
  one (a key/value head expanded along heads is read once per query head, nothing copied).
- backward: the gradients are freshly allocated, ``(B, M, H, K)``-contiguous
  (``at::empty(key.sizes())``), one per query head whatever ``key``'s strides.
- forward: ``out`` is ``(B, M, H, K)``-contiguous; ``logsumexp`` is float32 ``(B, H, ceil32(M))``
  with ``+inf`` pad rows and ``0`` for rows with no visible key.
- dropout (``attention.cu`` ``_efficient_attention_forward``, ``kernel_forward.h``): the forward
  takes ``(seed, offset)`` from the device's default generator (``philox_cuda_state`` of
  ``B * H * M * N`` numbers; modelled by :mod:`tests.standins.philox`) and returns them as
  ``int64`` scalars on the host (eager mode); a probability is kept when its uniform draw
  exceeds ``p`` and scaled by ``1 / (1 - p)``. The backward reads
  ``*philox_seed.data_ptr<int64_t>()`` and the offset likewise (``int64`` tensors, else the op
  raises) and regenerates the mask from them: handed the wrong ones, its gradients are wrong.

:func:`cutlass_forward` and :func:`cutlass_backward` are the ops around them,
``aten._efficient_attention_forward`` and ``_backward`` (torch's ``cutlassF``/``cutlassB``
dispatch; xformers' ``cutlass.FwOp.OPERATOR`` and ``BwOp.OPERATOR``), with their schemas;
:func:`efficient_attention` and :func:`efficient_attention_backward` are the SDPA-level aten ops
(``_scaled_dot_product_efficient_attention[_backward]``, ``(B, H, L, D)`` arguments), which
transpose to those views and call them, as ``attention.cu`` does.
"""

from __future__ import annotations

import math

import torch

from tests.standins import philox
from tests.standins.math import attend, bottom_right, grads, top_left
from tests.standins.memory import read_as

__all__ = [
    "cutlass_backward",
    "cutlass_forward",
    "efficient_attention",
    "efficient_attention_backward",
    "kernel_backward",
    "kernel_forward",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LSE_ALIGN = 32


def _op_generator(device: torch.device) -> torch.Generator:
    """The generator the op draws from, as upstream picks it (``getDefaultCUDAGenerator()`` of
    the device the op's guard sets; the CPU generator for a stand-in run on the CPU)."""
    if device.type == "cpu":
        return torch.default_generator
    return torch.cuda.default_generators[device.index or 0]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _vector(dtype: torch.dtype) -> int:
    """Elements in one 128-bit load."""
    return 128 // (torch.empty((), dtype=dtype).element_size() * 8)


def _check_bmhk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check(q.dim() == k.dim() == v.dim() == 4, "query, key, value must be 4-D")
    _check(q.dtype in _DTYPES, f"unsupported dtype {q.dtype}")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query, key, value must share a dtype")
    b, _, h, d = q.shape
    _check(k.shape[0] == b and k.shape[2] == h and k.shape[3] == d, "key shape")
    _check(v.shape[:3] == k.shape[:3], "value shape")
    for x in (q, k, v):  # check_supported: kMinimumAlignment is 4 elements from sm75
        _check(x.stride(-1) == 1, "last dimension must be contiguous")
        for s in x.stride()[:-1]:
            _check(s % 4 == 0, f"stride {s} not aligned to 4 elements")
        _check(x.storage_offset() % 4 == 0, "data pointer not aligned")


def _read(x: torch.Tensor) -> torch.Tensor:
    """What the kernel reads of ``q``, ``k`` or ``v``: from the data pointer, through the
    tensor's own strides (``ptr + b * strideB + m * strideM + h * strideH + d``)."""
    return read_as(x, tuple(x.shape), x.stride())


def _read_bias(
    bias: torch.Tensor | None, shape: tuple[int, int, int, int], dtype: torch.dtype
) -> torch.Tensor | None:
    """The bias as the scores see it, read through the kernel's 128-bit loads."""
    if bias is None:
        return None
    _check(bias.dim() == 4, "Bias expected in BMHK format")
    _check(tuple(bias.shape) == shape, f"bias shape {tuple(bias.shape)}, expected {shape}")
    _check(bias.dtype == dtype, "bias must have the query's dtype")
    _check(bias.stride(3) == 1, "attn_bias: wrong alignment (last dimension must be contiguous)")
    vector = _vector(bias.dtype)
    for size, stride in zip(shape[:3], bias.stride()[:3], strict=True):
        _check(size <= 1 or stride % vector == 0, f"bias stride {stride} not aligned")
    k_len = shape[3]
    read = -(-k_len // vector) * vector
    rows = read_as(bias, (*shape[:3], read), (*bias.stride()[:3], 1))
    return rows[..., :k_len].double()  # what was read past k_len is masked by the kernel


def kernel_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    visible: torch.Tensor | None,
    scale: float,
    drop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, M, H, K) contiguous, logsumexp float32 (B, H, ceil32(M)))`` from BMHK views;
    ``drop`` ``(B, H, M, N)`` is the dropout multiplier."""
    _check_bmhk(q, k, v)
    b, m, h, _ = q.shape
    read_bias = _read_bias(bias, (b, h, m, k.shape[1]), q.dtype)
    out, lse = attend(*map(_read, (q, k, v)), scale, visible, read_bias, drop)
    empty = torch.isneginf(lse)
    result = torch.empty(b, m, h, v.shape[-1], dtype=q.dtype)
    result.copy_(out.masked_fill(empty.transpose(1, 2).unsqueeze(-1), 0.0))
    logsumexp = torch.full((b, h, -(-m // _LSE_ALIGN) * _LSE_ALIGN), float("inf"))
    logsumexp[..., :m] = lse.masked_fill(empty, 0.0).float()
    return result, logsumexp


def kernel_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    drop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``, each ``(B, M, H, K)``-contiguous, from BMHK views."""
    _check_bmhk(q, k, v)
    b, m, h, _ = q.shape
    n, dv = k.shape[1], v.shape[-1]
    _check(out.shape == (b, m, h, dv) and out.dtype == q.dtype, "out shape/dtype")
    _check(grad_out.shape == out.shape, "grad_out shape")
    _check(logsumexp.dim() == 3 and logsumexp.shape[:2] == (b, h), "logsumexp shape")
    _check(h <= 1 or logsumexp.stride(1) % 8 == 0, "LSE is not correctly aligned (strideH)")
    grad_out = grad_out.contiguous()  # the host copies it
    if q.dtype in (torch.float16, torch.bfloat16):
        # kernel_backward.h: o_strideM() = head_dim_value * num_heads; only the batch and head
        # strides come from the tensor.
        out = read_as(out, (b, m, h, dv), (out.stride(0), h * dv, out.stride(2), 1))
    rows = -(-m // _LSE_ALIGN) * _LSE_ALIGN
    # lse_scalar_t is float; there is no lse row stride.
    lse = read_as(logsumexp, (b, h, rows), (*logsumexp.stride()[:2], 1), torch.float32)
    pad_spoils_dv = not bool(torch.isposinf(lse[..., m:]).all())
    read_bias = _read_bias(bias, (b, h, m, n), q.dtype)
    q, k, v = map(_read, (q, k, v))
    dq, dk, dv_ = grads(grad_out, q, k, v, out, lse[..., :m], scale, visible, read_bias, drop)
    if pad_spoils_dv:
        dv_ = torch.full_like(dv_, float("nan"))
    return tuple(torch.empty(g.shape, dtype=q.dtype).copy_(g) for g in (dq, dk, dv_))  # type: ignore[return-value]


def _scale(scale: float | None, head_dim: int) -> float:
    return 1 / math.sqrt(head_dim) if scale is None else scale


def _keep(seed: int, offset: int, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """The dropout multiplier of ``kernel_forward.h``: kept where the uniform draw exceeds ``p``."""
    return (philox.uniform(seed, offset, shape) > p).double() / (1 - p)


def _visible(custom_mask_type: int, q_len: int, k_len: int) -> torch.Tensor | None:
    """``sdp::CustomMaskType``: 0 none, 1 causal from the top left, 2 from the bottom right."""
    _check(custom_mask_type in (0, 1, 2), "invalid value for `custom_mask_type`")
    if custom_mask_type == 0:
        return None
    return (top_left if custom_mask_type == 1 else bottom_right)(q_len, k_len)


def _dense_only(*unmodelled: object) -> None:
    """Varlen (``cu_seqlens``, ``seqlen_k``), windows and bias gradients: no wrapper here sends
    them, so the stand-ins do not model them."""
    assert all(x is None or x is False for x in unmodelled), "not modelled by the stand-in"


def cutlass_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    dropout_p: float,
    custom_mask_type: int,
    compute_log_sumexp: bool = False,
    *,
    scale: float | None = None,
    seqlen_k: torch.Tensor | None = None,
    window_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """``aten._efficient_attention_forward`` on ``(B, M, H, K)`` views (``attention.cu``):
    ``(out, logsumexp, philox_seed, philox_offset, max_seqlen_q, max_seqlen_k)``. Without
    ``cu_seqlens`` the max lengths given are ignored (the op takes ``M`` and ``N``); without
    ``compute_log_sumexp`` the lse has 0 rows."""
    _dense_only(cu_seqlens_q, cu_seqlens_k, seqlen_k, window_size)
    _check_bmhk(query, key, value)
    b, m, h, _ = query.shape
    n = key.shape[1]
    seed_t = offset_t = torch.empty((), dtype=torch.long)
    drop = None
    if dropout_p > 0.0:
        seed, offset = philox.take(_op_generator(query.device), b * h * m * n)
        seed_t, offset_t = torch.tensor(seed), torch.tensor(offset)  # int64, on the host
        drop = _keep(seed, offset, (b, h, m, n), dropout_p)
    visible = _visible(custom_mask_type, m, n)
    scale = _scale(scale, query.shape[-1])
    out, lse = kernel_forward(query, key, value, bias, visible, scale, drop)
    return out, lse if compute_log_sumexp else lse.narrow(-1, 0, 0), seed_t, offset_t, m, n


def cutlass_backward(
    grad_out_: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    logsumexp: torch.Tensor,
    dropout_p: float,
    philox_seed: torch.Tensor,
    philox_offset: torch.Tensor,
    custom_mask_type: int,
    bias_requires_grad: bool,
    *,
    scale: float | None = None,
    num_splits_key: int | None = None,
    window_size: int | None = None,
    shared_storage_dqdkdv: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """``aten._efficient_attention_backward`` on ``(B, M, H, K)`` views
    (``attention_backward.cu``): ``(dq, dk, dv, None)``, each gradient freshly allocated
    ``(B, M, H, K)``-contiguous (``at::empty(key.sizes())``: one per query head whatever
    ``key``'s strides)."""
    _dense_only(cu_seqlens_q, cu_seqlens_k, window_size, bias_requires_grad, shared_storage_dqdkdv)
    _check(query.dim() == grad_out_.dim() == 4, "grad_out_ must be 4-D like query")
    _check(query.shape[:3] == grad_out_.shape[:3], "grad_out_ batch, length and heads")
    b, m, h, _ = query.shape
    n = key.shape[1]
    drop = None
    if dropout_p > 0.0:  # *philox_seed.data_ptr<int64_t>(), on the host in eager mode
        for name, x in (("philox_seed", philox_seed), ("philox_offset", philox_offset)):
            _check(x.dtype == torch.long, f"{name}: expected scalar type Long, got {x.dtype}")
            _check(x.device.type == "cpu", f"{name} is read on the host, got {x.device}")
        seed, offset = int(philox_seed.reshape(-1)[0]), int(philox_offset.reshape(-1)[0])
        drop = _keep(seed, offset, (b, h, m, n), dropout_p)
    visible = _visible(custom_mask_type, m, n)
    scale = _scale(scale, query.shape[-1])
    dq, dk, dv = kernel_backward(
        grad_out_, query, key, value, bias, out, logsumexp, visible, scale, drop
    )
    return dq, dk, dv, None


def efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    compute_log_sumexp: bool,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_efficient_attention`` on ``(B, H, L, D)`` arguments: their
    ``(B, L, H, D)`` transposes through :func:`cutlass_forward` with the top-left
    causal mask, as ``attention.cu`` does."""
    assert compute_log_sumexp, "the wrapper never asks otherwise"
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # BMHK views, no copy
    out, lse, seed_t, offset_t, _, _ = cutlass_forward(
        q, k, v, attn_bias, None, None, None, None, dropout_p, int(is_causal),
        compute_log_sumexp, scale=scale,
    )  # fmt: skip
    return out.transpose(1, 2), lse, seed_t, offset_t


def efficient_attention_backward(
    grad_out_: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    philox_seed: torch.Tensor,
    philox_offset: torch.Tensor,
    dropout_p: float,
    grad_input_mask: list[bool],
    is_causal: bool = False,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """``aten._scaled_dot_product_efficient_attention_backward`` on ``(B, H, L, D)`` arguments:
    through :func:`cutlass_backward` on their transposes, as ``attention.cu``
    does."""
    assert list(grad_input_mask) == [True, True, True, False]
    q, k, v, o, g = (x.transpose(1, 2) for x in (query, key, value, out, grad_out_))
    dq, dk, dv, _ = cutlass_backward(
        g, q, k, v, attn_bias, o, None, None, q.shape[1], k.shape[1], logsumexp, dropout_p,
        philox_seed, philox_offset, int(is_causal), False, scale=scale,
    )  # fmt: skip
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None
