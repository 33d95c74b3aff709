"""Logit softcapping (docs/spec.md, section 5): ``softcap * tanh(s / softcap)`` on every score
``s = scale * q . k``, as a feature of the call, exact against the float64 oracle; the kernels
that claim it pass the conformance kit's softcap checks, and the kit rejects kernels that get it
wrong; a call is validated, resolved and planned with its cap."""

from __future__ import annotations

import math
import re
import warnings

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ringdilated
from ringdilated.backends.flex import FLEX_SPEC, _softcap_score
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.core import Environment, KernelSpec, Request, Resolver, accumulation_dtype
from ringdilated.core.select import feature_cost
from ringdilated.testing import (
    ConformanceError,
    assert_within_tolerance,
    check_kernel,
    dense_attention,
    max_error,
    oracle,
)
from ringdilated.testing._oracle import scaled_scores
from ringdilated.testing.conformance import applicable_checks
from ringdilated.testing.kernel_cases import CaseSpace, KernelCase, kernel_cases
from tests.strategies import Case, cases, loss_of, upstream
from tests.test_gpu_kernel_wrappers import on_cpu

SOFTCAP_CHECKS = ("softcap", "softcap-gradients", "softcap-dropout")


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float64 else dtype


# The kernels -------------------------------------------------------------------------------------


def test_reference_passes_every_softcap_check() -> None:
    report = check_kernel("reference", checks=SOFTCAP_CHECKS, max_examples=30)
    assert report.passed == SOFTCAP_CHECKS


def test_flex_softcap_backward_through_torch_score_mod_on_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.13's own FlexAttention differentiates the softcap ``score_mod`` (its joint graph,
    run on CPU by the higher-order op's dense backward, ``sdpa_dense_backward``, the math of the
    Triton backward template). The public function refuses gradients on CPU in
    ``_validate_device`` only; with that one check lifted, the real op runs the kit."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    spec = on_cpu(FLEX_SPEC, frozenset({torch.float32, torch.float64}))
    report = check_kernel(
        spec, checks=("softcap", "softcap-gradients"), max_examples=8, space=_SMALL
    )
    assert report.passed == ("softcap", "softcap-gradients")


def test_flex_on_cpu_serves_softcap_forward_only() -> None:
    report = check_kernel("flex", checks=SOFTCAP_CHECKS, max_examples=10)
    assert report.passed == ("softcap",)
    assert report.not_applicable == ("softcap-gradients", "softcap-dropout")


def test_every_cap_shares_one_score_mod_code() -> None:
    """Like its masks, flex's caps are one code closing over a tensor: a compiled FlexAttention
    never guards on a cap's value."""
    one = _softcap_score(2.0, "cpu", torch.float32)
    other = _softcap_score(30.0, "cpu", torch.float32)
    assert one is _softcap_score(2.0, "cpu", torch.float32)
    assert one.__code__ is other.__code__
    score = torch.tensor([100.0, -0.5])
    assert torch.allclose(other(score, 0, 0, 0, 0), 30.0 * torch.tanh(score / 30.0))


def test_sdpa_does_not_claim_softcap_and_explain_says_so() -> None:
    assert not ringdilated.default_resolver().specs["sdpa"].capabilities.softcap
    request = Request(head_dim=16, softcap=5.0)
    with pytest.raises(ringdilated.ResolutionError) as info:
        ringdilated.default_resolver().resolve(request, "sdpa")
    assert "does not support logit softcapping (cap * tanh(score / cap))" in str(info.value)
    assert check_kernel("sdpa", checks=SOFTCAP_CHECKS, max_examples=2).not_applicable == (
        SOFTCAP_CHECKS
    )


_SMALL = CaseSpace(max_len=40, max_head_dim=32)


