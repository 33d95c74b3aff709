"""DilatedKVCache: appending tokens and attending them equals the full recomputation (the
float64 oracle over each row's whole sequence so far, padded prompt batches included), memory
stays bounded by the pattern, and a one-token step makes no host traffic and keeps the shapes,
strides and storage of everything it reads and writes (issue 20)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ringdilated import DilatedKVCache, DilatedTransformerBlock, MultiheadDilatedAttention
from ringdilated.rotary import rotary_embedding
from ringdilated.testing import assert_within_tolerance, dense_attention, oracle
from ringdilated.testing.hot_path import HotPathCounter
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
    # The buffers are fixed at the first call (issue 20: no allocation while decoding): per key
    # and value, 1 head each, the longest run's 8 slots plus one scratch slot, float32.
    assert cache.capacity == 8 + 4
    assert cache.nbytes == 2 * 2 * (8 + 1) * 4 * 4


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
    """The kept keys are copies in the cache's own fixed buffers: a 4096-token prompt's storage
    is not held alive."""
    cache = DilatedKVCache([8, 16], [1, 4], num_heads=2, causal=True)
    x = torch.randn(1, 4099, 2, 4)
    cache.attend(x, x, x)
    assert cache.cached_positions == 3 + 1  # positions 4096-4098 of pattern 0; 4097 of pattern 1
    assert cache.nbytes == 2 * 2 * (8 + 1) * 4 * 4  # the buffers, whatever the prompt
    held = [cache._keys, cache._values]  # the storage itself
    assert all(t is not None and t.untyped_storage().nbytes() * 2 == cache.nbytes for t in held)
    assert all(t is not None and t.untyped_storage().data_ptr() != x.data_ptr() for t in held)


def test_a_longnet_step_whose_merge_raises_leaves_the_cache_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 8, 4, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cache = DilatedKVCache([4, 8], [1, 2], num_heads=4, mode="longnet", kernel="reference")
    cache.attend(q[:, :5], k[:, :5], v[:, :5])

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("out of memory (simulated)")

    # A step of several tokens merges the runs on the host (one token runs on the device, below).
    with monkeypatch.context() as patch:
        patch.setattr(DilatedKVCache, "_merge", staticmethod(failing))
        with pytest.raises(RuntimeError, match="simulated"):
            cache.attend(q[:, 5:7], k[:, 5:7], v[:, 5:7])
    assert cache.length == 5
    out = cache.attend(q[:, 5:8], k[:, 5:8], v[:, 5:8])
    expected = oracle(q[:, 5:8], k, v, [4, 8], [1, 2], mode="longnet", causal=True)
    assert float((out - expected).abs().max()) < 1e-12


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_a_one_token_step_that_raises_leaves_the_cache_as_it_was(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device step writes its token's slot before attending; if it raises after that, the
    slot is one no query sees before the same position is written again."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 12, 4, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cache = DilatedKVCache([4, 8], [1, 2], num_heads=4, mode=mode, kernel="reference")
    cache.attend(q[:, :5], k[:, :5], v[:, :5])
    cache.attend(q[:, 5:6], k[:, 5:6], v[:, 5:6])

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("out of memory (simulated)")

    with monkeypatch.context() as patch:
        patch.setattr(torch, "softmax", failing)
        with pytest.raises(RuntimeError, match="simulated"):
            cache.attend(q[:, 6:7] + 100, k[:, 6:7] + 100, v[:, 6:7] + 100)  # other tokens
    assert cache.length == 6 and cache.positions is not None
    assert cache.positions.tolist() == [6, 6]
    for t in range(6, 12):
        out = cache.attend(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
        expected = oracle(q[:, t : t + 1], k[:, : t + 1], v[:, : t + 1], [4, 8], [1, 2],
                          mode=mode, causal=True)  # fmt: skip
        assert float((out - expected).abs().max()) < 1e-12


# -- issue 20: decoding on the device, padded prompt batches ------------------------------------

_LSE = {"rtol": 1e-6, "atol": 1e-6}


def _assert_step(
    out: torch.Tensor,
    lse: torch.Tensor,
    expected: torch.Tensor,
    expected_lse: torch.Tensor,
    what: str,
) -> None:
    """float64 ``out`` to 1e-12; float32 ``lse`` to float32 precision, ``-inf`` exactly where
    the oracle has it."""
    assert float((out - expected).abs().max()) < 1e-12, what
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse)), what
    torch.testing.assert_close(
        lse.double().masked_fill(torch.isneginf(lse), 0),
        expected_lse.masked_fill(torch.isneginf(expected_lse), 0),
        **_LSE,
        msg=what,
    )


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    ("segments", "rates", "heads", "kv_heads"),
    [
        ([4, 6, 8], [1, 2, 4], 6, 3),  # rates > 1 with offsets, GQA
        ([5, 10], [2, 3], 4, 1),  # one key/value head, segments not multiples of the rates
        ([3], [1], 2, 2),  # dense segments
        ([8, 16], [1, 4], 5, 5),  # head groups of unequal sizes
    ],
)
def test_one_token_steps_equal_the_oracle_across_segment_boundaries(
    mode: str, causal: bool, segments: list[int], rates: list[int], heads: int, kv_heads: int
) -> None:
    """Prefill (7 tokens), chunks of 2 and 3, then one token at a time across several segment
    boundaries of every pattern: out and lse equal the last rows of the oracle over the whole
    sequence so far."""
    g = torch.Generator().manual_seed(11)
    length = 40
    q = torch.randn(2, length, heads, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, length, kv_heads, 4, generator=g, dtype=torch.float64) for _ in "kv")
    cache = DilatedKVCache(segments, rates, num_heads=heads, num_kv_heads=kv_heads, mode=mode,
                           causal=causal, kernel="reference")  # fmt: skip
    steps = [7, 2, 3] + [1] * (length - 12)
    t = 0
    for m in steps:
        out, lse = cache.attend(q[:, t : t + m], k[:, t : t + m], v[:, t : t + m], True)
        step = (q[:, t : t + m], k[:, : t + m], v[:, : t + m], segments, rates)
        expected, expected_lse = oracle(*step, mode=mode, causal=causal, return_lse=True)
        _assert_step(out, lse, expected, expected_lse, f"tokens [{t}, {t + m})")
        t += m
        assert cache.lengths == (t, t)


def _padded_batch(
    runs: list[tuple[int, int]], prompt: int, decoded: int, heads: int, kv_heads: int, seed: int
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
    """A padded prompt batch (row ``b`` valid on ``runs[b]``), its mask, and ``decoded`` more
    tokens per row: ``(mask, rows, (q, k, v) of the prompt)``, ``rows[b]`` the row's own
    unpadded ``(q, k, v)`` over the prompt and the decoded tokens (the prompt's padded columns
    are filled with NaN: nothing may read them)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(runs)
    shapes = [(batch, prompt + decoded, h, 4) for h in (heads, kv_heads, kv_heads)]
    full = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    p = torch.arange(prompt)
    mask = torch.stack([(p < s) | (p >= e) for s, e in runs])
    prompt_qkv = tuple(x[:, :prompt].masked_fill(mask[:, :, None, None], float("nan"))
                       for x in full)  # fmt: skip
    rows = [
        tuple(torch.cat([x[b : b + 1, s:e], x[b : b + 1, prompt:]], 1) for x in full)
        for b, (s, e) in enumerate(runs)
    ]
    return mask, rows, prompt_qkv


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_padded_prompt_batch_decodes_each_row_at_its_own_position(
    mode: str, causal: bool
) -> None:
    """Right padding, left padding, both, a full row, an empty row and a one-token row: after a
    prefill with ``key_padding_mask`` each row decodes at its own position (one token at a time
    and in chunks), each equal to the oracle over that row's own unpadded sequence."""
    segments, rates, heads, kv_heads = [4, 6, 8], [1, 2, 4], 6, 3
    runs = [(0, 9), (3, 12), (2, 7), (0, 12), (0, 0), (11, 12)]
    prompt, steps = 12, [1] * 9 + [3] + [1] * 5 + [2]
    mask, rows, (q, k, v) = _padded_batch(runs, prompt, sum(steps), heads, kv_heads, seed=2)
    cache = DilatedKVCache(segments, rates, num_heads=heads, num_kv_heads=kv_heads, mode=mode,
                           causal=causal, kernel="reference")  # fmt: skip
    kw: dict[str, Any] = {"mode": mode, "causal": causal, "return_lse": True}
    out, lse = cache.attend(q, k, v, True, key_padding_mask=mask)
    for b, (s, e) in enumerate(runs):
        assert not out[b][mask[b]].any() and torch.isneginf(lse[b][:, mask[b]]).all()
        if e > s:
            rq, rk, rv = (x[:, : e - s] for x in rows[b])
            expected, expected_lse = oracle(rq, rk, rv, segments, rates, **kw)
            _assert_step(out[b : b + 1, s:e], lse[b : b + 1, :, s:e], expected, expected_lse,
                         f"prompt of row {b}")  # fmt: skip
    lengths = [e - s for s, e in runs]
    assert cache.lengths == tuple(lengths) and cache.length == max(lengths)
    done = 0
    for m in steps:
        new = [torch.cat([r[i][:, n + done : n + done + m] for r, n in zip(rows, lengths,
               strict=True)]) for i in range(3)]  # fmt: skip
        out, lse = cache.attend(*new, True)
        done += m
        for b, n in enumerate(lengths):
            rq, rk, rv = (x[:, : n + done] for x in rows[b])
            expected, expected_lse = oracle(rq[:, -m:], rk, rv, segments, rates, **kw)
            _assert_step(out[b : b + 1], lse[b : b + 1], expected, expected_lse,
                         f"row {b}, tokens [{n + done - m}, {n + done})")  # fmt: skip
        assert cache.lengths == tuple(n + done for n in lengths)


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_the_block_with_rotary_decodes_a_padded_batch_like_each_row_alone(mode: str) -> None:
    """Rotary positions come from each row's own position on the device: a padded prompt batch
    decoded through ``DilatedTransformerBlock(rotary=)`` (single tokens and a chunk) equals the
    block run on each row's own unpadded sequence."""
    torch.manual_seed(0)
    block = DilatedTransformerBlock(24, 6, segment_lengths=[4, 6, 8], dilation_rates=[1, 2, 4],
                                    num_kv_heads=3, mode=mode, causal=True, dtype=torch.float64,
                                    rotary=rotary_embedding).eval()  # fmt: skip
    runs, prompt, decoded = [(0, 7), (4, 12), (0, 0), (5, 6)], 12, 10
    g = torch.Generator().manual_seed(4)
    x = torch.randn(len(runs), prompt + decoded, 24, generator=g, dtype=torch.float64)
    p = torch.arange(prompt)
    mask = torch.stack([(p < s) | (p >= e) for s, e in runs])
    cache = block.make_cache()
    with torch.no_grad():
        first = block(x[:, :prompt], cache=cache, key_padding_mask=mask)
        outs, t = [], prompt
        for m in [1, 1, 1, 1, 3, 1, 1, 1]:  # a chunk of 3 too: rotary positions of each row
            outs.append(block(x[:, t : t + m], cache=cache))
            t += m
        assert t == prompt + decoded
        for b, (s, e) in enumerate(runs):
            alone = block(torch.cat([x[b : b + 1, s:e], x[b : b + 1, prompt:]], 1))
            got = torch.cat([first[b : b + 1, s:e], *(o[b : b + 1] for o in outs)], 1)
            assert float((got - alone).abs().max()) < 1e-12, b


