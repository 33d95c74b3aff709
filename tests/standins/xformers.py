"""A stand-in ``xformers`` 0.0.35 (``xformers.ops.fmha`` with its ``cutlass`` operators).

The Python layer is 0.0.35's, as read in facebookresearch/xformers@v0.0.35
(``xformers/ops/fmha/__init__.py``, ``common.py``, ``cutlass.py``, ``dispatch.py``):

- ``memory_efficient_attention_forward_requires_grad`` and ``memory_efficient_attention_backward``
  with their signatures, refusing dropout (the non-autograd API does);
- ``Inputs.validate_inputs``: one rank for all of BMK, BMHK, BMGHK; equal dtypes; shapes
  ``(B, M, H, K)`` or ``(B, M, G, H, K)`` alike for query, key and value ("HINT: We don't support
  broadcasting, please use `expand` yourself");
- the operators' ``not_supported_reasons``, raised as ``_ensure_op_supports_or_raise`` raises
  them: dtypes, bias types, ``check_lastdim_alignment_stride1`` (``FwOp``: query and value;
  ``BwOp``: query, key and value; 8 elements for half types, 4 for float32, as on sm80 on), and
  BMGHK, which ``FwOp`` declares (``SUPPORTS_BMGHK``) and ``BwOp`` does not ("operator does not
  support BMGHK format");
- ``FwOp.apply``: BMHK to its ``OPERATOR`` as is; BMGHK with one head per group squeezed to BMHK,
  otherwise group by group (``inp.key[:, :, group]``: a view, strides as they are) and the
  outputs and lse stacked (xformers runs each group on its own CUDA stream, which a CPU torch
  cannot model: here they run one after another);
- the backward's ``_detect_lse_packed_or_raise`` (non-varlen: ``lse`` shaped ``(B, *GH, >= M)``),
  ``Context.get_padded_lse(32)`` (pads a short lse with ``+inf``, passes one padded to 32 through;
  the sm75 ``force_pad_inf`` is not modelled), and ``BwOp.apply``'s call of its ``OPERATOR``.

The operators' ``OPERATOR`` are torch's ``aten._efficient_attention_forward`` and ``_backward``:
by default :func:`tests.standins.mem_efficient.cutlass_forward` and ``cutlass_backward``, which
check what the aten ops check and read memory as the kernels do (keys and values through their
strides, ``out`` with the hard-coded row stride, the lse in 32-row blocks); the FakeTensor tests
pass the real aten ops (their meta kernels). The device and compute-capability checks are not
modelled (the CPU run stands in for sm80 on). ``built_with_cuda=False`` models a wheel whose
compiled extension did not load: the module imports, and every CUDA call is refused, as
xformers does.
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.standins.mem_efficient import cutlass_backward, cutlass_forward

__all__ = ["install_xformers"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: ``_CustomMaskType`` (matches torch's ``sdp::CustomMaskType``).
_NO_MASK, _FROM_BOTTOM_RIGHT = 0, 2


class LowerTriangularFromBottomRightMask:
    """Query ``i`` sees key ``j`` iff ``j <= i + (Mk - Mq)``."""


def _mask_type(attn_bias: object) -> int:
    return _FROM_BOTTOM_RIGHT if isinstance(attn_bias, LowerTriangularFromBottomRightMask) else 0


def _validate_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """``Inputs.validate_inputs`` for the dense inputs the wrapper sends."""
    qkv = (query, key, value)
    if query.ndim not in (3, 4, 5) or any(x.ndim != query.ndim for x in qkv):
        raise ValueError(
            "Query/Key/Value should all have BMGHK, BMHK or BMK shape.\n"
            f"  query.shape: {query.shape}\n  key.shape  : {key.shape}\n"
            f"  value.shape: {value.shape}"
        )
    if any(x.dtype != query.dtype for x in qkv):
        raise ValueError("Query/Key/Value should either all have the same dtype")
    b, mq, k_dim = query.shape[0], query.shape[1], query.shape[-1]
    b, mkv = key.shape[:2]  # as upstream: the key's batch is the one checked against
    kv_dim = value.shape[-1]
    heads = tuple(query.shape[2:-1])  # () for BMK, (H,) for BMHK, (G, H) for BMGHK
    valid = (
        tuple(query.shape) == (b, mq, *heads, k_dim)
        and tuple(key.shape) == (b, mkv, *heads, k_dim)
        and tuple(value.shape) == (b, mkv, *heads, kv_dim)
    )
    if not valid:
        raise ValueError(
            "Incompatible shapes for attention inputs:\n"
            f"  query.shape: {query.shape}\n  key.shape  : {key.shape}\n"
            f"  value.shape: {value.shape}\n"
            "HINT: We don't support broadcasting, please use `expand` yourself before calling "
            "`memory_efficient_attention` if you need to"
        )


def _check_lastdim_alignment_stride1(reasons: list[str], name: str, x: torch.Tensor) -> None:
    """``common.check_lastdim_alignment_stride1`` with ``_minimum_gemm_alignment`` on sm80 on."""
    alignment = 8 if x.dtype in (torch.float16, torch.bfloat16) else 4
    if x.shape[-1] % alignment != 0:
        reasons.append(f"{name}.shape[-1] % {alignment} != 0")
    elif x.stride(-2) % alignment != 0:
        reasons.append(f"{name}.stride(-2) % {alignment} != 0 ({name}.stride() = {x.stride()})")
    if x.stride(-1) > 1:
        reasons.append(f"{name}.stride(-1) > 1 ({name}.stride() = {x.stride()})")


def _not_supported_reasons(
    op: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: object
) -> list[str]:
    """``AttentionOpBase.not_supported_reasons`` and the operator's own alignment checks."""
    reasons = []
    if query.dtype not in _DTYPES:
        reasons.append(f"dtype={query.dtype} (supported: {set(_DTYPES)})")
    if attn_bias is not None and not isinstance(attn_bias, LowerTriangularFromBottomRightMask):
        reasons.append(f"attn_bias type is {type(attn_bias)}")
    if not op.built_with_cuda and torch.version.hip is None:
        reasons.append("xFormers wasn't build with CUDA support")
    if not op.SUPPORTS_BMGHK and query.ndim == 5:
        reasons.append("operator does not support BMGHK format")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if name in op.CHECKED:
            _check_lastdim_alignment_stride1(reasons, name, x)
    return reasons


