"""torch's flash and cuDNN attention ops (the ``torch_flash`` and ``cudnn`` kernels) and the
memory-efficient op's dropout (``sdpa``) on FakeTensor ``cuda`` tensors, through torch 2.13's own
meta kernels, with every argument each op receives checked against what the ops read
(tests/standins/torch_flash.py and tests/standins/cudnn.py name the sources).

The driver runs on CPU with a recording kernel (tests/test_fake_cuda.py), through the public
``dilated_attention`` (both modes, causal, grouped heads, packed documents, a query suffix, whose
causal blocks have offsets other than 0), and each call it makes is replayed on fake ``cuda``
tensors with the same sizes, strides and offsets. A fake CUDA build has no CUDA generator, so the
dropout replays draw from a CPU generator standing in for it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import ringdilated
from ringdilated.backends._heads import repeat_kv
from ringdilated.backends.cudnn import CudnnKernel
from ringdilated.backends.sdpa import SdpaKernel
from ringdilated.backends.torch_flash import TorchFlashKernel
from ringdilated.core import KeyWindow
from ringdilated.core.contract.kernel import BlockOptions
from tests.standins import (
    cudnn_attention,
    cudnn_attention_backward,
    efficient_attention,
    efficient_attention_backward,
    flash_attention,
    flash_attention_backward,
)
from tests.standins.mem_efficient import cutlass_backward, cutlass_forward
from tests.test_fake_cuda import GRID, EfficientAttentionContract, Layout, Recorder

_aten = torch.ops.aten
FLASH = _aten._scaled_dot_product_flash_attention.default
FLASH_BACKWARD = _aten._scaled_dot_product_flash_attention_backward.default
CUDNN = _aten._scaled_dot_product_cudnn_attention.default
CUDNN_BACKWARD = _aten._scaled_dot_product_cudnn_attention_backward.default
EFFICIENT = _aten._scaled_dot_product_efficient_attention.default
EFFICIENT_BACKWARD = _aten._scaled_dot_product_efficient_attention_backward.default
HALF = (torch.float16, torch.bfloat16)


def bound(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of an aten call by its schema name, defaults filled in."""
    values: dict[str, Any] = {}
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args) and not argument.kwarg_only:
            values[argument.name] = args[i]
        elif argument.name in kwargs:
            values[argument.name] = kwargs[argument.name]
        else:
            values[argument.name] = argument.default_value
    return values


@pytest.mark.parametrize(
    ("op", "standin"),
    [
        (FLASH, flash_attention),
        (FLASH_BACKWARD, flash_attention_backward),
        (CUDNN, cudnn_attention),
        (CUDNN_BACKWARD, cudnn_attention_backward),
        (EFFICIENT, efficient_attention),
        (EFFICIENT_BACKWARD, efficient_attention_backward),
        (_aten._efficient_attention_forward.default, cutlass_forward),
        (_aten._efficient_attention_backward.default, cutlass_backward),
    ],
)
def test_standins_take_the_schemas_arguments(op: Any, standin: Callable[..., Any]) -> None:
    """Names, order, keyword-only markers and defaults of torch 2.13's schemas."""
    schema = [(a.name, a.kwarg_only, a.default_value) for a in op._schema.arguments]
    params = inspect.signature(standin).parameters.values()
    ours = [
        (p.name, p.kind is p.KEYWORD_ONLY, None if p.default is p.empty else p.default)
        for p in params
    ]
    assert ours == schema


# -- what each op is handed ------------------------------------------------------------------------


def _aligned(x: torch.Tensor, elements: int) -> bool:
    return x.storage_offset() % elements == 0 and all(
        s % elements == 0 for n, s in zip(x.shape[:-1], x.stride()[:-1], strict=True) if n > 1
    )


class Expected:
    """What the replayed kernel call should hand its op: the contract's ``scale``, dropout and
    key/value heads (the input's, unrepeated)."""

    def __init__(self, options: BlockOptions, kv_heads: int) -> None:
        self.options = options
        self.kv_heads = kv_heads