def test_reset_keeps_the_buffers_and_starts_over() -> None:
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 20, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cache = DilatedKVCache([4, 8], [1, 2], num_heads=2, kernel="reference")
    cache.attend(q[:, :9], k[:, :9], v[:, :9])
    cache.attend(q[:, 9:10], k[:, 9:10], v[:, 9:10])
    storage = [
        t.untyped_storage().data_ptr() for t in (cache._keys, cache._values) if t is not None
    ]
    cache.reset()
    assert cache.length == 0 and cache.lengths == ()
    for t in range(0, 20):  # a new sequence from one token: its stale slots are never seen
        out = cache.attend(q[:, t : t + 1] * 2, k[:, t : t + 1] * 2, v[:, t : t + 1])
        expected = oracle(q[:, t : t + 1] * 2, k[:, : t + 1] * 2, v[:, : t + 1], [4, 8], [1, 2],
                          causal=True)  # fmt: skip
        assert float((out - expected).abs().max()) < 1e-12, t
    assert storage == [t.untyped_storage().data_ptr() for t in (cache._keys, cache._values)
                       if t is not None]  # fmt: skip


def test_padding_after_the_prompt_and_packed_documents_are_rejected() -> None:
    cache = DilatedKVCache([4], [1], num_heads=2)
    x = torch.randn(2, 3, 2, 4)
    cache.attend(x, x, x, key_padding_mask=torch.tensor([[False] * 3, [True, False, False]]))
    with pytest.raises(ValueError, match=r"first call only .* positions \(3, 2\)"):
        cache.attend(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="contiguous"):
        DilatedKVCache([4], [1], num_heads=2).attend(
            x, x, x, key_padding_mask=torch.tensor([[False, True, False], [False] * 3])
        )
    m = MultiheadDilatedAttention(8, 2, segment_lengths=[4], dilation_rates=[1], causal=True)
    y = torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match="cu_seqlens=None"):
        m(y, y, y, cache=m.make_cache(), cu_seqlens=torch.tensor([0, 1, 3]))


