"""The GPU kernel wrappers (flash, xformers, flex, and sdpa's CUDA path), run on CPU against
stand-ins that enforce upstream's signatures and preconditions and read memory the way upstream's
kernels do (tests/standins), through the full conformance kit.

Each defect an upstream audit found has a test here that fails without its fix: the stand-ins
give wrong numbers (or raise) exactly where the real kernels would. What this cannot prove: the
real CUDA kernels' arithmetic (tests/test_gpu.py, marked ``gpu``).
"""

from __future__ import annotations

import sys
import types
import warnings

import attrs
import pytest
import torch

import ringdilated
from ringdilated.backends import _memeff, sdpa
from ringdilated.backends.flash import FLASH_SPEC, FlashKernel
from ringdilated.backends.flex import FLEX_SPEC, FlexFallbackWarning, FlexKernel, compile_flex
from ringdilated.backends.sdpa import SDPA_SPEC, EfficientAttention
from ringdilated.backends.xformers import XFORMERS_SPEC, XformersKernel
from ringdilated.core import Environment, KernelSpec, KeyWindow, Request, Resolver, Target
from ringdilated.core.contract.causal import bottom_right_pieces
from ringdilated.core.contract.kernel import BlockOptions
from ringdilated.testing import ConformanceError, assert_non_finite_rule, check_kernel
from ringdilated.testing.conformance import applicable_checks
from ringdilated.testing.kernel_cases import CaseSpace, dense
from tests.standins import (
    FLASH_VERSIONS,
    efficient_attention,
    efficient_attention_backward,
    install_flash_attn,
    install_xformers,
    math_flex_attention,
)

HALF = frozenset({torch.float16, torch.bfloat16})
#: Short problems (strided and contiguous) for the tests that show a defect is caught: the
#: defects do not need long blocks, and the full space is the conformance tests' job.
SHORT = CaseSpace(max_len=24, max_head_dim=64)


def on_cpu(spec: KernelSpec, dtypes: frozenset[torch.dtype] | None = None) -> KernelSpec:
    """``spec`` with its CUDA targets replaced by one CPU target declaring the same dtypes and
    head-dim limits (the stand-ins run on CPU and enforce the packages' own rules)."""
    cuda = [t for t in spec.capabilities.targets if t.device_type == "cuda"]
    limits = [t.max_head_dim for t in cuda if t.max_head_dim is not None]
    target = Target(
        "cpu",
        dtypes or frozenset(d for t in cuda for d in t.dtypes),
        max_head_dim=min(limits) if limits else None,
        head_dim_multiple=max(t.head_dim_multiple for t in cuda),
    )
    return attrs.evolve(
        spec, capabilities=attrs.evolve(spec.capabilities, targets=(target,), requires=())
    )


def test_bottom_right_pieces_reproduce_every_offset() -> None:
    for q_len in range(6):
        for k_len in range(6):
            for offset in [None, *range(-7, 8)]:
                _check_pieces(q_len, k_len, offset)


def _check_pieces(q_len: int, k_len: int, offset: int | None) -> None:
    visible = torch.zeros(q_len, k_len, dtype=torch.bool)
    for p in bottom_right_pieces(q_len, k_len, offset):
        rows = p.row_stop - p.row_start
        assert p.row_start < p.row_stop and 0 < p.keys <= k_len
        for i in range(rows):
            limit = i + (p.keys - rows) if p.causal else p.keys - 1
            assert limit >= 0, "a piece never contains an empty row"
            visible[p.row_start + i, : min(limit, p.keys - 1) + 1] = True
    rows = torch.arange(q_len).unsqueeze(1)
    cols = torch.arange(k_len).unsqueeze(0)
    expected = cols <= rows + (k_len if offset is None else offset)
    assert torch.equal(visible, expected)


# flash-attn ------------------------------------------------------------------------------------


def _bottom_right_kernel(
    monkeypatch: pytest.MonkeyPatch, package: str
) -> FlashKernel | XformersKernel:
    if package == "xformers":
        install_xformers(monkeypatch)
        return XformersKernel()
    install_flash_attn(monkeypatch, package.split()[1])
    return FlashKernel()


