"""The ``flash3`` (FlashAttention 3) and ``flash4`` (FlashAttention 4) kernels, run on CPU
against stand-ins that reproduce each supported interface's signatures, return tuples and
preconditions (tests/standins/flash_attn3.py, flash_attn4.py), through the conformance kit; their
choice by compute capability; their fallbacks, with reasons, for interfaces and releases they
were not written against; and, on FakeTensor ``cuda`` tensors, the arguments every op receives
when the driver's real calls are replayed. What this cannot prove: the real CUDA kernels'
arithmetic (tests/test_gpu.py, marked ``gpu``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ringdilated.backends.flash import FLASH_SPEC
from ringdilated.backends.flash3 import FLASH3_SPEC, Flash3Kernel
from ringdilated.backends.flash4 import FLASH4_SPEC, Flash4Kernel
from ringdilated.backends.sdpa import SDPA_SPEC
from ringdilated.core import FUSED_WINDOWED_GRID_LIMIT, Environment, KeyWindow, Request, Resolver
from ringdilated.core.contract.kernel import BlockOptions
from ringdilated.core.plan.pattern import DilationPattern
from ringdilated.core.plan.window import as_window
from ringdilated.core.run.local import CallState, DilatedAttentionFunction, pattern_run
from ringdilated.testing import check_kernel
from ringdilated.testing.conformance import CHECKS, applicable_checks
from ringdilated.testing.kernel_cases import dense
from tests.standins import flash_attn3 as fa3
from tests.standins import flash_attn4 as fa4
from tests.standins import install_flash_attn
from tests.test_fake_cuda import Recorder
from tests.test_flash_dropout import deterministic_algorithms
from tests.test_gpu_kernel_wrappers import on_cpu

Install = Callable[[pytest.MonkeyPatch], None]
#: Every stand-in the kernels support: (kernel class, installer, the stand-in's call record).
SUPPORTED: dict[str, tuple[type, Install, list[dict[str, Any]]]] = {
    **{
        f"flash3 {name}": (
            Flash3Kernel,
            lambda mp, name=name: fa3.install_flash_attn3(mp, name),
            fa3.CALLS,
        )
        for name in fa3.INTERFACES
    },
    **{
        f"flash4 {version}": (
            Flash4Kernel,
            lambda mp, version=version: fa4.install_flash_attn4(mp, version),
            fa4.CALLS,
        )
        for version in fa4.VERSIONS
    },
}
SPECS = {"flash3": FLASH3_SPEC, "flash4": FLASH4_SPEC}
HALF = (torch.float16, torch.bfloat16)


def _kernel(monkeypatch: pytest.MonkeyPatch, which: str) -> Any:
    kernel_class, install, _ = SUPPORTED[which]
    install(monkeypatch)
    return kernel_class()


@pytest.mark.parametrize("which", sorted(SUPPORTED))
def test_conforms_on_every_supported_interface(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """The kit's every check (forward, causal offsets, empty rows, gradients from the merged
    out and lse, split-merge, no mutation, non-finite inputs) through the stand-in."""
    _, install, _ = SUPPORTED[which]
    install(monkeypatch)
    spec = on_cpu(SPECS[which.split()[0]])
    report = check_kernel(spec, max_examples=8)
    unclaimed = {"dropout", "softcap-dropout"}  # no dropout
    if which == "flash4 4.0.0b5":  # softcapped gradients from 4.0.0b9: the kit draws gradients
        unclaimed |= {"softcap", "softcap-gradients"}
    assert (
        report.passed == applicable_checks(spec) == tuple(c for c in CHECKS if c not in unclaimed)
    )


def _problem(
    heads: int = 4, kv_heads: int = 2, q_len: int = 20, k_len: int = 24, dim: int = 16
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, q_len, dim, generator=g).half()
    k, v = (torch.randn(2, kv_heads, k_len, dim, generator=g).half() for _ in range(2))
    dout = torch.randn(2, heads, q_len, dim, generator=g).half()
    return q, k, v, dout


@pytest.mark.parametrize("which", sorted(SUPPORTED))
def test_grouped_heads_reach_the_op_unrepeated(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """Both interfaces take ``num_heads_k`` dividing ``num_heads``: every call gets 2 key/value
    heads for 4 query heads (a wrapper repeating them would hand it 4), and the result is
    attention with query head ``h`` reading key/value head ``h // 2``."""
    kernel = _kernel(monkeypatch, which)
    calls = SUPPORTED[which][2]
    q, k, v, dout = _problem()
    options = BlockOptions(scale=0.3, window=KeyWindow(None, 2))
    out, lse = kernel.forward(q, k, v, options)
    kernel.backward(dout, q, k, v, out, lse, options)
    expected, _ = dense(q, k, v, 0.3, 2)
    assert float((out.double() - expected).abs().max()) < 2e-3
    assert [c["op"] for c in calls] == ["forward", "backward"]
    for call in calls:
        for name in ("k", "v"):
            shape = call["tensors"][name][0]
            assert shape[2] == 2, f"{call['op']} got {name} with {shape[2]} heads: repeated"
        assert call["tensors"]["q"][0][2] == 4