# -- no host traffic, fixed shapes -------------------------------------------------------------


def _zero_traffic(step: Callable[[], object]) -> None:
    with HotPathCounter() as counts:
        step()
    assert counts.host_traffic == 0, counts.events


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_a_one_token_step_makes_no_host_traffic(mode: str) -> None:
    """Through the cache (with and without lse), the module with rotary embeddings, and the
    block; rows at different positions (a padded prompt) included."""
    kw: dict[str, Any] = {"segment_lengths": [4, 6, 8], "dilation_rates": [1, 2, 4],
                          "mode": mode, "causal": True}  # fmt: skip
    g = torch.Generator().manual_seed(8)
    cache = DilatedKVCache(kw["segment_lengths"], kw["dilation_rates"], num_heads=6,
                           num_kv_heads=3, mode=mode)  # fmt: skip
    q, k, v = torch.randn(2, 9, 6, 4, generator=g), *torch.randn(2, 2, 9, 3, 4, generator=g)
    mask = torch.tensor([[False] * 9, [True] * 4 + [False] * 5])
    cache.attend(q, k, v, key_padding_mask=mask)
    token = (q[:, :1], k[:, :1], v[:, :1])
    cache.attend(*token)
    _zero_traffic(lambda: cache.attend(*token))
    _zero_traffic(lambda: cache.attend(*token, return_lse=True))

    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(24, 6, num_kv_heads=3, rotary=rotary_embedding, **kw)
    block = DilatedTransformerBlock(24, 6, rotary=rotary_embedding, **kw)
    x = torch.randn(2, 9, 24, generator=g)
    steps: list[tuple[Any, Callable[..., torch.Tensor]]] = [
        (mha, lambda y, c, **kw: mha(y, y, y, cache=c, **kw)[0]),
        (block, lambda y, c, **kw: block(y, cache=c, **kw)),
    ]
    for module, call in steps:
        c = module.make_cache()
        with torch.no_grad():
            call(x, c, key_padding_mask=mask)  # the prompt, planned on the host
            call(x[:, :1], c)
            _zero_traffic(lambda c=c, call=call: call(x[:, 1:2], c))
        # And with autograd recording (decoding under grad is allowed, if unusual).
        _zero_traffic(lambda c=c, call=call: call(x[:, 2:3], c))


