"""The flex kernel's block masks, built from the causal offset with no dense mask
(:mod:`ringdilated.backends._flex_blocks`).

- Equivalence: tensor by tensor, what ``create_block_mask`` builds from the dense mask on CPU, for
  lengths on and off block multiples, offsets negative, zero, positive and past either length,
  and several block sizes.
- Exactness: the kernel through the conformance kit with a stand-in that reads the block mask as
  the Triton kernels do (tests/standins/flex.py), with small blocks so short problems span many;
  and the stand-in shown to catch a wrong block mask.
- Memory: the driver's real block shapes, up to one 128k x 128k block, built on FakeTensor
  ``cuda`` tensors with every allocation recorded: nothing grows like ``q_len * k_len``.
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import attrs
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ringdilated.backends._flex_blocks import offset_block_mask
from ringdilated.backends.flex import FLEX_SPEC, FlexKernel, _block_mask, offset_mask
from ringdilated.core import KeyWindow
from ringdilated.core.contract.kernel import BlockOptions
from ringdilated.core.plan.documents import DocumentLayout
from ringdilated.core.plan.pattern import DilationPattern
from ringdilated.core.plan.window import CAUSAL
from ringdilated.core.run.local import CallState, pattern_run
from ringdilated.testing import check_kernel
from ringdilated.testing.conformance import CHECKS, applicable_checks
from tests.standins import math_flex_attention
from tests.standins.flex import kernel_visibility
from tests.test_gpu_kernel_wrappers import on_cpu

TABLES = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)
BLOCK_SIZES = [(128, 128), (16, 16), (16, 40), (24, 8)]
AUX = types.SimpleNamespace(lse=True)


def _lengths(block: int) -> list[int]:
    """On, just off and well off multiples of ``block``."""
    return [1, block - 1, block, block + 1, 3 * block + 5]


def _offsets(q_len: int, k_len: int, bq: int, bk: int) -> list[int]:
    near = {-q_len - 7, -q_len, -q_len + 1, -bq - 1, -bq, -1, 0, 1, bk - 1, bk, bk + 1}
    return sorted(near | {k_len - 2, k_len - 1, k_len, k_len + 9, -(10**12), 10**12})


def _assert_same(got: BlockMask, expected: BlockMask, case: object) -> None:
    assert got.seq_lengths == expected.seq_lengths, case
    assert got.BLOCK_SIZE == expected.BLOCK_SIZE, case
    for name in TABLES:
        a, b = getattr(got, name), getattr(expected, name)
        assert a.dtype == b.dtype == torch.int32, (case, name)
        assert a.is_contiguous(), (case, name)
        assert a.shape == b.shape and torch.equal(a, b), (case, name, a, b)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_the_analytic_block_mask_equals_create_block_mask(block_size: tuple[int, int]) -> None:
    """Every table, entries past each row's count included, equals ``create_block_mask``'s on
    CPU, through the kernel's own cached path (the offset saturated, the mask_mod's tensor
    holding it)."""
    bq, bk = block_size
    for q_len, k_len in itertools.product(_lengths(bq), _lengths(bk)):
        for offset in _offsets(q_len, k_len, bq, bk):
            case = (q_len, k_len, offset, block_size)
            dense = offset_mask(torch.tensor(offset))

            def reference(b, h, q, kv, offset=offset):  # type: ignore[no-untyped-def]
                return kv <= q + offset  # the rule, not the code under test

            expected = create_block_mask(reference, None, None, q_len, k_len, "cpu", block_size)
            _assert_same(_block_mask(q_len, k_len, offset, "cpu", block_size), expected, case)
            built = offset_block_mask(q_len, k_len, offset, dense, "cpu", block_size)
            _assert_same(built, expected, case)
            assert built.mask_mod is dense


@pytest.mark.parametrize("block_size", BLOCK_SIZES[1:])
def test_a_sliding_windows_block_mask_equals_create_block_mask(
    block_size: tuple[int, int],
) -> None:
    """A window with a left bound (issue 24): every table equals ``create_block_mask``'s for
    bands about every diagonal, narrower and wider than a block, with and without a right
    bound, rows at the start or the end seeing nothing and none seeing anything; through the
    kernel's cached path, its ``mask_mod`` the window's (left bound first)."""
    bq, bk = block_size
    for q_len, k_len in itertools.product((1, bq + 1, 3 * bq + 5), (bk, 3 * bk + 5)):
        lefts = {-k_len - 3, -bk, -1, 0, 1, bq - 1, bq + 3, q_len - 1, q_len + 5}
        rights = {None, -q_len - 2, -bq, -1, 0, 1, bk + 1, k_len}
        for left, right in itertools.product(sorted(lefts), rights):
            case = (q_len, k_len, left, right, block_size)

            def reference(b, h, q, kv, left=left, right=right):  # type: ignore[no-untyped-def]
                seen = kv >= q - left  # the rule, not the code under test
                return seen if right is None else seen & (kv <= q + right)

            expected = create_block_mask(reference, None, None, q_len, k_len, "cpu", block_size)
            got = _block_mask(q_len, k_len, KeyWindow(left, right), "cpu", block_size)
            _assert_same(got, expected, case)
            rows, cols = torch.arange(q_len).view(-1, 1), torch.arange(k_len).view(1, -1)
            assert torch.equal(got.mask_mod(None, None, rows, cols), reference(0, 0, rows, cols))


def _standin_spec(block_size: tuple[int, int]) -> Any:
    return attrs.evolve(
        on_cpu(FLEX_SPEC, frozenset({torch.float32, torch.float64})),
        factory=lambda: FlexKernel(attention=math_flex_attention, block_size=block_size),
    )


@pytest.mark.parametrize("block_size", [(16, 8), (8, 24)])
def test_the_kernel_reading_the_block_mask_as_the_kernels_do_conforms(
    block_size: tuple[int, int],
) -> None:
    """The conformance kit (causal offsets, empty rows, gradients against the float64 oracle)
    on a flex kernel whose attention computes only the blocks the mask lists, the mask_mod
    only in partial ones, and the backward's view checked to be the transpose."""
    spec = _standin_spec(block_size)
    report = check_kernel(spec, max_examples=10)
    unclaimed = ("dropout", "softcap-dropout")  # flex declares no dropout
    assert (
        report.passed == applicable_checks(spec) == tuple(c for c in CHECKS if c not in unclaimed)
    )


