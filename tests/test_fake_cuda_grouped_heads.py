"""Grouped-query heads reach the memory-efficient ops unrepeated, on FakeTensor ``cuda`` tensors.

The driver's kernel calls are recorded on CPU (tests/test_fake_cuda.py) and replayed on fake
``cuda`` tensors of the same sizes, strides and offsets through the ``xformers`` kernel (over
the xformers 0.0.35 stand-in whose ``cutlass`` operators are torch's real
``aten._efficient_attention_forward``/``_backward``, so their meta kernels run) and the ``sdpa``
CUDA path (``aten._scaled_dot_product_efficient_attention[_backward]``). A dispatch mode checks
every op call against the caller's ``q``, ``k``, ``v``:

- the op's key and value are views of the caller's (same storage: no copy reached the op), with
  the op's own equal head counts (``query.size(2) == key.size(2)``);
- for grouped heads, the op's key and value heads have stride 0 (one key/value head expanded
  to its group), and the call's query heads ``h0 ..`` read key/value head ``h0 // r``;
- no op materialises the caller's ``k`` or ``v`` (``clone``, ``copy_``, ``index_select``,
  ``repeat``, ``cat``, ...: what ``repeat_interleave`` decomposes to, among others);
- one op call per key/value head when grouped, else one.

The bottom-right pieces of other causal offsets slice with Python indexing, which a CPU-only
torch refuses on fake ``cuda`` tensors, so the replays are the driver's one-process calls
(offsets 0 and ``None``: whole calls); the pieces' arithmetic is checked on CPU
(tests/test_grouped_heads.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ringdilated.backends import _heads
from ringdilated.backends._heads import repeat_kv
from ringdilated.backends.sdpa import SdpaKernel
from ringdilated.backends.xformers import XformersKernel
from tests.standins import install_xformers
from tests.test_fake_cuda import EfficientAttentionContract, Recorder, _aligned, _record

_aten = torch.ops.aten
#: The memory-efficient ops, and their head dimension: BMHK (2) for the raw ops xformers calls,
#: ``(B, H, L, D)`` (1) for the SDPA-level ones.
HEADS_DIM = {
    _aten._efficient_attention_forward.default: 2,
    _aten._efficient_attention_backward.default: 2,
    _aten._scaled_dot_product_efficient_attention.default: 1,
    _aten._scaled_dot_product_efficient_attention_backward.default: 1,
}
#: Ops that write a new tensor holding another's elements.
COPIES = {
    _aten.clone, _aten.copy_, _aten._to_copy, _aten.index_select, _aten.index, _aten.gather,
    _aten.repeat, _aten.repeat_interleave, _aten.cat, _aten.stack, _aten.expand_copy,
}  # fmt: skip


@pytest.fixture(autouse=True)
def _grouped_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every grouped call here goes one call per key/value head, however small (the size rule
    that repeats small calls instead is tested in tests/test_heads_grouping.py)."""
    monkeypatch.setattr(_heads, "GROUPED_MIN_TILES", 0)


def _storage(x: torch.Tensor) -> int:
    return int(x.untyped_storage()._cdata)


def _arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _cutlass_backward_outputs(a: dict[str, Any]) -> tuple[Any, ...]:
    """What ``aten._efficient_attention_backward`` returns without a bias gradient:
    ``at::empty(query.sizes())`` and likewise for key and value (``attention_backward.cu``), no
    ``grad_bias``. torch 2.13's meta kernel for it cannot stand in: it is registered with a
    signature that lacks ``out`` and ``window_size`` (``meta__efficient_attention_backward`` in
    ``torch/_meta_registrations.py``), so FakeTensor's call with a keyword ``scale`` raises."""
    grads = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in
             (a["query"], a["key"], a["value"]))  # fmt: skip
    return (*grads, None)


