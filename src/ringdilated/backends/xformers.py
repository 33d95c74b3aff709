"""xformers' memory-efficient attention (its ``cutlass`` operators) behind the kernel contract.

Forward is ``xformers.ops.fmha.memory_efficient_attention_forward_requires_grad`` (``(out,
lse)``), backward ``memory_efficient_attention_backward`` fed the final merged ``out`` and
``lse``; both with the ``cutlass`` operators forced, so this kernel declares what those
operators declare. Read against xformers 0.0.35, whose ``cutlass`` operators are torch's own
``aten._efficient_attention_forward``/``_backward``, so the layout rules of
:mod:`ringdilated.backends._memeff` apply: ``out`` is handed over as packed ``(N, L, H, D)`` (the
backward hard-codes its row stride), and the lse as float32 padded to 32 rows with ``+inf``
(xformers passes an lse already padded to 32 through unchanged, except on sm75). The raw aten
kernels do not split batches beyond the 65535 launch-grid limit, so the kernel declares it.

The CUTLASS operators have no "partial" mode, which is why ``memory_efficient_attention_partial``
is not used: the lse from ``forward_requires_grad`` is the same quantity. Causal offsets use
``LowerTriangularFromBottomRightMask`` in at most two calls
(:mod:`ringdilated.core.contract.causal`). Key/value heads are repeated for grouped-query attention.

``import xformers`` succeeds, with a logged warning only, when its compiled part fails to load (a
wheel built for another torch); xformers then rejects every CUDA call ("xFormers wasn't build with
CUDA support"). The factory asks xformers the same questions (its build flags and its operators'
``is_available()``) and raises ``ImportError`` with the answer, so the resolver falls back with
that reason instead of choosing a kernel that cannot run. Not yet run on GPU hardware by this
project.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ringdilated.backends._dense import GuardedBottomRightKernel
from ringdilated.backends._heads import repeat_kv, sum_kv
from ringdilated.backends._memeff import packed_bmhk, padded_lse
from ringdilated.backends._versions import version_tuple
from ringdilated.core import FUSED_GRID_LIMIT, Capabilities, KernelSpec, PriorityRule, Target

__all__ = ["MIN_VERSION", "XFORMERS_SPEC", "XformersKernel", "unusable_reasons"]


def _bmhk(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _bmhk_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """``q``, ``k``, ``v`` in xformers' ``(N, L, H, D)``, key/value heads repeated to ``q``'s."""
    return [_bmhk(q), *(_bmhk(repeat_kv(x, q.shape[1])) for x in (k, v))]


#: The xformers whose ``fmha`` this wrapper was written against (its ``cutlass`` operators are
#: torch's own kernels from 0.0.35 on).
MIN_VERSION = (0, 0, 35)


def unusable_reasons(fmha: Any, version: str) -> list[str]:
    """Why xformers' ``cutlass`` operators cannot run here: a version this wrapper was not written
    against, or what xformers asks itself (``AttentionOpBase.not_supported_reasons``: the build
    flag, and the operators' availability)."""
    if version_tuple(version, 3) < MIN_VERSION:
        wanted = ".".join(map(str, MIN_VERSION))
        return [f"xformers {version} is older than the {wanted} this kernel was written against"]
    reasons = []
    common: Any = getattr(fmha, "common", None)
    if not hasattr(common, "_built_with_cuda"):
        return [f"xformers {version}: fmha.common._built_with_cuda is gone; cannot tell whether "
                "its compiled extension loaded"]  # fmt: skip
    if not common._built_with_cuda and torch.version.hip is None:
        reasons.append(
            "xFormers wasn't built with CUDA support: its compiled extension did not load "
            "(a wheel built for another torch or CUDA?); see python -m xformers.info"
        )
    for op in (fmha.cutlass.FwOp, fmha.cutlass.BwOp):
        if not op.is_available():
            reasons.append(f"xformers operator {getattr(op, 'NAME', op.__name__)} is not available")
    return reasons


class XformersKernel(GuardedBottomRightKernel):
    """xformers CUTLASS kernels. Construction imports ``xformers.ops.fmha`` and raises
    ``ImportError`` with xformers' own reasons when its operators cannot run."""

    def __init__(self) -> None:
        version = str(getattr(importlib.import_module("xformers"), "__version__", "0"))
        self._fmha: Any = importlib.import_module("xformers.ops.fmha")
        self._cutlass: Any = self._fmha.cutlass
        reasons = unusable_reasons(self._fmha, version)
        if reasons:
            raise ImportError("; ".join(reasons))

    def _bias(self, causal: bool) -> object:
        return self._fmha.attn_bias.LowerTriangularFromBottomRightMask() if causal else None

    def native_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = self._fmha.memory_efficient_attention_forward_requires_grad(
            *_bmhk_inputs(q, k, v), attn_bias=self._bias(causal), scale=scale, op=self._cutlass.FwOp
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
        dq, dk, dv = self._fmha.memory_efficient_attention_backward(
            _bmhk(dout),
            _bmhk(packed_bmhk(out)),
            padded_lse(lse),
            *_bmhk_inputs(q, k, v),
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
        batch_limit=FUSED_GRID_LIMIT,
    ),
    priority=50,
    priority_rules=(PriorityRule(150, "cuda", min_capability=(7, 0), max_capability=(7, 5)),),
    description="xformers memory-efficient attention (CUTLASS): Maxwell to Hopper",
)