def _scores_visible(q_len: int, k_len: int, offset: int) -> torch.Tensor:
    return torch.arange(k_len).view(1, -1) <= torch.arange(q_len).view(-1, 1) + offset


@pytest.mark.parametrize(("q_len", "k_len", "offset"), [(40, 50, 0), (37, 29, -9), (50, 41, 13)])
def test_the_stand_in_sees_exactly_the_offset_mask(q_len: int, k_len: int, offset: int) -> None:
    mask = _block_mask(q_len, k_len, offset, "cpu", (8, 16))
    assert torch.equal(kernel_visibility(mask, q_len, k_len), _scores_visible(q_len, k_len, offset))


def test_the_stand_in_catches_a_wrong_block_mask() -> None:
    """The exactness test bites: a partial block listed as full shows hidden keys; a backward
    view that is not the forward's transpose is refused."""
    q_len, k_len, offset = 40, 40, 0
    mask = _block_mask(q_len, k_len, offset, "cpu", (8, 8))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float64, generator=g) for _ in range(3))

    # Row m's diagonal block (m, m) is partial; full_kv_indices lists m at position m: count it.
    wrong = BlockMask.from_kv_blocks(
        torch.zeros_like(mask.kv_num_blocks), mask.kv_indices, mask.full_kv_num_blocks + 1,
        mask.full_kv_indices, BLOCK_SIZE=(8, 8), mask_mod=mask.mask_mod,
        seq_lengths=(q_len, k_len),
    )  # fmt: skip
    right_out, _ = math_flex_attention(q, k, v, block_mask=mask, scale=0.25, return_aux=AUX)
    wrong_out, _ = math_flex_attention(q, k, v, block_mask=wrong, scale=0.25, return_aux=AUX)
    dense_out, _ = math_flex_attention(
        q, k, v, block_mask=types.SimpleNamespace(mask_mod=mask.mask_mod, shape=mask.shape),
        scale=0.25, return_aux=AUX,
    )  # fmt: skip
    assert torch.allclose(right_out, dense_out, atol=1e-12)
    assert not torch.allclose(wrong_out, dense_out, atol=1e-3)

    transposed_wrongly = BlockMask(
        (q_len, k_len), mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
        mask.full_kv_indices, mask.full_q_num_blocks, mask.full_q_indices, mask.q_num_blocks,
        mask.q_indices, BLOCK_SIZE=(8, 8), mask_mod=mask.mask_mod,
    )  # fmt: skip
    with pytest.raises(AssertionError, match="key-block view"):
        kernel_visibility(transposed_wrongly, q_len, k_len)


# Memory ------------------------------------------------------------------------------------------