class UnrepeatedKeys(TorchDispatchMode):
    """The checks of the module docstring for the kernel call whose caller tensors are
    :attr:`caller` (``q``, ``k``, ``v`` in kernel layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.caller: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.op_calls: list[str] = []

    def _check_op(self, name: str, a: dict[str, Any], dim: int) -> None:
        assert self.caller is not None
        q, k, v = self.caller
        query, key, value = a["query"], a["key"], a["value"]
        r = q.shape[1] // k.shape[1]
        for what, x, mine in (("key", key, k), ("value", value, v)):
            assert _storage(x) == _storage(mine), (
                f"{name}: {what} is a copy, not a view of the caller's {what} (repeated heads?)"
            )
            assert x.shape[dim] == query.shape[dim], f"{name}: the op takes equal head counts"
            if r > 1:
                assert x.stride(dim) == 0 or x.shape[dim] == 1, (
                    f"{name}: grouped {what} heads not expanded with stride 0: {x.stride()}"
                )
                first = (query.storage_offset() - q.storage_offset()) // q.stride(1)
                expected = mine.storage_offset() + (first // r) * mine.stride(1)
                assert x.storage_offset() == expected, (
                    f"{name}: query heads from {first} read {what} head "
                    f"{(x.storage_offset() - mine.storage_offset()) // mine.stride(1)}, "
                    f"not {first // r}"
                )
        self.op_calls.append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in HEADS_DIM and self.caller is not None:
            a = _arguments(func, args, kwargs)
            self._check_op(str(func.overloadpacket.__name__), a, HEADS_DIM[func])
            if func is _aten._efficient_attention_backward.default:
                return _cutlass_backward_outputs(a)
        elif func.overloadpacket in COPIES and self.caller is not None:
            kv = {_storage(x) for x in self.caller[1:]}
            tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            assert not any(_storage(x) in kv for x in tensors), (
                f"{func} materialises the caller's key or value"
            )
        return func(*args, **kwargs)


def _replay(kernel: Any, recorder: Recorder, contract: TorchDispatchMode) -> UnrepeatedKeys:
    """Each recorded call on fake ``cuda`` tensors, under ``contract`` and the checks above;
    asserts the number of op calls each kernel call makes."""
    checks = UnrepeatedKeys()
    with FakeTensorMode(), checks, contract:  # the contract sees each op first
        for kind, layouts, options in recorder.calls:
            tensors = [layout.fake() for layout in layouts]
            q, k, v = tensors[:3] if kind == "forward" else tensors[1:4]
            checks.caller = (q, k, v)
            before = len(checks.op_calls)
            if kind == "forward":
                out, lse = kernel.forward(*tensors, options)
                assert out.shape == q.shape and lse.shape == q.shape[:-1]
            else:
                dout, q, k, v, out, lse = tensors
                if lse.dtype != torch.float32:  # the reference records float64 for float64
                    lse = lse.float()
                grads = kernel.backward(dout, q, k, v, out, lse, options)
                assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
            calls = k.shape[1] if k.shape[1] < q.shape[1] else 1
            assert len(checks.op_calls) - before == calls, "one op call per key/value head"
            checks.caller = None
    return checks


GROUPED = [("head_groups", True, 4, 2), ("longnet", True, 4, 1), ("longnet", False, 6, 3),
           ("head_groups", False, 4, 4)]  # fmt: skip


class NoContract(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class CutlassContract(NoContract):
    """What the raw ops read (``attention.cu``, ``attention_backward.cu``, ``kernel_backward.h``)
    in the layouts xformers hands them: BMHK, last dimension contiguous, strides and start
    aligned to 4 elements; the backward's ``out`` packed for *its* heads (``o_strideM() =
    head_dim_value * num_heads``) and its lse float32, 32-row padded, ``strideH % 8 == 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in (_aten._efficient_attention_forward.default,
                    _aten._efficient_attention_backward.default):  # fmt: skip
            a = _arguments(func, args, kwargs)
            q, k = a["query"], a["key"]
            for name in ("query", "key", "value"):
                x = a[name]
                assert x.dim() == 4 and x.stride(-1) == 1, f"{name}: BMHK, last dim contiguous"
                assert _aligned(x, 4), f"{name}: start and strides aligned to 4 elements"
            assert a["bias"] is None and a["custom_mask_type"] in (0, 2), "bottom-right or none"
            if func is _aten._efficient_attention_forward.default:
                assert a["compute_log_sumexp"] is True
                self.seen["forward"] += 1
            else:
                out, lse = a["out"], a["logsumexp"]
                b, m, h = out.shape[:3]
                assert out.is_contiguous(), f"out packed for the call's heads: {out.stride()}"
                assert a["grad_out_"].shape == out.shape == (*q.shape[:3], a["value"].shape[3])
                assert lse.dtype == torch.float32 and lse.stride(-1) == 1
                assert tuple(lse.shape) == (b, h, -(-m // 32) * 32), "lse padded to 32 rows"
                assert h <= 1 or lse.stride(1) % 8 == 0, "LSE is not correctly aligned (strideH)"
                assert k.shape[1] == a["value"].shape[1]
                self.seen["backward"] += 1
        return func(*args, **kwargs)


def _fake_xformers(monkeypatch: pytest.MonkeyPatch) -> XformersKernel:
    forward, backward = _aten._efficient_attention_forward, _aten._efficient_attention_backward
    install_xformers(monkeypatch, operators=(forward, backward))
    return XformersKernel()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("mode", "causal", "heads", "kv_heads"), GROUPED)
def test_xformers_hands_the_cutlass_ops_grouped_heads_unrepeated(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    mode: str,
    causal: bool,
    heads: int,
    kv_heads: int,
) -> None:
    """Under :class:`CutlassContract` too."""
    kernel = _fake_xformers(monkeypatch)
    recorder = _record(dtype, mode, causal, heads, kv_heads, lse_grad=True)
    contract = CutlassContract()
    checks = _replay(kernel, recorder, contract)
    names = set(checks.op_calls)
    assert names == {"_efficient_attention_forward", "_efficient_attention_backward"}
    assert contract.seen["forward"] >= 1 and contract.seen["backward"] >= 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("mode", "causal", "heads", "kv_heads"), GROUPED)