@pytest.mark.parametrize("which", sorted(SUPPORTED))
def test_the_deterministic_flag_reaches_the_backward(
    monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """From ``BlockOptions.deterministic`` (the plan's reading of torch's switch), to every
    piece's call (a window of two pieces); torch's switch alone is not read by the kernel."""
    kernel = _kernel(monkeypatch, which)
    calls = SUPPORTED[which][2]
    q, k, v, dout = _problem(kv_heads=4)  # pre-3.0.0 FlashAttention 3 deadlocks with GQA
    options = BlockOptions(scale=0.3)
    out, lse = kernel.forward(q, k, v, options)
    kernel.backward(dout, q, k, v, out, lse, options)
    kernel.backward(dout, q, k, v, out, lse, attrs.evolve(options, deterministic=True))
    with deterministic_algorithms():
        kernel.backward(dout, q, k, v, out, lse, options)
    two_pieces = BlockOptions(scale=0.3, window=KeyWindow(None, 6), deterministic=True)
    out, lse = kernel.forward(q, k, v, two_pieces)
    kernel.backward(dout, q, k, v, out, lse, two_pieces)
    flags = [c["deterministic"] for c in calls if c["op"] == "backward"]
    assert flags == [False, True, False, True, True]


@pytest.mark.parametrize("which", ["flash3 v2.8.3", "flash4 4.0.0b5"])
def test_misaligned_views_are_copied_before_the_tensor_maps_see_them(
    monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """A view starting one element into its storage: the stand-ins refuse it (a TMA descriptor
    or FlashAttention 4's compiled 16-byte assumption would), the wrapper hands over a copy."""
    kernel = _kernel(monkeypatch, which)
    q, k, v, _ = _problem(kv_heads=4, k_len=20)
    storage = torch.zeros(q.numel() + 1, dtype=q.dtype)
    shifted = storage[1:].view(q.shape).copy_(q)
    out, _ = kernel.forward(shifted, k, v, BlockOptions(scale=0.3))
    expected, _ = dense(q, k, v, 0.3, None)
    assert float((out.double() - expected).abs().max()) < 2e-3
    arguments = {"softmax_scale": 0.3, "causal": False, **getattr(kernel, "_forward_extra", {})}
    if which.startswith("flash4"):
        arguments["return_lse"] = True
    inputs = (x.transpose(1, 2) for x in (shifted, k, v))
    with pytest.raises(RuntimeError, match="align"):
        kernel._forward(*inputs, **arguments)


def test_flash3_reads_the_lse_by_address_so_the_wrapper_passes_it_dense(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel = _kernel(monkeypatch, "flash3 3.0.0")
    q, k, v, dout = _problem(kv_heads=4, k_len=20)
    out, lse = kernel.native_forward(q, k, v, False, 0.25)
    right = kernel.native_backward(dout, q, k, v, out, lse, False, 0.25)
    strided = torch.full((2, 20, 4), float("nan")).transpose(1, 2).copy_(lse)
    dense_call = kernel.native_backward(dout, q, k, v, out, strided, False, 0.25)
    for a, b in zip(right, dense_call, strict=True):
        assert torch.equal(a, b), "the wrapper hands FlashAttention 3 a dense copy of any lse"
    buffers = [torch.empty(x.transpose(1, 2).shape, dtype=x.dtype) for x in (q, k, v)]
    kernel._backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), strided, dq=buffers[0], dk=buffers[1], dv=buffers[2],
        softmax_scale=0.25, is_causal=False, deterministic=False,
    )  # fmt: skip
    assert not torch.equal(buffers[0], right[0].transpose(1, 2)), "a strided lse is misread"


# choice by hardware, and fallbacks ---------------------------------------------------------------

ALL = frozenset({"flash_attn", "flash_attn_interface", "flash_attn.cute"})


def _resolve(request: Request, packages: frozenset[str] = ALL) -> Any:
    env = Environment(packages, compute_capability=request.compute_capability)
    specs = [FLASH_SPEC, FLASH3_SPEC, FLASH4_SPEC, SDPA_SPEC]
    return Resolver(specs, env=env).resolve(request)


@contextlib.contextmanager
def _all_installed(monkeypatch: pytest.MonkeyPatch, fa3_interface: str = "3.0.0") -> Iterator[None]:
    install_flash_attn(monkeypatch, "2.8.3")
    fa3.install_flash_attn3(monkeypatch, fa3_interface)
    fa4.install_flash_attn4(monkeypatch, "4.0.0b27")
    yield


@pytest.mark.parametrize(
    ("cc", "head_dim", "packages", "chosen"),
    [
        ((8, 0), 64, ALL, "flash"),  # neither declares Ampere
        ((8, 9), 128, ALL, "flash"),
        ((9, 0), 64, ALL, "flash3"),  # Hopper: flash3 450 > flash4 400 > flash 300
        ((9, 0), 256, ALL, "flash3"),
        ((9, 0), 64, ALL - {"flash_attn_interface"}, "flash4"),
        ((10, 0), 128, ALL, "flash4"),  # Blackwell: flash4 500; flash3 is sm90 only
        ((10, 3), 64, ALL - {"flash_attn"}, "flash4"),
        ((10, 0), 256, ALL, "flash"),  # beyond flash4's declared Blackwell head dims
        ((12, 0), 64, ALL, "flash"),  # consumer Blackwell: neither declares it
    ],
)
def test_chosen_by_compute_capability(
    monkeypatch: pytest.MonkeyPatch,
    cc: tuple[int, int],
    head_dim: int,
    packages: frozenset[str],
    chosen: str,
) -> None:
    with _all_installed(monkeypatch):
        plan = _resolve(Request("cuda", torch.bfloat16, head_dim, cc), packages)
    assert plan.kernel_name == chosen, plan.explain()


def test_priorities_are_data() -> None:
    hopper, blackwell = (
        Request("cuda", torch.float16, 64, (9, 0)),
        Request("cuda", torch.float16, 64, (10, 0)),
    )
    assert FLASH3_SPEC.priority_for(hopper) == 450
    assert FLASH4_SPEC.priority_for(hopper) == 400
    assert FLASH4_SPEC.priority_for(blackwell) == 500
    assert FLASH_SPEC.priority_for(hopper) == FLASH_SPEC.priority_for(blackwell) == 300
    for spec in (FLASH3_SPEC, FLASH4_SPEC):
        capabilities = spec.capabilities
        assert capabilities.gqa and capabilities.deterministic and not capabilities.dropout
        assert capabilities.batch_limit.per_call(1) == 65535
        assert capabilities.batch_limit == FUSED_WINDOWED_GRID_LIMIT


@pytest.mark.parametrize(
    ("interface", "head_dim", "gqa", "chosen", "reason"),
    [
        ("3.0.0", 128, True, "flash3", None),
        ("v2.8.3", 128, True, "flash4", "may deadlock before 3.0.0"),
        ("v2.7.4.post1", 128, True, "flash4", "of unknown version"),
        ("v2.8.3", 128, False, "flash3", None),
        ("3.0.0", 256, False, "flash4", "takes head dims up to 192"),
    ],
)
def test_flash3_declines_deterministic_backwards_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
    interface: str,
    head_dim: int,
    gqa: bool,
    chosen: str,
    reason: str | None,
) -> None:
    with _all_installed(monkeypatch, interface):
        request = Request("cuda", torch.float16, head_dim, (9, 0), gqa=gqa, deterministic=True)
        plan = _resolve(request)
        assert plan.kernel_name == chosen, plan.explain()
        if reason is not None:
            assert reason in plan.explain()
        forward_only = attrs.evolve(request, backward=False)
        assert _resolve(forward_only).kernel_name == "flash3", "only the backward is refused"


