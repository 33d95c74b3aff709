"""The main job: dilated attention on this machine, checked against the float64 oracle.

    python examples/quickstart.py            # about 10 s on 2 CPU cores

1. A small problem (L=1000, a partial last segment, GQA, causal, both modes) against the float64
   dense oracle: forward, lse and gradients, with the tolerance rule of docs/spec.md, section 4.
2. The resolver's plan for the default module, with the reasons behind it.
3. A long sequence (L=65536, H=8, D=64, segments [2048, 4096, 8192], rates [1, 2, 4]):
   forward time and GFLOP/s of the pattern's work.
"""

from __future__ import annotations

import time

import torch

import ringdilated
from ringdilated.testing import assert_within_tolerance, dense_attention, oracle


def check_against_oracle() -> None:
    torch.manual_seed(0)
    segments, rates = [128, 256, 512], [1, 2, 4]
    for mode in ("head_groups", "longnet"):
        q = torch.randn(1, 1000, 6, 32, requires_grad=True)
        k = torch.randn(1, 1000, 2, 32, requires_grad=True)
        v = torch.randn(1, 1000, 2, 32, requires_grad=True)
        out, lse = ringdilated.dilated_attention(
            q, k, v, segments, rates, mode=mode, causal=True, return_lse=True
        )
        expected, expected_lse = oracle(
            q, k, v, segments, rates, mode=mode, causal=True, return_lse=True
        )
        baseline, baseline_lse = dense_attention(q, k, v, segments, rates, mode=mode, causal=True)
        assert_within_tolerance(out, expected, baseline, what="out")
        assert_within_tolerance(lse, expected_lse, baseline_lse, what="lse")
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        expected_grads = torch.autograd.grad(expected, (q, k, v), dout.double())
        baseline_grads = torch.autograd.grad(baseline, (q, k, v), dout)
        for name, g, e, b in zip("qkv", grads, expected_grads, baseline_grads, strict=True):
            assert_within_tolerance(g, e, b, what=f"d{name}")
        error = float((out.detach().double() - expected.detach()).abs().max())
        print(
            f"oracle check ({mode}, causal, GQA 6/2, L=1000): "
            f"max |out - oracle| = {error:.2e}  PASS"
        )


def long_sequence() -> None:
    segments, rates = [2048, 4096, 8192], [1, 2, 4]
    attn = ringdilated.DilatedAttention(segments, rates)
    length = 65536
    q, k, v = (torch.randn(1, length, 8, 64) for _ in range(3))
    attn(q, k, v)
    assert attn.plan is not None  # chosen for the tensors of the call above
    print("\nplan of the module's call:\n" + attn.plan.explain())
    start = time.perf_counter()
    attn(q, k, v)
    seconds = time.perf_counter() - start
    flops = attn.pattern.flops(length, 8, 64)
    print(
        f"\nL={length}, H=8, D=64, float32 forward: {seconds:.3f} s, "
        f"{flops / seconds / 1e9:.0f} GFLOP/s of the pattern's work "
        f"({torch.get_num_threads()} threads)"
    )


if __name__ == "__main__":
    check_against_oracle()
    long_sequence()
