"""FlashAttention 4 (``flash_attn/cute`` of Dao-AILab/flash-attention: the package
``flash_attn.cute``, installed as ``flash-attn-4``) behind the kernel contract.

Read at the tags ``fa4-v4.0.0.beta5`` and ``fa4-v4.0.0.beta27``, and ``beta8``/``beta9`` for the
softcapped backward (``flash_attn/cute/interface.py``, ``flash_bwd_preprocess.py``,
``softmax.py``, ``mask.py``):

- Forward is ``_flash_attn_fwd(q, k, v, softmax_scale=, causal=, return_lse=True)``, which
  returns ``(out, lse)`` (4.0.0b5 to b18) or ``(out, lse, p, row_max)`` (from b19); ``lse`` is
  float32 ``(batch, heads, seqlen_q)``, ``-inf`` for a row whose exponentials sum to 0 or NaN.
- Backward is ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=, causal=,
  deterministic=, dq=, dk=, dv=)`` fed the final merged ``out`` and ``lse``, writing into the
  buffers given and returning them. Its preprocess turns an lse of ``-inf`` into ``0`` (as
  FlashAttention 3 does; a bottom-right call's rows see a key, so this never matters here).
- Its ``dlse`` argument (from b5) folds an lse gradient into the same call: the preprocess
  (``flash_bwd_preprocess.py``) uses ``D' = rowsum(dout * out) - dlse`` (``dS = P * (dP - D) +
  dlse * P``), "so the main backward kernel is unchanged". The interface only makes its last
  stride 1 (``maybe_contiguous``; b27's also aligns it to 16 bytes); the compiled preprocess
  takes it as a float32 tensor of the lse's shape ``(batch, heads, seqlen_q)``
  (``fake_tensor(Float32, mLSE.shape)``), read through its strides. This kernel implements the
  contract's optional :meth:`Flash4Kernel.backward_with_lse`
  (:class:`ringdilated.core.LseGradientKernel`) with it: where the caller differentiates the
  lse, the driver makes one backward call per window piece, each given its rows of
  ``dlse`` as a dense float32 ``(batch, heads, rows)``, instead of the second backward call any
  other kernel gets (``lse_gradient`` in ``ringdilated.core.contract.lse``). A non-finite
  ``dlse`` makes its problem's ``dq`` and ``dk`` NaN, as that second call does (its ``dout`` is
  ``dlse``), and leaves ``dv`` exact (``dV = P.T @ dO``, ``flash_bwd_sm90.py``, never reads
  ``D'``); rows that see no key are in no piece, so a finite ``dlse`` there adds nothing.
  (b27's dedicated head-dim-256 backward on sm100 refuses ``dlse``; this kernel declares head
  dims up to 128 there.)
- Checks (``assert``, so ``AssertionError``): fp16/bf16 (fp8 forward only on sm100, not used),
  shapes, ``num_head % num_head_kv == 0`` (key/value heads are never repeated), head dims by
  architecture (``_validate_head_dims``: sm90 8 to 256, sm100/sm110 8 to 128, both multiples of
  8 for 2-byte types; 4.0.0b11 adds a dedicated 256 kernel on sm100, not declared here). The
  kernels are compiled assuming 16-byte aligned inputs (b5 passes inputs as they are; b27 copies
  misaligned ones itself), so inputs are aligned first (:mod:`ringdilated.backends._layouts`).
- Key windows, forward and backward, in every supported release: ``window_size_left`` and
  ``window_size_right`` (``None``: unbounded), aligned to the bottom right like ``causal``
  (``mask.py``: ``seqlen_k - seqlen_q`` row offset); ``_resolve_causal_local_window`` drops a
  window whose bounds sum below 0. A block's top-left window runs as at most three calls each
  of which the op computes exactly (:mod:`ringdilated.backends._windows`), each given ``causal``
  for a right bound of 0 and ``window_size_left`` (the right always ``None``); a block without
  a left bound makes the calls it made before.
- Softcapping (``softcap``, a ``score_mod`` made by ``utils.create_softcap_scoremod``): forward
  in every supported release; the backward of 4.0.0b5 to b8 passes ``None`` to its kernels
  ("softcap - not yet supported in backward": its gradients would ignore the cap), and from
  4.0.0b9 it applies ``create_softcap_scoremod_bwd``. Requests for softcapped gradients are
  declined with the reason below b9 or for an unknown version (:func:`softcap_reasons`), and the
  kernel raises for them. (b11's dedicated head-dim-256 kernels on sm100 refuse softcap; this
  kernel declares head dims up to 128 there.)
- ``deterministic`` (when ``BlockOptions.deterministic``): b5 is the first
  release that takes it on sm90 (b0 to b4 assert "bwd deterministic only supported for
  sm100/sm110"), and the first whose backward takes ``dlse``: the minimum this kernel accepts.
  Versions are read from the ``flash-attn-4`` distribution (``flash_attn.cute.__version__``
  reads a distribution named ``fa4`` and says ``0.0.0``); with none, the signature decides.

Hardware: the forward runs on 8.x to 12.x, the backward on 9.x to 12.x; declared for sm90
(priority 400: FlashAttention 3, the Hopper kernel this project reads as mature there, is
preferred at 450) and sm100/sm110 (priority 500, the best kernel there: flash-attn 2 has no
Blackwell-specific kernels), each above flash-attn 2's 300. Not 8.x (no backward) nor 12.x (no
deterministic backward, consumer Blackwell untried). No dropout. Not yet run on GPU hardware by
this project.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch

from ringdilated.backends._dense import refuse_dropout
from ringdilated.backends._layouts import aligned, dense_float32
from ringdilated.backends._upstream import check_parameters, distribution_version, release
from ringdilated.backends._windows import NativeWindowKernel, WindowPiece, backward_by_window
from ringdilated.core import (
    FUSED_WINDOWED_GRID_LIMIT,
    BlockOptions,
    Capabilities,
    Environment,
    KernelSpec,
    PriorityRule,
    Request,
    Target,
    mark_non_finite_problems,
)

__all__ = [
    "FLASH4_SPEC",
    "MIN_VERSION",
    "SOFTCAP_BACKWARD_VERSION",
    "Flash4Kernel",
    "softcap_reasons",
]

MIN_VERSION = "4.0.0b5"
#: The first release whose backward applies ``softcap`` (b5 to b8 pass ``None`` to its kernels).
SOFTCAP_BACKWARD_VERSION = "4.0.0b9"
_FORWARD_NEEDS = frozenset(
    {"q", "k", "v", "softmax_scale", "causal", "return_lse", "softcap", "window_size_left",
     "window_size_right"}
)  # fmt: skip
_BACKWARD_NEEDS = frozenset(
    {"q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "deterministic", "dq", "dk",
     "dv", "dlse", "softcap", "window_size_left", "window_size_right"}
)  # fmt: skip
_HALF = frozenset({torch.float16, torch.bfloat16})


def _installed_version() -> str | None:
    """The installed release (``flash-attn-4``; 4.0.0b0 to b3 were ``flash-attn4``)."""
    return distribution_version("flash-attn-4", "flash-attn4")


def _softcap_backward(version: str | None) -> bool:
    """Whether the backward of release ``version`` applies ``softcap`` (unknown: no)."""
    return version is not None and release(version) >= release(SOFTCAP_BACKWARD_VERSION)


def softcap_reasons(request: Request, env: Environment) -> Iterable[str]:
    """Softcapped gradients need the backward of 4.0.0b9 or later (b5 to b8 drop the cap)."""
    if request.softcap is None or not request.backward:
        return ()
    version = _installed_version()
    if _softcap_backward(version):
        return ()
    return (
        f"flash-attn-4 {version or 'of unknown version'}: its backward applies softcap from "
        f"{SOFTCAP_BACKWARD_VERSION} on (before, _flash_attn_bwd passes None to its kernels: "
        "'softcap - not yet supported in backward')",
    )


class Flash4Kernel(NativeWindowKernel):
    """FlashAttention 4's kernels. Construction checks the installed release and imports
    ``flash_attn.cute.interface``, checking both functions' parameters; a mismatch raises
    ``ImportError`` with the reason. :meth:`backward_with_lse` takes the lse's gradient in the
    same call (the module docstring)."""

    def __init__(self) -> None:
        version = _installed_version()
        text = version or "(version unknown)"
        if version is not None and release(version) < release(MIN_VERSION):
            raise ImportError(
                f"flash-attn-4 {version} is older than the {MIN_VERSION} this kernel needs "
                f"(its backward's dlse, and a deterministic backward on sm90)"
            )
        interface = importlib.import_module("flash_attn.cute.interface")
        self._forward: Any = interface._flash_attn_fwd
        self._backward: Any = interface._flash_attn_bwd
        package, known = f"FlashAttention 4 {text}", f"the interfaces of {MIN_VERSION} to 4.0.0b27"
        check_parameters(
            self._forward, "_flash_attn_fwd", _FORWARD_NEEDS, package=package, known=known
        )
        check_parameters(
            self._backward, "_flash_attn_bwd", _BACKWARD_NEEDS, package=package, known=known
        )
        self._version = version

    def native_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        *,
        window_left: int | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One ``_flash_attn_fwd`` call (``causal`` and ``window_left``: the op's bottom-right
        mask)."""
        qt, kt, vt = (aligned(x.transpose(1, 2)) for x in (q, k, v))
        out, lse, *_ = self._forward(
            q=qt, k=kt, v=vt, softmax_scale=scale, causal=causal, softcap=softcap,
            window_size_left=window_left, window_size_right=None, return_lse=True,
        )  # fmt: skip
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
        *,
        deterministic: bool = False,
        dlse: torch.Tensor | None = None,
        window_left: int | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One ``_flash_attn_bwd`` call; with ``dlse`` (``(batch, heads, rows)``, handed over
        dense float32), the gradient of ``sum(dout * out) + sum(dlse * lse)``. Raises
        ``NotImplementedError`` for ``softcap`` before 4.0.0b9 (module docstring)."""
        if softcap and not _softcap_backward(self._version):
            raise NotImplementedError(
                f"flash-attn-4 {self._version or '(version unknown)'}: no softcap in backward "
                f"before {SOFTCAP_BACKWARD_VERSION} (softcap={softcap})"
            )
        dout_t, qt, kt, vt, out_t = (aligned(x.transpose(1, 2)) for x in (dout, q, k, v, out))
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (qt, kt, vt))
        self._backward(
            q=qt,
            k=kt,
            v=vt,
            out=out_t,
            dout=dout_t,
            lse=dense_float32(lse),
            softmax_scale=scale,
            causal=causal,
            softcap=softcap or 0.0,
            window_size_left=window_left,
            window_size_right=None,
            deterministic=deterministic,
            dq=dq,
            dk=dk,
            dv=dv,
            dlse=None if dlse is None else dense_float32(dlse),
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def backward_with_lse(
        self,
        dout: torch.Tensor,
        dlse: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of ``sum(dout * out) + sum(dlse * lse)``: one ``_flash_attn_bwd``
        per window piece, its rows of ``dlse`` passed as ``dlse=``; repaired for non-finite
        inputs as :meth:`backward` is, ``dlse`` counted as one of them."""
        refuse_dropout(type(self).__name__, options)

        def native(
            dout: torch.Tensor,
            dlse: torch.Tensor | None,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            out: torch.Tensor,
            lse: torch.Tensor,
            piece: WindowPiece,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.native_backward(
                dout, q, k, v, out, lse, piece.causal, options.scale,
                deterministic=options.deterministic, dlse=dlse, window_left=piece.left,
                softcap=options.softcap,
            )  # fmt: skip

        window = options.window
        dq, dk, dv = backward_by_window(native, dout, dlse, q, k, v, out, lse, window)
        mark_non_finite_problems(
            dq, dk, dv, dout, q, k, v, lse, forward_marked=True, options=options, dlse=dlse
        )
        return dq, dk, dv


FLASH4_SPEC = KernelSpec(
    name="flash4",
    factory=Flash4Kernel,
    capabilities=Capabilities(
        targets=(
            Target(
                "cuda",
                _HALF,
                min_capability=(9, 0),
                max_capability=(9, 0),
                max_head_dim=256,
                head_dim_multiple=8,
                note="FlashAttention 4 on Hopper (sm90)",
            ),
            Target(
                "cuda",
                _HALF,
                min_capability=(10, 0),
                max_capability=(11, 9),
                max_head_dim=128,
                head_dim_multiple=8,
                note="FlashAttention 4 on Blackwell (sm100/sm110): head dims up to 128",
            ),
        ),
        causal=True,
        sliding_window=True,
        softcap=True,
        backward=True,
        dropout=False,
        gqa=True,
        deterministic=True,
        requires=("flash_attn.cute",),
        batch_limit=FUSED_WINDOWED_GRID_LIMIT,
    ),
    priority=0,
    priority_rules=(
        PriorityRule(500, "cuda", min_capability=(10, 0), max_capability=(11, 9)),
        PriorityRule(400, "cuda", min_capability=(9, 0), max_capability=(9, 0)),
    ),
    description="FlashAttention 4 (flash-attn-4 4.0.0b5 on): Hopper and Blackwell, fp16/bf16, "
    "sliding windows, softcap (gradients from 4.0.0b9)",
    extra_reasons=softcap_reasons,
)