@pytest.mark.parametrize(
    ("interface", "heads", "dim", "match"),
    [("3.0.0", 4, 256, "not supported for hdim 256"), ("v2.8.3", 2, 64, "deadlocks")],
)
def test_the_refused_deterministic_backwards_do_fail_in_the_stand_ins(
    monkeypatch: pytest.MonkeyPatch, interface: str, heads: int, dim: int, match: str
) -> None:
    """The refusals above are not vacuous: forced, the kernel fails where upstream does."""
    fa3.install_flash_attn3(monkeypatch, interface)
    kernel = Flash3Kernel()
    q, k, v, dout = _problem(kv_heads=heads, k_len=20, dim=dim)
    out, lse = kernel.forward(q, k, v, BlockOptions(scale=0.1))
    with pytest.raises(RuntimeError, match=match):
        kernel.backward(dout, q, k, v, out, lse, BlockOptions(scale=0.1, deterministic=True))


def test_flash3_of_an_interface_it_does_not_know_falls_back_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fa3.install_flash_attn3(monkeypatch, fa3.UNSUPPORTED)
    plan = _resolve(Request("cuda", torch.float16, 64, (9, 0)), frozenset({"flash_attn_interface"}))
    assert plan.kernel_name == "sdpa"
    assert (
        "rejected flash3: factory failed: ImportError: FlashAttention 3: _flash_attn_forward "
        "requires ['window_size'], which this kernel does not know"
    ) in plan.explain()


