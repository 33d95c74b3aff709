"""The ``cudnn`` kernel's causal offsets inside the keys, its lazy spec and its stand-in's grouped
heads, on CPU against the stand-in of torch 2.13's cuDNN ops (tests/standins/cudnn.py) and the
float64 oracle. The ops' arguments on fake ``cuda`` tensors: tests/test_fake_cuda_torch_ops.py.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import attrs
import pytest
import torch
from hypothesis import strategies as st

from ringdilated.backends import cudnn
from ringdilated.backends.cudnn import CudnnKernel
from ringdilated.backends.reference import REFERENCE_SPEC
from ringdilated.core import KeyWindow, Request, Resolver
from ringdilated.core.contract.kernel import BlockOptions
from ringdilated.core.select.capabilities import Environment
from ringdilated.testing import ConformanceError, check_kernel, conformance
from ringdilated.testing.kernel_cases import KernelCase, dense
from tests.standins import cudnn_attention, cudnn_attention_backward
from tests.standins.math import attend, grads
from tests.test_gpu_kernel_wrappers import SHORT, on_cpu

# -- causal offsets inside the keys, through the conformance kit -----------------------------------


def _case(q_len: int, k_len: int, heads: int, kv_heads: int, right: int, **kw: Any) -> KernelCase:
    fields = {"n": 2, "head_dim": 16, "dtype": torch.float16, "scale": 0.3, "seed": right}
    return KernelCase(
        heads=heads, kv_heads=kv_heads, q_len=q_len, k_len=k_len, window=KeyWindow(None, right),
        **{**fields, **kw},
    )  # fmt: skip


#: Offsets ``0 < o < Lk - 1``: a one-key unmasked piece (``o = 1``), causal pieces longer than
#: the queries (``Lk - o > Lq``: rows see a prefix), as long, shorter, of two keys; ``Lq > Lk``;
#: grouped heads 2:1, 3:1 and 4:1; the driver's strided views; bfloat16.
INSIDE = [
    _case(20, 45, 4, 2, 1),
    _case(20, 45, 4, 2, 2),
    _case(20, 45, 6, 2, 17, layout="strided", rate=2, offset=1),
    _case(20, 45, 4, 1, 25),
    _case(33, 65, 4, 4, 63, dtype=torch.bfloat16),
    _case(40, 24, 3, 1, 5, layout="strided", rate=3),
    _case(16, 16, 2, 2, 3, head_dim=64),
]


def _signature(case: KernelCase) -> tuple[int, ...]:
    return case.q_len, case.k_len, case.heads, case.kv_heads, case.window.right or 0


class SeenKernel(CudnnKernel):
    """The stand-in-backed kernel, recording the problems its forward is given."""

    seen: ClassVar[set[tuple[int, ...]]] = set()

    def __init__(self) -> None:
        super().__init__(cudnn_attention, cudnn_attention_backward)

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        heads = (q.shape[1], k.shape[1])
        self.seen.add((q.shape[-2], k.shape[-2], *heads, options.window.right or 0))
        return super().forward(q, k, v, options)


@pytest.fixture
def fixed_cases(monkeypatch: pytest.MonkeyPatch) -> list[KernelCase]:
    """The kit drawing from :data:`INSIDE` only (``forward``, which draws no mask, gets them
    unmasked)."""

    def cases(*args: object, causal: bool | None = None, **kw: object) -> Any:
        unmasked = [attrs.evolve(c, window=KeyWindow()) for c in INSIDE]
        return st.sampled_from(unmasked if causal is False else INSIDE)

    monkeypatch.setattr(conformance, "kernel_cases", cases)
    SeenKernel.seen = set()
    return INSIDE


CHECKS = ("causal", "gradients", "split-merge", "no-mutation", "non-finite", "non-finite-gradients")


def test_offsets_inside_the_keys_conform(fixed_cases: list[KernelCase]) -> None:
    """Two top-left pieces merged by log-sum-exp, each backward handed the merged ``out`` and
    ``lse``, against the float64 oracle: values, gradients, the split-merge property and the
    non-finite rules, with the op never seeing a row without a key (the stand-in gives NaN)."""
    spec = attrs.evolve(on_cpu(cudnn.cudnn_spec()), factory=SeenKernel)
    report = check_kernel(spec, checks=CHECKS, max_examples=4 * len(fixed_cases))
    assert report.passed == CHECKS
    assert {_signature(c) for c in fixed_cases} <= SeenKernel.seen, "every case ran"


def test_the_merge_is_checked_by_the_kit(fixed_cases: list[KernelCase]) -> None:
    """Defect: the causal piece's result alone, as if keys before the offset were hidden."""

    class LastPieceOnly(SeenKernel):
        def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
            right = options.window.right
            if right is None or not 0 < right < k.shape[-2] - 1:
                return super().forward(q, k, v, options)
            causal = BlockOptions(options.scale, KeyWindow(None, 0))
            return super().forward(q, k[..., right:, :], v[..., right:, :], causal)

    spec = attrs.evolve(on_cpu(cudnn.cudnn_spec()), factory=LastPieceOnly)
    with pytest.raises(ConformanceError, match=r"\[causal\]"):
        check_kernel(spec, checks=("causal",), max_examples=4 * len(fixed_cases))


