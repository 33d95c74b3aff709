"""A stand-in ``flash_attn.cute`` (FlashAttention 4: ``flash_attn/cute`` of
Dao-AILab/flash-attention, installed as ``flash-attn-4``) for each release the ``flash4`` kernel
supports, run on CPU in float64, and one it does not.

``_flash_attn_fwd`` and ``_flash_attn_bwd`` take exactly the parameters (names, order, defaults)
of ``flash_attn/cute/interface.py`` at ``fa4-v4.0.0.beta4`` (unsupported: no ``dlse``),
``beta5`` and ``beta27``, read with ``ast`` from the tags; the forward returns ``(out, lse)``
(b5) or ``(out, lse, p, row_max)`` (b27), the backward ``(dq, dk, dv)``. The checks are the
interface's ``assert``s (dtypes, shapes, ``num_head % num_head_kv``, ``lse`` float32 of shape
``(batch, num_head, seqlen_q)``, ``_validate_head_dims`` for the architecture the stand-in is
installed for, b4's "bwd deterministic only supported for sm100/sm110") and the kernels'
compiled assumption of 16-byte aligned inputs: b5 passes inputs as they are (a misaligned one
raises here, as a misaligned access faults there), b27 copies misaligned ones first
(``maybe_contiguous(t, align_bytes=16)``). The backward reads ``lse`` through its strides (a
dynamic layout), an lse of ``-inf`` taken as ``0`` (``flash_bwd_preprocess.py``).

``dlse`` (b5 and b27; b4 has none): the interface asserts nothing of it and only passes it
through ``maybe_contiguous`` (as the lse: b5 fixes a last stride that is not 1, b27 also copies
a misaligned one); the compiled preprocess takes it as ``fake_tensor(Float32, mLSE.shape)``, so
its TVM FFI call refuses any other dtype or a shape other than the lse's: a ``RuntimeError``
here (the FFI's own message differs). It is read through its strides and folded in as
``D' = rowsum(dout * out) - dlse`` (:func:`tests.standins.math.grads`).

Windows and softcapping: ``causal``, ``window_size_left`` and ``window_size_right`` become a
mask as ``_resolve_causal_local_window`` and ``mask.py`` make it
(:func:`tests.standins.flash_windows.fa4_visible`: bottom-right, ``None`` unbounded, a window
whose bounds sum below 0 dropped); ``softcap`` (``0.0``: none) caps every forward score, and the
backward applies it from 4.0.0b9 only: b4 and b5 pass ``None`` to their backward kernels
("softcap - not yet supported in backward"), so their gradients here ignore the cap, as theirs do.

Inputs on a ``cuda`` device (FakeTensor ``cuda`` tensors) are checked the same way and recorded,
not computed. Every call's arguments are recorded in :data:`CALLS`.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

import pytest
import torch

from tests.standins.distributions import fake_distributions
from tests.standins.flash_windows import fa4_visible
from tests.standins.math import attend, grads

__all__ = ["CALLS", "UNSUPPORTED", "VERSIONS", "install_flash_attn4"]

VERSIONS = ("4.0.0b5", "4.0.0b27")
UNSUPPORTED = "4.0.0b4"
CALLS: list[dict[str, Any]] = []

_FWD_B4 = (
    "cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, "
    "max_seqlen_k=None, page_table=None, softmax_scale=None, causal=False, softcap=None, "
    "window_size_left=None, window_size_right=None, learnable_sink=None, m_block_size=128, "
    "n_block_size=128, num_threads=384, num_splits=1, pack_gqa=None, _arch=None, score_mod=None, "
    "mask_mod=None, block_sparse_tensors=None, return_lse=False, out=None, lse=None, "
    "aux_tensors=None"
)
_FWD_B5 = _FWD_B4.replace(
    "m_block_size=128, n_block_size=128,", "tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None,"
)
_FWD_B27 = (
    "qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, "
    "max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, "
    "softmax_scale=None, causal=False, softcap=None, window_size_left=None, "
    "window_size_right=None, learnable_sink=None, tile_mn=None, mma_pv_is_rs=None, "
    "intra_wg_overlap=None, num_threads=384, num_splits=1, pack_gqa=None, _arch=None, "
    "score_mod=None, mask_mod=None, block_sparse_tensors=None, return_lse=False, out=None, "
    "lse=None, aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None, "
    "v_descale=None, gather_kv_indices=None, scheduler_metadata=None, seqlen_k_per_split=None, "
    "disable_scheduler_metadata=False"
)
_BWD_B4 = (
    "softmax_scale=None, causal=False, softcap=0.0, window_size_left=None, "
    "window_size_right=None, m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False, "
    "num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False, "
    "AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2, V_in_regs=False, cu_seqlens_q=None, "
    "cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, "
    "deterministic=False, dq=None, dk=None, dv=None, score_mod=None, score_mod_bwd=None, "
    "mask_mod=None, aux_tensors=None, block_sparse_tensors=None"
)
_BWD_B5 = _BWD_B4 + ", dlse=None"
_BWD_B27 = _BWD_B4.replace("aux_tensors=None,", "aux_tensors=None, aux_scalars=None,") + (
    ", dlse=None, learnable_sink=None"
)
_SIGNATURES = {
    "4.0.0b4": (_FWD_B4, _BWD_B4),
    "4.0.0b5": (_FWD_B5, _BWD_B5),
    "4.0.0b27": (_FWD_B27, _BWD_B27),
}
#: What the wrapper leaves at its default; anything else is "not what we call".
_DEFAULTED = ("cu_seqlens_q", "page_table", "score_mod", "mask_mod")
#: The releases whose backward drops ``softcap`` (before 4.0.0b9).
_BACKWARD_WITHOUT_SOFTCAP = ("4.0.0b4", "4.0.0b5")


def _flags(a: dict[str, Any]) -> dict[str, Any]:
    """The mask and cap arguments of a call, as recorded."""
    window = (a["window_size_left"], a["window_size_right"])
    return {"causal": a["causal"], "window": window, "softcap": a["softcap"]}


def _visible(a: dict[str, Any], q_len: int, k_len: int) -> torch.Tensor | None:
    return fa4_visible(q_len, k_len, a["causal"], a["window_size_left"], a["window_size_right"])


def _signature(required: tuple[str, ...], optional: str) -> inspect.Signature:
    parameters = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in required]
    for item in optional.split(", "):
        name, default = item.split("=")
        value = eval(default)  # literals only: None, False, numbers
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        parameters.append(inspect.Parameter(name, kind, default=value))
    return inspect.Signature(parameters)


def _layout(x: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype)


def _aligned(x: torch.Tensor) -> bool:
    size = x.element_size()
    steps = [s * size for n, s in zip(x.shape[:-1], x.stride()[:-1], strict=True) if n > 1]
    return (x.storage_offset() * size) % 16 == 0 and all(step % 16 == 0 for step in steps)


class _Release:
    """One release's two functions, checking what its interface asserts."""

    def __init__(self, version: str, arch: int) -> None:
        self.version, self.arch = version, arch

    def inputs(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``maybe_contiguous``: b27 copies misaligned inputs; b5 only fixes the last stride
        and hands the kernel what it got (16-byte aligned it must be, but for the lse and its
        gradient, which b5 converts assuming 4 bytes)."""
        fixed = {}
        for name, x in tensors.items():
            x = x.contiguous() if x.stride(-1) != 1 else x
            # b5 converts the lse, dlse with assumed_align=4 (their fake tensors: divisibility=1).
            strict = name not in ("lse", "dlse") or self.version == "4.0.0b27"
            if strict and not _aligned(x):
                if self.version != "4.0.0b27":
                    raise RuntimeError(f"{name}: misaligned address (kernel assumes 16 bytes)")
                x = x.clone(memory_format=torch.contiguous_format)
            fixed[name] = x
        return fixed

    def head_dims(self, d: int, dtype: torch.dtype) -> None:
        """``_validate_head_dims`` with ``alignment = 16 // element_size``."""
        alignment = 16 // torch.empty((), dtype=dtype).element_size()
        top = 256 if self.arch // 10 == 9 else 128
        assert 8 <= d <= top and d % alignment == 0, f"(head_dim, head_dim_v)=({d}, {d})"

    def forward(self, bound: inspect.BoundArguments) -> Any:
        a = bound.arguments
        for name in _DEFAULTED:
            assert a.get(name) is None, f"not what we call: {name}"
        t = self.inputs({"q": a["q"], "k": a["k"], "v": a["v"]})
        q, k, v = t["q"], t["k"], t["v"]
        b, sq, h, d = q.shape
        sk, hk = v.shape[1], v.shape[2]
        assert k.shape == (b, sk, hk, d) and v.shape == (b, sk, hk, d)
        assert v.dtype in (torch.float16, torch.bfloat16), "inputs must be float16, bfloat16"
        assert q.dtype == v.dtype and k.dtype == v.dtype, "q, k, v, and qv must have the same dtype"
        assert self.arch // 10 in (8, 9, 10, 11, 12), "Unsupported compute capability"
        assert h % hk == 0, "num_head must be divisible by num_head_kv"
        self.head_dims(d, q.dtype)
        tensors = {"q": _layout(q), "k": _layout(k), "v": _layout(v)}
        CALLS.append({"op": "forward", "tensors": tensors, **_flags(a)})
        if q.device.type != "cpu":
            out = torch.empty(b, sq, h, d, dtype=q.dtype, device=q.device)
            lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
        else:
            softcap = a["softcap"] or None  # ``if softcap == 0.0: softcap = None``
            visible = _visible(a, sq, sk)
            out64, lse64 = attend(q, k, v, a["softmax_scale"], visible, softcap=softcap)
            out = out64.to(q.dtype)
            lse = lse64.masked_fill(torch.isnan(lse64), float("-inf")).float()
        lse = lse if a["return_lse"] else None
        return (out, lse) if self.version != "4.0.0b27" else (out, lse, None, None)

    def backward(self, bound: inspect.BoundArguments) -> Any:
        a = bound.arguments
        for name in _DEFAULTED:
            assert a.get(name) is None, f"not what we call: {name}"
        assert self.arch // 10 in (9, 10, 11, 12), "Unsupported compute capability"
        if self.version == "4.0.0b4" and self.arch // 10 not in (10, 11):
            assert a["deterministic"] is False, "bwd deterministic only supported for sm100/sm110"
        names = ("q", "k", "v", "out", "dout", "lse")
        if a.get("dlse") is not None:
            names += ("dlse",)
        t = self.inputs({n: a[n] for n in names})
        q, k, v, out, dout, lse = (t[n] for n in names[:6])
        dlse = t.get("dlse")
        b, sq, h, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        assert k.shape == (b, sk, hk, d) and v.shape == (b, sk, hk, d)
        assert out.shape == (b, sq, h, d) and dout.shape == (b, sq, h, d)
        assert lse.shape == (b, h, sq), "lse must have shape (batch_size, num_head, seqlen_q)"
        assert q.dtype in (torch.float16, torch.bfloat16), "inputs must be float16 or bfloat16"
        assert q.dtype == k.dtype == v.dtype == out.dtype == dout.dtype, "the same dtype"
        assert lse.dtype == torch.float32, "lse must be float32"
        assert h % hk == 0, "num_head must be divisible by num_head_kv"
        self.head_dims(d, q.dtype)
        if dlse is not None and (dlse.dtype != torch.float32 or dlse.shape != lse.shape):
            raise RuntimeError(
                f"dlse: the preprocess takes Float32 of the lse's shape {tuple(lse.shape)}, got "
                f"{str(dlse.dtype).removeprefix('torch.')} {tuple(dlse.shape)}"
            )
        buffers = []
        for name, like in (("dq", q), ("dk", k), ("dv", v)):
            g = a[name]
            assert g is not None, "we always pass buffers"
            assert g.shape == like.shape and g.dtype == q.dtype, f"{name} shape/dtype"
            buffers.append(g)
        tensors = {n: _layout(t[n]) for n in names}
        det = a["deterministic"]
        CALLS.append({"op": "backward", "tensors": tensors, "deterministic": det, **_flags(a)})
        if q.device.type == "cpu":
            seen = lse.masked_fill(torch.isneginf(lse), 0.0)  # lse_log2 = 0 where lse is -inf
            visible = _visible(a, sq, sk)
            scale = a["softmax_scale"]
            dropped = self.version in _BACKWARD_WITHOUT_SOFTCAP
            softcap = None if dropped else a["softcap"] or None
            computed = grads(dout, q, k, v, out, seen, scale, visible, dlse=dlse, softcap=softcap)
            for buffer, grad in zip(buffers, computed, strict=True):
                buffer.copy_(grad)
        return tuple(buffers)


def _functions(version: str, arch: int) -> tuple[Any, Any]:
    forward_text, backward_text = _SIGNATURES[version]
    release = _Release(version, arch)
    forward_signature = _signature(("q", "k", "v"), forward_text)
    backward_signature = _signature(("q", "k", "v", "out", "dout", "lse"), backward_text)

    def _flash_attn_fwd(*args: Any, **kwargs: Any) -> Any:
        return release.forward(forward_signature.bind(*args, **kwargs))

    def _flash_attn_bwd(*args: Any, **kwargs: Any) -> Any:
        return release.backward(backward_signature.bind(*args, **kwargs))

    _flash_attn_fwd.__signature__ = forward_signature  # type: ignore[attr-defined]
    _flash_attn_bwd.__signature__ = backward_signature  # type: ignore[attr-defined]
    return _flash_attn_fwd, _flash_attn_bwd


def install_flash_attn4(
    monkeypatch: pytest.MonkeyPatch, version: str = "4.0.0b27", arch: int = 90
) -> None:
    """Put the stand-in ``flash_attn.cute`` of ``version`` for a device of compute capability
    ``arch`` (e.g. 90, 100) in ``sys.modules`` (under an existing ``flash_attn`` stand-in, or a
    bare namespace package, as ``flash-attn-4`` alone installs), its ``flash-attn-4``
    distribution seen; :data:`CALLS` starts empty."""
    CALLS.clear()
    package = sys.modules.get("flash_attn")
    if package is None:
        package = types.ModuleType("flash_attn")
        package.__path__ = []  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "flash_attn", package)
    cute = types.ModuleType("flash_attn.cute")
    cute.__path__ = []  # type: ignore[attr-defined]
    interface = types.ModuleType("flash_attn.cute.interface")
    forward, backward = _functions(version, arch)
    interface._flash_attn_fwd = forward  # type: ignore[attr-defined]
    interface._flash_attn_bwd = backward  # type: ignore[attr-defined]
    cute.interface = interface  # type: ignore[attr-defined]
    monkeypatch.setattr(package, "cute", cute, raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    fake_distributions(monkeypatch, {"flash-attn-4": version, "flash-attn4": None})
