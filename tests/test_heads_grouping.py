"""When the memory-efficient kernels group heads and when they repeat them
(``ringdilated.backends._heads.kv_groups``): one call per key/value head only where each group's
grid fills ``GROUPED_MIN_TILES`` query tiles; smaller calls repeat ``k``, ``v`` and make one call,
which the conformance kit holds to the oracle like the grouped calls
(tests/test_grouped_heads.py)."""

from __future__ import annotations

import pytest
import torch

from ringdilated.backends import _heads
from ringdilated.backends.sdpa import EfficientAttention
from ringdilated.core import KeyWindow
from ringdilated.testing import conformance
from ringdilated.testing.kernel_cases import KernelCase
from tests.standins import efficient_attention, efficient_attention_backward


def _shapes(n: int, heads: int, kv_heads: int, q_len: int) -> tuple[torch.Tensor, ...]:
    q = torch.empty(n, heads, q_len, 8, device="meta")
    k = torch.empty(n, kv_heads, 16, 8, device="meta")
    return q, k, k


def test_a_small_call_repeats_and_goes_once() -> None:
    """4 query heads on 2, one problem of 64 rows: 2 tiles a group, far below 256."""
    (group,) = _heads.kv_groups(*_shapes(1, 4, 2, 64))
    assert (group.q.shape[1], group.k.shape[1], group.kv_heads) == (4, 4, 2)
    assert group.k.stride(1) != 0, "repeated: a copy, not an expansion"


def test_a_call_whose_groups_fill_the_threshold_goes_once_per_key_value_head() -> None:
    """2 query heads a group: ``n * 2 * ceil(Lq / 64) = 256`` tiles exactly at n = 2, Lq = 4096."""
    groups = _heads.kv_groups(*_shapes(2, 8, 4, 4096))
    assert [(g.first, g.q.shape[1], g.k.shape[1], g.k.stride(1)) for g in groups] == [
        (2 * g, 2, 2, 0) for g in range(4)
    ]
    (one,) = _heads.kv_groups(*_shapes(2, 8, 4, 4096 - 64))  # 254 tiles: below
    assert one.k.stride(1) != 0


def test_multi_query_is_always_one_expanded_call() -> None:
    (group,) = _heads.kv_groups(*_shapes(1, 4, 1, 8))
    assert (group.q.shape[1], group.k.shape[1], group.k.stride(1)) == (4, 4, 0)


@pytest.mark.parametrize("offset", [None, 6, -3])
def test_the_repeated_call_passes_the_kits_checks(offset: int | None) -> None:
    """The small-call path against the float64 oracle, forward, gradients (the repeated heads'
    ``dk``, ``dv`` summed per group), the non-finite rule and dropout replay."""
    kernel = EfficientAttention(efficient_attention, efficient_attention_backward)
    case = KernelCase(
        n=2, heads=4, kv_heads=2, q_len=12, k_len=16, head_dim=16, dtype=torch.float16,
        scale=0.3, window=KeyWindow(None, offset), seed=5, layout="strided", rate=2, offset=1,
    )  # fmt: skip
    assert _heads.kv_groups(*_shapes(2, 4, 2, 12))[0].kv_heads == 2  # the repeated path
    for check in ("causal", "gradients", "non-finite", "non-finite-gradients", "dropout"):
        conformance._RUNNERS[check](kernel, case, True)
