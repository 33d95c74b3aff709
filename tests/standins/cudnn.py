"""Stand-ins for torch 2.13's cuDNN attention ops, on CPU, in float64.

:func:`cudnn_attention` is ``aten._scaled_dot_product_cudnn_attention`` and
:func:`cudnn_attention_backward` its backward, with the schemas' signatures and return tuples
and what the ops and cuDNN's graph do, read from pytorch/pytorch and NVIDIA/cudnn-frontend:

- ``attention.cu`` ``_cudnn_attention_forward``: a 2-D or 3-D ``attn_bias`` is expanded to
  ``(B, 1, Lq, Lk)``, a 4-D one to ``(B, bias.size(1), Lq, Lk)``; the Philox seed and offset are
  ``int64`` scalars on the device; ``max_q``, ``max_k`` are the lengths.
- ``cudnn/MHA.cpp``: the graph's io type is the query's (fp16 or bf16), every tensor goes with its
  own sizes and strides (``build_graph``: ``Q``, ``K``, ``V``, ``O`` ``set_dim(x.sizes())``,
  ``set_stride(x.strides())``), so ``K`` and ``V`` keep their own head counts; the bias is added
  to the scores, ``set_causal_mask`` is the top-left mask (key ``j`` visible to query ``i`` iff
  ``j <= i``); ``output`` is allocated in the query's dimension order
  (``alloc_with_matching_layout``: ``empty_like(query)`` for ``(B, H, Lq, D)``), ``logsumexp``
  float32 ``(B, H, Lq, 1)``; the backward declares ``logsumexp``'s own sizes and strides as the
  float ``Stats`` tensor (read here through them, as float32) and copies ``grad_out`` only when
  its last stride is not 1. A zero-element input makes both ops return without writing their
  outputs (NaN here).
- Grouped heads. The ops take ``key`` and ``value`` with fewer heads than ``query``, and nothing
  in torch checks their count on the op's path: the dispatcher's
  ``check_batch_size_and_num_heads_dense<supports_gqa=true, requires_same_num_heads=false>``
  (``sdp_utils.cpp``, ``sdp_utils_cpp.h`` ``check_grouped_query_attention``) asks that each of
  ``Hk`` and ``Hv`` divide ``H`` (they may differ) and cuDNN's frontend refuses the graph
  otherwise (``validate_sdpa_support_surface``, ``node/sdpa_support_surface.h``: "For
  group-query attention, number of heads for key and query must be a factor of number of heads
  for query"), raised here with that message. Query head ``h`` reads key/value head
  ``h // (H / Hk)`` (``repeat_interleave``, the meaning of SDPA's ``enable_gqa``). The backward
  (``_cudnn_attention_backward``) allocates ``dq``, ``dk``, ``dv`` with ``at::empty_like`` of
  ``query``, ``key``, ``value`` and ``build_graph_backward`` declares ``dQ``, ``dK``, ``dV`` with
  those tensors' sizes and strides: ``dk`` and ``dv`` come back with ``Hk`` and ``Hv`` heads,
  each the sum over the query heads that read it.
- cuDNN's own limits, which the op leaves to the graph (``sdp_utils.cpp``'s
  ``check_cudnn_tensor_shapes`` keeps SDPA off them): head dims a multiple of 8 and at most 256,
  key length not 1 (pytorch#138529: "cuDNN Frontend error"), and 16-byte alignment of every
  tensor's start and of its strides (assumed from cuDNN's TMA loads; torch realigns ``grad_out``
  for it in pytorch#191576). Such calls raise here.
- What cuDNN returns for a row whose every score is ``-inf`` is not documented: NaN here, so a
  wrapper that hands the op such rows fails the kit.

Sources read: pytorch/pytorch, the 2.13.0 wheel (git cf30153c): ``torch.ops.aten`` schemas,
``torch/_meta_registrations.py`` (``meta__scaled_dot_product_cudnn_attention``: lse
``(B, H, S_Q, 1)``; ``meta__scaled_dot_product_cudnn_backward``: ``empty_like`` of query, key,
value), ``include/ATen/Context.h`` (the default ``sdp_priority_order``),
``torch/distributed/tensor/experimental/_context_parallel/_attention.py`` (how context
parallelism calls both ops); ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` at
001f694a (``can_use_cudnn_attention``, ``check_cudnn_tensor_shapes``,
``check_prefer_cudnn_attention``); ``aten/src/ATen/native/cudnn/MHA.cpp`` at 02a4a0fe and a 2026
snapshot of ``main`` (``check_cudnn_sdpa_decode``, ``use_ragged_in_dense``, ``bias_data_type``:
``build_graph``, ``build_graph_backward``, ``run_cudnn_SDP_fprop``, ``run_cudnn_SDP_bprop``);
``aten/src/ATen/native/transformers/cuda/attention_backward.cu`` at 00afd8f2 (whose
``_cudnn_attention_backward`` passes ``logsumexp.unsqueeze(-1)``, for the 3-D lse of its day)
and a later copy (AOTriton v3's era) that passes the 4-D ``logsumexp`` as it is, both with
``_scaled_dot_product_cudnn_attention_backward_cuda`` calling it;
NVIDIA/cudnn-frontend ``include/cudnn_frontend/node/sdpa_support_surface.h`` at 05067cac. The
v2.13.0 tag's copies of the C++ files were not available to read.
"""

