"""One call path: the call plan, kernels and communicators given as instances, transfer
statistics that belong to the call, and torch.compile around a sharded module."""

from __future__ import annotations

import math

import torch

import ringdilated
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.core import Resolver
from ringdilated.core.call.prepare import CallOptions, prepare_call
from ringdilated.functional import attend
from ringdilated.testing import oracle
from tests.distributed_harness import Workers


class Counting(ReferenceKernel):
    def __init__(self) -> None:
        self.calls = 0

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        self.calls += 1
        return super().forward(q, k, v, options)


def _qkv() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 24, 2, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def test_a_kernel_instance_is_used_as_it_is() -> None:
    kernel = Counting()
    q, k, v = _qkv()
    out = ringdilated.dilated_attention(q, k, v, [8], [1], causal=True, kernel=kernel)
    assert kernel.calls > 0
    assert torch.allclose(out, oracle(q, k, v, [8], [1], causal=True), atol=1e-12, rtol=0)
    attn = ringdilated.DilatedAttention([8], [1], kernel=kernel)
    attn(q, k, v)
    assert attn.plan is not None and attn.plan.kernel_name == "Counting instance"


def test_a_one_process_call_resolves_no_communicator() -> None:
    """A resolver that knows no communicator at all serves one-process calls."""
    q, k, v = _qkv()
    resolver = Resolver([REFERENCE_SPEC])
    out, _, plan = attend(
        ([8], [1]), q, k, v, causal=False, scale=None, dropout_p=0.0, kernel="reference",
        resolver=resolver,
    )  # fmt: skip
    assert plan is not None and plan.kernel.kernel_name == "reference"
    assert torch.allclose(out, oracle(q, k, v, [8], [1]), atol=1e-12, rtol=0)


def test_the_call_plan_resolves_the_scale_and_holds_no_shards_on_one_process() -> None:
    q, k, v = _qkv()
    plan = prepare_call(([8], [1]), q, k, v, CallOptions(), ringdilated.default_resolver())
    assert plan.scale == 1 / math.sqrt(8) and plan.shard is None and plan.communicator is None
    assert plan.pattern == ringdilated.DilationPattern([8], [1])


def test_transfer_stats_belong_to_the_call_and_instances_and_compile_work_sharded(
    workers2: Workers,
) -> None:
    for result in workers2.results("stats_and_instances", {}):
        first, second = result["sent"]
        assert first == second > 0, "each call counts its own bytes, forward and backward"
        assert first == result["minimum"], "a forward-only call sends the analytic minimum"
        assert max(result["errors"]) < 1e-12