def _oracle_gradients(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, case: KernelCase
) -> tuple[torch.Tensor, ...]:
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, _ = dense(*exact, case.scale, case.window)
    return torch.autograd.grad((out * dout.double()).sum(), exact)


def test_each_piece_gets_the_merged_lse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's gradients match the float64 oracle; a defect handing each piece's backward
    the lse its own forward returned (not the merged one the contract hands over) makes
    ``P = exp(s - lse)`` each piece's own softmax, and misses by far."""
    case = _case(12, 20, 4, 2, 6)
    q, k, v = case.tensors()
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).half()
    expected = _oracle_gradients(q, k, v, dout, case)
    kernel = CudnnKernel(cudnn_attention, cudnn_attention_backward)

    def error() -> float:
        out, lse = kernel.forward(q, k, v, case.options())
        got = kernel.backward(dout, q, k, v, out, lse, case.options())
        return max(float((g.double() - e).abs().max()) for g, e in zip(got, expected, strict=True))

    assert error() < 1e-2

    def own_lse(self, dout, q, k, v, out, stats, piece, scale):  # type: ignore[no-untyped-def]
        _, lse = self._forward_piece(q, k, v, piece, scale)
        return original(self, dout, q, k, v, out, piece.rows(lse.unsqueeze(-1)), piece, scale)

    original = CudnnKernel._backward_piece
    monkeypatch.setattr(CudnnKernel, "_backward_piece", own_lse)
    assert error() > 1.0


