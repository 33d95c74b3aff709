"""Bad input, hostile kernels and non-finite values on one process: a clear exception that names
the culprit, raised before any work, with the caller's tensors unchanged; or, for NaN and
infinity, the rule of docs/spec.md section 4: non-finite wherever the exact math is, never
silently finite, and NaN elsewhere only through a non-finite input in an output's own kernel
block (:func:`ringdilated.testing.nan_allowed`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import attrs
import numpy as np
import pytest
import torch

import ringdilated
from ringdilated.backends.local import LOCAL_SPEC
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.core import DilationPattern, Resolver
from ringdilated.core.contract.guard import KernelContractError
from ringdilated.functional import attend
from ringdilated.testing import assert_non_finite_rule, dense_attention, nan_allowed, oracle


def _qkv(length: int = 16, heads: int = 2, dim: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, length, heads, dim, generator=g, dtype=torch.float64) for _ in range(3)]


def _call(**change: Any) -> Callable[[list[torch.Tensor]], object]:
    def call(tensors: list[torch.Tensor]) -> object:
        q, k, v = tensors
        kwargs: dict[str, Any] = {"segment_lengths": [8], "dilation_rates": [1]}
        kwargs.update(change)
        args = [kwargs.pop(name, x) for name, x in (("q", q), ("k", k), ("v", v))]
        return ringdilated.dilated_attention(*args, **kwargs)

    return call


BAD_CALLS = [
    ("segment 0", _call(segment_lengths=[0]), ValueError, "segment_lengths must be positive"),
    ("rate above segment", _call(dilation_rates=[9]), ValueError, "dilation_rates[0] = 9"),
    ("counts differ", _call(dilation_rates=[1, 2]), ValueError, "same length"),
    ("float segment", _call(segment_lengths=[8.0]), TypeError, "segment_lengths must hold ints"),
    ("bool rate", _call(dilation_rates=[True]), TypeError, "dilation_rates must hold ints"),
    ("string pattern", _call(segment_lengths="8"), TypeError, "segment_lengths must be a seq"),
    ("mode", _call(mode="dilated"), ValueError, "mode must be one of"),
    ("causal 1", _call(causal=1), TypeError, "causal must be a bool, got 1"),
    ("return_lse 'no'", _call(return_lse="no"), TypeError, "return_lse must be a bool"),
    ("scale -1", _call(scale=-1.0), ValueError, "scale must be a positive finite number"),
    ("scale nan", _call(scale=float("nan")), ValueError, "scale must be a positive finite"),
    ("dropout 1", _call(dropout_p=1.0), ValueError, "dropout_p must satisfy 0 <= dropout_p < 1"),
    ("kernel 3", _call(kernel=3), TypeError, "kernel must be 'auto', a backend name"),
    ("unknown kernel", _call(kernel="fast"), ValueError, "unknown kernel 'fast'"),
    ("communicator", _call(communicator="mpi"), ValueError, "unknown communicator 'mpi'"),
    ("q 3-D", _call(q=torch.zeros(1, 16, 8)), ValueError, "q must be 4-D"),
    ("int q", _call(q=torch.zeros(1, 16, 2, 8, dtype=torch.int64)), TypeError, "q must be float"),
    ("list q", _call(q=[[1.0]]), TypeError, "q must be a torch.Tensor, got list"),
    ("sparse k", _call(k=torch.zeros(1, 16, 2, 8).to_sparse()), TypeError, "k must be a dense"),
    (
        "nested k",
        _call(k=torch.nested.nested_tensor([torch.zeros(16, 2, 8)], layout=torch.jagged)),
        TypeError,
        "k must be a dense (strided) tensor, got a nested tensor",
    ),
    ("scale tensor", _call(scale=torch.tensor(0.5)), TypeError, "scale must be a float or None"),
    ("empty q", _call(q=torch.zeros(1, 0, 2, 8)), ValueError, "q must have no empty dimension"),
    ("dtypes differ", _call(v=torch.zeros(1, 16, 2, 8)), TypeError, "share one dtype"),
    ("k longer than q", _call(k=torch.zeros(1, 17, 2, 8, dtype=torch.float64)), ValueError, "k"),
    ("head dims", _call(v=torch.zeros(1, 16, 2, 4, dtype=torch.float64)), ValueError, "same shape"),
    ("kv heads", _call(k=torch.zeros(1, 16, 3, 8, dtype=torch.float64)), ValueError, "k and v"),
    (
        "too few heads",
        _call(segment_lengths=[4, 8, 16], dilation_rates=[1, 1, 1]),
        ValueError,
        "num_heads >= 3",
    ),
]


@pytest.mark.parametrize(("call", "error", "named"), [c[1:] for c in BAD_CALLS],
                         ids=[c[0] for c in BAD_CALLS])  # fmt: skip
def test_bad_input_is_rejected_naming_the_culprit_and_nothing_changes(
    call: Callable[[list[torch.Tensor]], object], error: type[Exception], named: str
) -> None:
    tensors = _qkv()
    before = [t.clone() for t in tensors]
    with pytest.raises(error) as info:
        call(tensors)
    assert named in str(info.value), str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))


def test_a_numpy_or_fractional_scale_is_a_real_number_like_any_other() -> None:
    q, k, v = _qkv()
    expected = oracle(q, k, v, [8], [1], scale=0.25)
    for scale in (np.float32(0.25), Fraction(1, 4), 0.25):
        out = ringdilated.dilated_attention(q, k, v, [8], [1], scale=scale)
        assert float((out - expected).abs().max()) < 1e-12, type(scale)


HUGE_RATES = """
import time, torch, ringdilated
from ringdilated.testing import assert_non_finite_rule, dense_attention, nan_allowed, oracle
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 10, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
start = time.monotonic()
for mode in ("longnet", "head_groups"):
    # Not only powers of two: rate * stride must never reach a tensor (2**62 * H * D wraps to 0
    # in int64 when H * D is a multiple of 4; the others overflow).
    for w in (2**62, 2**62 - 1, 10**18, 2**53 + 1):
        out = ringdilated.dilated_attention(q, k, v, [w, 7], [w, 3], mode=mode)
        expected = oracle(q, k, v, [w, 7], [w, 3], mode=mode)
        assert float((out - expected).abs().max()) < 1e-12, (mode, w)
