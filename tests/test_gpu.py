"""GPU kernels against the float64 oracle. Marked ``gpu``: skipped where CUDA is unavailable.

These have not yet run on hardware in this project's CI (no GPU there); see docs/index.md.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ringdilated
from ringdilated.core import Environment, Request
from ringdilated.functional import default_resolver
from ringdilated.testing import assert_within_tolerance, check_kernel, dense_attention, oracle

pytestmark = pytest.mark.gpu


def _cuda_dtypes() -> list[torch.dtype]:
    if not torch.cuda.is_available():
        return [torch.float32]
    dtypes = [torch.float32, torch.float16]
    if torch.cuda.get_device_capability() >= (8, 0):
        dtypes.append(torch.bfloat16)
    return dtypes


GPU_KERNELS = ["sdpa", "torch_flash", "cudnn", "flash", "flash3", "flash4", "xformers", "flex"]


def _skip_unless_fits(kernel: str, dtype: torch.dtype, gqa: bool = False) -> None:
    request = Request(
        "cuda", dtype, 16, Environment().capability(torch.device("cuda")), window=True, gqa=gqa
    )
    reasons = default_resolver().specs[kernel].reasons(request, Environment())
    if reasons:
        pytest.skip(f"{kernel} does not serve {request.describe()}: {'; '.join(reasons)}")


@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_gpu_kernel_conforms(kernel: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _skip_unless_fits(kernel, _cuda_dtypes()[-1])
    report = check_kernel(kernel, device="cuda", max_examples=25)
    assert "forward" in report.passed and "gradients" in report.passed


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("dtype", _cuda_dtypes())
@given(
    seq_len=st.integers(1, 80),
    causal=st.booleans(),
    mode=st.sampled_from(["head_groups", "longnet"]),
    gqa=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_gpu_kernel_matches_oracle(
    kernel: str, dtype: torch.dtype, seq_len: int, causal: bool, mode: str, gqa: bool, seed: int
) -> None:
    _skip_unless_fits(kernel, dtype, gqa)
    g = torch.Generator().manual_seed(seed)
    kv_heads = 2 if gqa else 4
    q = torch.randn(2, seq_len, 4, 16, generator=g).to("cuda", dtype).requires_grad_()
    k = torch.randn(2, seq_len, kv_heads, 16, generator=g).to("cuda", dtype).requires_grad_()
    v = torch.randn(2, seq_len, kv_heads, 16, generator=g).to("cuda", dtype).requires_grad_()
    kwargs = {"mode": mode, "causal": causal}
    out, lse = ringdilated.dilated_attention(
        q, k, v, [16, 32], [1, 2], **kwargs, kernel=kernel, return_lse=True
    )
    expected, expected_lse = oracle(q, k, v, [16, 32], [1, 2], **kwargs, return_lse=True)
    baseline, baseline_lse = dense_attention(q, k, v, [16, 32], [1, 2], **kwargs)
    assert_within_tolerance(out, expected, baseline, what="out")
    assert_within_tolerance(lse, expected_lse, baseline_lse, dtype=dtype, what="lse")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected_grads = torch.autograd.grad(expected, (q, k, v), dout.double())
    baseline_grads = torch.autograd.grad(baseline, (q, k, v), dout)
    for name, a, e, b in zip("qkv", grads, expected_grads, baseline_grads, strict=True):
        assert_within_tolerance(a, e, b, what=f"d{name}")