class _Trace(TorchDispatchMode):
    """Every aten op of a step: its name and, per tensor argument, shape, strides, dtype, and
    the storage when it is one of ``persistent`` (``None`` for tensors made during the step)."""

    def __init__(self, persistent: set[int]) -> None:
        super().__init__()
        self.persistent = persistent
        self.ops: list[tuple[object, ...]] = []
        self.written: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        described = []
        for x in tree_leaves((args, kwargs)):
            if isinstance(x, torch.Tensor):
                ptr = x.untyped_storage().data_ptr()
                known = ptr if ptr in self.persistent else None
                described.append((tuple(x.shape), x.stride(), x.dtype, known))
        for argument, x in zip(func._schema.arguments, args, strict=False):
            if argument.alias_info is not None and argument.alias_info.is_write:
                self.written.add(x.untyped_storage().data_ptr())
        self.ops.append((str(func), tuple(described)))
        return func(*args, **kwargs)


def _storages(*objects: object) -> set[int]:
    found: set[int] = set()
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            found |= {p.untyped_storage().data_ptr() for p in obj.parameters()}
        elif isinstance(obj, DilatedKVCache):
            tensors = [obj._keys, obj._values, obj._positions]
            if obj._tables is not None:
                tensors += [x for x in attrs.astuple(obj._tables, recurse=False) if x is not None]
            found |= {t.untyped_storage().data_ptr() for t in tensors if t is not None}
    return found


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_steps_repeat_the_same_ops_on_the_same_tensors(mode: str) -> None:
    """What CUDA-graph capture needs: consecutive one-token steps (across a segment boundary,
    rows at different positions) run the same aten ops on tensors of the same shapes, strides
    and dtypes, read and write the same persistent storage (the cache's buffers, positions and
    tables, the parameters), and write nothing else that outlives the step."""
    torch.manual_seed(0)
    block = DilatedTransformerBlock(24, 6, segment_lengths=[4, 6, 8], dilation_rates=[1, 2, 4],
                                    num_kv_heads=3, mode=mode, causal=True,
                                    rotary=rotary_embedding).eval()  # fmt: skip
    cache = block.make_cache()
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 9, 24, generator=g)
    mask = torch.tensor([[False] * 9, [True] * 2 + [False] * 7])
    with torch.no_grad():
        block(x, cache=cache, key_padding_mask=mask)
        block(x[:, :1], cache=cache)
        persistent = _storages(block, cache)
        traces = []
        for t in range(1, 9):  # positions 10-17 and 8-15: every pattern's boundary crossed
            with _Trace(persistent) as trace:
                block(x[:, t : t + 1], cache=cache)
            traces.append(trace)
    held = (cache._keys, cache._values, cache._positions)
    state = {t.untyped_storage().data_ptr() for t in held if t is not None}
    for trace in traces:
        assert trace.ops == traces[0].ops
        # In place, a step writes the keys, values and positions, and no other lasting tensor.
        assert trace.written & persistent == state


def test_a_non_finite_value_reaches_only_its_own_runs_and_their_next_segment() -> None:
    """docs/spec.md section 4 for the device step. A NaN value at position 10 (selected by
    head 0's pattern, w=4 r=1, not by head 1's, w=8 r=2 offset 1): head 1 stays exact (the
    token went to its scratch slot as 0); head 0 is NaN where the exact math is (10, 11), exact
    again once slot 2 is overwritten (14 on), and may be NaN in between (12, 13: a hidden slot
    of its buffer still holds the value, as a fused kernel's masked key can)."""
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 20, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    v[0, 10] = float("nan")
    cache = DilatedKVCache([4, 8], [1, 2], num_heads=2, kernel="reference")
    cache.attend(q[:, :6], k[:, :6], v[:, :6])
    for t in range(6, 20):
        out = cache.attend(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])[0, 0]
        expected = oracle(q[:, t : t + 1], k[:, : t + 1], v[:, : t + 1], [4, 8], [1, 2],
                          causal=True)[0, 0]  # fmt: skip
        assert float((out[1] - expected[1]).abs().max()) < 1e-12, t
        if t in (10, 11):
            assert expected[0].isnan().all() and out[0].isnan().all(), t
        elif t not in (12, 13):
            assert float((out[0] - expected[0]).abs().max()) < 1e-12, t