def test_a_cudnn_wrapper_sending_rows_that_see_no_key_fails_the_kit() -> None:
    """Defect: every masked block as one call with an additive 0/-inf bias (what the op takes),
    the rows that see no key included. cuDNN's value for such rows is undocumented (NaN in the
    stand-in), and its backward, handed their merged ``lse = -inf``, recomputes
    ``P = exp(s + bias - lse)``: ``exp(-inf + inf)`` is NaN, in ``dk`` and ``dv`` of every key.
    The kernel's top-left pieces never hand the op such a row."""

    def bias(q: torch.Tensor, k: torch.Tensor, right: int) -> torch.Tensor:
        q_len, k_len = q.shape[-2], k.shape[-2]
        padded = -(-k_len // 8) * 8  # rows 16 bytes apart, as the op's loads assume
        hidden = torch.arange(k_len) > torch.arange(q_len).unsqueeze(1) + right
        rows = torch.zeros(q_len, padded, dtype=q.dtype).narrow(1, 0, k_len)
        return rows.masked_fill_(hidden, float("-inf"))

    def masked(options: BlockOptions, k: torch.Tensor) -> int | None:
        right = options.window.right
        return right if right is not None and right < k.shape[-2] - 1 else None

    class BiasForEveryOffset(SeenKernel):
        def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
            right = masked(options, k)
            if right is None or k.shape[-2] <= 1 or not q.numel():
                return super().forward(q, k, v, options)
            out, lse, *_ = cudnn_attention(q, k, v, bias(q, k, right), True, scale=options.scale)
            return out, lse.squeeze(-1)

        def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
            right = masked(options, k)
            if right is None or k.shape[-2] <= 1 or not q.numel():
                return super().backward(dout, q, k, v, out, lse, options)
            unused = torch.empty((), dtype=torch.int64)
            stats = lse.unsqueeze(-1).float().contiguous()
            return cudnn_attention_backward(
                dout.contiguous(), q, k, v, out.contiguous(), stats, unused, unused,
                bias(q, k, right), None, None, q.shape[-2], k.shape[-2], 0.0, False,
                scale=options.scale,
            )  # fmt: skip

    spec = attrs.evolve(on_cpu(cudnn.cudnn_spec()), factory=BiasForEveryOffset)
    with pytest.raises(ConformanceError, match=r"\[gradients\]"):
        check_kernel(spec, max_examples=25, checks=("gradients",), space=SHORT)


# -- the stand-in's grouped heads ------------------------------------------------------------------


def test_the_standin_takes_key_and_value_head_counts_that_divide_the_querys() -> None:
    """cuDNN's frontend takes ``Hk`` and ``Hv`` that each divide ``H`` (they may differ); the
    backward's ``dk``, ``dv`` are allocated like ``key``, ``value`` and sum their query heads."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 6, 16, 16, generator=g).half()
    k = torch.randn(1, 3, 24, 16, generator=g).half()
    v = torch.randn(1, 2, 24, 16, generator=g).half()
    out, lse, *rest = cudnn_attention(q, k, v, None, True, is_causal=True, scale=0.25)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    visible = torch.arange(24) <= torch.arange(16).unsqueeze(1)  # top-left
    scores = qd @ kd.repeat_interleave(2, 1).transpose(-1, -2) * 0.25
    scores = scores.masked_fill(visible.logical_not(), float("-inf"))
    expected = scores.softmax(-1) @ vd.repeat_interleave(3, 1)
    assert (out.double() - expected).abs().max() < 2e-3
    assert (lse.squeeze(-1).double() - scores.logsumexp(-1)).abs().max() < 1e-4
    dout = torch.randn(out.shape, generator=g).half()
    (expected * dout.double()).sum().backward()
    seed, offset = rest[4], rest[5]
    dq, dk, dv = cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, None, None, 16, 24, 0.0, True, scale=0.25
    )
    assert (dk.shape, dv.shape) == (k.shape, v.shape)
    for got, want in ((dq, qd.grad), (dk, kd.grad), (dv, vd.grad)):
        assert want is not None and (got.double() - want).abs().max() < 2e-2


@pytest.mark.parametrize(("k_heads", "v_heads"), [(4, 2), (2, 4), (6, 5)])
def test_the_standin_refuses_head_counts_that_do_not_divide(k_heads: int, v_heads: int) -> None:
    q = torch.randn(1, 6, 16, 16).half()
    k, v = torch.randn(1, k_heads, 16, 16).half(), torch.randn(1, v_heads, 16, 16).half()
    message = "must be a factor of number of heads for query"
    with pytest.raises(RuntimeError, match=message):
        cudnn_attention(q, k, v, None, True, scale=0.25)


def test_the_oracle_helpers_fold_value_heads_by_their_own_count() -> None:
    """``tests/standins/math.py``'s ``grads`` sums ``dv`` over ``v``'s groups, not ``k``'s."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 8, h, 8, generator=g).double() for h in (6, 3, 2))
    out, lse = attend(q, k, v, 0.5, None)
    dout = torch.randn(out.shape, generator=g).double()
    _, dk, dv = grads(dout, q, k, v, out, lse, 0.5, None)
    assert (dk.shape, dv.shape) == (k.shape, v.shape)


# -- the spec reads this process's cuDNN only when asked -------------------------------------------


class ReadEnviron(dict[str, str]):
    """``os.environ`` recording the names read through ``get`` and ``[]``."""

    def __init__(self, values: Mapping[str, str]) -> None:
        super().__init__(values)
        self.read: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.read.append(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.read.append(key)
        return super().__getitem__(key)


@pytest.fixture
def reloaded(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, ReadEnviron]]:
    """``ringdilated.backends.cudnn`` imported again with ``torch.backends.cudnn.version``
    raising and ``os.environ`` recording reads; the module's original objects are put back
    afterwards (other modules hold them)."""

    def version() -> int:
        raise AssertionError("torch.backends.cudnn.version() called")

    environ = ReadEnviron(os.environ)
    monkeypatch.setattr(torch.backends.cudnn, "version", version)
    monkeypatch.setattr(os, "environ", environ)
    saved = dict(vars(cudnn))
    try:
        yield importlib.reload(cudnn), environ
    finally:
        vars(cudnn).clear()
        vars(cudnn).update(saved)


def _hopper(head_dim: int = 64) -> Request:
    return Request("cuda", torch.float16, head_dim, compute_capability=(9, 0))


def test_importing_the_module_reads_no_cudnn_version_and_no_environment(
    reloaded: tuple[Any, ReadEnviron], monkeypatch: pytest.MonkeyPatch
) -> None:
    module, environ = reloaded
    assert cudnn.DEPRIORITIZED_ENV_VAR not in environ.read, "read at import"
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91600)
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    environ.pop(cudnn.DEPRIORITIZED_ENV_VAR, None)
    specs = [module.CUDNN_SPEC, REFERENCE_SPEC]

    def chosen() -> str:
        resolver = Resolver(specs, env=Environment(packages=frozenset()))
        return resolver.resolve(_hopper()).kernel_name

    assert chosen() == "cudnn", "torch prefers cuDNN 9.16 on sm90"
    assert cudnn.DEPRIORITIZED_ENV_VAR in environ.read, "read when the resolver ranks it"
    environ[cudnn.DEPRIORITIZED_ENV_VAR] = "1"
    assert chosen() == "reference"
    del environ[cudnn.DEPRIORITIZED_ENV_VAR]
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91500)
    assert chosen() == "reference", "9.15.0 is not newer than 9.15.0"