print(time.monotonic() - start)
"""


def test_huge_rates_cost_nothing_per_call() -> None:
    """Per-call work depends on the number of patterns, heads and blocks, not on w or r. In a
    subprocess, so that a regression to work in w fails on the timeout instead of hanging."""
    done = subprocess.run(
        [sys.executable, "-c", HUGE_RATES], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 2.0, done.stdout


# NaN and infinity --------------------------------------------------------------------------------


def _meets_the_non_finite_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: tuple[list[int], list[int]],
    out: torch.Tensor,
    lse: torch.Tensor,
    **kwargs: Any,
) -> None:
    """``(out, lse)`` of ``dilated_attention`` judged against the float64 oracle by the
    non-finite rule, with the plain dense result in the inputs' dtype as the baseline."""
    expected, expected_lse = oracle(q, k, v, *pattern, return_lse=True, **kwargs)
    baseline, baseline_lse = dense_attention(q, k, v, *pattern, **kwargs)
    kwargs.pop("causal", None)
    may = nan_allowed(q, k, v, *pattern, **kwargs)  # (B, L, H)
    assert_non_finite_rule(out, expected, baseline, may.unsqueeze(-1), what="out")
    assert_non_finite_rule(lse, expected_lse, baseline_lse, may.transpose(1, 2), what="lse")