def test_a_longnet_chunk_step_has_exact_gradients() -> None:
    """A step of several tokens merges its runs through their lse: gradients flow through it
    (a review found them dropped when the lse came back without a gradient)."""
    torch.manual_seed(0)
    heads, dim = 4, 8
    cache = DilatedKVCache([4, 8], [1, 2], num_heads=heads, mode="longnet")
    q, k, v = (
        torch.randn(1, 12, heads, dim, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    cache.attend(q[:, :7], k[:, :7], v[:, :7])
    out = cache.attend(q[:, 7:10], k[:, 7:10], v[:, 7:10])
    expected = oracle(q[:, :10], k[:, :10], v[:, :10], [4, 8], [1, 2], mode="longnet", causal=True)[
        :, 7:10
    ]
    assert float((out - expected).detach().abs().max()) < 1e-12
    for a, e in zip(
        torch.autograd.grad(out.sum(), (q, k, v)),
        torch.autograd.grad(expected.sum(), (q, k, v)),
        strict=True,
    ):
        assert float((a - e).abs().max()) < 1e-12


def test_a_longnet_chunk_step_keeps_a_non_finite_lse_non_finite() -> None:
    """The runs' lse are merged by log-sum-exp: a NaN there stays NaN, never -inf (which would
    say "no key" and let a later merge weight the row by zero)."""
    heads, dim = 4, 8
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 12, heads, dim, generator=g, dtype=torch.float64) for _ in range(3))
    k[0, 8, 1, 3] = float("nan")
    cache = DilatedKVCache([4, 8], [1, 2], num_heads=heads, mode="longnet")
    cache.attend(q[:, :7], k[:, :7], v[:, :7])
    _, lse = cache.attend(q[:, 7:10], k[:, 7:10], v[:, 7:10], return_lse=True)
    _, expected = oracle(
        q[:, :10], k[:, :10], v[:, :10], [4, 8], [1, 2], mode="longnet", causal=True,
        return_lse=True,
    )  # fmt: skip
    expected = expected[..., 7:]
    assert bool(torch.isnan(expected).any()), "the case holds a NaN lse"
    assert not bool((torch.isnan(expected) & torch.isneginf(lse)).any())
    assert bool(torch.isnan(lse[torch.isnan(expected)]).all())


# -- a cache fits its module, and only its module (issue 21) ------------------------------------


def _module(**kw: Any) -> MultiheadDilatedAttention:
    torch.manual_seed(0)
    args: dict[str, Any] = {"segment_lengths": [4, 8], "dilation_rates": [1, 2],
                            "num_kv_heads": 2, "causal": True, "dtype": torch.float64}  # fmt: skip
    return MultiheadDilatedAttention(16, 4, **{**args, **kw}).eval()


def _counted(module: torch.nn.Module) -> list[int]:
    """Calls of ``module``'s forward from now on (a list that grows by one per call)."""
    calls: list[int] = []
    module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"segment_lengths": [8], "dilation_rates": [1]},
         r"segment_lengths: the cache's \(8,\), the module's \(4, 8\); dilation_rates: the "
         r"cache's \(1,\), the module's \(1, 2\)"),
        ({"mode": "longnet"}, "mode: the cache's 'longnet', the module's 'head_groups'"),
        ({"causal": False}, "causal: the cache's False, the module's True"),
        ({"scale": 0.25}, "scale: the cache's 0.25, the module's 0.5"),
        ({"num_kv_heads": 4}, "num_kv_heads: the cache's 4, the module's 2"),
    ],
)  # fmt: skip
def test_a_module_refuses_a_cache_made_for_another_configuration(
    changed: dict[str, Any], message: str
) -> None:
    """Issue 21, item 2: such a cache gave outputs off by 3.9 (another pattern) or 3.2 (not
    causal). Now each differing field is named with both values, before any work (the
    projections never run) and with the cache untouched."""
    m = _module()
    config: dict[str, Any] = {"segment_lengths": [4, 8], "dilation_rates": [1, 2],
                              "num_heads": 4, "num_kv_heads": 2, "causal": True}  # fmt: skip
    config.update(changed)
    cache = DilatedKVCache(config.pop("segment_lengths"), config.pop("dilation_rates"), **config)
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    calls = _counted(m.q_proj)
    with pytest.raises(ValueError, match=f"does not fit MultiheadDilatedAttention.*{message}"):
        m(x, x, x, cache=cache)
    assert calls == [] and cache.positions is None and cache.owner is None