@pytest.mark.parametrize("package", ["flash-attn 2.6.3", "flash-attn 2.8.3", "xformers"])
def test_infinity_behind_the_causal_mask_stays_in_its_problem(
    monkeypatch: pytest.MonkeyPatch, package: str
) -> None:
    """An infinite value at key 9 of head 1: the native kernels weight hidden keys by zero, and
    ``0 * inf`` turns queries 0-8 of head 1, which never see it, into NaN. The kernel contract
    allows that (a non-finite value in their own problem); it must reach neither head 0 nor
    leave a query that sees it finite."""
    kernel = _bottom_right_kernel(monkeypatch, package)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 32, generator=g).half() for _ in range(3))
    v[0, 1, 9, 3] = float("inf")
    native, _ = kernel.native_forward(q, k, v, True, 0.2)
    assert bool(native[0, 1, :9, 3].isnan().all()), "the stand-in reproduces the hazard"
    out, lse = kernel.forward(q, k, v, BlockOptions(scale=0.2, window=KeyWindow(None, 0)))
    expected, expected_lse = dense(q, k, v, 0.2, 0)
    baseline, baseline_lse = dense(q, k, v, 0.2, 0, torch.float16)
    problem = torch.tensor([False, True]).view(1, 2, 1)  # head 1 holds the infinity
    assert_non_finite_rule(out, expected, baseline, problem.unsqueeze(-1), what="out")
    assert_non_finite_rule(lse, expected_lse, baseline_lse, problem, dtype=torch.float16)
    assert not bool(torch.isfinite(out[0, 1, 9:, 3]).any()), "the queries that see it"
    assert bool(torch.isfinite(out[0, 0]).all()), "the other head never sees it"


@pytest.mark.parametrize("package", ["flash-attn 2.8.3", "xformers"])
def test_a_row_whose_scores_are_all_minus_inf_is_nan_not_the_kernels_zeros(
    monkeypatch: pytest.MonkeyPatch, package: str
) -> None:
    """``q[..., 0] = +inf`` against keys whose first component is negative: every score of
    that query is ``-inf``, which the fused kernels (and their stand-ins) take for a fully
    masked row and return as zeros; softmax is NaN. The wrapper makes it NaN, on the device."""
    kernel = _bottom_right_kernel(monkeypatch, package)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 12, 16, generator=g).half() for _ in range(3))
    k[0, 0, :, 0] = -(k[0, 0, :, 0].abs() + 0.5)
    q[0, 0, 4, 0] = float("inf")
    native, _ = kernel.native_forward(q, k, v, False, 0.3)
    assert bool((native[0, 0, 4] == 0).all()), "the stand-in zeroes the row, as the kernels do"
    out, lse = kernel.forward(q, k, v, BlockOptions(scale=0.3))
    assert bool(out[0, 0, 4].isnan().all()) and bool(lse[0, 0, 4].isnan())
    assert bool(torch.isfinite(out[0, 1]).all()) and bool(torch.isfinite(out[0, 0, :4]).all())


class UnguardedFlash(FlashKernel):
    """The flash wrapper without its non-finite repair (the native calls only)."""

    forward = FlashKernel.unguarded_forward  # type: ignore[assignment]
    backward = FlashKernel.unguarded_backward  # type: ignore[assignment]


def test_without_the_repair_the_flash_wrapper_fails_the_non_finite_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_flash_attn(monkeypatch)
    spec = attrs.evolve(on_cpu(FLASH_SPEC), factory=UnguardedFlash)
    with pytest.raises(ConformanceError) as info:
        check_kernel(spec, max_examples=30, checks=("non-finite",), space=SHORT)
    assert "turned into finite numbers" in str(info.value)


