"""The sdpa CUDA path on FakeTensor ``cuda`` tensors, through torch's own meta kernels, with every
attention op's arguments checked against what the CUDA kernels assume (torch 2.13's
``mem_eff_attention`` sources; see :mod:`ringdilated.backends._memeff`).

A CPU-only torch runs no autograd on fake CUDA tensors and cannot index them with slices, so the
driver runs on CPU with a recording kernel, and each call it makes (forward, backward, the lse
gradient) is replayed on fake ``cuda`` tensors with the same sizes, strides and offsets: exactly
the strided views the driver really sends. FlexAttention's block masks are built on fake
``cuda`` tensors for the driver's real block shapes in tests/test_flex_block_mask.py, with every
allocation recorded: the kernel's construction is elementwise, where torch's
``create_block_mask`` (indexing with tensors, which a CPU-only torch refuses for fake CUDA
tensors) could not run there. The compiled call itself (inductor's Triton kernels) cannot run on
fake CUDA here; its dynamo side is covered by the eager-backend tests in
tests/test_gpu_kernel_wrappers.py.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ringdilated.backends.reference import ReferenceKernel
from ringdilated.backends.sdpa import SDPA_SPEC, SdpaKernel
from ringdilated.core import KeyWindow
from ringdilated.core.contract.kernel import BlockOptions
from ringdilated.core.plan.pattern import DilationPattern
from ringdilated.core.plan.window import FULL, as_window
from ringdilated.core.run.local import CallState, DilatedAttentionFunction, pattern_run

_aten = torch.ops.aten


LSE_ALIGN = 32
GRID = 65535


@attrs.frozen
class Layout:
    """A tensor argument as the kernel received it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage: int  # elements
    dtype: torch.dtype

    @classmethod
    def of(cls, x: torch.Tensor) -> Layout:
        storage = x.untyped_storage().nbytes() // x.element_size()
        return cls(tuple(x.shape), x.stride(), x.storage_offset(), storage, x.dtype)

    def fake(self) -> torch.Tensor:
        base = torch.empty(self.storage, dtype=self.dtype, device="cuda")
        return base.as_strided(self.shape, self.stride, self.offset)