def test_a_module_refuses_a_cache_holding_another_head_dim_dtype_or_device() -> None:
    """A sequence's head dim, dtype and device, compared before the projections; a module on
    another device (meta, here) is refused before it computes anything."""
    cache = DilatedKVCache([4, 8], [1, 2], num_heads=4, num_kv_heads=2)
    y = torch.randn(1, 5, 4, 8)
    cache.attend(y, y[:, :, :2], y[:, :, :2])  # head dim 8, float32, on the CPU
    for m, field in (
        (_module(), "head_dim: the cache's 8, the module's 4; dtype: the cache's "
                    r"torch.float32, the module's torch.float64 \(.*reset\(\)"),
        (_module(device="meta", dtype=torch.float32), "device: the cache's cpu, the module's meta"),
    ):  # fmt: skip
        calls = _counted(m.q_proj)
        x = torch.randn(1, 1, 16, dtype=m.dtype, device=m.q_proj.weight.device)
        with pytest.raises(ValueError, match=field):
            m(x, x, x, cache=cache)
        assert calls == [] and cache.lengths == (5,) and cache.owner is None


def test_a_hand_built_cache_of_the_module_s_configuration_serves_it() -> None:
    """Fitting compares the effective scale: ``scale=head_dim ** -0.5`` is the module's
    ``None``. Decoded through the module, it equals the module on the whole sequence."""
    m = _module()
    cache = DilatedKVCache([4, 8], [1, 2], num_heads=4, num_kv_heads=2, scale=0.5)
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    with torch.no_grad():
        full = m(x, x, x)[0]
        steps = [m(x[:, :6], x[:, :6], x[:, :6], cache=cache)[0]]
        steps += [m(*(x[:, t : t + 1],) * 3, cache=cache)[0] for t in range(6, 11)]
    assert cache.owner is m
    assert float((torch.cat(steps, 1) - full).abs().max()) < 1e-12


def _state(cache: DilatedKVCache) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor]:
    """A copy of what the cache holds: its rows' lengths, keys and values."""
    assert cache._keys is not None and cache._values is not None
    return cache.lengths, cache._keys.clone(), cache._values.clone()


def test_swapped_per_layer_caches_are_refused_naming_their_owner() -> None:
    """Two blocks of identical configuration: passing one's cache to the other (before or
    after a reset) raises, naming the owner so that ``named_modules()`` finds it, and changes
    neither cache; decoding in the right order then equals the blocks on the whole sequence.
    A hand-built cache belongs to the first module it is passed to."""
    torch.manual_seed(0)
    kw: dict[str, Any] = {"segment_lengths": [4, 8], "dilation_rates": [1, 2], "causal": True,
                          "dtype": torch.float64}  # fmt: skip
    model = torch.nn.Sequential(*(DilatedTransformerBlock(16, 4, **kw) for _ in range(2))).eval()
    caches = [block.make_cache() for block in model]
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    with torch.no_grad():
        full = model(x)
        h = x[:, :7]
        outs = []
        for block, cache in zip(model, caches, strict=True):
            h = block(h, cache=cache)
        outs.append(h)
        kept = [_state(c) for c in caches]
        calls = _counted(model[0].attn_norm)
        owner = f"belongs to another module, MultiheadDilatedAttention at {id(model[1].attn):#x}"
        with pytest.raises(ValueError, match=owner) as error:
            model[0](x[:, 7:8], cache=caches[1])
        hint = str(error.value).split("swapped? ")[1].split(" names it")[0]
        assert eval(hint, {"model": model}) == ["1.attn"]
        assert calls == []
        for cache, state in zip(caches, kept, strict=True):
            assert cache.lengths == state[0] and all(map(torch.equal, _state(cache)[1:], state[1:]))
        for t in range(7, 12):
            h = x[:, t : t + 1]
            for block, cache in zip(model, caches, strict=True):
                h = block(h, cache=cache)
            outs.append(h)
        assert float((torch.cat(outs, 1) - full).abs().max()) < 1e-12
        caches[0].reset()  # the owner stays
        with pytest.raises(ValueError, match="belongs to another module"):
            model[1](x[:, :3], cache=caches[0])
        mine = DilatedKVCache([4, 8], [1, 2], num_heads=4)
        model[1](x[:, :3], cache=mine)
        assert mine.owner is model[1].attn
        with pytest.raises(ValueError, match="belongs to another module"):
            model[0](x[:, 3:4], cache=mine)


