"""FlashAttention 2 (the ``flash-attn`` package, 2.6 to 2.8) behind the kernel contract.

Forward is ``flash_attn_func(..., return_attn_probs=True)``, which returns ``(out, softmax_lse,
S_dmask)`` in every supported version; backward is
``flash_attn.flash_attn_interface._flash_attn_backward`` fed the final merged ``out`` and ``lse``,
as the contract asks, writing into ``dq``, ``dk``, ``dv`` buffers it is given. Its signature
changed, read from the released sources:

- 2.6.x: ``(..., causal, window_size, softcap, alibi_slopes, deterministic, rng_state=None)``,
  ``window_size`` a ``(left, right)`` tuple; returns ``(dq, dk, dv, softmax_d)``.
- 2.7 and 2.8: ``(..., causal, window_size_left, window_size_right, softcap, alibi_slopes,
  deterministic, rng_state=None)``, a ``torch.library`` custom op; returns ``softmax_d`` only.

:class:`FlashKernel` picks the keywords by version and checks the function's parameters at
construction, so an unknown signature fails there (the resolver falls back, with the reason)
rather than on the first backward. ``flash_api.cpp`` reads ``softmax_lse`` as a dense float32
``(batch, heads, seqlen_q)`` array with no check, so it is passed contiguous; every other tensor
needs only a contiguous last dimension. flash-attn's causal mask is bottom-right aligned, so any
causal offset runs as at most two calls (:mod:`ringdilated.core.contract.causal`).

Declared (:data:`FLASH_SPEC`), with the reasons the spec cannot hold: 2.6.x takes compute
capability 8.x and 9.0 only, as its ``flash_api.cpp`` checks; the batch is ``gridDim.y``; no
dropout, as flash-attn draws its own dropout mask, which a backward cannot regenerate from the
contract's seed. Not yet run on GPU hardware by this project.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
from collections.abc import Iterable
from typing import Any

import torch

from ringdilated.backends._dense import GuardedBottomRightKernel
from ringdilated.backends._versions import version_tuple
from ringdilated.core import (
    FUSED_GRID_LIMIT,
    Capabilities,
    Environment,
    KernelSpec,
    PriorityRule,
    Request,
    Target,
)

__all__ = ["FLASH_SPEC", "MIN_VERSION", "FlashKernel", "backward_window_keywords"]

MIN_VERSION = (2, 6)
#: The first version whose backward takes ``window_size_left`` / ``window_size_right``.
SPLIT_WINDOW_VERSION = (2, 7)


def backward_window_keywords(version: tuple[int, ...]) -> dict[str, Any]:
    """The "no sliding window" keywords of ``_flash_attn_backward`` in ``version``."""
    if version < SPLIT_WINDOW_VERSION:
        return {"window_size": (-1, -1)}
    return {"window_size_left": -1, "window_size_right": -1}


def _parameters(function: Any) -> tuple[str, ...] | None:
    """Parameter names of a plain function or of a ``torch.library`` custom op's function."""
    try:
        return tuple(inspect.signature(getattr(function, "_init_fn", function)).parameters)
    except (TypeError, ValueError):
        return None


class FlashKernel(GuardedBottomRightKernel):
    """flash-attn 2 kernels. Construction imports the package, checks its version and the
    backward's parameters; any mismatch raises ``ImportError`` with the reason."""

    def __init__(self) -> None:
        package = importlib.import_module("flash_attn")
        text = str(getattr(package, "__version__", "0"))
        version = version_tuple(text, 2)
        if version < MIN_VERSION:
            wanted = ".".join(map(str, MIN_VERSION))
            raise ImportError(f"flash-attn {text} is older than the {wanted} this kernel needs")
        interface = importlib.import_module("flash_attn.flash_attn_interface")
        self._forward: Any = package.flash_attn_func
        self._backward: Any = interface._flash_attn_backward
        self._window = backward_window_keywords(version)
        names = _parameters(self._backward)
        needed = {"softcap", "alibi_slopes", "deterministic", *self._window}
        if names is not None and not needed <= set(names):
            raise ImportError(
                f"flash-attn {text}: _flash_attn_backward takes ({', '.join(names)}), which "
                f"lacks {sorted(needed - set(names))}; this kernel knows the 2.6 to 2.8 signatures"
            )

    def native_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        out, lse, _ = self._forward(
            qt, kt, vt, dropout_p=0.0, softmax_scale=scale, causal=causal, return_attn_probs=True
        )
        return out.transpose(1, 2), lse

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
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (qt, kt, vt))
        self._backward(
            dout.transpose(1, 2),
            qt,
            kt,
            vt,
            out.transpose(1, 2),
            lse.to(torch.float32).contiguous(),
            dq,
            dk,
            dv,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            rng_state=None,
            **self._window,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _installed_version() -> tuple[int, ...] | None:
    """flash-attn's version without importing it (its CUDA extension loads on import)."""
    module = sys.modules.get("flash_attn")
    if module is not None:
        return version_tuple(str(getattr(module, "__version__", "0")), 2)
    try:
        return version_tuple(importlib.metadata.version("flash-attn"), 2)
    except importlib.metadata.PackageNotFoundError:
        return None


def _version_reasons(request: Request, env: Environment) -> Iterable[str]:
    """flash-attn 2.6.x's ``flash_api.cpp`` accepts compute capability 8.x and 9.0 only."""
    version = _installed_version()
    cc = request.compute_capability
    if version is not None and version < SPLIT_WINDOW_VERSION and cc is not None and cc > (9, 0):
        return (
            f"flash-attn {'.'.join(map(str, version))} supports compute capability 8.x and 9.0 "
            f"only (2.7 lifts it), device has {cc[0]}.{cc[1]}",
        )
    return ()


FLASH_SPEC = KernelSpec(
    name="flash",
    factory=FlashKernel,
    capabilities=Capabilities(
        targets=(
            Target(
                "cuda",
                frozenset({torch.float16, torch.bfloat16}),
                min_capability=(8, 0),
                max_head_dim=256,
                head_dim_multiple=8,
                note="flash-attn 2 needs Ampere or newer",
            ),
        ),
        causal=True,
        backward=True,
        dropout=False,
        gqa=True,
        requires=("flash_attn",),
        batch_limit=FUSED_GRID_LIMIT,
    ),
    priority=0,
    priority_rules=(PriorityRule(300, "cuda", min_capability=(8, 0)),),
    description="FlashAttention 2 (flash-attn 2.6 to 2.8): Ampere and newer, fp16/bf16",
    extra_reasons=_version_reasons,
)