def test_flash3_missing_the_deterministic_flag_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    fa3.install_flash_attn3(monkeypatch, "v2.8.3")
    module = __import__("flash_attn_interface")

    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal):  # type: ignore[no-untyped-def]  # fmt: skip
        raise AssertionError("never called")

    monkeypatch.setattr(module, "_flash_attn_backward", backward)
    plan = _resolve(Request("cuda", torch.float16, 64, (9, 0)), frozenset({"flash_attn_interface"}))
    assert plan.kernel_name == "sdpa"
    assert "_flash_attn_backward takes (" in plan.explain()
    assert "lacks ['deterministic']" in plan.explain()


def test_flash4_older_than_beta5_falls_back_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fa4.install_flash_attn4(monkeypatch, fa4.UNSUPPORTED)
    plan = _resolve(Request("cuda", torch.float16, 64, (10, 0)), frozenset({"flash_attn.cute"}))
    assert plan.kernel_name == "sdpa"
    assert "flash-attn-4 4.0.0b4 is older than the 4.0.0b5 this kernel needs" in plan.explain()


def test_flash4_of_unknown_version_is_judged_by_its_signature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A source checkout has no ``flash-attn-4`` metadata: b4's backward, without ``dlse``,
    is refused by its parameters; b27's is accepted."""
    from tests.standins.distributions import fake_distributions

    for version, accepted in (("4.0.0b4", False), ("4.0.0b27", True)):
        fa4.install_flash_attn4(monkeypatch, version)
        fake_distributions(monkeypatch, {"flash-attn-4": None, "flash-attn4": None})
        if accepted:
            Flash4Kernel()
        else:
            with pytest.raises(ImportError, match=r"\(version unknown\).*lacks \['dlse'\]"):
                Flash4Kernel()


def test_flash4_declares_its_head_dims_per_architecture() -> None:
    env = Environment(frozenset({"flash_attn.cute"}))
    for cc, head_dim, fits in (((9, 0), 256, True), ((10, 0), 128, True), ((10, 0), 136, False)):
        reasons = FLASH4_SPEC.reasons(Request("cuda", torch.float16, head_dim, cc), env)
        assert (not reasons) == fits, reasons