from __future__ import annotations

import math

import torch

from tests.standins.math import attend, grads, top_left
from tests.standins.memory import read_as

__all__ = ["cudnn_attention", "cudnn_attention_backward"]

_HALF = (torch.float16, torch.bfloat16)
_ALIGN_BYTES = 16


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _check_aligned(name: str, x: torch.Tensor) -> None:
    item = x.element_size()
    _check(x.stride(-1) == 1 or x.shape[-1] == 1, f"{name}: last dimension must be contiguous")
    _check(x.storage_offset() * item % _ALIGN_BYTES == 0, f"{name}: data pointer not aligned")
    for size, stride in zip(x.shape[:-1], x.stride()[:-1], strict=True):
        _check(size <= 1 or stride * item % _ALIGN_BYTES == 0, f"{name}: stride {stride} unaligned")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check(q.dim() == k.dim() == v.dim() == 4, "query, key, value must be 4-D (B, H, L, D)")
    _check(q.dtype in _HALF, f"cuDNN attention: unsupported dtype {q.dtype}")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query, key, value must share a dtype")
    b, h = q.shape[:2]
    _check(k.shape[0] == b and v.shape[0] == b, "batch sizes differ")
    _check(
        h % k.shape[1] == 0 and h % v.shape[1] == 0,
        "cuDNN Frontend error: For group-query attention, number of heads for key and query "
        f"must be a factor of number of heads for query (query {h}, key {k.shape[1]}, value "
        f"{v.shape[1]})",
    )
    _check(k.shape[2] == v.shape[2], "key and value lengths differ")
    _check(q.shape[3] == k.shape[3], "query and key head dims differ")
    for name, x in (("query", q), ("key", k), ("value", v)):
        _check_aligned(name, x)
    for d in (q.shape[3], v.shape[3]):
        _check(d % 8 == 0 and d <= 256, f"cuDNN Frontend error: head dim {d} is not supported")


def _expanded_bias(bias: torch.Tensor | None, q: torch.Tensor, k_len: int) -> torch.Tensor | None:
    """The bias as ``_cudnn_attention_forward`` expands it, read through its strides, added to
    every query head: ``(B, H, Lq, Lk)`` float64."""
    if bias is None:
        return None
    b, h, q_len = q.shape[:3]
    _check(bias.dtype == q.dtype, "bias must have the query's dtype (the graph's io type)")
    if bias.dim() in (2, 3):
        bias = bias.expand(b, 1, q_len, k_len)
    else:
        _check(bias.dim() == 4, f"cuDNN SDPA expects a 2D, 3D, or 4D attn_bias, got {bias.dim()}D")
        bias = bias.expand(b, bias.shape[1], q_len, k_len)
    _check_aligned("attn_bias", bias)
    read = read_as(bias, tuple(bias.shape), bias.stride())
    return read.double().expand(b, h, q_len, k_len)


