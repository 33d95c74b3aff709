"""A stand-in ``flash_attn`` package for each supported version, run on CPU in float64.

Signatures and return tuples are those of the released sources (``flash_attn_interface.py`` of
2.6.3, 2.7.4.post1 and 2.8.3); the checks are ``flash_api.cpp``'s ``TORCH_CHECK``s (half dtypes,
matching dtypes, contiguous last dimension, head sizes, shapes, ``p_dropout < 1``,
``return_softmax`` only with dropout, no softcap with dropout). The window arguments and
``causal`` become a mask exactly as ``mha_fwd``, ``mha_bwd`` and ``set_params_fprop`` rewrite them
(:func:`tests.standins.flash_windows.fa2_visible`: bottom-right, a bound ``>= seqlen_k`` dropped,
an unbounded right beside a left bound made ``seqlen_k``), and ``softcap`` caps every score,
forward and backward (:mod:`tests.standins.math`). ``softmax_lse`` is read the way
the backward kernel reads it: a dense float32 ``(b, h, seqlen_q)`` array from its data pointer,
whatever its strides or dtype, so a strided or float64 lse gives wrong gradients here exactly as
on a GPU. Gradients are written into the ``dq``, ``dk``, ``dv`` given, through their strides.
From 2.7 both functions are ``torch.library`` custom ops (schema-checked arguments, keyword names
from the schema), as upstream registers them.

Dropout as ``flash_api.cpp`` does it: the forward takes ``(seed, offset)`` from the default
generator of the inputs' device (:func:`tests.standins.philox.philox_state`, which advances it),
draws its mask from them and returns them as the int64 ``rng_state``; the backward reads
``rng_state[0]`` and ``rng_state[1]`` by address as uint64 and replays that mask (without an
``rng_state`` it draws a fresh ``(seed, offset)``, as ``mha_bwd`` does), so a wrong state gives
wrong gradients. Every backward call's ``deterministic`` and ``rng_state`` are recorded in
:data:`BACKWARD_CALLS`; every call's shapes, ``causal``, window and softcap in :data:`CALLS`.
Inputs on a ``cuda`` device (FakeTensor ``cuda`` tensors) are checked and recorded, not
computed (2.7+'s custom ops have fake implementations, as upstream registers them).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.standins.flash_windows import fa2_visible
from tests.standins.math import attend, grads
from tests.standins.memory import read_as
from tests.standins.philox import keep_mask, philox_state

__all__ = ["BACKWARD_CALLS", "CALLS", "VERSIONS", "install_flash_attn"]

VERSIONS = ("2.6.3", "2.7.4.post1", "2.8.3")
_HALF = (torch.float16, torch.bfloat16)
#: ``{"deterministic": bool, "rng_state": (seed, offset) | None}`` per backward call, in order.
BACKWARD_CALLS: list[dict[str, Any]] = []
#: ``{"op", "rows", "keys", "causal", "window", "softcap", "q", "k"}`` per call, in order (``q``,
#: ``k``: ``(shape, stride, storage_offset)`` as the op got them).
CALLS: list[dict[str, Any]] = []


def _record(op: str, q: Any, k: Any, causal: bool, window: Any, softcap: float) -> None:
    CALLS.append({
        "op": op, "rows": q.shape[1], "keys": k.shape[1], "causal": causal,
        "window": tuple(window), "softcap": softcap,
        "q": (tuple(q.shape), q.stride(), q.storage_offset()),
        "k": (tuple(k.shape), k.stride(), k.storage_offset()),
    })  # fmt: skip


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)  # TORCH_CHECK raises RuntimeError


def maybe_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check(q.dtype in _HALF, "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype")
    for x in (q, k, v):
        _check(x.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    b, _, h, d = q.shape
    _check(b > 0, "batch size must be positive")
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(k.dim() == 4 and k.shape[0] == b and k.shape[3] == d, "key shape")
    _check(v.shape == k.shape, "value shape")
    _check(h % k.shape[2] == 0, "Number of heads in key/value must divide number of heads in query")


def _check_dropout(dropout_p: float, softcap: float) -> None:
    _check(dropout_p < 1.0, "p_dropout < 1")
    if softcap > 0.0:
        _check(dropout_p == 0.0, "Softcapping does not support dropout for now")


def _drop(
    seed: int, offset: int, q: torch.Tensor, k: torch.Tensor, p: float
) -> torch.Tensor | None:
    """The mask of ``(seed, offset)`` over ``(b, h, seqlen_q, seqlen_k)``, kept elements scaled
    by ``1 / (1 - p)`` (``rp_dropout``)."""
    shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    return keep_mask(seed, offset, shape, p).double() / (1.0 - p)


def _forward(  # type: ignore[no-untyped-def]
    q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, return_softmax
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, softmax_lse, rng_state)`` of ``mha_fwd``."""
    assert alibi_slopes is None, "not what we call"
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))
    _check_qkv(q, k, v)
    _check(q.shape[3] % 8 == 0, "head_size that is a multiple of 8")
    _check_dropout(dropout_p, softcap)
    if return_softmax:
        _check(dropout_p > 0.0, "return_softmax is only supported when p_dropout > 0.0")
    _record("forward", q, k, causal, window, softcap)
    if q.device.type != "cpu":  # a fake cuda tensor: shapes only
        b, sq, h, d = q.shape
        lse = q.new_empty(b, h, sq, dtype=torch.float32)
        return q.new_empty(b, sq, h, d), lse, q.new_empty(2, dtype=torch.int64)
    rng_state = torch.full((2,), -1, dtype=torch.int64)  # torch::empty: only dropout writes it
    drop = None
    if dropout_p > 0.0:
        seed, offset = philox_state(torch.default_generator, q.shape[0] * q.shape[2] * 32)
        rng_state = torch.tensor([seed, offset], dtype=torch.int64)
        drop = _drop(seed, offset, q, k, dropout_p)
    visible = fa2_visible(q.shape[1], k.shape[1], causal, *window, forward=True)
    out, lse = attend(q, k, v, softmax_scale, visible, drop=drop, softcap=softcap)
    lse = lse.masked_fill(torch.isneginf(lse), float("inf")).float()
    return out.to(q.dtype).contiguous(), lse, rng_state