def _ensure_op_supports_or_raise(
    name: str, op: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: object
) -> None:
    reasons = _not_supported_reasons(op, query, key, value, bias)
    if reasons:
        raise ValueError(
            f"Operator `{name}` does not support inputs:\n"
            f"`{op.NAME}` is not supported because:\n    " + "\n    ".join(reasons)
        )


def _padded_lse(lse: torch.Tensor, pad_to: int = 32) -> torch.Tensor:
    """``Context.get_padded_lse(32)`` (``force_pad_inf`` off: not on sm75)."""
    pad = (pad_to - lse.shape[2] % pad_to) % pad_to
    return torch.nn.functional.pad(lse, [0, pad], value=math.inf) if pad else lse


def install_xformers(
    monkeypatch: pytest.MonkeyPatch,
    built_with_cuda: bool = True,
    version: str = "0.0.35",
    operators: tuple[Callable[..., Any], Callable[..., Any]] = (cutlass_forward, cutlass_backward),
) -> None:
    """Put the stand-in (claiming ``version``) in ``sys.modules``; ``operators``: the ``OPERATOR``
    of ``cutlass.FwOp`` and ``BwOp`` (``aten._efficient_attention_forward`` and ``_backward``)."""

    class FwOp:
        NAME = "cutlassF-pt"
        OPERATOR = staticmethod(operators[0])
        SUPPORTS_BMGHK = True
        CHECKED = ("query", "value")

        @classmethod
        def is_available(cls) -> bool:
            return True

        @classmethod
        def apply_bmhk(
            cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: object, scale: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            out, lse, _, _, _, _ = cls.OPERATOR(
                query=q, key=k, value=v, bias=None, cu_seqlens_q=None, cu_seqlens_k=None,
                max_seqlen_q=-1, max_seqlen_k=-1, dropout_p=0.0, compute_log_sumexp=True,
                custom_mask_type=_mask_type(bias), scale=scale, seqlen_k=None, window_size=None,
            )  # fmt: skip
            return out, lse

        @classmethod
        def apply(
            cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: object, scale: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            assert q.ndim in (4, 5), "BMK (normalize_bmhk) is not modelled: never sent"
            if q.ndim == 4:
                return cls.apply_bmhk(q, k, v, bias, scale)
            if q.shape[3] == 1:  # one head per group: squeezed to BMHK
                out, lse = cls.apply_bmhk(q.squeeze(3), k.squeeze(3), v.squeeze(3), bias, scale)
                return out.unsqueeze(3), lse.unsqueeze(1)
            groups = [
                cls.apply_bmhk(q.select(2, g), k.select(2, g), v.select(2, g), bias, scale)
                for g in range(k.shape[2])
            ]
            return torch.stack([o for o, _ in groups], 2), torch.stack([s for _, s in groups], 1)

    class BwOp:
        NAME = "cutlassB-pt"
        OPERATOR = staticmethod(operators[1])
        SUPPORTS_BMGHK = False
        CHECKED = ("query", "key", "value")

        @classmethod
        def is_available(cls) -> bool:
            return True

    FwOp.built_with_cuda = BwOp.built_with_cuda = built_with_cuda  # type: ignore[attr-defined]

    def memory_efficient_attention_forward_requires_grad(
        query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None, output_dtype=None
    ):  # type: ignore[no-untyped-def]
        if p != 0.0:
            raise NotImplementedError("dropout is not supported on the non-autograd API.")
        assert op is FwOp and output_dtype is None, "the wrapper forces the CUTLASS operator"
        _validate_inputs(query, key, value)
        output_shape = (*query.shape[:-1], value.shape[-1])
        _ensure_op_supports_or_raise("memory_efficient_attention", FwOp, query, key, value,
                                     attn_bias)  # fmt: skip
        out, lse = FwOp.apply(query, key, value, attn_bias, scale)
        return out.reshape(output_shape), lse

    def memory_efficient_attention_backward(
        grad, output, lse, query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None
    ):  # type: ignore[no-untyped-def]
        if p != 0.0:
            raise NotImplementedError("dropout is not supported on the non-autograd API.")
        assert op is BwOp, "the wrapper forces the CUTLASS operator"
        _validate_inputs(query, key, value)
        if grad.ndim != query.ndim or grad.ndim != output.ndim:
            raise ValueError("All tensors should be either in BMK (ndim=3) or BMHK (ndim=4) format")
        shapes = [x.shape for x in (query, key, value)]
        # _detect_lse_packed_or_raise, not varlen: lse (B, *GH, >= M)
        if (
            lse.ndim != query.ndim - 1
            or lse.shape[1:-1] != query.shape[2:-1]
            or lse.shape[0] != query.shape[0]
            or lse.shape[-1] < query.shape[1]
        ):
            raise ValueError(
                f"Input tensors have incompatible shapes.\n  lse.shape    : {lse.shape}\n"
                f"  query.shape  : {query.shape}"
            )
        _ensure_op_supports_or_raise("memory_efficient_attention_backward", BwOp, query, key,
                                     value, attn_bias)  # fmt: skip
        unused = torch.Tensor()  # rng_seed = rng_offset = torch.Tensor() without dropout
        dq, dk, dv, _ = BwOp.OPERATOR(
            grad.to(query.dtype), query, key, value, bias=None, bias_requires_grad=False,
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=-1, max_seqlen_k=-1,
            logsumexp=_padded_lse(lse), out=output.to(query.dtype), dropout_p=0.0,
            philox_seed=unused, philox_offset=unused, custom_mask_type=_mask_type(attn_bias),
            scale=scale, num_splits_key=None, window_size=None,
        )  # fmt: skip
        return tuple(g.reshape(s) for g, s in zip((dq, dk, dv), shapes, strict=True))

    fmha = types.ModuleType("xformers.ops.fmha")
    cutlass = types.ModuleType("xformers.ops.fmha.cutlass")
    common = types.ModuleType("xformers.ops.fmha.common")
    attn_bias = types.ModuleType("xformers.ops.fmha.attn_bias")
    attn_bias.LowerTriangularFromBottomRightMask = LowerTriangularFromBottomRightMask  # type: ignore[attr-defined]
    cutlass.FwOp, cutlass.BwOp = FwOp, BwOp  # type: ignore[attr-defined]
    common._built_with_cuda = built_with_cuda  # type: ignore[attr-defined]
    fmha.attn_bias, fmha.cutlass, fmha.common = attn_bias, cutlass, common  # type: ignore[attr-defined]
    fmha.memory_efficient_attention_forward_requires_grad = (  # type: ignore[attr-defined]
        memory_efficient_attention_forward_requires_grad
    )
    fmha.memory_efficient_attention_backward = memory_efficient_attention_backward  # type: ignore[attr-defined]
    ops = types.ModuleType("xformers.ops")
    ops.fmha = fmha  # type: ignore[attr-defined]
    root = types.ModuleType("xformers")
    root.ops = ops  # type: ignore[attr-defined]
    root.__version__ = version  # type: ignore[attr-defined]
    for name, module in (
        ("xformers", root),
        ("xformers.ops", ops),
        ("xformers.ops.fmha", fmha),
        ("xformers.ops.fmha.cutlass", cutlass),
        ("xformers.ops.fmha.common", common),
        ("xformers.ops.fmha.attn_bias", attn_bias),
    ):
        monkeypatch.setitem(sys.modules, name, module)