class OpContract(TorchDispatchMode):
    """Checks each attention op call's arguments; records ``(op, rows, keys, is_causal)``."""

    def __init__(self) -> None:
        super().__init__()
        self.expected: Expected | None = None
        self.calls: list[tuple[str, int, int, bool]] = []

    def _inputs(self, a: dict[str, Any]) -> None:
        q, k, v = a["query"], a["key"], a["value"]
        assert self.expected is not None
        for name, x in (("query", q), ("key", k), ("value", v)):
            assert x.device.type == "cuda" and x.dim() == 4, name
            assert x.stride(-1) == 1, f"{name}: last dimension must be contiguous"
            assert x.dtype == q.dtype and x.dtype in HALF, f"{name}: {x.dtype}"
            # Both load rows 16 bytes at a time (FA2's cp.async of 128 bits, cuDNN's TMA).
            assert _aligned(x, 8), f"{name}: start and strides 16-byte aligned"
        d = q.shape[-1]
        assert d % 8 == 0 and d <= 256 and k.shape[-1] == d == v.shape[-1], f"head dim {d}"
        assert k.shape == v.shape, f"key {tuple(k.shape)} and value {tuple(v.shape)}"
        assert q.shape[0] == k.shape[0] <= GRID, "the batch is a grid dimension"
        assert k.shape[1] == self.expected.kv_heads, (
            f"grouped heads repeated: the op got {k.shape[1]} key/value heads, the call has "
            f"{self.expected.kv_heads} (the op takes them unrepeated)"
        )
        assert q.shape[1] % k.shape[1] == 0
        assert a["scale"] == self.expected.options.scale, "the contract's scale"
        assert a["dropout_p"] == self.expected.options.dropout_p, "the contract's dropout_p"

    def _record(self, op: str, a: dict[str, Any]) -> None:
        rows, keys = a["query"].shape[2], a["key"].shape[2]
        self.calls.append((op, rows, keys, bool(a["is_causal"])))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        a = bound(func, args, kwargs)
        if func is FLASH:
            self._inputs(a)
            assert a["return_debug_mask"] is False
            self._record("flash", a)
        elif func is FLASH_BACKWARD:
            self._inputs(a)
            self._flash_backward(a)
            self._record("flash_backward", a)
        elif func is CUDNN:
            self._inputs(a)
            self._cudnn_common(a)
            assert a["compute_log_sumexp"] is True and a["return_debug_mask"] is False
            self._record("cudnn", a)
        elif func is CUDNN_BACKWARD:
            self._inputs(a)
            self._cudnn_common(a)
            self._cudnn_backward(a)
            self._record("cudnn_backward", a)
        return func(*args, **kwargs)

    def _flash_backward(self, a: dict[str, Any]) -> None:
        q, k, lse = a["query"], a["key"], a["logsumexp"]
        assert a["grad_out"].shape == a["out"].shape == q.shape
        # mha_bwd reads softmax_lse by address as dense float32 (B, H, Lq).
        assert lse.dtype == torch.float32 and lse.is_contiguous(), f"lse {lse.stride()}"
        assert tuple(lse.shape) == tuple(q.shape[:3])
        assert a["cum_seq_q"] is None and a["cum_seq_k"] is None
        assert (a["max_q"], a["max_k"]) == (q.shape[2], k.shape[2])
        if a["dropout_p"] > 0:
            state = a["philox_seed"]  # read as data_ptr<uint64_t>(): rng_state
            assert state.dtype == torch.uint64 and tuple(state.shape) == (2,), "rng_state"
            assert state.device.type == "cuda", "rng_state is read on the device"

    def _cudnn_common(self, a: dict[str, Any]) -> None:
        assert a["key"].shape[2] > 1, "cuDNN takes no key length 1"
        assert a["attn_bias"] is None, "no bias: the masks are top-left pieces"

    def _cudnn_backward(self, a: dict[str, Any]) -> None:
        q, k, lse = a["query"], a["key"], a["logsumexp"]
        for name in ("out", "grad_out"):
            x = a[name]
            assert tuple(x.shape) == tuple(q.shape) and x.stride(-1) == 1 and _aligned(x, 8)
        # Stats: logsumexp's own sizes and strides, float.
        assert lse.dtype == torch.float32 and tuple(lse.shape) == (*q.shape[:3], 1)
        assert lse.is_contiguous(), f"lse strides {lse.stride()}: the forward's layout"
        assert a["cum_seq_q"] is None and a["cum_seq_k"] is None
        assert (a["max_q"], a["max_k"]) == (q.shape[2], k.shape[2])


