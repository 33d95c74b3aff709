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
(:mod:`ringdilated.core.contract.causal`).

Grouped-query heads, as xformers 0.0.35 takes them (``xformers/ops/fmha/__init__.py``,
``common.py``, ``cutlass.py``), nothing repeated:

- forward: the documented ``BMGHK`` layout, ``(N, L, G, H/G, D)`` with key/value head ``g``
  *expanded* along the last head dimension (stride 0). ``Inputs.validate_inputs`` asks equal
  ``(B, M, G, H, K)`` shapes ("please use `expand` yourself"); ``cutlass.FwOp`` declares
  ``SUPPORTS_BMGHK`` and its ``apply`` runs each group ``inp.key[:, :, group]`` (a view: the
  strides, 0 included, go through) through ``aten._efficient_attention_forward``, each on its
  own CUDA stream, and stacks the outputs (a copy of ``out`` and the lse, never of the keys).
  The op reads keys through their strides (``key_ptr + head_id * k_strideH``; its stride rules,
  a contiguous last dimension and strides that are multiples of the alignment, hold for 0);
- backward: ``cutlass.BwOp`` does not declare ``SUPPORTS_BMGHK`` (``AttentionOpBase``: "operator
  does not support BMGHK format"; the docstring: "MQA/GQA is an experimental feature supported
  only for the forward pass"), so it runs once per key/value head on ``BMHK`` views, that
  head expanded to its group's query heads with stride 0
  (:func:`~ringdilated.backends._heads.kv_groups`); ``aten._efficient_attention_backward``
  allocates a dense ``grad_k = at::empty(key.sizes())``, one gradient per query head, which
  :func:`~ringdilated.backends._heads.sum_kv` reduces to the key/value head. Each call's ``out``
  is packed on its own (the backward's hard-coded row stride is ``head_dim_value * num_heads``
  of that call) and its lse padded on its own.

``import xformers`` succeeds, with a logged warning only, when its compiled part fails to load (a
wheel built for another torch); xformers then rejects every CUDA call ("xFormers wasn't build with
CUDA support"). The factory asks xformers the same questions (its build flags and its operators'
``is_available()``) and raises ``ImportError`` with the answer, so the resolver falls back with
that reason instead of choosing a kernel that cannot run.

No sliding window and no softcap (read at v0.0.35: ``fmha/attn_bias.py``, ``cutlass.py``,
``flash.py``, ``flash3.py``): of the local-attention biases, ``cutlass.FwOp`` takes
``LowerTriangularFromBottomRightLocalAttentionMask`` (a left window only together with the
bottom-right causal diagonal, ``window_size`` of ``aten._efficient_attention_forward``) and the
block-diagonal ones (which need packed ``B = 1`` inputs), and ``cutlass.BwOp`` leaves the
bottom-right local mask out ("Still some infs/nans in the BW pass for local + causal");
``LocalAttentionFromBottomRightMask`` (both bounds) is served only by xformers' own flash
operators, which this kernel does not use. A block of a windowed call also needs keys cut on the
left with none cut on the right, which no ``cutlass`` mask expresses; so the spec declines
windows with a left bound (:func:`window_softcap_reasons`). The ``cutlass`` operators have no
softcap (xformers' flash operators pass ``softcap = 0.0``). Not yet run on GPU hardware by this
project.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ringdilated.backends._dense import GuardedBottomRightKernel
from ringdilated.backends._heads import join_heads, kv_groups
from ringdilated.backends._memeff import packed_bmhk, padded_lse
from ringdilated.backends._versions import version_tuple
from ringdilated.core import (
    FUSED_GRID_LIMIT,
    BlockOptions,
    Capabilities,
    Environment,
    KernelSpec,
    PriorityRule,
    Request,
    Target,
)

__all__ = [
    "MIN_VERSION",
    "XFORMERS_SPEC",
    "XformersKernel",
    "unusable_reasons",
    "window_softcap_reasons",
]


def _bmhk(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _bmghk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q (N, H, L, D)`` and ``k, v (N, G, L, D)`` in xformers' ``(N, L, G, H / G, D)``, the keys
    and values expanded along the last head dimension with stride 0: views."""
    groups, group = k.shape[1], q.shape[1] // k.shape[1]

    def expanded(x: torch.Tensor) -> torch.Tensor:
        return _bmhk(x).unsqueeze(3).expand(-1, -1, -1, group, -1)

    n, length, _, d = _bmhk(q).shape
    return _bmhk(q).view(n, length, groups, group, d), expanded(k), expanded(v)


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

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _refuse_softcap(options)
        return super().forward(q, k, v, options)

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
        _refuse_softcap(options)
        return super().backward(dout, q, k, v, out, lse, options)

    def _bias(self, causal: bool) -> object:
        return self._fmha.attn_bias.LowerTriangularFromBottomRightMask() if causal else None

    def native_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        grouped = q.shape[1] != k.shape[1]
        inputs = _bmghk(q, k, v) if grouped else (_bmhk(q), _bmhk(k), _bmhk(v))
        out, lse = self._fmha.memory_efficient_attention_forward_requires_grad(
            *inputs, attn_bias=self._bias(causal), scale=scale, op=self._cutlass.FwOp
        )
        if grouped:  # (N, L, G, H / G, D) and (N, G, H / G, L): stacked, so flattening is a view
            out, lse = out.flatten(2, 3), lse.flatten(1, 2)
        return _bmhk(out), lse.narrow(-1, 0, q.shape[-2])

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
        grads = []
        for group in kv_groups(q, k, v):
            dq, dk, dv = self._fmha.memory_efficient_attention_backward(
                _bmhk(group.query_heads(dout)),
                _bmhk(packed_bmhk(group.query_heads(out))),
                padded_lse(group.query_heads(lse)),
                _bmhk(group.q),
                _bmhk(group.k),
                _bmhk(group.v),
                attn_bias=self._bias(causal),
                scale=scale,
                op=self._cutlass.BwOp,
            )
            grads.append((_bmhk(dq), group.kv_grad(_bmhk(dk)), group.kv_grad(_bmhk(dv))))
        dq, dk, dv = (join_heads(part) for part in zip(*grads, strict=True))
        return dq, dk, dv


_NO_WINDOW = (
    "xformers 0.0.35's cutlass operators mask a left window only with the bottom-right causal "
    "diagonal (LowerTriangularFromBottomRightLocalAttentionMask), forward only (cutlassB: "
    "'Still some infs/nans in the BW pass for local + causal'), while a windowed call's blocks "
    "also need keys cut on the left alone"
)
_NO_SOFTCAP = "xformers 0.0.35's cutlass operators have no softcap"


def window_softcap_reasons(request: Request, env: Environment) -> tuple[str, ...]:
    """Why the ``cutlass`` operators cannot serve a window with a left bound or a softcap."""
    return tuple(
        reason
        for needed, reason in (
            (request.sliding_window, _NO_WINDOW),
            (request.softcap is not None, _NO_SOFTCAP),
        )
        if needed
    )


def _refuse_softcap(options: BlockOptions) -> None:
    if options.softcap is not None:
        raise NotImplementedError(f"{_NO_SOFTCAP} (softcap={options.softcap})")


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
    extra_reasons=window_softcap_reasons,
)
