"""FlashAttention 3 (``hopper/`` of Dao-AILab/flash-attention: the module ``flash_attn_interface``
and its extension ``flash_attn_3``) behind the kernel contract.

FlashAttention 3 has no release tags of its own; its ``hopper/`` directory ships inside the
repository's tags. Read at ``v2.7.4.post1`` and ``v2.8.3`` (version ``3.0.0b1``, plain functions)
and at ``fa4-v4.0.0.beta27`` (``3.0.0``, ``torch.library`` custom ops, from commit ``c7697bbf``
of 2025-11-17 on): ``hopper/flash_attn_interface.py`` and ``hopper/flash_api.cpp``.

- Forward is ``_flash_attn_forward`` (``flash_attn_func`` returns no lse from 2025-07 on), which
  returns ``(out, softmax_lse, out_accum, softmax_lse_accum)``; ``softmax_lse`` is float32
  ``(batch, heads, seqlen_q)``, ``-inf`` for a row whose exponentials sum to 0 or NaN (a row that
  sees no key: ``softmax.h``, ``finalize``).
- Backward is ``_flash_attn_backward`` fed the final merged ``out`` and ``lse``, writing into the
  ``dq``, ``dk``, ``dv`` it is given (it returns ``(dq, dk, dv, softmax_d)`` in 3.0.0b1 and
  ``softmax_d`` in 3.0.0). ``mha_bwd`` reads ``softmax_lse`` by address as dense float32
  ``(batch, heads, seqlen_q)`` (``flash_bwd_launch_template.h``: strides ``(1, seqlen_q,
  heads * seqlen_q)``, no check), so it is passed contiguous; its preprocess kernel turns an lse
  of ``-inf`` into ``0``, not into "no weight", which never matters here: a row of a bottom-right
  call sees a key, so its merged lse is finite unless its inputs are not (then the rows are
  repaired on the device, :class:`~ringdilated.backends._dense.GuardedBottomRightKernel`).
- The signatures changed: 3.0.0b1 declares most optional inputs (``k_new``, ``qv``,
  ``cu_seqlens_q``, ...) without a default and names the causal flag ``causal`` in both
  functions; 3.0.0 gives every one a default and names the backward's flag ``is_causal``. The
  kernel reads which parameters have no default at construction and passes ``None`` for those it
  knows to be unused inputs; an unknown one (an interface it was not written against) raises
  ``ImportError`` with the reason, so the resolver falls back. Every version's sliding-window
  default (no window) is kept.
- ``mha_fwd`` / ``mha_bwd`` check: fp16/bf16 (fp8 forward only, not used), a contiguous last
  dimension, head dim a multiple of 8 and at most 256, ``num_heads_k`` dividing ``num_heads``
  (key/value heads are never repeated). On sm90 the inputs go through TMA tensor maps, which need
  16-byte alignment (:mod:`ringdilated.backends._layouts`).
- Key windows and softcapping, forward and backward, in every supported interface:
  ``window_size=(left, right)`` (3.0.0b1) or ``window_size_left``/``window_size_right`` (3.0.0),
  and ``softcap`` (``flash_api.cpp``: ``Has_softcap`` forward and backward kernels, refused only
  by a build with ``FLASHATTENTION_DISABLE_SOFTCAP``). The masks are bottom-right aligned
  (``flash_attn_func``'s docstring, ``hopper/mask.h``) and ``mha_fwd``/``mha_bwd`` rewrite the
  window (``left >= seqlen_k - 1`` and ``right >= seqlen_q - 1`` become unbounded), so a block's
  top-left window runs as at most three calls each of which the op computes exactly
  (:mod:`ringdilated.backends._windows`), each given ``causal`` for a right bound of 0 and its
  left bound (``-1``: none; the right always ``-1``); a block without a left bound makes the calls
  it made before. ``softcap`` is passed as given (``0.0``: none).
- ``deterministic=True`` (when ``BlockOptions.deterministic``: the plan's reading of torch's
  switch) serialises the ``dq`` (and, with grouped heads, ``dk``/``dv``) accumulation. 3.0.0's
  ``mha_bwd`` refuses it for head dims above 192 ("Deterministic backward not supported for
  hdim 256", since 2025-09-17), and before commit ``832d5448`` (2025-08-25, after ``v2.8.3``;
  builds still called 3.0.0b1) the grouped-query deterministic backward left its ``dk``/``dv``
  semaphores uninitialised and deadlocks: requests for either are declined with the reason
  (:func:`determinism_reasons`), so a kernel that serves them is chosen instead.

Hardware: ``setup.py`` builds sm90a kernels and sm80 ones (``ARCH_SWITCH`` sends 8.x to the
latter and everything from 9.0 up to the sm90a kernels, which do not run on Blackwell); the
README asks for H100/H800. Declared for 9.0 only, where it is preferred (priority 450, above
flash-attn 2's 300): on 8.x flash-attn 2 serves. No dropout (``p_dropout`` is fixed at 0). Not
yet run on GPU hardware by this project.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch

from ringdilated.backends._layouts import aligned, dense_float32
from ringdilated.backends._upstream import (
    check_parameters,
    distribution_version,
    release,
    required_parameters,
)
from ringdilated.backends._windows import NativeWindowKernel
from ringdilated.core import (
    FUSED_WINDOWED_GRID_LIMIT,
    Capabilities,
    Environment,
    KernelSpec,
    PriorityRule,
    Request,
    Target,
)

__all__ = [
    "BACKWARD_UNUSED",
    "FLASH3_SPEC",
    "FORWARD_UNUSED",
    "Flash3Kernel",
    "determinism_reasons",
]

#: The first version whose grouped-query deterministic backward does not deadlock.
FIXED_GQA_DETERMINISM = release("3.0.0")
#: The largest head dim 3.0.0's deterministic backward takes (``round_up_headdim`` below 256).
MAX_DETERMINISTIC_HEAD_DIM = 192
#: Inputs of ``_flash_attn_forward`` this kernel never passes: 3.0.0b1 declares them without a
#: default, so they are passed ``None`` there.
FORWARD_UNUSED = frozenset(
    {
        "k_new", "v_new", "qv", "out", "out_", "cu_seqlens_q", "cu_seqlens_k",
        "cu_seqlens_k_new", "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k",
        "page_table", "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary",
        "q_descale", "k_descale", "v_descale",
    }
)  # fmt: skip
#: Likewise for ``_flash_attn_backward`` (the varlen inputs; upstream spells ``sequed_q``).
BACKWARD_UNUSED = frozenset(
    {"cu_seqlens_q", "cu_seqlens_k", "sequed_q", "sequed_k", "max_seqlen_q", "max_seqlen_k"}
)
_FORWARD_GIVEN = frozenset({"q", "k", "v", "softmax_scale", "causal"})
_BACKWARD_GIVEN = frozenset(
    {"dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale"}
)


def _installed_version() -> str | None:
    """The ``flash_attn_3`` distribution's version (``None``: not installed under that name, as
    builds of ``v2.7.4.post1`` and older, named ``flash_attn`` or ``flashattn-hopper``, are)."""
    return distribution_version("flash_attn_3")


def _nones(function: Any, name: str, given: frozenset[str], unused: frozenset[str]) -> list[str]:
    """The parameters of ``function`` without a default that the kernel does not pass itself,
    all of which must be ``unused`` inputs (passed ``None``); ``ImportError`` otherwise."""
    required = required_parameters(function)
    if required is None:
        raise ImportError(f"FlashAttention 3: cannot read the parameters of {name}")
    unknown = [p for p in required if p not in given and p not in unused]
    if unknown:
        raise ImportError(
            f"FlashAttention 3: {name} requires {unknown}, which this kernel does not know "
            f"(it knows the interfaces of 3.0.0b1, v2.7.4.post1 to v2.8.3, and of 3.0.0)"
        )
    return [p for p in required if p in unused]


def _check(function: Any, name: str, needed: set[str]) -> tuple[str, ...]:
    return check_parameters(function, name, needed, package="FlashAttention 3")


def _window(split: bool, left: int | None) -> dict[str, Any]:
    """The window keywords for a left bound ``left`` (``None``: none) and no right bound:
    ``window_size_left``/``_right`` (``split``, 3.0.0) or the ``window_size`` pair (3.0.0b1)."""
    bound = -1 if left is None else left
    if split:
        return {"window_size_left": bound, "window_size_right": -1}
    return {"window_size": (bound, -1)}


class Flash3Kernel(NativeWindowKernel):
    """FlashAttention 3's kernels. Construction imports ``flash_attn_interface`` (which loads
    the extension) and reads both functions' parameters; an interface it does not know raises
    ``ImportError`` with the reason."""

    def __init__(self) -> None:
        interface = importlib.import_module("flash_attn_interface")
        self._forward: Any = interface._flash_attn_forward
        self._backward: Any = interface._flash_attn_backward
        forward_names = _check(self._forward, "_flash_attn_forward", {"softmax_scale", "causal"})
        names = _check(self._backward, "_flash_attn_backward", {"softmax_scale", "deterministic"})
        self._causal = "is_causal" if "is_causal" in names else "causal"
        _check(self._backward, "_flash_attn_backward", {self._causal, "dq", "dk", "dv"})
        forward_nones = _nones(self._forward, "_flash_attn_forward", _FORWARD_GIVEN, FORWARD_UNUSED)
        given = _BACKWARD_GIVEN | {self._causal}
        backward_nones = _nones(self._backward, "_flash_attn_backward", given, BACKWARD_UNUSED)
        self._forward_extra = dict.fromkeys(forward_nones)
        self._backward_extra = dict.fromkeys(backward_nones)
        self._split = "window_size_left" in forward_names
        windowed = {"softcap", *_window(self._split, None)}
        _check(self._forward, "_flash_attn_forward", windowed)
        _check(self._backward, "_flash_attn_backward", windowed)

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
        """One ``_flash_attn_forward`` call (``causal`` and ``window_left``: the op's
        bottom-right mask)."""
        qt, kt, vt = (aligned(x.transpose(1, 2)) for x in (q, k, v))
        out, lse, *_ = self._forward(
            qt, kt, vt, softmax_scale=scale, causal=causal, softcap=softcap or 0.0,
            **_window(self._split, window_left), **self._forward_extra,
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
        window_left: int | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One ``_flash_attn_backward`` call into fresh ``dq``, ``dk``, ``dv``."""
        dout_t, qt, kt, vt, out_t = (aligned(x.transpose(1, 2)) for x in (dout, q, k, v, out))
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (qt, kt, vt))
        self._backward(
            dout_t,
            qt,
            kt,
            vt,
            out_t,
            dense_float32(lse),
            dq=dq,
            dk=dk,
            dv=dv,
            softmax_scale=scale,
            deterministic=deterministic,
            softcap=softcap or 0.0,
            **{self._causal: causal},
            **_window(self._split, window_left),
            **self._backward_extra,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def determinism_reasons(request: Request, env: Environment) -> Iterable[str]:
    """Why the installed FlashAttention 3 cannot give ``request`` a deterministic backward:
    3.0.0 refuses head dims above 192; builds before 3.0.0 (or of unknown version) may deadlock
    with grouped-query heads."""
    if not (request.deterministic and request.backward):
        return ()
    reasons = []
    head_dim = request.head_dim
    if head_dim is not None and head_dim > MAX_DETERMINISTIC_HEAD_DIM:
        reasons.append(
            f"FlashAttention 3's deterministic backward takes head dims up to "
            f"{MAX_DETERMINISTIC_HEAD_DIM} (mha_bwd: 'Deterministic backward not supported for "
            f"hdim 256'), head_dim {head_dim} asked under torch.use_deterministic_algorithms"
        )
    version = _installed_version()
    if request.gqa and (version is None or release(version) < FIXED_GQA_DETERMINISM):
        reasons.append(
            f"FlashAttention 3 {version or 'of unknown version'}: its deterministic backward "
            f"with grouped-query heads may deadlock before 3.0.0 (dk/dv semaphores zeroed from "
            f"commit 832d5448, 2025-08-25)"
        )
    return reasons


FLASH3_SPEC = KernelSpec(
    name="flash3",
    factory=Flash3Kernel,
    capabilities=Capabilities(
        targets=(
            Target(
                "cuda",
                frozenset({torch.float16, torch.bfloat16}),
                min_capability=(9, 0),
                max_capability=(9, 0),
                max_head_dim=256,
                head_dim_multiple=8,
                note="FlashAttention 3 runs on Hopper (sm90)",
            ),
        ),
        causal=True,
        sliding_window=True,
        softcap=True,
        backward=True,
        dropout=False,
        gqa=True,
        deterministic=True,
        requires=("flash_attn_interface",),
        batch_limit=FUSED_WINDOWED_GRID_LIMIT,
    ),
    priority=0,
    priority_rules=(PriorityRule(450, "cuda", min_capability=(9, 0), max_capability=(9, 0)),),
    description="FlashAttention 3 (flash_attn_interface, 3.0.0b1 and 3.0.0): Hopper, fp16/bf16, "
    "sliding windows, softcap",
    extra_reasons=determinism_reasons,
)