def _backward_into(  # type: ignore[no-untyped-def]
    dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window,
    softcap, deterministic, rng_state,
) -> torch.Tensor:  # fmt: skip
    dout, q, k, v, out = (maybe_contiguous(x) for x in (dout, q, k, v, out))
    _check_qkv(q, k, v)
    _check_dropout(dropout_p, softcap)
    _check(out.dtype == q.dtype and dout.dtype == q.dtype, "out and dout must have q's dtype")
    b, sq, h, d = q.shape
    sk = k.shape[1]
    _check(d % 8 == 0, "head_size should be a multiple of 8")
    _check(out.shape == q.shape and dout.shape == q.shape, "out/dout shape")
    for g, like in ((dq, q), (dk, k), (dv, v)):
        _check(g.dtype == q.dtype, "dq, dk, dv must have q's dtype")
        _check(g.stride(-1) == 1, "dq, dk, dv must have contiguous last dimension")
        _check(g.shape == like.shape, "dq, dk, dv shape")
    _record("backward", q, k, causal, window, softcap)
    if q.device.type != "cpu":
        return q.new_empty(b, h, -(-sq // 128) * 128, dtype=torch.float32)
    drop, replayed = None, None
    if dropout_p > 0.0:
        if rng_state is not None:  # flash_bwd_kernel.h: params.rng_state[0], [1] as uint64
            seed, offset = read_as(rng_state, (2,), (1,), torch.int64).tolist()
            replayed = (seed, offset)
        else:  # mha_bwd draws a fresh state from the generator
            seed, offset = philox_state(torch.default_generator, b * h * 32)
        drop = _drop(seed, offset, q, k, dropout_p)
    BACKWARD_CALLS.append({"deterministic": deterministic, "rng_state": replayed})
    # flash_bwd_kernel.h: lse is read at (bidb * h + bidh) * seqlen_q + row, as float32.
    lse = read_as(softmax_lse, (b, h, sq), (h * sq, sq, 1), torch.float32)
    visible = fa2_visible(sq, sk, causal, *window, forward=False)
    computed = grads(dout, q, k, v, out, lse, softmax_scale, visible, drop=drop, softcap=softcap)
    for buffer, grad in zip((dq, dk, dv), computed, strict=True):
        buffer.copy_(grad)
    return torch.zeros(b, h, -(-sq // 128) * 128)


def _flash_attn_func(version: str) -> Callable[..., Any]:
    def flash_attn_func(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):  # type: ignore[no-untyped-def]
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5
        out, lse, _ = _forward(
            q, k, v, dropout_p, softmax_scale, causal, tuple(window_size), softcap, alibi_slopes,
            return_attn_probs and dropout_p > 0,
        )  # fmt: skip
        if not return_attn_probs:
            return out
        # 2.6.3 leaves S_dmask undefined without dropout (None); 2.7+ returns an empty tensor.
        s_dmask = None if version.startswith("2.6") else torch.empty(0)
        return out, lse, s_dmask

    return flash_attn_func


def _functions_2_6() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """2.6.x: plain functions, ``window_size`` a tuple."""

    def _flash_attn_forward(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        return_softmax,
    ):  # type: ignore[no-untyped-def]  # fmt: skip
        q, k, v = (maybe_contiguous(x) for x in (q, k, v))
        out, lse, rng_state = _forward(
            q, k, v, dropout_p, softmax_scale, causal, tuple(window_size), softcap, alibi_slopes,
            return_softmax,
        )  # fmt: skip
        return out, q, k, v, out, lse, None, rng_state

    def _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, rng_state=None,
    ):  # type: ignore[no-untyped-def]  # fmt: skip
        softmax_d = _backward_into(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
            tuple(window_size), softcap, deterministic, rng_state,
        )  # fmt: skip
        return dq, dk, dv, softmax_d

    return _flash_attn_forward, _flash_attn_backward


_OPS: dict[str, tuple[Any, Any]] = {}


def _custom_ops(version: str) -> tuple[Any, Any]:
    """2.7+: ``flash_attn::_flash_attn_forward`` and ``_flash_attn_backward`` (the latter
    mutating dq, dk, dv); registered once per version under a stand-in namespace (the real one
    would clash across versions)."""
    if version in _OPS:
        return _OPS[version]
    namespace = "flash_attn_standin_" + version.replace(".", "_")

    @torch.library.custom_op(f"{namespace}::_flash_attn_forward", mutates_args=())
    def _flash_attn_forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: torch.Tensor | None,
        return_softmax: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out, lse, rng_state = _forward(
            q, k, v, dropout_p, softmax_scale, causal, (window_size_left, window_size_right),
            softcap, alibi_slopes, return_softmax,
        )  # fmt: skip
        return out, lse, q.new_empty(0), rng_state

    @_flash_attn_forward.register_fake
    def _(*args, **kwargs):  # type: ignore[no-untyped-def]
        return _flash_attn_forward._init_fn(*args, **kwargs)

    @torch.library.custom_op(f"{namespace}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
    def _flash_attn_backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: torch.Tensor | None,
        dk: torch.Tensor | None,
        dv: torch.Tensor | None,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: torch.Tensor | None,
        deterministic: bool,
        rng_state: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert dq is not None and dk is not None and dv is not None, "we always pass buffers"
        return _backward_into(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
            (window_size_left, window_size_right), softcap, deterministic, rng_state,
        )  # fmt: skip

    @_flash_attn_backward.register_fake
    def _(*args, **kwargs):  # type: ignore[no-untyped-def]
        return _flash_attn_backward._init_fn(*args, **kwargs)

    _OPS[version] = (_flash_attn_forward, _flash_attn_backward)
    return _OPS[version]


def install_flash_attn(monkeypatch: pytest.MonkeyPatch, version: str = "2.8.3") -> None:
    """Put the stand-in ``flash_attn`` of ``version`` (or an older, unsupported one) in
    ``sys.modules``; :data:`BACKWARD_CALLS` and :data:`CALLS` start empty."""
    BACKWARD_CALLS.clear()
    CALLS.clear()
    package = types.ModuleType("flash_attn")
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    package.__version__ = version  # type: ignore[attr-defined]
    package.flash_attn_func = _flash_attn_func(version)  # type: ignore[attr-defined]
    interface.flash_attn_func = package.flash_attn_func  # type: ignore[attr-defined]
    old = version.startswith(("2.6", "2.5"))
    forward, backward = _functions_2_6() if old else _custom_ops(version)
    interface._flash_attn_forward = forward  # type: ignore[attr-defined]
    interface._flash_attn_backward = backward  # type: ignore[attr-defined]
    package.flash_attn_interface = interface  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