def test_the_stand_in_enforces_flash4s_blackwell_head_dims(monkeypatch: pytest.MonkeyPatch) -> None:
    fa4.install_flash_attn4(monkeypatch, "4.0.0b27", arch=100)
    kernel = Flash4Kernel()
    q, k, v, _ = _problem(kv_heads=4, k_len=20, dim=136)
    with pytest.raises(AssertionError, match="head_dim"):
        kernel.forward(q, k, v, BlockOptions(scale=0.1))


# FakeTensor cuda: the driver's calls replayed -----------------------------------------------------


def _record(mode: str, causal: bool, heads: int, kv_heads: int) -> Recorder:
    """The driver's kernel calls (forward, backward, the lse gradient) on CPU, recorded."""
    recorder = Recorder()
    pattern = DilationPattern([8, 16], [1, 2], mode)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 40, heads, 16, generator=g).half().requires_grad_()
    k = torch.randn(2, 40, kv_heads, 16, generator=g).half().requires_grad_()
    v = torch.randn(2, 40, kv_heads, 16, generator=g).half().requires_grad_()
    run = pattern_run(recorder, pattern, q, k, window=as_window(causal), scale=None, dropout_p=0.0)
    out, lse = DilatedAttentionFunction.apply(q, k, v, run, CallState())
    (out.float().square().sum() + lse.exp().sum()).backward()
    return recorder


def _aligned(layout: tuple[Any, ...]) -> bool:
    shape, stride, offset, dtype = layout
    size = torch.empty((), dtype=dtype).element_size()
    steps = [s * size for n, s in zip(shape[:-1], stride[:-1], strict=True) if n > 1]
    return (offset * size) % 16 == 0 and all(step % 16 == 0 for step in steps)


@pytest.mark.parametrize("which", sorted(SUPPORTED))
@pytest.mark.parametrize(
    ("mode", "heads", "kv_heads"), [("head_groups", 4, 2), ("longnet", 6, 3), ("longnet", 4, 1)]
)
def test_on_fake_cuda_every_op_gets_what_its_kernels_assume(
    monkeypatch: pytest.MonkeyPatch, which: str, mode: str, heads: int, kv_heads: int
) -> None:
    """Non-causal calls only: a causal diagonal block runs as two bottom-right calls whose rows
    core's ``forward_in_pieces`` selects by slicing, which a CPU-only torch refuses for fake
    ``cuda`` tensors (the pieces themselves are covered on CPU by the conformance kit)."""
    recorder = _record(mode, False, heads, kv_heads)
    kernel = _kernel(monkeypatch, which)
    calls = SUPPORTED[which][2]
    with FakeTensorMode():
        for kind, layouts, options in recorder.calls:
            tensors = [layout.fake() for layout in layouts]
            if kind == "forward":
                out, lse = kernel.forward(*tensors, options)
                assert out.device.type == "cuda" and out.shape == tensors[0].shape
                assert lse.dtype == torch.float32 and lse.shape == tensors[0].shape[:-1]
            else:
                grads = kernel.backward(*tensors, options)
                assert [g.shape for g in grads] == [t.shape for t in tensors[1:4]]
    assert [c["op"] for c in calls] == [kind for kind, _, _ in recorder.calls], "one op per call"
    for call, (kind, layouts, _) in zip(calls, recorder.calls, strict=True):
        tensors = call["tensors"]
        q_layout, k_layout = layouts[:2] if kind == "forward" else layouts[1:3]
        assert tensors["q"][0][2] == q_layout.shape[1], "query heads as the driver passed them"
        assert tensors["k"][0][2] == tensors["v"][0][2] == k_layout.shape[1], "unrepeated"
        for name, layout in tensors.items():
            if name in ("softmax_lse", "lse"):
                batch, rows, heads_, _ = tensors["q"][0]
                assert layout[0] == (batch, heads_, rows) and layout[3] == torch.float32
                assert layout[1] == (heads_ * rows, rows, 1), "the lse is handed over dense"
            else:
                assert layout[3] == torch.float16 and _aligned(layout), f"{name}: {layout}"
        if call["op"] == "backward":
            assert call["deterministic"] is False