# -- the driver's calls, recorded on CPU -----------------------------------------------------------

CASES = {
    "head_groups": {"mode": "head_groups", "causal": False, "heads": (4, 4)},
    "head_groups causal gqa": {"mode": "head_groups", "causal": True, "heads": (4, 2)},
    "longnet causal mqa": {"mode": "longnet", "causal": True, "heads": (4, 1)},
    "longnet gqa": {"mode": "longnet", "causal": False, "heads": (6, 3)},
    "documents causal gqa": {
        "mode": "longnet",
        "causal": True,
        "heads": (4, 2),
        "cu_seqlens": [0, 13, 40],
    },
    "query suffix causal": {"mode": "head_groups", "causal": True, "heads": (4, 2), "suffix": 11},
}


def record(case: dict[str, Any], dtype: torch.dtype, dropout_p: float = 0.0) -> Recorder:
    """The kernel calls of one ``dilated_attention`` call and its backward (the lse too)."""
    recorder = Recorder()
    heads, kv_heads = case["heads"]
    g = torch.Generator().manual_seed(0)
    length = 40
    q_len = case.get("suffix", length)
    q = torch.randn(1, q_len, heads, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(1, length, kv_heads, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(1, length, kv_heads, 16, generator=g).to(dtype).requires_grad_()
    cu = case.get("cu_seqlens")
    out, lse = ringdilated.dilated_attention(
        q, k, v, [8, 16], [1, 2], mode=case["mode"], causal=case["causal"],
        dropout_p=dropout_p, return_lse=True, kernel=recorder,
        cu_seqlens=None if cu is None else torch.tensor(cu),
    )  # fmt: skip
    (out.float().square().sum() + lse.exp().nan_to_num(posinf=0.0).sum()).backward()
    return recorder


def replay(kernel: Any, recorder: Recorder, contract: OpContract) -> list[BlockOptions]:
    """Each recorded call on fake ``cuda`` tensors; the options of the calls made."""
    made = []
    with FakeTensorMode(), contract:
        for kind, layouts, options in recorder.calls:
            tensors = [layout.fake() for layout in layouts]
            kv_heads = tensors[1 if kind == "forward" else 2].shape[1]
            contract.expected = Expected(options, kv_heads)
            if kind == "forward":
                out, lse = kernel.forward(*tensors, options)
                assert out.shape == tensors[0].shape and out.device.type == "cuda"
                assert lse.shape == tensors[0].shape[:-1] and lse.dtype == torch.float32
            else:
                dout, q, k, v, out, lse = tensors
                grads = kernel.backward(dout, q, k, v, out, lse, options)
                assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
            made.append((kind, q_shape(layouts), options))
    return made  # type: ignore[return-value]


def q_shape(layouts: tuple[Layout, ...]) -> tuple[int, int]:
    """``(q_len, k_len)`` of a recorded call (forward: q, k, v; backward: dout, q, k, ...)."""
    if len(layouts) == 3:
        return layouts[0].shape[2], layouts[1].shape[2]
    return layouts[1].shape[2], layouts[2].shape[2]


def flash_plan(q_len: int, k_len: int, right: int | None) -> list[tuple[int, int, bool]]:
    """The calls torch's bottom-right ``is_causal`` needs for ``window.right = right``, worked
    out here, not by the code under test: rows before ``-right`` see no key (no call); rows
    whose last visible key is at or past the last key see every key (one unmasked call); the
    rows between are one bottom-right causal call on keys ``[0, stop + right)``."""
    if right is None or right >= k_len - 1:
        return [(q_len, k_len, False)]
    first = min(q_len, max(0, -right))
    stop = min(q_len, max(first, k_len - right))  # first row that sees every key
    calls = [(stop - first, stop + right, True)] if stop > first else []
    return calls + ([(q_len - stop, k_len, False)] if q_len > stop else [])


def cudnn_plan(q_len: int, k_len: int, right: int | None) -> list[tuple[int, int, bool]]:
    """The calls cuDNN's top-left ``is_causal`` needs for ``window.right = right``, worked out
    here, not by the code under test: ``(rows, keys, is_causal)``. None for a key length of 0
    or 1 (the dense math) or when no row sees a key; rows before ``-right`` see no key (no call);
    an offset inside the keys is two calls over every row: keys ``[0, right)``, which every row
    sees, unmasked, and keys ``[right, k_len)``, top-left causal from ``right`` (row ``i`` sees
    ``j <= i + right``); a piece of one key (``right = 1``) is no call (the dense math)."""
    if k_len <= 1 or not q_len:
        return []
    if right is None or right >= k_len - 1:
        return [(q_len, k_len, False)]
    if right <= 0:
        rows = q_len - min(q_len, -right)
        return [(rows, k_len, True)] if rows else []
    pieces = [(q_len, right, False), (q_len, k_len - right, True)]
    return [piece for piece in pieces if piece[1] > 1]


def _expected_calls(made: Any, planner: Callable[..., list[Any]], op: str) -> list[Any]:
    calls = []
    for kind, (q_len, k_len), options in made:
        suffix = "" if kind == "forward" else "_backward"
        for plan in planner(q_len, k_len, options.window.right):
            calls.append((op + suffix, *plan))
    return calls


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", list(CASES))
def test_torch_flash_hands_the_ops_what_mha_fwd_and_mha_bwd_read(
    dtype: torch.dtype, case: str
) -> None:
    recorder = record(CASES[case], dtype)
    contract = OpContract()
    made = replay(TorchFlashKernel(), recorder, contract)
    assert contract.calls == _expected_calls(made, flash_plan, "flash"), "bottom-right pieces"
    assert {c[0] for c in contract.calls} == {"flash", "flash_backward"}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", list(CASES))
def test_cudnn_hands_the_ops_what_the_graph_reads(dtype: torch.dtype, case: str) -> None:
    recorder = record(CASES[case], dtype)
    contract = OpContract()
    made = replay(CudnnKernel(), recorder, contract)
    assert contract.calls == _expected_calls(made, cudnn_plan, "cudnn"), "top-left pieces"
    assert {c[0] for c in contract.calls} == {"cudnn", "cudnn_backward"}


def test_the_query_suffix_and_documents_give_the_ops_other_offsets() -> None:
    """The recorded cases are not all offset 0: a query suffix shifts the causal diagonal."""
    rights = {
        options.window.right
        for name in ("query suffix causal", "documents causal gqa")
        for _, _, options in record(CASES[name], torch.float16).calls
    }
    assert rights - {None, 0}, rights


@pytest.mark.parametrize("kernel", [TorchFlashKernel, CudnnKernel])
@pytest.mark.parametrize("offset", [None, -7, -2, 0, 2, 3, 17, 43, 44, 60])
def test_any_causal_offset_on_strided_views(kernel: type, offset: int | None) -> None:
    """Kernel-contract calls (a sharded run's pieces) take any offset, on the driver's strided
    views (rate 2, heads 2-3 of 6, grouped 2:1)."""
    contract = OpContract()
    options = BlockOptions(scale=0.25, window=KeyWindow(None, offset))
    instance = kernel()  # outside the contract: construction may ask a meta kernel
    with FakeTensorMode(), contract:
        base = torch.empty(2, 45, 6, 16, dtype=torch.float16, device="cuda")
        q = base.as_strided((2, 2, 20, 16), (45 * 96, 16, 192, 1), 32)
        k = base.as_strided((2, 1, 45, 16), (45 * 96, 16, 96, 1), 64)
        contract.expected = Expected(options, kv_heads=1)
        out, lse = instance.forward(q, k, k, options)
        instance.backward(out, q, k, k, out, lse, options)
    plan = flash_plan if kernel is TorchFlashKernel else cudnn_plan
    name = "flash" if kernel is TorchFlashKernel else "cudnn"
    made = [("forward", (20, 45), options), ("backward", (20, 45), options)]
    assert contract.calls == _expected_calls(made, plan, name)


class Allocations(OpContract):
    """The op contract, recording each cuDNN call's arguments and the shape of every tensor an
    op returns (what a call allocates, views included)."""

    def __init__(self) -> None:
        super().__init__()
        self.cudnn: list[dict[str, Any]] = []
        self.returned: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (CUDNN, CUDNN_BACKWARD):
            self.cudnn.append(bound(func, args, kwargs or {}))
        result = super().__torch_dispatch__(func, types, args, kwargs)
        leaves = tree_leaves(result)
        self.returned += [tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]
        return result


@pytest.mark.parametrize("right", [2, 3, 17, 25, 43])
def test_an_offset_inside_the_keys_is_two_top_left_calls_without_a_scores_sized_tensor(
    right: int,
) -> None:
    """``0 < right < Lk - 1`` (``Lq = 20``, ``Lk = 45``: the causal piece longer than the rows,
    as long, of two keys): the forward and the backward each call the op twice over every row,
    keys ``[0, right)`` unmasked and keys ``[right, Lk)`` with ``is_causal``, reading the
    block's own key and value memory from those rows on, with no bias; both backward calls get
    the block's final ``out`` and the merged lse as ``(B, H, Lq, 1)`` float32 contiguous; and no
    op returns a tensor of ``Lq`` rows by ``Lk`` keys (the dense bias the offset once took) or
    one larger than the block's inputs (scores)."""
    contract = Allocations()
    options = BlockOptions(scale=0.25, window=KeyWindow(None, right))
    with FakeTensorMode():
        base = torch.empty(2, 45, 6, 16, dtype=torch.float16, device="cuda")
        q = base.as_strided((2, 2, 20, 16), (45 * 96, 16, 192, 1), 32)
        k = base.as_strided((2, 1, 45, 16), (45 * 96, 16, 96, 1), 64)
        v = base.as_strided((2, 1, 45, 16), (45 * 96, 16, 96, 1), 80)
        dout = torch.empty(2, 2, 20, 16, dtype=torch.float16, device="cuda")
        contract.expected = Expected(options, kv_heads=1)
        with contract:
            out, lse = CudnnKernel().forward(q, k, v, options)
            dq, dk, dv = CudnnKernel().backward(dout, q, k, v, out, lse, options)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    pieces = [(0, right, False), (right, 45, True)]
    assert [a["is_causal"] for a in contract.cudnn] == [False, True, False, True]
    for a, (start, stop, _) in zip(contract.cudnn, pieces * 2, strict=True):
        assert (a["query"].shape[2], a["key"].shape[2]) == (20, stop - start)
        assert a["query"].storage_offset() == q.storage_offset(), "every row"
        for name, x in (("key", k), ("value", v)):
            assert a[name].storage_offset() == x.storage_offset() + start * x.stride(2), name
            assert a[name].stride() == x.stride(), f"{name}: the block's own memory"
        assert a["attn_bias"] is None
    for a in contract.cudnn[2:]:
        assert a["out"]._base is out, "the block's final out"
        assert a["logsumexp"]._base is lse and a["logsumexp"].is_contiguous(), "the merged lse"
    scores_sized = [s for s in contract.returned if 20 in s and max(s) >= 44]
    assert not scores_sized, f"tensors of Lq rows by Lk keys: {scores_sized}"
    largest = max(x.numel() for x in (q, k, v))
    assert max(math.prod(s) for s in contract.returned) <= largest


@pytest.mark.parametrize("kernel", [TorchFlashKernel, CudnnKernel])
def test_a_misaligned_caller_view_reaches_the_op_aligned(kernel: type) -> None:
    """A caller's tensor starting one element into its storage (not 16-byte aligned: the ops'
    128-bit loads and cuDNN's descriptors assume it) is copied before the op sees it."""
    contract = OpContract()
    options = BlockOptions(scale=0.25, window=KeyWindow(None, 0))
    with FakeTensorMode(), contract:
        base = torch.empty(1 + 2 * 40 * 16, dtype=torch.float16, device="cuda")
        q = base.as_strided((1, 2, 40, 16), (2 * 40 * 16, 16, 32, 1), 1)
        assert q.storage_offset() * q.element_size() % 16
        contract.expected = Expected(options, kv_heads=2)
        out, lse = kernel().forward(q, q, q, options)
        kernel().backward(out, q, q, q, out, lse, options)
    assert len(contract.calls) == 2


@pytest.mark.parametrize(("kernel", "op"), [(TorchFlashKernel, "flash"), (CudnnKernel, "cudnn")])
def test_the_contract_catches_grouped_heads_repeated_for_an_op_that_takes_them(
    kernel: type, op: str
) -> None:
    """A wrapper that repeats ``k``, ``v`` to the query's heads (what the memory-efficient op
    needs, and these ops do not) fails the check."""

    class Repeating(kernel):  # type: ignore[misc, valid-type]
        def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
            return super().forward(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]), options)

    recorder = record(CASES["head_groups causal gqa"], torch.float16)
    with pytest.raises(
        AssertionError, match="grouped heads repeated: the op got 2 key/value heads, the call has 1"
    ):
        replay(Repeating(), recorder, OpContract())