def test_sdpa_hands_the_memory_efficient_ops_grouped_heads_unrepeated(
    dtype: torch.dtype, mode: str, causal: bool, heads: int, kv_heads: int
) -> None:
    """Under tests/test_fake_cuda.py's contract too (packed ``out`` per call, padded lse, bias)."""
    recorder = _record(dtype, mode, causal, heads, kv_heads, lse_grad=True)
    contract = EfficientAttentionContract()
    checks = _replay(SdpaKernel(), recorder, contract)
    assert set(checks.op_calls) == {
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
    }
    assert contract.seen["forward"] >= 1 and contract.seen["backward"] >= 1


class RepeatingXformers(XformersKernel):
    """The pre-fix wrapper: ``k``, ``v`` repeated to the query's heads before the op."""

    def native_forward(self, q, k, v, causal, scale):  # type: ignore[no-untyped-def]
        return super().native_forward(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]),
                                      causal, scale)  # fmt: skip


class RepeatingSdpa(SdpaKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        return super().forward(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]), options)


@pytest.mark.parametrize("kernel", ["xformers", "sdpa"])
def test_the_checks_catch_heads_repeated_before_the_op(
    monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    if kernel == "xformers":
        _fake_xformers(monkeypatch)
        wrapper: Any = RepeatingXformers()
    else:
        wrapper = RepeatingSdpa()
    recorder = _record(torch.float16, "head_groups", True, 4, 2, lse_grad=False)
    with pytest.raises(AssertionError, match="materialises the caller's key or value"):
        _replay(wrapper, recorder, NoContract())


def test_the_checks_catch_an_out_not_packed_for_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward's ``out`` row stride is ``head_dim_value * num_heads`` of each call: the
    driver's strided ``out`` handed over as is fails :class:`CutlassContract`."""
    from ringdilated.backends import xformers

    kernel = _fake_xformers(monkeypatch)
    monkeypatch.setattr(xformers, "packed_bmhk", lambda x: x)
    recorder = _record(torch.float16, "head_groups", True, 4, 2, lse_grad=False)
    with pytest.raises(AssertionError, match="out packed for the call's heads"):
        _replay(kernel, recorder, CutlassContract())