class IgnoresCap(ReferenceKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        return super().forward(q, k, v, attrs.evolve(options, softcap=None))


class CapsBeforeScaling(ReferenceKernel):
    """``scale * c * tanh(q . k / c)``: the cap on the unscaled product."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        if options.softcap is None:
            return super().forward(q, k, v, options)
        cap = options.softcap / options.scale
        return super().forward(q, k, v, attrs.evolve(options, scale=1.0, softcap=cap))


class BackwardWithoutTheTanhDerivative(ReferenceKernel):
    """The capped probabilities, but the scores' gradient taken as if the cap were not there
    (the contract's backward in plain dense ops, without ``1 - tanh(s / c)^2``)."""

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        acc = accumulation_dtype(q.dtype)
        scores = scaled_scores(q, k, options.scale, acc)
        if options.softcap is not None:
            scores = options.softcap * torch.tanh(scores / options.softcap)
        q_len, k_len = scores.shape[-2:]
        visible = torch.ones(q_len, k_len, dtype=torch.bool)
        if options.window.right is not None:
            visible = torch.arange(k_len) <= torch.arange(q_len).unsqueeze(1) + options.window.right
        finite = lse.to(acc).masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1)
        p = torch.exp(scores - finite).masked_fill(~visible, 0.0)
        group = q.shape[1] // k.shape[1]
        kd, vd = (x.to(acc).repeat_interleave(group, 1) for x in (k, v))
        do = dout.to(acc)
        delta = (do * out.to(acc)).sum(-1, keepdim=True)
        ds = p * (do @ vd.transpose(-1, -2) - delta) * options.scale

        def fold(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(1, (k.shape[1], group)).sum(2)

        dk, dv = fold(ds.transpose(-1, -2) @ q.to(acc)), fold(p.transpose(-1, -2) @ do)
        return (ds @ kd).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _softcap_spec(kernel: type) -> KernelSpec:
    return KernelSpec(
        name=kernel.__name__, factory=kernel, capabilities=REFERENCE_SPEC.capabilities
    )


@pytest.mark.parametrize(
    ("kernel", "check"),
    [
        (IgnoresCap, "softcap"),
        (CapsBeforeScaling, "softcap"),
        (IgnoresCap, "softcap-dropout"),
        (BackwardWithoutTheTanhDerivative, "softcap-gradients"),
    ],
)
def test_the_kit_rejects_a_wrong_cap(kernel: type, check: str) -> None:
    with pytest.raises(ConformanceError) as info:
        check_kernel(_softcap_spec(kernel), checks=(check,), max_examples=30, space=_SMALL)
    assert info.value.check == check
    assert "max error" in str(info.value)


def test_a_kernel_right_without_a_cap_passes_every_other_check() -> None:
    """The softcap checks are what catch it: ``IgnoresCap`` is the reference kernel elsewhere."""
    spec = _softcap_spec(IgnoresCap)
    others = tuple(c for c in applicable_checks(spec) if c not in SOFTCAP_CHECKS)
    report = check_kernel(spec, checks=others, max_examples=5, space=_SMALL)
    assert report.passed == others


def test_saturated_scores_are_drawn() -> None:
    """One case in three puts most scores far past the cap (``tanh`` saturated)."""
    saturated = []

    @settings(max_examples=40, derandomize=True, database=None)
    @given(case=kernel_cases(REFERENCE_SPEC, softcap=True, space=_SMALL))
    def collect(case: KernelCase) -> None:
        assert case.softcap is not None
        q, k, _ = case.tensors()
        scores = scaled_scores(q, k, case.scale, torch.float64)
        saturated.append(float((scores.abs() > 3 * case.softcap).double().mean()))

    collect()
    assert sum(share > 0.5 for share in saturated) >= 5


# The call ----------------------------------------------------------------------------------------


@st.composite
def capped_cases(draw: st.DrawFn) -> tuple[Case, float]:
    case = draw(cases())
    return case, draw(st.sampled_from([0.5, 2.0, 20.0]) | st.floats(0.1, 50.0))


@given(drawn=capped_cases())
def test_forward_and_lse_match_the_oracle(drawn: tuple[Case, float]) -> None:
    case, cap = drawn
    q, k, v = case.tensors()
    q = q * 4  # scores past small caps
    pattern = (case.segment_lengths, case.dilation_rates)
    kwargs = {**case.kwargs(), "softcap": cap}
    out, lse = ringdilated.dilated_attention(
        q, k, v, *pattern, **kwargs, kernel="reference", return_lse=True
    )
    expected_out, expected_lse = oracle(q, k, v, *pattern, **kwargs, return_lse=True)
    base_out, _ = dense_attention(q, k, v, *pattern, **kwargs)
    _, base_lse = dense_attention(q, k, v, *pattern, **kwargs, dtype=_lse_dtype(case.dtype))
    assert_within_tolerance(out, expected_out, base_out, what="out")
    assert_within_tolerance(lse, expected_lse, base_lse, dtype=_lse_dtype(case.dtype), what="lse")


@given(drawn=capped_cases())
def test_gradients_match_the_oracle(drawn: tuple[Case, float]) -> None:
    case, cap = drawn
    q, k, v = case.tensors(requires_grad=True)
    pattern = (case.segment_lengths, case.dilation_rates)
    kwargs = {**case.kwargs(), "softcap": cap}
    out, lse = ringdilated.dilated_attention(
        q, k, v, *pattern, **kwargs, kernel="reference", return_lse=True
    )
    dout, dlse = upstream(case.seed, out, lse)
    grads = torch.autograd.grad(loss_of(out, lse, dout, dlse), (q, k, v))
    expected = torch.autograd.grad(
        loss_of(*oracle(q, k, v, *pattern, **kwargs, return_lse=True), dout, dlse), (q, k, v)
    )
    baseline = torch.autograd.grad(
        loss_of(*dense_attention(q, k, v, *pattern, **kwargs), dout, dlse), (q, k, v)
    )
    for name, actual, exp, base in zip("qkv", grads, expected, baseline, strict=True):
        assert_within_tolerance(actual, exp, base, what=f"d{name}")


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_documents_padding_and_a_query_suffix_with_a_cap(mode: str) -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (3 * torch.randn(2, 24, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    pattern = ([8, 12], [1, 2])
    cu_seqlens = torch.tensor([0, 10, 24])
    mask = torch.zeros(2, 24, dtype=torch.bool)
    mask[0, :5] = True
    for kwargs in ({"cu_seqlens": cu_seqlens}, {"key_padding_mask": mask}, {}):
        for suffix in (24, 7):
            got = ringdilated.dilated_attention(
                q[:, 24 - suffix :], k, v, *pattern, mode=mode, causal=True, softcap=1.5,
                kernel="reference", **kwargs,
            )  # fmt: skip
            expected = oracle(
                q[:, 24 - suffix :], k, v, *pattern, mode=mode, causal=True, softcap=1.5, **kwargs
            )
            assert max_error(got, expected) < 1e-12


def test_the_cap_is_in_the_plan_key() -> None:
    """Two caps on one layout: two plans, each with its own cap (a plan found by a key without
    the cap would run the first cap again)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (4 * torch.randn(1, 16, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for cap in (1.0, 3.0, 1.0, None):
        got = ringdilated.dilated_attention(q, k, v, [8], [1], softcap=cap, kernel="reference")
        assert max_error(got, oracle(q, k, v, [8], [1], softcap=cap)) < 1e-12


def test_auto_on_cpu_falls_to_reference_with_a_warning_that_names_softcap() -> None:
    q = torch.randn(1, 16, 2, 8)
    feature_cost._warned.clear()
    with pytest.warns(ringdilated.SlowFeatureWarning, match="softcap"):
        ringdilated.dilated_attention(q, q, q, [8], [1], softcap=10.0)
    module = ringdilated.DilatedAttention([8], [1], softcap=10.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        module(q, q, q)
    assert module.plan is not None and module.plan.kernel_name == "reference"
    assert "softcap" in module.plan.explain()


def test_the_resolver_picks_only_kernels_claiming_softcap() -> None:
    env = Environment(frozenset())
    without = attrs.evolve(REFERENCE_SPEC.capabilities, softcap=False)
    plain = KernelSpec("plain", ReferenceKernel, without, priority=50)
    resolver = Resolver([plain, REFERENCE_SPEC], env=env)
    assert resolver.resolve(Request(head_dim=8)).kernel_name == "plain"
    chosen = resolver.resolve(Request(head_dim=8, softcap=2.0))
    assert chosen.kernel_name == "reference"
    assert "rejected plain: does not support logit softcapping" in chosen.explain()


@pytest.mark.parametrize(
    ("value", "error", "shown"),
    [
        (0.0, ValueError, "got 0.0"),
        (-2, ValueError, "got -2"),
        (math.inf, ValueError, "got inf"),
        (math.nan, ValueError, "got nan"),
        (True, TypeError, "got True"),
        ("30", TypeError, "got '30'"),
    ],
)
def test_a_bad_cap_is_refused_before_any_work(value: object, error: type, shown: str) -> None:
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(error, match=f"softcap must be .*{shown}"):
        ringdilated.dilated_attention(q, q, q, [8], [1], softcap=value, kernel="reference")  # type: ignore[arg-type]
    with pytest.raises(error, match=f"softcap must be .*{shown}"):
        ringdilated.DilatedAttention([8], [1], softcap=value)  # type: ignore[arg-type]
    with pytest.raises(error, match=f"softcap must be .*{shown}"):
        ringdilated.DilatedKVCache([8], [1], num_heads=2, softcap=value)  # type: ignore[arg-type]


def test_modules_and_decoding_apply_the_cap() -> None:
    torch.manual_seed(0)
    block = ringdilated.DilatedTransformerBlock(
        16, 2, segment_lengths=[4, 8], dilation_rates=[1, 2], causal=True, softcap=0.5,
        kernel="reference", dtype=torch.float64,
    )  # fmt: skip
    attn = block.attn
    assert attn.attention.softcap == 0.5
    x = 5 * torch.randn(2, 12, 16, dtype=torch.float64)
    whole = attn(x, x, x)[0]
    q = attn.q_proj(x).view(2, 12, 2, 8)
    k = attn.k_proj(x).view(2, 12, 2, 8)
    v = attn.v_proj(x).view(2, 12, 2, 8)
    expected = oracle(q, k, v, [4, 8], [1, 2], causal=True, softcap=0.5)
    inner = attn.out_proj(attn.norm(expected.reshape(2, 12, 16)))
    assert max_error(whole, inner) < 1e-10
    cache = block.make_cache()
    with torch.no_grad():
        steps = [attn(x[:, :5], x[:, :5], x[:, :5], cache=cache)[0]]
        steps += [attn(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], cache=cache)[0]
                  for t in range(5, 9)]  # fmt: skip
        steps.append(attn(x[:, 9:], x[:, 9:], x[:, 9:], cache=cache)[0])
    assert max_error(torch.cat(steps, 1), whole) < 1e-10
    other = ringdilated.MultiheadDilatedAttention(
        16, 2, segment_lengths=[4, 8], dilation_rates=[1, 2], causal=True, dtype=torch.float64
    )
    with pytest.raises(ValueError, match=re.escape("softcap: the cache's 0.5, the module's None")):
        other(x[:, :1], x[:, :1], x[:, :1], cache=block.make_cache())


def test_flex_after_capped_calls_takes_one_tensor_passed_as_q_k_and_v() -> None:
    """Capped calls of two shapes, then an uncapped causal one with ``(x, x, x)``: torch 2.13's
    dynamo raised ``TypeError`` wording that recompile's reason (its tensor-aliasing guard,
    evaluated against the capped graph's ``score_mod`` closure) unless the kernel hands
    FlexAttention distinct tensor objects."""
    from ringdilated.backends.flex import FlexKernel
    from ringdilated.core import BlockOptions, KeyWindow

    kernel = FlexKernel()
    g = torch.Generator().manual_seed(0)
    for shape in ((1, 1, 31, 65), (1, 3, 18, 24)):
        q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
        kernel.forward(q, k, v, BlockOptions(0.3, softcap=2.0))
    x = torch.randn(1, 3, 20, 16, generator=g)
    out, _ = FlexKernel().forward(x, x, x, BlockOptions(0.25, KeyWindow(None, 0)))
    expected = oracle(x.transpose(1, 2), x.transpose(1, 2), x.transpose(1, 2), [20], [1],
                      causal=True, scale=0.25)  # fmt: skip
    assert max_error(out, expected.transpose(1, 2)) < 1e-5