def test_the_contract_catches_a_strided_lse_handed_to_the_flash_backward() -> None:
    """``mha_bwd`` reads the lse by address: the check asks for a dense float32 one."""
    contract = OpContract()
    contract.expected = Expected(BlockOptions(scale=0.25), kv_heads=3)
    with FakeTensorMode():
        q = torch.empty(2, 3, 16, 16, dtype=torch.float16, device="cuda")
        lse = torch.empty(2, 16, 3, device="cuda").transpose(1, 2)
        seeds = (torch.empty(2, dtype=torch.uint64, device="cuda"),
                 torch.empty((), dtype=torch.uint64, device="cuda"))  # fmt: skip
        with contract, pytest.raises(AssertionError, match=r"lse \(48, 1, 3\)"):
            _aten._scaled_dot_product_flash_attention_backward(
                q, q, q, q, q, lse, None, None, 16, 16, 0.0, False, *seeds, scale=0.25
            )


# -- dropout: the generator state each op is handed ------------------------------------------------


@pytest.fixture
def cuda_generator(monkeypatch: pytest.MonkeyPatch) -> torch.Generator:
    """A CPU generator standing in for the (absent) default generator of ``cuda:0``, where the
    wrapper and the stand-in each look it up by their own rule."""
    generator = torch.Generator().manual_seed(7)
    monkeypatch.setattr(torch.cuda, "default_generators", (generator,))
    return generator