@pytest.mark.parametrize("version", FLASH_VERSIONS)
def test_flash_wrapper_conforms_on_every_supported_version(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """2.6.x takes ``window_size=(l, r)`` and returns ``(dq, dk, dv, softmax_d)``; 2.7 and 2.8
    take ``window_size_left``/``_right`` (a custom op) and return ``softmax_d``. Before the fix
    every backward on 2.6 raised ``TypeError``."""
    install_flash_attn(monkeypatch, version)
    report = check_kernel(on_cpu(FLASH_SPEC), max_examples=12)
    assert report.passed == applicable_checks(on_cpu(FLASH_SPEC))


@pytest.mark.parametrize("version", FLASH_VERSIONS)
def test_flash_standins_keep_each_versions_backward_signature(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """The stand-ins refuse the other version's keywords, as the released functions do (a plain
    function with ``TypeError``, 2.7+'s custom op with its schema's ``RuntimeError``)."""
    install_flash_attn(monkeypatch, version)
    backward = sys.modules["flash_attn.flash_attn_interface"]._flash_attn_backward
    x = torch.randn(1, 4, 1, 8, dtype=torch.float16)
    lse = torch.zeros(1, 1, 4)
    wrong = (
        {"window_size_left": -1, "window_size_right": -1}
        if version.startswith("2.6")
        else {"window_size": (-1, -1)}
    )
    with pytest.raises((TypeError, RuntimeError), match=r"window_size|unexpected|missing"):
        backward(x, x, x, x, x, lse, x.clone(), x.clone(), x.clone(), dropout_p=0.0,
                 softmax_scale=1.0, causal=False, softcap=0.0, alibi_slopes=None,
                 deterministic=False, **wrong)  # fmt: skip


def test_flash_reads_the_lse_by_address_so_the_wrapper_passes_it_dense(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``flash_api.cpp`` does not check the lse: a strided one is misread (stand-in does too)."""
    install_flash_attn(monkeypatch)
    kernel = FlashKernel()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 16, generator=g).to(torch.float16) for _ in range(3))
    out, lse = kernel.native_forward(q, k, v, False, 0.25)
    dout = torch.randn(q.shape, generator=g).to(torch.float16)
    right = kernel.native_backward(dout, q, k, v, out, lse, False, 0.25)
    strided = torch.full((2, 40, 3), float("nan")).transpose(1, 2).copy_(lse)
    contiguous_call = kernel.native_backward(dout, q, k, v, out, strided, False, 0.25)
    for a, b in zip(right, contiguous_call, strict=True):
        assert torch.equal(a, b), "the wrapper hands flash a dense copy of any lse"
    interface = sys.modules["flash_attn.flash_attn_interface"]
    buffers = [torch.empty(x.transpose(1, 2).shape, dtype=x.dtype) for x in (q, k, v)]
    interface._flash_attn_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), strided, *buffers, dropout_p=0.0, softmax_scale=0.25, causal=False,
        window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
        deterministic=False,
    )  # fmt: skip
    assert not torch.equal(buffers[0], right[0].transpose(1, 2)), "a strided lse is misread"


def test_flash_older_than_2_6_falls_back_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    install_flash_attn(monkeypatch, version="2.5.9")
    env = Environment(frozenset({"flash_attn"}), compute_capability=(8, 0))
    resolver = Resolver([FLASH_SPEC, SDPA_SPEC], env=env)
    plan = resolver.resolve(Request("cuda", torch.bfloat16, 64, (8, 0)))
    assert plan.kernel_name == "sdpa"
    assert "flash-attn 2.5.9 is older than the 2.6 this kernel needs" in plan.explain()


def test_flash_with_an_unknown_backward_signature_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_flash_attn(monkeypatch, version="2.9.0")
    interface = sys.modules["flash_attn.flash_attn_interface"]

    def changed(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                window_size, alibi_slopes, deterministic):  # type: ignore[no-untyped-def]  # fmt: skip
        raise AssertionError("never called")

    monkeypatch.setattr(interface, "_flash_attn_backward", changed)
    env = Environment(frozenset({"flash_attn"}), compute_capability=(9, 0))
    request = Request("cuda", torch.float16, 64, (9, 0))
    plan = Resolver([FLASH_SPEC, SDPA_SPEC], env=env).resolve(request)
    assert plan.kernel_name == "sdpa"
    assert "_flash_attn_backward takes (" in plan.explain()
    lacking = "lacks ['rng_state', 'softcap', 'window_size_left', 'window_size_right']"
    assert lacking in plan.explain()


@pytest.mark.parametrize(("version", "fits"), [("2.6.3", False), ("2.7.4.post1", True)])
def test_flash_2_6_declines_devices_newer_than_hopper(
    monkeypatch: pytest.MonkeyPatch, version: str, fits: bool
) -> None:
    install_flash_attn(monkeypatch, version)
    env = Environment(frozenset({"flash_attn"}))
    reasons = FLASH_SPEC.reasons(Request("cuda", torch.bfloat16, 64, (10, 0)), env)
    assert (not reasons) == fits, reasons
    if not fits:
        assert "supports compute capability 8.x and 9.0 only" in reasons[0]


# the memory-efficient kernels: sdpa's CUDA path and xformers -------------------------------------


def efficient_spec(kernel: type = EfficientAttention) -> KernelSpec:
    return attrs.evolve(
        on_cpu(SDPA_SPEC),
        factory=lambda: kernel(efficient_attention, efficient_attention_backward),
    )


def test_sdpa_cuda_path_conforms() -> None:
    report = check_kernel(efficient_spec(), max_examples=15)
    assert report.passed == applicable_checks(efficient_spec())


def test_sdpa_cuda_path_without_packing_out_gives_wrong_half_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The backward reads ``out`` with a hard-coded row stride: the driver's strided ``out``
    gives wrong dq and dk in half precision unless packed (the defect the audit found)."""
    monkeypatch.setattr(sdpa, "packed_bmhk", lambda x: x)
    spec = efficient_spec()
    spec = attrs.evolve(spec, capabilities=on_cpu(SDPA_SPEC, HALF).capabilities)
    with pytest.raises(ConformanceError) as info:
        check_kernel(spec, max_examples=25, checks=("gradients",), space=SHORT)
    assert "max error" in str(info.value) or "OutOfBoundsRead" in str(info.value)


def test_lse_handed_to_the_backward_is_float32_padded_with_inf() -> None:
    lse = torch.tensor([[[0.5, float("-inf"), 2.0]]], dtype=torch.float64)
    padded = _memeff.padded_lse(lse)
    assert padded.dtype == torch.float32 and padded.is_contiguous()
    assert padded.shape == (1, 1, 32)
    assert padded[0, 0, :3].tolist() == [0.5, 0.0, 2.0], "no key: 0, as the forward stores it"
    assert bool(torch.isposinf(padded[..., 3:]).all()), "pad rows: +inf, so P = 0 there"


def test_bias_pad_is_zero_as_torch_pads_its_own_masks() -> None:
    """The kernels load bias rows 128 bits at a time, past ``k_len`` (the memory must exist) and
    mask what they read there; the pad is zeroed anyway, as torch's ``pad_bias`` does."""
    mask = torch.tensor([[0.0, float("-inf"), float("-inf")]], dtype=torch.float16)
    bias = _memeff.padded_bias(mask, torch.empty(2, 3, 1, 8, dtype=torch.float16))
    assert bias is not None and bias.shape == (2, 3, 1, 3) and bias.stride() == (0, 0, 16, 1)
    row = bias[0, 0, 0].as_strided((16,), (1,))
    assert row[3:].eq(0).all(), "the over-read part of each row is zero"


def test_sdpa_cuda_path_with_a_finite_lse_pad_spoils_dv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows past the last query have scores from whatever the kernel reads there; only a pad
    lse of +inf makes their probabilities 0 regardless (what the forward writes, and what
    xformers forces on sm75). The pre-fix pad of zeros is caught by the stand-in."""

    def zero_pad(lse):  # type: ignore[no-untyped-def]
        pad = -(-lse.shape[-1] // 32) * 32 - lse.shape[-1]
        return torch.nn.functional.pad(_memeff.finite_lse(lse, torch.float32), (0, pad))

    monkeypatch.setattr(sdpa, "padded_lse", zero_pad)
    with pytest.raises(ConformanceError, match=r"\[gradients\] dv"):
        check_kernel(efficient_spec(), max_examples=10, checks=("gradients",), space=SHORT)


def test_xformers_wrapper_conforms(monkeypatch: pytest.MonkeyPatch) -> None:
    install_xformers(monkeypatch)
    report = check_kernel(on_cpu(XFORMERS_SPEC), max_examples=12)
    assert report.passed == applicable_checks(on_cpu(XFORMERS_SPEC))


def test_xformers_lse_stays_float32_under_a_float64_default_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_xformers(monkeypatch)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        report = check_kernel(on_cpu(XFORMERS_SPEC), max_examples=10, checks=("gradients",))
    finally:
        torch.set_default_dtype(default)
    assert report.passed == ("gradients",)


def test_xformers_whose_extension_did_not_load_is_not_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``import xformers`` succeeds with a logged warning when ``_C`` fails to load; xformers then
    refuses every CUDA call. The factory asks the same question, so the resolver falls back."""
    install_xformers(monkeypatch, built_with_cuda=False)
    env = Environment(frozenset({"xformers"}), compute_capability=(7, 5))
    resolver = Resolver([XFORMERS_SPEC, SDPA_SPEC], env=env)
    plan = resolver.resolve(Request("cuda", torch.float16, 64, (7, 5)))
    assert plan.kernel_name == "sdpa"
    assert "rejected xformers: factory failed: ImportError: xFormers wasn't built with CUDA" in (
        plan.explain()
    )


# FlexAttention -----------------------------------------------------------------------------------


def test_flex_backward_rule_conforms() -> None:
    spec = attrs.evolve(
        on_cpu(FLEX_SPEC, frozenset({torch.float32, torch.float64})),
        factory=lambda: FlexKernel(attention=math_flex_attention),
    )
    report = check_kernel(spec, max_examples=20)
    assert report.passed == applicable_checks(spec)


def _eager_dynamo(counter: object, **extra: object):  # type: ignore[no-untyped-def]
    """A compile that runs real dynamo (its guards and recompiles) with the eager backend."""

    def compile(fn):  # type: ignore[no-untyped-def]
        return torch.compile(fn, backend=counter, dynamic=True, fullgraph=True, **extra)

    return compile


SHAPES_AND_OFFSETS = [(40, 50, 0), (40, 50, 5), (70, 90, -3), (30, 30, 2), (130, 200, 2),
                      (300, 260, 7), (140, 140, 0), (20, 25, 1)]  # fmt: skip


def _run_flex(kernel: FlexKernel) -> None:
    from ringdilated.backends.flex import _block_mask

    g = torch.Generator().manual_seed(0)
    for q_len, k_len, offset in SHAPES_AND_OFFSETS:
        q = torch.randn(2, 3, q_len, 16, generator=g)
        k = torch.randn(2, 3, k_len, 16, generator=g)
        out, _ = kernel.forward(q, k, k, BlockOptions(scale=0.3, window=KeyWindow(None, offset)))
        expected, _ = math_flex_attention(
            q, k, k, block_mask=_dense_mask(q_len, k_len, offset), scale=0.3,
            return_aux=types.SimpleNamespace(lse=True),
        )  # fmt: skip
        assert torch.allclose(out, expected, atol=1e-5)
        mask = _block_mask(q_len, k_len, offset, "cpu")
        assert _block_mask(q_len, k_len, offset, "cpu") is mask, "block masks are cached"


def test_flex_compiles_once_for_every_offset_and_length() -> None:
    """``compile_flex`` (the production compile, here with a counting eager backend): one
    compiled function, two graphs (one block of 128 or more), whatever the lengths and offsets;
    with static shapes (what the kernel did before) every length is a new graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiles = []

    def compile(fn):  # type: ignore[no-untyped-def]
        compiles.append(fn)
        return compile_flex(fn, backend=counter)

    _run_flex(FlexKernel(compile=compile, compiled_devices=("cpu",)))
    assert len(compiles) == 1
    assert counter.frame_count <= 2, f"{counter.frame_count} graphs"

    torch._dynamo.reset()
    static = CompileCounterWithBackend("eager")
    _run_flex(
        FlexKernel(
            compile=lambda fn: torch.compile(fn, backend=static, dynamic=False, fullgraph=True),
            compiled_devices=("cpu",),
        )
    )
    assert static.frame_count > 2, "static shapes recompile per length (the defect)"


def test_every_flex_mask_shares_one_code_closing_over_a_tensor() -> None:
    from ringdilated.backends.flex import _block_mask

    masks = [_block_mask(q, k, offset, "cpu") for q, k, offset in SHAPES_AND_OFFSETS]
    assert len({m.mask_mod.__code__ for m in masks}) == 1
    for mask in masks:
        (cell,) = mask.mask_mod.__closure__
        assert isinstance(cell.cell_contents, torch.Tensor)


def _dense_mask(q_len: int, k_len: int, offset: int):  # type: ignore[no-untyped-def]
    return types.SimpleNamespace(
        mask_mod=lambda b, h, q, kv: kv <= q + offset, shape=(1, 1, q_len, k_len)
    )


def test_flex_past_the_recompile_limit_warns_once_and_stays_exact() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    kernel = FlexKernel(
        compile=_eager_dynamo(counter, recompile_limit=1, isolate_recompiles=True),
        compiled_devices=("cpu",),
    )
    g = torch.Generator().manual_seed(1)
    shapes = [(20, 20), (200, 150), (300, 260)]  # one block, then more: a second graph
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for q_len, k_len in shapes:
            q = torch.randn(1, 2, q_len, 16, generator=g)
            k = torch.randn(1, 2, k_len, 16, generator=g)
            out, _ = kernel.forward(q, k, k, BlockOptions(scale=0.3))
            expected, _ = math_flex_attention(
                q, k, k, scale=0.3, return_aux=types.SimpleNamespace(lse=True)
            )
            assert torch.allclose(out, expected, atol=1e-5)
    fallbacks = [w for w in record if w.category is FlexFallbackWarning]
    assert len(fallbacks) == 1 and "recompile limit" in str(fallbacks[0].message)
    assert kernel.uncompiled_calls == 2


def test_flex_on_cpu_is_forward_only_and_conforms() -> None:
    report = check_kernel("flex", max_examples=6)
    assert report.passed == (
        "capabilities",
        "forward",
        "causal",
        "empty-rows",
        "no-mutation",
        "non-finite",
        "softcap",
    )
    assert report.not_applicable == (
        "gradients",
        "split-merge",
        "non-finite-gradients",
        "dropout",
        "softcap-gradients",
        "softcap-dropout",
    )
    reasons = FLEX_SPEC.reasons(Request(head_dim=16, backward=True), Environment())
    assert reasons == (
        "no backward (gradients) on cpu (eager FlexAttention: forward only, unfused)",
    )


def test_forced_flex_serves_inference_on_cpu_and_says_it_is_unfused() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 4, 16, generator=g) for _ in range(3))
    with torch.no_grad():
        out = ringdilated.dilated_attention(q, k, v, [8, 16], [1, 2], causal=True, kernel="flex")
    expected = ringdilated.testing.oracle(q, k, v, [8, 16], [1, 2], causal=True)
    assert ringdilated.testing.max_error(out, expected) < 1e-5
    plan = ringdilated.default_resolver().resolve(Request(head_dim=16, backward=False), "flex")
    assert "kernel: flex (priority -10, forced by kernel='flex'): eager FlexAttention" in (
        plan.explain()
    )
    with pytest.raises(ringdilated.ResolutionError, match="no backward"):
        ringdilated.dilated_attention(
            q.requires_grad_(), k, v, [8, 16], [1, 2], causal=True, kernel="flex"
        )


def test_no_warning_leaks_from_the_wrappers() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = torch.randn(1, 3, 20, 16)
        FlexKernel().forward(q, q, q, BlockOptions(scale=0.25, window=KeyWindow(None, 0)))


def test_xformers_older_than_the_version_read_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    install_xformers(monkeypatch, version="0.0.28.post1")
    env = Environment(frozenset({"xformers"}), compute_capability=(7, 5))
    plan = Resolver([XFORMERS_SPEC, SDPA_SPEC], env=env).resolve(
        Request("cuda", torch.float16, 64, (7, 5))
    )
    assert plan.kernel_name == "sdpa"
    assert "xformers 0.0.28.post1 is older than the 0.0.35 this kernel was written against" in (
        plan.explain()
    )
