"""DilatedKVCache: appending tokens and attending them equals the full recomputation (the
float64 oracle over the whole sequence so far), and memory stays bounded by the pattern."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ringdilated import DilatedKVCache, MultiheadDilatedAttention
from ringdilated.testing import assert_within_tolerance, dense_attention, oracle
from tests.strategies import Case, cases


def _bound(case: Case) -> int:
    """Positions a cache may hold: every run of heads keeps at most one segment's selected
    positions, and there are at most H runs per pattern."""
    per_pattern = (
        -(-w // r) for w, r in zip(case.segment_lengths, case.dilation_rates, strict=True)
    )
    return sum(per_pattern) * case.num_heads


@pytest.mark.parametrize("kernel", ["sdpa", "reference"])
@given(case=cases(max_len=28), data=st.data())
def test_steps_equal_the_full_recomputation(kernel: str, case: Case, data: st.DataObject) -> None:
    q, k, v = case.tensors()
    cache = DilatedKVCache(
        case.segment_lengths,
        case.dilation_rates,
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        mode=case.mode,  # type: ignore[arg-type]
        causal=case.causal,
        scale=case.scale,
        kernel=kernel,
    )
    pattern = (case.segment_lengths, case.dilation_rates)
    t = 0
    while t < case.seq_len:
        m = data.draw(st.integers(1, min(6, case.seq_len - t)), label="tokens")
        out, lse = cache.attend(q[:, t : t + m], k[:, t : t + m], v[:, t : t + m], return_lse=True)
        step = (q[:, t : t + m], k[:, : t + m], v[:, : t + m])
        expected, expected_lse = oracle(*step, *pattern, **case.kwargs(), return_lse=True)
        base, _ = dense_attention(*step, *pattern, **case.kwargs())
        lse_dtype = torch.float32 if case.dtype == torch.float64 else case.dtype
        _, base_lse = dense_attention(*step, *pattern, **case.kwargs(), dtype=lse_dtype)
        assert out.dtype == case.dtype and lse.dtype == torch.float32
        assert_within_tolerance(out, expected, base, what=f"out of tokens [{t}, {t + m})")
        assert_within_tolerance(lse, expected_lse, base_lse, dtype=lse_dtype, what="lse")
        t += m
        assert cache.length == t
        assert cache.cached_positions <= _bound(case)


def test_memory_is_bounded_by_the_pattern_not_the_tokens() -> None:
    """head_groups keeps ceil((w_i - offset) / r_i) positions per pattern at most."""
    cache = DilatedKVCache([8, 16], [1, 4], num_heads=2, causal=True)
    g = torch.Generator().manual_seed(0)
    held = []
    for _ in range(100):
        x = torch.randn(1, 1, 2, 4, generator=g)
        cache.attend(x, x, x)
        held.append(cache.cached_positions)
    # Pattern 0 (w=8, r=1, offset 0): up to 7 kept (a full segment is dropped as the next one
    # starts); pattern 1 (w=16, r=4, offset 1): positions 1, 5, 9, 13 of a segment, up to 4.
    assert max(held) == 7 + 4
    assert held[-1] == 100 % 8 + len([p for p in range(96, 100) if (p % 16) % 4 == 1])
    assert cache.nbytes == held[-1] * 2 * 4 * 4  # keys and values, 1 head each, float32


def test_the_multihead_module_decodes_with_a_cache() -> None:
    """Prefill then token-by-token decoding through the module's cache equals the module on
    the whole sequence (causal), position by position."""
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(
        16, 4, segment_lengths=[4, 8], dilation_rates=[1, 2], num_kv_heads=2, causal=True,
        dtype=torch.float64,
    )  # fmt: skip
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    full, _ = m(x, x, x)
    cache = m.make_cache()
    steps = [m(x[:, :5], x[:, :5], x[:, :5], cache=cache)[0]]
    for t in range(5, 13):
        token = x[:, t : t + 1]
        steps.append(m(token, token, token, cache=cache)[0])
    assert float((torch.cat(steps, 1) - full).detach().abs().max()) < 1e-12


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c, x: c.attend(x[:, :2], x, x), "same new tokens"),
        (lambda c, x: c.attend(x.flatten(2), x, x), "must be a 4-D tensor"),
        (lambda c, x: c.attend(x.double(), x.double(), x.double()), "holds batch 1, head dim 4"),
    ],
)
def test_bad_steps_are_rejected(call, message) -> None:  # type: ignore[no-untyped-def]
    cache = DilatedKVCache([4], [1], num_heads=2)
    x = torch.randn(1, 3, 2, 4)
    cache.attend(x, x, x)
    with pytest.raises(ValueError, match=message):
        call(cache, x)


def test_the_greedy_decoding_example_decodes_what_recomputation_decodes() -> None:
    """examples/decode_greedy.py: cached and recomputed greedy decoding agree token for token."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[1] / "examples" / "decode_greedy.py"
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "identical: True" in done.stdout


def test_a_step_that_raises_leaves_the_cache_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of memory (simulated) in the second run of heads: the retry equals the oracle."""
    import ringdilated.cache as cache_module

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 9, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cache = DilatedKVCache([4, 8], [1, 2], num_heads=2, kernel="reference")
    cache.attend(q[:, :5], k[:, :5], v[:, :5])
    real, calls = cache_module.attend, []

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(cache_module, "attend", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        cache.attend(q[:, 5:7], k[:, 5:7], v[:, 5:7])
    assert cache.length == 5
    monkeypatch.setattr(cache_module, "attend", real)
    out = cache.attend(q[:, 5:7], k[:, 5:7], v[:, 5:7])
    expected = oracle(q[:, 5:7], k[:, :7], v[:, :7], [4, 8], [1, 2], causal=True)
    assert float((out - expected).abs().max()) < 1e-12


def test_after_a_long_prefill_the_cache_keeps_only_its_segments() -> None:
    """The kept keys are copies: a 4096-token prompt's storage is not held alive."""
    cache = DilatedKVCache([8, 16], [1, 4], num_heads=2, causal=True)
    x = torch.randn(1, 4099, 2, 4)
    cache.attend(x, x, x)
    assert cache.cached_positions == 3 + 1  # positions 4096-4098 of pattern 0; 4097 of pattern 1
    assert cache.nbytes == cache.cached_positions * 2 * 4 * 4  # keys and values, 1 head each
    held = [t for t in (*cache._keys, *cache._values) if t is not None]  # the storage itself
    assert sum(t.untyped_storage().nbytes() for t in held) == cache.nbytes


def test_a_longnet_step_whose_merge_raises_leaves_the_cache_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 8, 4, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cache = DilatedKVCache([4, 8], [1, 2], num_heads=4, mode="longnet", kernel="reference")
    cache.attend(q[:, :5], k[:, :5], v[:, :5])

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("out of memory (simulated)")

    with monkeypatch.context() as patch:
        patch.setattr(DilatedKVCache, "_merge", staticmethod(failing))
        with pytest.raises(RuntimeError, match="simulated"):
            cache.attend(q[:, 5:6], k[:, 5:6], v[:, 5:6])
    assert cache.length == 5
    out = cache.attend(q[:, 5:8], k[:, 5:8], v[:, 5:8])
    expected = oracle(q[:, 5:8], k, v, [4, 8], [1, 2], mode="longnet", causal=True)
    assert float((out - expected).abs().max()) < 1e-12