def _nan_q_element(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    q[0, 5, 0, 3] = float("nan")


def _every_key_of_a_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    k[0, 8:16, 1] = float("nan")


def _only_visible_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    k[0, 8, 0] = float("nan")  # causal: position 8 is the only key of query 8 in its segment


def _inf_value(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    v[0, 12, 1, 2] = float("inf")  # only queries 12..15 of that segment see it (causal)


def _scores_all_minus_inf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Query 11 (head 0) scores -inf against every key of its segment: softmax is NaN there,
    where flash-style kernels return zeros."""
    k[0, 8:16, 0, 0] = -(k[0, 8:16, 0, 0].abs() + 0.5)
    q[0, 11, 0, 0] = float("inf")


@pytest.mark.parametrize("kernel", ["sdpa", "reference"])
@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
@pytest.mark.parametrize(
    "corrupt",
    [_nan_q_element, _every_key_of_a_query, _only_visible_key, _inf_value, _scores_all_minus_inf],
)
def test_nan_and_inf_are_never_lost_and_stay_in_their_blocks(
    kernel: str, mode: str, corrupt: Callable[..., None]
) -> None:
    q, k, v = (x.float() for x in _qkv())
    corrupt(q, k, v)
    out, lse = ringdilated.dilated_attention(
        q, k, v, [8], [1], mode=mode, causal=True, kernel=kernel, return_lse=True
    )
    expected = oracle(q, k, v, [8], [1], mode=mode, causal=True)
    assert not bool(torch.isfinite(expected).all()), "the case has non-finite outputs"
    _meets_the_non_finite_rule(q, k, v, ([8], [1]), out, lse, mode=mode, causal=True)
    if corrupt is not _nan_q_element:
        assert bool(torch.isfinite(out[0, :8]).all()), "segment 0 holds no non-finite input"


@pytest.mark.parametrize("kernel", ["sdpa", "reference"])
@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_nan_reaches_no_other_segment_head_or_batch_row(kernel: str, mode: str) -> None:
    """Two patterns, two batch rows, four heads: a NaN key of batch row 1, head 2, position 21
    may reach only that row and head's blocks that read position 21."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 32, 4, 8, generator=g) for _ in range(3))
    k[1, 21, 2, 5] = float("nan")
    pattern = ([8, 16], [1, 2])
    out, lse = ringdilated.dilated_attention(
        q, k, v, *pattern, mode=mode, kernel=kernel, return_lse=True
    )
    _meets_the_non_finite_rule(q, k, v, pattern, out, lse, mode=mode)
    assert bool(torch.isfinite(out[0]).all()), "the other batch row"
    assert bool(torch.isfinite(out[1][:, [0, 1, 3]]).all()), "the other heads"
    assert not bool(torch.isfinite(out[1, 21, 2]).all()), "the query at the NaN key sees it"


def test_multihead_attention_with_an_all_nan_query_row_gives_nan_not_zeros() -> None:
    mha = ringdilated.MultiheadDilatedAttention(
        16, 2, segment_lengths=[8], dilation_rates=[1], dtype=torch.float32
    )
    x = torch.randn(1, 16, 16)
    x[0, 3] = float("nan")
    out, _ = mha(x, x, x)
    assert bool(out[0, 3].isnan().all()), "the NaN row stays NaN"
    assert bool(torch.isnan(out[0, :8]).any(-1).all()), "its keys are NaN for its whole segment"
    assert bool(torch.isfinite(out[0, 8:]).all()), "the other segment never sees it"


def test_the_oracle_keeps_infinity_away_from_queries_that_never_see_it() -> None:
    q, k, v = _qkv()
    v[0, 3, 0, 0] = float("inf")
    out = oracle(q, k, v, [8], [1], causal=True)
    assert bool(torch.isposinf(out[0, 3:8, 0, 0]).all())
    assert bool(torch.isfinite(out[0, :3]).all()) and bool(torch.isfinite(out[0, 8:]).all())


# hostile kernels ---------------------------------------------------------------------------------


class Narrow(ReferenceKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q, k, v, options)
        return out[..., :1], lse


class WrongLseDtype(ReferenceKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q, k, v, options)
        return out, lse.half()


class LseInFloat32(ReferenceKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q, k, v, options)
        return out, lse.float()  # float64 inputs: the contract says float64


class OutOnMeta(ReferenceKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q, k, v, options)
        return out.to("meta"), lse


class GradInFloat32(ReferenceKernel):
    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        dq, dk, dv = super().backward(dout, q, k, v, out, lse, options)
        return dq, dk, dv.float()


class WritesIntoV(ReferenceKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        v.add_(1.0)
        return super().forward(q, k, v, options)


class ReturnsOneThing(ReferenceKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        return super().forward(q, k, v, options)[0]


class WrongGradShape(ReferenceKernel):
    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        dq, dk, dv = super().backward(dout, q, k, v, out, lse, options)
        return dq, dk[:, :1], dv


@pytest.mark.parametrize(
    ("kernel", "named"),
    [
        (Narrow, "forward's out is (2, 2, 8, 1) float64, expected (2, 2, 8, 8) float64"),
        (WrongLseDtype, "forward's lse is (2, 2, 8) float16, expected (2, 2, 8) float64"),
        (LseInFloat32, "forward's lse is (2, 2, 8) float32, expected (2, 2, 8) float64"),
        (OutOnMeta, "forward's out is on meta, expected cpu (its input's)"),
        (GradInFloat32, "backward's dv is (2, 2, 8, 8) float32, expected (2, 2, 8, 8) float64"),
        (WritesIntoV, "it modified its input(s) v in place"),
        (ReturnsOneThing, "forward returned Tensor, not (out, lse)"),
        (WrongGradShape, "backward's dk is (2, 1, 8, 8)"),
    ],
)
def test_a_kernel_that_breaks_the_contract_is_named(kernel: type, named: str) -> None:
    resolver = Resolver(
        [attrs.evolve(REFERENCE_SPEC, name="hostile", factory=kernel)], communicators=[LOCAL_SPEC]
    )
    q, k, v = (x.requires_grad_() for x in _qkv())
    before = [x.detach().clone() for x in (q, k, v)]

    def forward_and_backward() -> None:
        out, _, _ = attend(
            DilationPattern([8], [1]), q, k, v, causal=False, scale=None, dropout_p=0.0,
            kernel="hostile", resolver=resolver,
        )  # fmt: skip
        out.sum().backward()

    with pytest.raises(KernelContractError) as info:
        forward_and_backward()
    assert str(info.value).startswith("kernel 'hostile' broke the kernel contract: ")
    assert named in str(info.value)
    if kernel is not WritesIntoV:
        assert all(torch.equal(x.detach(), b) for x, b in zip((q, k, v), before, strict=True))


def test_double_backward_says_it_is_not_supported() -> None:
    q, k, v = (x.requires_grad_() for x in _qkv())
    out = ringdilated.dilated_attention(q, k, v, [8], [1])
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="ringdilated does not support higher-order gradients"):
        dq.sum().backward()


# modules -----------------------------------------------------------------------------------------


def _mha(**change: Any) -> object:
    kwargs: dict[str, Any] = {"segment_lengths": [8], "dilation_rates": [1]}
    kwargs.update(change)
    return ringdilated.MultiheadDilatedAttention(kwargs.pop("embed_dim", 16), 2, **kwargs)


def _block(**change: Any) -> object:
    return ringdilated.DilatedTransformerBlock(
        16, 2, segment_lengths=[8], dilation_rates=[1], **change
    )


@pytest.mark.parametrize(
    ("build", "error", "named"),
    [
        (lambda: _mha(layer_norm_eps=-1), ValueError, "layer_norm_eps must be a positive"),
        (lambda: _mha(gamma_init=float("nan")), ValueError, "gamma_init must be a positive"),
        (lambda: _mha(embed_dim=15), ValueError, "embed_dim (15) must be divisible"),
        (lambda: _mha(num_kv_heads=3), ValueError, "num_kv_heads (3) must divide"),
        (lambda: _mha(bias="yes"), TypeError, "bias must be a bool"),
        (lambda: _mha(kernel="fast"), ValueError, "unknown kernel 'fast'"),
        (lambda: _block(ffn_dim=0), ValueError, "ffn_dim must be a positive int, got 0"),
        (lambda: _block(ffn_dim=-5), ValueError, "ffn_dim must be a positive int, got -5"),
        (lambda: _block(layer_norm_eps=0.0), ValueError, "layer_norm_eps must be a positive"),
    ],
)
def test_bad_module_arguments_are_rejected_on_construction(
    build: Callable[[], object], error: type[Exception], named: str
) -> None:
    with pytest.raises(error) as info:
        build()
    assert named in str(info.value)


def test_a_wrong_embed_dim_in_forward_is_named() -> None:
    x = torch.randn(1, 16, 12)
    with pytest.raises(ValueError, match=r"query must be \(batch, seq_len, embed_dim=16\)"):
        _mha(dtype=torch.float32)(x, x, x)  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"x must be \(batch, seq_len, embed_dim=16\)"):
        _block(dtype=torch.float32)(x)  # type: ignore[operator]


def test_double_backward_says_so_whichever_input_requires_grad() -> None:
    q, k, v = _qkv()
    k.requires_grad_()
    out = ringdilated.dilated_attention(q, k, v, [8], [1])
    (dk,) = torch.autograd.grad(out.sum(), k, create_graph=True)
    with pytest.raises(RuntimeError, match="ringdilated does not support higher-order gradients"):
        torch.autograd.grad((dk**2).sum() + k.sum(), k)


@pytest.mark.parametrize("kernel", ["sdpa", "reference"])
def test_a_pattern_whose_scores_are_all_minus_inf_meets_the_rule_in_the_merge(kernel: str) -> None:
    """longnet merges patterns: one pattern sees only keys scoring -inf for some queries
    (softmax there alone would be NaN), another pattern sees other keys; the exact union is
    finite. The -inf keys sit in those queries' own blocks, so NaN is allowed there
    (docs/spec.md section 4); never elsewhere, and never an inexact finite number."""
    q, k, v = _qkv(8, heads=2, dim=4)
    q[..., 0] = q[..., 0].abs() + 0.1
    k[0, 0:2, 0, 0] = float("-inf")
    pattern = ([2, 8], [1, 1])
    out, lse = ringdilated.dilated_attention(
        q, k, v, *pattern, mode="longnet", kernel=kernel, return_lse=True
    )
    expected = oracle(q, k, v, *pattern, mode="longnet")
    assert bool(torch.isfinite(expected).all())
    _meets_the_non_finite_rule(q, k, v, pattern, out, lse, mode="longnet")
    may = nan_allowed(q, k, v, *pattern, mode="longnet")
    assert not bool(may[0, :, 1].any()), "head 1 reads no infinite key"
    assert bool(torch.isfinite(out[0, :, 1]).all())


@pytest.mark.parametrize("kernel", ["sdpa", "reference"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_keep_nan_inside_the_blocks_that_hold_it(kernel: str, causal: bool) -> None:
    """longnet merges every pattern's partial into one lse: a NaN merged lse must not make NaN
    the gradients of another block. An infinite key at position 1: every gradient outside the
    longest pattern's segment [0, 8) is the oracle's (a review found dq NaN at rows of the
    8-segment that no block holding the key reaches), and dq inside it only where allowed."""
    g = torch.Generator().manual_seed(12)
    q, k, v = (
        torch.randn(1, 16, 2, 4, generator=g, dtype=torch.float64).requires_grad_()
        for _ in range(3)
    )
    with torch.no_grad():
        k[0, 1, :, 0] = float("inf")
    kw: dict[str, Any] = {"mode": "longnet", "causal": causal}
    out = ringdilated.dilated_attention(q, k, v, [4, 8], [1, 2], kernel=kernel, **kw)
    expected = oracle(q, k, v, [4, 8], [1, 2], **kw)
    dout = torch.randn(out.shape, generator=g, dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    exact = torch.autograd.grad(expected, (q, k, v), dout)
    may = nan_allowed(q, k, v, [4, 8], [1, 2], mode="longnet")  # (B, L, H)
    dq, exact_dq = grads[0], exact[0]
    outside = ~may.unsqueeze(-1) & torch.isfinite(exact_dq)
    assert not bool(dq[outside].isnan().any()), "NaN crossed into another block's dq"
    assert torch.allclose(dq[outside], exact_dq[outside], atol=1e-10, rtol=0)
    for grad, ref in zip(grads, exact, strict=True):
        later = slice(8, 16)  # no block reaching these positions holds the infinite key
        assert bool(torch.isfinite(grad[:, later]).all()), "NaN crossed into a later segment"
        assert torch.allclose(grad[:, later], ref[:, later], atol=1e-10, rtol=0)