class DropoutContract(EfficientAttentionContract):
    """The memory-efficient ops' checks, and the Philox scalars their dropout needs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        a = bound(func, args, kwargs or {})
        if func is EFFICIENT:
            self.seen["dropout_p"] = a["dropout_p"]
        elif func is EFFICIENT_BACKWARD and a["dropout_p"] > 0:
            for name in ("philox_seed", "philox_offset"):
                x = a[name]  # *x.data_ptr<int64_t>(), on the host in eager mode
                assert x.dtype == torch.int64 and x.dim() == 0, f"{name}: {x.dtype} {x.shape}"
                assert x.device.type == "cpu", f"{name} is read on the host, got {x.device}"
            self.seen["replayed"] = self.seen.get("replayed", 0) + 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_sdpa_cuda_path_replays_dropout_from_host_scalars(cuda_generator: torch.Generator) -> None:
    recorder = record(CASES["longnet causal mqa"], torch.float16, dropout_p=0.3)
    # Forwards and backwards drop; the lse's gradient goes through backwards without dropout.
    assert {(kind, o.dropout_p) for kind, _, o in recorder.calls} == {
        ("forward", 0.3),
        ("backward", 0.3),
        ("backward", 0.0),
    }
    contract = DropoutContract()
    state = cuda_generator.get_state()
    with FakeTensorMode(), contract:
        for kind, layouts, options in recorder.calls:
            tensors = [layout.fake() for layout in layouts]
            if kind == "forward":
                SdpaKernel().forward(*tensors, options)
            else:
                SdpaKernel().backward(*tensors, options)
    assert contract.seen["dropout_p"] == 0.3 and contract.seen["replayed"] >= 1
    assert torch.equal(cuda_generator.get_state(), state), "the caller's stream did not move"


@pytest.mark.parametrize("case", ["head_groups causal gqa", "query suffix causal"])
def test_torch_flash_replays_dropout_from_an_rng_state_on_the_device(
    cuda_generator: torch.Generator, case: str
) -> None:
    recorder = record(CASES[case], torch.bfloat16, dropout_p=0.25)
    contract = OpContract()
    state = cuda_generator.get_state()
    replay(TorchFlashKernel(), recorder, contract)
    assert any(c[0] == "flash_backward" for c in contract.calls)
    assert torch.equal(cuda_generator.get_state(), state), "the caller's stream did not move"