@pytest.mark.parametrize(
    ("version", "cuda", "preferred"),
    [(91600, "12.9", {(9, 0), (10, 3)}), (91600, "13.0", {(9, 0), (9, 5), (10, 3)}),
     (91500, "13.0", set()), (None, "12.9", set())],
)  # fmt: skip
def test_the_lazy_spec_follows_the_runtime_it_finds(
    monkeypatch: pytest.MonkeyPatch,
    version: int | None,
    cuda: str,
    preferred: set[tuple[int, int]],
) -> None:
    """The built-in spec reads the version each time it is asked: the same object ranks by
    whatever cuDNN and CUDA build torch reports then."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: version is not None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: version)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.delenv(cudnn.DEPRIORITIZED_ENV_VAR, raising=False)
    for cc in [(8, 0), (9, 0), (9, 5), (10, 3), (12, 0)]:
        request = Request("cuda", torch.float16, 64, compute_capability=cc)
        expected = cudnn.PREFERRED_PRIORITY if cc in preferred else -5
        assert cudnn.CUDNN_SPEC.priority_for(request) == expected, cc


# -- one query row where torch refuses cuDNN decoding ----------------------------------------------


@pytest.mark.parametrize(
    ("capability", "version", "broken"),
    [
        ((10, 0), 91900, True),  # the first version named: 9.19.0
        ((10, 3), 92500, True),  # the last: 9.25.0
        ((11, 0), 92200, True),
        ((10, 0), 92401, False),  # "except 9.24.1"
        ((10, 0), 91802, False),
        ((10, 0), 92501, False),
        ((9, 0), 92000, False),  # SM 9.x is not named
        ((12, 0), 92000, False),
        ((10, 0), None, False),
    ],
)
def test_decode_is_refused_as_check_cudnn_sdpa_decode_says(
    capability: tuple[int, int], version: int | None, broken: bool
) -> None:
    """ "cuDNN SDPA decode is disabled for cuDNN versions 9.19-9.25.0 (except 9.24.1) on SM
    10.x and 11.x" (pytorch ``MHA.cpp``, pytorch#193893, #194927)."""
    assert cudnn.decode_broken(capability, version) is broken


@pytest.mark.parametrize("right", [None, 0, 5, -4])
def test_one_query_row_goes_to_the_dense_math_where_decoding_is_refused(
    monkeypatch: pytest.MonkeyPatch, right: int | None
) -> None:
    """A block whose cuDNN call would hold one query row (decoding; or rows cut to one by a
    negative offset) never reaches the op where :func:`cudnn.decode_refused`; its results are
    the oracle's."""
    monkeypatch.setattr(cudnn, "decode_refused", lambda device: True)

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the cuDNN op got one query row")

    kernel = CudnnKernel(never, never)
    q_len = 5 if right == -4 else 1
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, q_len, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(2, 2, 9, 16, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    options = BlockOptions(0.25, KeyWindow(None, right))
    out, lse = kernel.forward(q.detach(), k.detach(), v.detach(), options)
    want_out, want_lse = dense(q, k, v, 0.25, right)
    assert float((out - want_out.detach()).abs().max()) < 1e-12
    want_lse = want_lse.detach()
    assert torch.equal(lse == float("-inf"), want_lse == float("-inf"))
    seen = want_lse > float("-inf")
    assert float((lse - want_lse)[seen].abs().max()) < 1e-12
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = kernel.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, options)
    wanted = torch.autograd.grad(want_out, (q, k, v), dout)
    for name, a, b in zip("qkv", got, wanted, strict=True):
        assert float((a - b).abs().max()) < 1e-12, f"d{name}"