def test_a_block_checks_its_cache_once_per_step_and_a_swap_after_the_check_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode step through a block checks the cache once (before the norm), not again in
    its attention; the skip holds only for the very objects checked: a forward pre-hook on
    the attention that swaps in another block's cache is still refused, and the skip ends with
    the step (a failed step leaves nothing behind)."""
    kw: dict[str, Any] = {"segment_lengths": [4, 8], "dilation_rates": [1, 2], "causal": True,
                          "dtype": torch.float64}  # fmt: skip
    blocks = [DilatedTransformerBlock(16, 4, **kw).eval() for _ in range(2)]
    caches = [b.make_cache() for b in blocks]
    checks: list[object] = []
    real = MultiheadDilatedAttention._check_cache

    def counted(self: MultiheadDilatedAttention, cache: object, *args: object) -> None:
        checks.append(cache)
        real(self, cache, *args)

    monkeypatch.setattr(MultiheadDilatedAttention, "_check_cache", counted)
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    with torch.no_grad():
        blocks[0](x[:, :5], cache=caches[0])
        blocks[0](x[:, 5:6], cache=caches[0])
        assert checks == [caches[0]] * 2
        assert blocks[0].attn._checked_call == ()
        handle = blocks[0].attn.register_forward_pre_hook(
            lambda m, args, kwargs: (args, {**kwargs, "cache": caches[1]}), with_kwargs=True
        )
        with pytest.raises(ValueError, match="belongs to another module"):
            blocks[0](x[:, 5:6], cache=caches[0])
        handle.remove()
        assert checks[2:] == [caches[0], caches[1]]
        assert blocks[0].attn._checked_call == ()


def test_a_cache_whose_module_no_longer_exists_is_refused() -> None:
    """Its buffers may hold a deleted module's keys: refused, not adopted."""
    import gc

    cache = _module().make_cache()
    gc.collect()
    assert cache.owner is None
    x = torch.randn(1, 3, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="belongs to a module that no longer exists, Multihead"):
        _module()(x, x, x, cache=cache)


def test_a_module_in_training_mode_with_dropout_refuses_a_cache() -> None:
    """Issue 21, item 7: the cache drops no attention probability, so a module whose dropout
    applies (training mode, dropout > 0) refuses it before any work; in eval mode it decodes
    what the module computes on the whole sequence."""
    m = _module(dropout=0.1).train()
    block = DilatedTransformerBlock(16, 4, segment_lengths=[4, 8], dilation_rates=[1, 2],
                                    causal=True, dropout=0.1, dtype=torch.float64)  # fmt: skip
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    calls = _counted(m.q_proj), _counted(block.attn_norm)
    caches = m.make_cache(), block.make_cache()
    with pytest.raises(ValueError, match=r"training mode with dropout=0\.1.*call \.eval\(\)"):
        m(x, x, x, cache=caches[0])
    with pytest.raises(ValueError, match=r"training mode with dropout=0\.1.*call \.eval\(\)"):
        block(x, cache=caches[1])
    assert calls == ([], []) and caches[0].positions is None and caches[1].positions is None
    m.eval()
    cache = m.make_cache()
    with torch.no_grad():
        steps = [m(x[:, :5], x[:, :5], x[:, :5], cache=cache)[0]]
        steps += [m(*(x[:, t : t + 1],) * 3, cache=cache)[0] for t in range(5, 9)]
        assert float((torch.cat(steps, 1) - m(x, x, x)[0]).abs().max()) < 1e-12


def test_an_unknown_kernel_is_rejected_on_construction() -> None:
    """Issue 21, item 9: not at the first attend, and naming the valid kernels."""
    with pytest.raises(ValueError, match=r"unknown kernel 'nonsense'; known kernels: .*reference"):
        DilatedKVCache([4], [1], num_heads=2, kernel="nonsense")
    with pytest.raises(TypeError, match="kernel must be 'auto'"):
        DilatedKVCache([4], [1], num_heads=2, kernel=3)  # type: ignore[arg-type]


class _Tag(torch.autograd.Function):
    """The identity, whose graph node holds ``tag``: alive exactly while the graph is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tag: object) -> torch.Tensor:
        ctx.tag = tag
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def test_decoding_under_autograd_keeps_the_graph_until_reset() -> None:
    """Issue 21, item 9 (the documented behaviour): under autograd the buffers hold every
    step's graph (a step's keys with what they were computed from), under ``torch.no_grad()``
    none; ``reset()`` releases it (it used to zero the buffers in place, which kept it)."""
    import gc
    import weakref

    class Marker:
        pass

    cache = DilatedKVCache([4, 8], [1, 2], num_heads=2)
    leaf = torch.randn(1, 6, 2, 4, requires_grad=True)
    tags = [Marker() for _ in range(4)]  # the prompt's, then each step's
    alive = [weakref.ref(t) for t in tags]
    x = _Tag.apply(leaf[:, :3], tags[0])
    cache.attend(x, x, x)
    for t in range(3, 6):
        x = _Tag.apply(leaf[:, t : t + 1], tags[t - 2])
        cache.attend(x, x, x)  # the output is dropped: only the buffers hold the graph
    del tags, x
    gc.collect()
    assert all(r() is not None for r in alive)
    cache.reset()
    gc.collect()
    assert all(r() is None for r in alive)
    with torch.no_grad():
        cache.attend(leaf[:, :3], leaf[:, :3], leaf[:, :3])
        cache.attend(leaf[:, 3:4], leaf[:, 3:4], leaf[:, 3:4])
    assert cache._keys is not None and not cache._keys.requires_grad


def test_a_saved_or_copied_cache_keeps_its_sequence_and_no_owner() -> None:
    """A review found a bound cache could not be pickled (its owner is a weak reference) and a
    deep-copied model refused its own copied caches as another module's. A copy or a loaded
    cache keeps every buffer; a loaded one belongs to the first module it is passed to, one
    copied with its module to the module's copy."""
    import copy
    import io

    torch.manual_seed(0)
    module = MultiheadDilatedAttention(
        16, 2, segment_lengths=[4, 8], dilation_rates=[1, 2], causal=True, dtype=torch.float64
    )
    cache = module.make_cache()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    with torch.no_grad():
        module(x, x, x, cache=cache)
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    model_copy, cache_copy = copy.deepcopy((module, cache))
    step = torch.randn(1, 1, 16, dtype=torch.float64)
    with torch.no_grad():
        expected = module(step, step, step, cache=cache)[0]
        from_loaded = module(step, step, step, cache=loaded)[0]  # its first module: this one
        from_copy = model_copy(step, step, step, cache=cache_copy)[0]
    assert loaded.owner is module and cache_copy.owner is model_copy
    assert torch.equal(from_loaded, expected) and torch.equal(from_copy, expected)