class Allocations(TorchDispatchMode):
    """Every tensor an op returns on ``device``: its element count (views counted whole)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.sizes: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        for x in tree_flatten(result)[0]:
            if isinstance(x, torch.Tensor) and x.device.type == self.device:
                self.sizes.append((x.numel(), str(func)))
        return result

    @property
    def largest(self) -> int:
        return max(n for n, _ in self.sizes)


class ShapeRecorder:
    """A kernel that records each masked block's ``(q_len, k_len, offset)`` and computes
    nothing (zeros), so the driver can plan 128k-long blocks on CPU."""

    def __init__(self) -> None:
        self.masked: set[tuple[int, int, int]] = set()

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        q_len, k_len = q.shape[-2], k.shape[-2]
        if options.needs_mask(q_len, k_len):
            self.masked.add((q_len, k_len, options.window.right))
        lse = torch.zeros(q.shape[:-1], dtype=torch.float32)
        return torch.zeros_like(q), lse

    def backward(self, *args):  # type: ignore[no-untyped-def]
        raise AssertionError("forward only")


def _driver_block_shapes(
    pattern: DilationPattern, length: int, query_length: int
) -> set[tuple[int, int, int]]:
    """The masked blocks of one causal call over ``length`` keys and the last ``query_length``
    queries (a query suffix, as in chunked prefill, shifts the offsets)."""
    recorder = ShapeRecorder()
    q, k = torch.zeros(1, query_length, 4, 16), torch.zeros(1, length, 4, 16)
    layout = DocumentLayout.whole(1, length, query_length)
    run = pattern_run(
        recorder, pattern, q, k, window=CAUSAL, scale=None, dropout_p=0.0, layout=layout
    )
    with torch.no_grad():
        run.forward(q, k, k, CallState())
    return recorder.masked


def _fake_attention(query, key, value, block_mask=None, **kwargs):  # type: ignore[no-untyped-def]
    assert block_mask.kv_indices.device.type == "cuda"
    lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
    return torch.empty_like(query), types.SimpleNamespace(lse=lse)


PATTERNS = [
    (DilationPattern([2048, 8192, 32768], [1, 4, 16]), 32768, 32768),
    (DilationPattern([2048, 8192, 32768], [1, 4, 16]), 32768, 1500),
    (DilationPattern([4096, 16384], [2, 4], "longnet"), 16384, 16384),
    (DilationPattern([131072], [1]), 131072, 131072),
    (DilationPattern([131072], [1]), 131072, 3000),
]


@pytest.mark.parametrize(("pattern", "length", "query_length"), PATTERNS)
def test_the_driver_blocks_masks_on_fake_cuda_allocate_nothing_dense(
    pattern: DilationPattern, length: int, query_length: int
) -> None:
    """The flex kernel's forward on FakeTensor ``cuda`` tensors for each masked block shape the
    driver really makes: building the block mask allocates at most one
    ``(q_len / 128) x (k_len / 128)`` table (4 MiB at 128k, where a dense mask is 16 GiB), the
    whole forward nothing above the block's own activations."""
    shapes = _driver_block_shapes(pattern, length, query_length)
    assert shapes, "the causal pattern masks some block"
    kernel = FlexKernel(attention=_fake_attention, compiled_devices=())
    try:
        for q_len, k_len, offset in sorted(shapes):
            tables = -(-q_len // 128) * -(-k_len // 128)
            building, calling = Allocations("cuda"), Allocations("cuda")
            with FakeTensorMode():
                with building:
                    _block_mask(q_len, k_len, offset, "cuda:0")
                q = torch.empty(1, 2, q_len, 16, dtype=torch.float16, device="cuda")
                k = torch.empty(1, 2, k_len, 16, dtype=torch.float16, device="cuda")
                with calling:
                    options = BlockOptions(scale=0.25, window=KeyWindow(None, offset))
                    kernel.forward(q, k, k, options)
            assert building.largest <= tables, building.sizes
            assert calling.largest <= max(q.numel(), k.numel(), tables), calling.sizes
            if (q_len, k_len) == (131072, 131072):
                assert building.largest == 1024 * 1024  # an int32 table: 4 MiB; dense: 16 GiB
    finally:
        _block_mask_cache_clear()
    if length == query_length == 131072:
        assert shapes == {(131072, 131072, 0)}


def test_a_sliding_windows_block_mask_on_fake_cuda_allocates_nothing_dense() -> None:
    """A sliding window's block mask at 128k (``window=(4096, 0)``) is built on FakeTensor
    ``cuda`` tensors in ``(q_len / 128) x (k_len / 128)`` int32 tables at most, like the causal
    one: 4 MiB, where a dense mask is 16 GiB."""
    building = Allocations("cuda")
    try:
        with FakeTensorMode(), building:
            _block_mask(131072, 131072, KeyWindow(4096, 0), "cuda:0")
    finally:
        _block_mask_cache_clear()
    assert building.largest == 1024 * 1024


def _block_mask_cache_clear() -> None:
    """Fake tensors must not outlive their mode in the kernel's cache."""
    from ringdilated.backends.flex import _cached_block_mask

    _cached_block_mask.cache_clear()


def test_the_allocation_record_sees_a_dense_mask() -> None:
    """The record above is not vacuous: ``create_block_mask`` (what the kernel called before),
    recorded the same way on CPU, allocates ``q_len * k_len`` elements."""
    q_len, k_len = 1000, 900
    allocations = Allocations("cpu")
    with allocations:
        create_block_mask(offset_mask(torch.tensor(0)), None, None, q_len, k_len, "cpu")
    assert allocations.largest >= q_len * k_len
