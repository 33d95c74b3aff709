"""A stand-in ``xformers`` 0.0.35 (``xformers.ops.fmha`` with its ``cutlass`` operators), on CPU.

Signatures are those of 0.0.35's ``fmha/__init__.py``; the checks are its ``cutlass.FwOp`` /
``BwOp`` ``not_supported_reasons`` (dtypes, last-dimension alignment, equal head counts in BMHK,
bias types) and ``_detect_lse_packed_or_raise``. Its ``cutlass`` operators are torch's
``aten._efficient_attention_forward``/``_backward``, so the arithmetic and the memory reads are
:mod:`tests.standins.mem_efficient`'s (``out`` read with the hard-coded row stride, the lse read
as float32 up to 32-row blocks). ``get_padded_lse`` pads a short lse with ``+inf`` and passes one
already padded to 32 through unchanged (not on sm75, which this stand-in does not model).
``built_with_cuda=False`` models a wheel whose compiled extension did not load: the module
imports, and every CUDA call is refused, as xformers does.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from tests.standins.math import bottom_right
from tests.standins.mem_efficient import kernel_backward, kernel_forward

__all__ = ["install_xformers"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class LowerTriangularFromBottomRightMask:
    """Query ``i`` sees key ``j`` iff ``j <= i + (Mk - Mq)``."""


def _reasons(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: object) -> list[str]:
    reasons = []
    if q.dtype not in _DTYPES:
        reasons.append(f"dtype={q.dtype} (supported: {_DTYPES})")
    if not (q.dim() == k.dim() == v.dim() == 4):
        reasons.append("query, key, value must be BMHK")
    elif not (q.shape[2] == k.shape[2] == v.shape[2]):
        reasons.append("BMHK takes equal head counts (use BMGHK for grouped heads)")
    align = 8 if q.dtype in (torch.float16, torch.bfloat16) else 4
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.shape[-1] % align:
            reasons.append(f"{name}.shape[-1] % {align} != 0")
        if x.stride(-2) % align:
            reasons.append(f"{name}.stride(-2) % {align} != 0")
        if x.stride(-1) != 1:
            reasons.append(f"{name}.stride(-1) > 1")
    if attn_bias is not None and not isinstance(attn_bias, LowerTriangularFromBottomRightMask):
        reasons.append(f"attn_bias type is {type(attn_bias)}")
    return reasons


def install_xformers(
    monkeypatch: pytest.MonkeyPatch, built_with_cuda: bool = True, version: str = "0.0.35"
) -> None:
    """Put the stand-in (claiming ``version``) in ``sys.modules``."""

    class FwOp:
        NAME = "cutlassF-pt"

        @classmethod
        def is_available(cls) -> bool:
            return True

    class BwOp:
        NAME = "cutlassB-pt"

        @classmethod
        def is_available(cls) -> bool:
            return True

    def refuse(op: type, q, k, v, attn_bias) -> None:  # type: ignore[no-untyped-def]
        reasons = _reasons(q, k, v, attn_bias)
        if not built_with_cuda and torch.version.hip is None:
            reasons.append("xFormers wasn't build with CUDA support")
        if reasons:
            raise ValueError(
                f"`{op.NAME}` is not supported because:\n    " + "\n    ".join(reasons)
            )

    def memory_efficient_attention_forward_requires_grad(
        query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None, output_dtype=None
    ):  # type: ignore[no-untyped-def]
        if p != 0.0:
            raise NotImplementedError("dropout is not supported on the non-autograd API")
        assert op is FwOp and output_dtype is None, "the wrapper forces the CUTLASS operator"
        refuse(FwOp, query, key, value, attn_bias)
        scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        visible = bottom_right(query.shape[1], key.shape[1]) if attn_bias is not None else None
        return kernel_forward(query, key, value, None, visible, scale)

    def memory_efficient_attention_backward(
        grad, output, lse, query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None
    ):  # type: ignore[no-untyped-def]
        assert op is BwOp and p == 0.0, "the wrapper forces the CUTLASS operator"
        if not (grad.ndim == query.ndim == output.ndim):
            raise ValueError("All tensors should be either in BMK (ndim=3) or BMHK (ndim=4)")
        b, m, h, _ = query.shape
        if lse.ndim != 3 or lse.shape[0] != b or lse.shape[1] != h or lse.shape[-1] < m:
            raise ValueError(f"Input tensors have incompatible shapes: lse {tuple(lse.shape)}")
        refuse(BwOp, query, key, value, attn_bias)
        pad = (32 - lse.shape[2] % 32) % 32  # Context.get_padded_lse(32), not on sm75
        if pad:
            lse = torch.nn.functional.pad(lse, [0, pad], value=math.inf)
        scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        visible = bottom_right(m, key.shape[1]) if attn_bias is not None else None
        return kernel_backward(
            grad.to(query.dtype), query, key, value, None, output.to(query.dtype), lse, visible,
            scale,
        )  # fmt: skip

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