def _decoded_blocks() -> tuple[torch.nn.Sequential, list[DilatedKVCache], torch.Tensor]:
    """Two blocks of identical configuration, each with its own cache holding 7 tokens."""
    torch.manual_seed(0)
    kw: dict[str, Any] = {"segment_lengths": [4, 8], "dilation_rates": [1, 2], "causal": True,
                          "dtype": torch.float64}  # fmt: skip
    model = torch.nn.Sequential(*(DilatedTransformerBlock(16, 4, **kw) for _ in range(2))).eval()
    caches = [block.make_cache() for block in model]
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    with torch.no_grad():
        h = x[:, :7]
        for block, cache in zip(model, caches, strict=True):
            h = block(h, cache=cache)
    return model, caches, x


def test_caches_deep_copied_with_their_model_belong_to_its_copies_and_swaps_are_refused() -> None:
    """A review found ``copy.deepcopy((model, caches))`` dropped each cache's owner, so the
    first copied module a copy reached adopted it and swapped copies passed. Each copy belongs
    to its module's copy: swapped, they are refused naming it; in order, they decode as the
    originals do."""
    import copy

    model, caches, x = _decoded_blocks()
    model2, caches2 = copy.deepcopy((model, caches))
    assert [c.owner for c in caches2] == [block.attn for block in model2]
    with torch.no_grad():
        owner = f"belongs to another module, MultiheadDilatedAttention at {id(model2[1].attn):#x}"
        with pytest.raises(ValueError, match=owner):
            model2[0](x[:, 7:8], cache=caches2[1])
        with pytest.raises(ValueError, match="belongs to another module"):
            model2[1](x[:, 7:8], cache=caches2[0])
        h, h2 = x[:, 7:8], x[:, 7:8]
        for block, cache, block2, cache2 in zip(model, caches, model2, caches2, strict=True):
            h, h2 = block(h, cache=cache), block2(h2, cache=cache2)
    assert torch.equal(h2, h)


def test_a_shallow_copy_shares_its_buffers_and_keeps_its_module() -> None:
    """A re-review: ``copy.copy(cache)`` went through pickling's state, belonged to no module
    and shared the buffers, so another layer adopted it and wrote into this layer's cache. It
    keeps the owner: the other layer refuses it, the buffers untouched."""
    import copy

    model, caches, x = _decoded_blocks()
    shallow = copy.copy(caches[0])
    assert shallow.owner is model[0].attn and shallow._keys is caches[0]._keys
    kept = _state(caches[0])
    with torch.no_grad(), pytest.raises(ValueError, match="belongs to another module"):
        model[1](x[:, 7:8], cache=shallow)
    assert caches[0].lengths == kept[0] and all(map(torch.equal, _state(caches[0])[1:], kept[1:]))


def test_a_cache_deep_copied_alone_keeps_its_module() -> None:
    """``copy.deepcopy(cache)`` (a branch of a decode) gave a cache of no module, which a
    layer it was swapped to adopted. The copy belongs to the original's module: refused by the
    other layer, and it decodes for its own as the original does, independently."""
    import copy

    model, caches, x = _decoded_blocks()
    branch = copy.deepcopy(caches[0])
    assert branch.owner is model[0].attn and branch.lengths == caches[0].lengths
    with torch.no_grad():
        with pytest.raises(ValueError, match="belongs to another module"):
            model[1](x[:, 7:8], cache=branch)
        stepped = model[0](x[:, 7:8], cache=branch)
        assert branch.lengths == (8,) and caches[0].lengths == (7,)
        assert torch.equal(model[0](x[:, 7:8], cache=caches[0]), stepped)