class Recorder(ReferenceKernel):
    """Computes with the reference kernel on CPU; records every call's argument layouts."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Layout, ...], BlockOptions]] = []

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        self.calls.append(("forward", tuple(map(Layout.of, (q, k, v))), options))
        return super().forward(q, k, v, options)

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        args = (dout, q, k, v, out, lse)
        self.calls.append(("backward", tuple(map(Layout.of, args)), options))
        return super().backward(dout, q, k, v, out, lse, options)


def _aligned(x: torch.Tensor, elements: int) -> bool:
    return x.storage_offset() % elements == 0 and all(
        s % elements == 0 for n, s in zip(x.shape[:-1], x.stride()[:-1], strict=True) if n > 1
    )


class EfficientAttentionContract(TorchDispatchMode):
    """Checks each memory-efficient attention op's arguments against the CUDA kernels' rules."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, int] = {}

    def _inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for name, x in (("q", q), ("k", k), ("v", v)):
            assert x.device.type == "cuda" and x.dim() == 4, name
            assert x.stride(-1) == 1, f"{name}: last dimension must be contiguous"
            assert _aligned(x, 4), f"{name}: strides/offset not aligned to 4 elements"
            assert x.dtype == q.dtype, name
        assert k.shape[1] == q.shape[1] == v.shape[1], "the op takes equal head counts"
        assert q.shape[0] <= GRID and q.shape[1] <= GRID, "batch and heads are grid dimensions"

    def _bias(self, bias: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> None:
        if bias is None:
            return
        assert bias.dim() == 4 and tuple(bias.shape) == (*q.shape[:3], k.shape[2])
        assert bias.dtype == q.dtype and bias.stride(-1) == 1
        assert _aligned(bias, 16), "bias rows aligned for 128-bit loads"
        self.seen["bias"] = self.seen.get("bias", 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is _aten._scaled_dot_product_efficient_attention.default:
            q, k, v, bias, compute_lse = args[:5]
            self._inputs(q, k, v)
            self._bias(bias, q, k)
            assert compute_lse is True
            self.seen["forward"] = self.seen.get("forward", 0) + 1
        elif func is _aten._scaled_dot_product_efficient_attention_backward.default:
            grad_out, q, k, v, bias, out, lse = args[:7]
            self._inputs(q, k, v)
            self._bias(bias, q, k)
            assert grad_out.shape == out.shape == (*q.shape[:3], v.shape[3])
            # kernel_backward.h: o_strideM() = head_dim_value * num_heads. (Only half precision
            # reads out that way; float32 computes rowsum(dout * out) on the host with the real
            # strides. The check asks it of every dtype, stricter than upstream, as the wrapper
            # packs out for every dtype.)
            assert out.transpose(1, 2).is_contiguous(), f"out must be packed: {out.stride()}"
            rows = -(-q.shape[2] // LSE_ALIGN) * LSE_ALIGN
            assert lse.dtype == torch.float32 and lse.is_contiguous()
            assert tuple(lse.shape) == (*q.shape[:2], rows), "lse padded to 32 rows"
            assert lse.stride(1) % 8 == 0, "LSE is not correctly aligned (strideH)"
            self.seen["backward"] = self.seen.get("backward", 0) + 1
        return func(*args, **kwargs)


def _record(
    dtype: torch.dtype, mode: str, causal: bool, heads: int, kv_heads: int, lse_grad: bool
) -> Recorder:
    recorder = Recorder()
    pattern = DilationPattern([8, 16], [1, 2], mode)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 40, heads, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, 40, kv_heads, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(2, 40, kv_heads, 16, generator=g).to(dtype).requires_grad_()
    run = pattern_run(recorder, pattern, q, k, window=as_window(causal), scale=None, dropout_p=0.0)
    out, lse = DilatedAttentionFunction.apply(q, k, v, run, CallState())
    loss = out.float().square().sum() + (lse.exp().sum() if lse_grad else 0)
    loss.backward()
    return recorder


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("mode", "causal", "heads", "kv_heads", "lse_grad"),
    [
        ("head_groups", False, 4, 4, False),
        ("head_groups", True, 4, 2, True),
        ("longnet", True, 4, 1, False),
        ("longnet", False, 6, 3, True),
    ],
)
def test_sdpa_cuda_path_hands_the_ops_what_the_kernels_assume(
    dtype: torch.dtype, mode: str, causal: bool, heads: int, kv_heads: int, lse_grad: bool
) -> None:
    recorder = _record(dtype, mode, causal, heads, kv_heads, lse_grad)
    assert {c[0] for c in recorder.calls} == {"forward", "backward"}
    kernel = SdpaKernel()
    contract = EfficientAttentionContract()
    with FakeTensorMode(), contract:
        for kind, layouts, options in recorder.calls:
            tensors = [layout.fake() for layout in layouts]
            if kind == "forward":
                out, lse = kernel.forward(*tensors, options)
                assert out.device.type == "cuda" and out.shape == tensors[0].shape
                assert lse.shape == tensors[0].shape[:-1] and lse.dtype == torch.float32
            else:
                dout, q, k, v, out, lse = tensors
                if lse.dtype != torch.float32:  # the reference records float64 for float64
                    lse = lse.float()
                grads = kernel.backward(dout, q, k, v, out, lse, options)
                assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert contract.seen["forward"] >= 1 and contract.seen["backward"] >= 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("offset", [-2, 3, 17])
def test_causal_offsets_other_than_0_hand_the_ops_an_aligned_padded_bias(
    dtype: torch.dtype, offset: int
) -> None:
    """The driver's one-process calls use offsets 0 and None (the ops' own causal flag); any
    other offset (kernel-contract calls, a sharded run's pieces) goes through the bias."""
    kernel, contract = SdpaKernel(), EfficientAttentionContract()
    # Fake tensors hold no data: the kernel's non-finite repair runs on them because it never
    # reads a value on the host (a read would raise DataDependentOutputException here).
    options = BlockOptions(scale=0.25, window=KeyWindow(None, offset))
    with FakeTensorMode(), contract:
        base = torch.empty(2, 45, 6, 16, dtype=dtype, device="cuda")
        q = base.as_strided((2, 2, 20, 16), (45 * 96, 16, 192, 1), 32)  # rate 2, heads 2-3
        k = base.as_strided((2, 2, 45, 16), (45 * 96, 16, 96, 1), 64)
        out, lse = kernel.forward(q, k, k, options)
        kernel.backward(out, q, k, k, out, lse, options)
    assert contract.seen == {"forward": 1, "backward": 1, "bias": 2}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "window", [KeyWindow(3, 0), KeyWindow(5, -2), KeyWindow(-30, None)], ids=str
)
def test_a_sliding_window_hands_the_ops_an_aligned_padded_bias(
    dtype: torch.dtype, window: KeyWindow
) -> None:
    """A window with a left bound (a sliding window's band, another rank's shifted piece, rows
    at the end that see no key) is never the ops' own causal flag: always the aligned, padded
    bias, forward and backward, on the driver's strided views, with no host read."""
    kernel, contract = SdpaKernel(), EfficientAttentionContract()
    options = BlockOptions(scale=0.25, window=window)
    with FakeTensorMode(), contract:
        base = torch.empty(2, 45, 6, 16, dtype=dtype, device="cuda")
        q = base.as_strided((2, 2, 20, 16), (45 * 96, 16, 192, 1), 32)  # rate 2, heads 2-3
        k = base.as_strided((2, 2, 45, 16), (45 * 96, 16, 96, 1), 64)
        out, lse = kernel.forward(q, k, k, options)
        kernel.backward(out, q, k, k, out, lse, options)
    assert contract.seen == {"forward": 1, "backward": 1, "bias": 2}


def test_driver_keeps_every_call_within_the_grid_at_a_quarter_million_tokens_of_segment_4() -> None:
    """Segment length 4 over 2**18 positions makes 65536 problems per block; the driver splits
    them for the sdpa CUDA path's declared limit."""
    recorder = Recorder()
    pattern = DilationPattern([4], [1])
    q = torch.zeros(1, 2**18, 1, 8)
    run = pattern_run(recorder, pattern, q, q, window=FULL, scale=None, dropout_p=0.0,
                      batch_limit=SDPA_SPEC.capabilities.batch_limit)  # fmt: skip
    with torch.no_grad():
        run.forward(q, q, q, CallState())
    contract = EfficientAttentionContract()
    with FakeTensorMode(), contract:
        for _, layouts, options in recorder.calls:
            SdpaKernel().forward(*(layout.fake() for layout in layouts), options)
    assert contract.seen["forward"] == 2


def test_the_contract_check_catches_an_unpacked_out() -> None:
    """The check above is not vacuous: the pre-fix backward (``out`` passed as the driver's
    strided view) fails it."""
    contract = EfficientAttentionContract()
    with FakeTensorMode(), contract:
        base = torch.empty(2, 40, 4, 16, dtype=torch.float16, device="cuda")
        view = base.as_strided((2, 2, 20, 16), (2560, 16, 128, 1), 0)  # rate 2, heads 0-1
        lse = torch.empty(2, 2, 32, device="cuda")
        seed = torch.empty((), dtype=torch.long)
        with pytest.raises(AssertionError, match="out must be packed"):
            _aten._scaled_dot_product_efficient_attention_backward(
                view, view, view, view, None, view, lse, seed, seed, 0.0,
                [True, True, True, False], False, scale=0.25,
            )  # fmt: skip