def _scale(scale: float | None, head_dim: int) -> float:
    return 1 / math.sqrt(head_dim) if scale is None else scale


def _empty(*tensors: torch.Tensor) -> bool:
    return any(t.numel() == 0 for t in tensors)


def cudnn_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    compute_log_sumexp: bool,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple[object, ...]:
    """``aten._scaled_dot_product_cudnn_attention``: ``(output, logsumexp, cum_seq_q,
    cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask)``."""
    assert dropout_p == 0.0 and not return_debug_mask, "the wrapper never asks for these"
    _check_inputs(query, key, value)
    b, h, q_len, _ = query.shape
    k_len = key.shape[2]
    output = torch.empty_like(query)  # alloc_with_matching_layout: q's shape, so empty_like
    logsumexp = torch.empty(b, h, q_len, 1)
    seed, offset = torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)
    if _empty(query, key, value):  # run_cudnn_SDP_fprop returns before writing anything
        output.fill_(math.nan)
        logsumexp.fill_(math.nan)
        return output, logsumexp, None, None, q_len, k_len, seed, offset, None
    _check(k_len != 1, "cuDNN Frontend error: key/value sequence length 1 is not supported")
    bias = _expanded_bias(attn_bias, query, k_len)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    visible = top_left(q_len, k_len) if is_causal else None
    out, lse = attend(q, k, v, _scale(scale, q.shape[-1]), visible, bias)
    no_key = torch.isneginf(lse)  # undocumented in cuDNN: NaN here
    out = out.masked_fill(no_key.transpose(1, 2).unsqueeze(-1), math.nan)
    output.copy_(out.transpose(1, 2))
    logsumexp.copy_(lse.masked_fill(no_key, math.nan).unsqueeze(-1))
    return output, logsumexp, None, None, q_len, k_len, seed, offset, None


def cudnn_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    philox_seed: torch.Tensor,
    philox_offset: torch.Tensor,
    attn_bias: torch.Tensor | None,
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_cudnn_attention_backward``: ``(dq, dk, dv)``, allocated like
    ``query``, ``key``, ``value`` (``empty_like``: ``dk``, ``dv`` keep the key's and value's head
    counts, each the sum over the query heads that read it)."""
    assert dropout_p == 0.0 and cum_seq_q is None and cum_seq_k is None, "never asked here"
    _check_inputs(query, key, value)
    b, h, q_len, _ = query.shape
    k_len = key.shape[2]
    _check(tuple(out.shape) == (b, h, q_len, value.shape[3]), "out shape")
    _check(grad_out.shape == out.shape and out.dtype == query.dtype, "grad_out shape/dtype")
    assert (max_q, max_k) == (q_len, k_len), f"max_q, max_k = {max_q}, {max_k}"  # MHAParams
    dq, dk, dv = (torch.empty_like(x) for x in (query, key, value))
    if _empty(query, key, value, out, grad_out, logsumexp):  # returns before writing anything
        return dq.fill_(math.nan), dk.fill_(math.nan), dv.fill_(math.nan)
    _check(k_len != 1, "cuDNN Frontend error: key/value sequence length 1 is not supported")
    if grad_out.stride(-1) != 1:  # permute_to_matching_layout: a copy in out's order
        grad_out = grad_out.contiguous()
    _check_aligned("out", out)
    _check_aligned("grad_out", grad_out)
    # Stats: logsumexp's own sizes and strides, data type FLOAT.
    _check(logsumexp.dim() == 4 and tuple(logsumexp.shape) == (b, h, q_len, 1), "Stats dims")
    lse = read_as(logsumexp, (b, h, q_len), logsumexp.stride()[:3], torch.float32)
    bias = _expanded_bias(attn_bias, query, k_len)
    q, k, v, o, do = (x.transpose(1, 2) for x in (query, key, value, out, grad_out))
    visible = top_left(q_len, k_len) if is_causal else None
    gq, gk, gv = grads(do, q, k, v, o, lse, _scale(scale, q.shape[-1]), visible, bias)
    for buffer, grad in ((dq, gq), (dk, gk), (dv, gv)):
        buffer.copy_(grad.transpose(1, 2))
    return dq, dk, dv
