"""Packed documents, padding and query suffixes against the float64 oracle (docs/spec.md,
sections 1 and 2): out, lse and gradients, every CPU kernel, both modes, causal and not, GQA."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ringdilated
from ringdilated.testing import assert_within_tolerance, dense_attention, oracle
from tests.strategies import Case, LayoutCase, cases, layouts, loss_of, upstream

# tests.strategies.layouts() draws batches whose every row is padding on purpose (the output is
# then zeros, checked against the oracle): the PaddingMaskWarning such a mask gives is expected.
pytestmark = pytest.mark.filterwarnings("ignore:key_padding_mask .* is True at every position")

KERNELS = ["sdpa", "reference"]


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float64 else dtype


def _attend(case: Case, layout: LayoutCase, q, k, v, kernel: str):  # type: ignore[no-untyped-def]
    return ringdilated.dilated_attention(
        layout.queries(q),
        k,
        v,
        case.segment_lengths,
        case.dilation_rates,
        **case.kwargs(),
        **layout.kwargs(),
        kernel=kernel,
        return_lse=True,
    )


def _dense(case: Case, layout: LayoutCase, q, k, v, dtype=None):  # type: ignore[no-untyped-def]
    return dense_attention(
        layout.queries(q),
        k,
        v,
        case.segment_lengths,
        case.dilation_rates,
        **case.kwargs(),
        **layout.kwargs(),
        dtype=dtype,
    )


@pytest.mark.parametrize("kernel", KERNELS)
@given(case=cases(max_len=32), data=st.data())
def test_forward_matches_oracle(kernel: str, case: Case, data: st.DataObject) -> None:
    layout = data.draw(layouts(case.batch, case.seq_len))
    q, k, v = case.tensors()
    out, lse = _attend(case, layout, q, k, v, kernel)
    assert out.dtype == case.dtype and lse.dtype == torch.float32
    expected_out, expected_lse = _dense(case, layout, q, k, v, torch.float64)
    base_out, _ = _dense(case, layout, q, k, v)
    _, base_lse = _dense(case, layout, q, k, v, _lse_dtype(case.dtype))
    assert_within_tolerance(out, expected_out, base_out, what="out")
    assert_within_tolerance(lse, expected_lse, base_lse, dtype=_lse_dtype(case.dtype), what="lse")


@pytest.mark.parametrize("kernel", KERNELS)
@given(case=cases(max_len=24), data=st.data())
def test_gradients_match_oracle(kernel: str, case: Case, data: st.DataObject) -> None:
    layout = data.draw(layouts(case.batch, case.seq_len))
    q, k, v = case.tensors(requires_grad=True)
    out, lse = _attend(case, layout, q, k, v, kernel)
    dout, dlse = upstream(case.seed, out, lse)
    grads = torch.autograd.grad(loss_of(out, lse, dout, dlse), (q, k, v))
    expected = torch.autograd.grad(
        loss_of(*_dense(case, layout, q, k, v, torch.float64), dout, dlse), (q, k, v)
    )
    baseline = torch.autograd.grad(loss_of(*_dense(case, layout, q, k, v), dout, dlse), (q, k, v))
    for name, actual, exp, base in zip("qkv", grads, expected, baseline, strict=True):
        assert actual.dtype == case.dtype
        assert_within_tolerance(actual, exp, base, what=f"d{name}")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_documents_equal_separate_calls(kernel: str, mode: str) -> None:
    """Each packed document equals a call on that document alone (positions and segments
    restart at its start), and the padded rows' valid runs equal the unpadded sequences."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 37, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    bounds = [0, 5, 19, 37]
    pattern = ([8, 6], [1, 2])
    out = ringdilated.dilated_attention(
        q, k, v, *pattern, mode=mode, causal=True, kernel=kernel,
        cu_seqlens=torch.tensor(bounds),
    )  # fmt: skip
    for s, e in itertools.pairwise(bounds):
        alone = oracle(q[:, s:e], k[:, s:e], v[:, s:e], *pattern, mode=mode, causal=True)
        assert torch.allclose(out[:, s:e], alone, rtol=0, atol=1e-12)
    # The same sequences as padded rows: right padding for one, left for the other.
    rows = (
        torch.zeros(2, 20, 4, 8, dtype=torch.float64),
        torch.zeros(2, 20, 4, 8, dtype=torch.float64),
    )
    mask = torch.ones(2, 20, dtype=torch.bool)
    padded_q, padded_kv = rows
    padded_q[0, :14], padded_kv[0, :14], mask[0, :14] = q[0, 5:19], k[0, 5:19], False
    padded_q[1, 2:], padded_kv[1, 2:], mask[1, 2:] = q[0, 19:37], k[0, 19:37], False
    out_padded, lse = ringdilated.dilated_attention(
        padded_q, padded_kv, padded_kv, *pattern, mode=mode, causal=True, kernel=kernel,
        key_padding_mask=mask, return_lse=True,
    )  # fmt: skip
    first = oracle(q[:, 5:19], k[:, 5:19], k[:, 5:19], *pattern, mode=mode, causal=True)
    second = oracle(q[:, 19:], k[:, 19:], k[:, 19:], *pattern, mode=mode, causal=True)
    assert torch.allclose(out_padded[0, :14], first[0], rtol=0, atol=1e-12)
    assert torch.allclose(out_padded[1, 2:], second[0], rtol=0, atol=1e-12)
    assert torch.all(out_padded[mask] == 0)
    assert torch.all(torch.isneginf(lse.transpose(1, 2)[mask]))


@pytest.mark.parametrize("kernel", KERNELS)
def test_padding_holding_nan_stays_out_of_valid_rows(kernel: str) -> None:
    """Padded positions are nobody's keys: NaN there reaches no valid query (and padded queries
    give 0, not NaN), as the oracle says."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 16, 2, 4, generator=g) for _ in range(3))
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[0, 12:] = True
    mask[1, :3] = True
    for x in (q, k, v):
        x[mask] = float("nan")
    out, lse = ringdilated.dilated_attention(
        q, k, v, [4, 8], [1, 2], kernel=kernel, key_padding_mask=mask, return_lse=True
    )
    expected, expected_lse = oracle(q, k, v, [4, 8], [1, 2], key_padding_mask=mask, return_lse=True)
    assert not torch.isnan(out).any()
    assert torch.allclose(out.double(), expected, rtol=0, atol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse))


def test_query_suffix_is_bottom_right_aligned() -> None:
    """A one-query suffix is the last position: with causal=True it sees every selected key of
    its segment (all of them at or before it), and equals the last row of the full call."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 24, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    last = ringdilated.dilated_attention(q[:, -1:], k, v, [16, 8], [1, 2], causal=True)
    full = oracle(q, k, v, [16, 8], [1, 2], causal=True)
    assert torch.allclose(last, full[:, -1:], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"cu_seqlens": torch.tensor([0, 5, 5, 16])},
            ValueError,
            r"strictly increasing.*\[1\] = 5",
        ),
        ({"cu_seqlens": torch.tensor([0, 9, 7, 16])}, ValueError, "strictly increasing"),
        ({"cu_seqlens": torch.tensor([0, 8, 15])}, ValueError, "from 0 to the sequence length 16"),
        ({"cu_seqlens": torch.tensor([1, 8, 16])}, ValueError, "from 0 to the sequence length"),
        ({"cu_seqlens": torch.tensor([0.0, 16.0])}, TypeError, "integer tensor, got torch.float32"),
        ({"cu_seqlens": torch.tensor([[0, 16]])}, ValueError, r"1-D integer tensor, got shape"),
        ({"cu_seqlens": torch.tensor(16)}, ValueError, r"got shape \(\)"),
        ({"cu_seqlens": [0, 16]}, TypeError, "got list"),
        ({"key_padding_mask": torch.zeros(2, 15, dtype=torch.bool)}, ValueError, r"\(2, 16\)"),
        ({"key_padding_mask": torch.zeros(2, 16)}, TypeError, "bool tensor.*float32"),
        (
            {"key_padding_mask": torch.tensor([[False] * 4 + [True] * 4 + [False] * 8] * 2)},
            ValueError,
            "row 0 must hold one contiguous run.*12 valid positions between 0 and 15",
        ),
        (
            {
                "cu_seqlens": torch.tensor([0, 16]),
                "key_padding_mask": torch.zeros(2, 16, dtype=torch.bool),
            },
            ValueError,
            "not both",
        ),
    ],
)
def test_bad_layouts_are_rejected(kwargs: dict[str, object], error: type, match: str) -> None:
    q = torch.randn(2, 16, 2, 4)
    with pytest.raises(error, match=match):
        ringdilated.dilated_attention(q, q, q, [4], [1], **kwargs)  # type: ignore[arg-type]


def test_a_split_padding_row_error_names_the_convention_without_the_adapter() -> None:
    """The error used to end with a sentence about the Hugging Face adapter, shown to users who
    never touched it; it now states the convention on its own."""
    q = torch.randn(1, 16, 2, 4)
    mask = torch.tensor([[False] * 4 + [True] * 4 + [False] * 8])
    with pytest.raises(ValueError, match=r"^key_padding_mask row 0 ") as caught:
        ringdilated.dilated_attention(q, q, q, [4], [1], key_padding_mask=mask)
    message = str(caught.value)
    assert message.startswith(
        "key_padding_mask row 0 must hold one contiguous run of valid (False) positions (left or "
        "right padding; True = padding, the negation of transformers' attention_mask), got 12 "
        "valid positions between 0 and 15"
    )
    assert "Hugging Face" not in message and "adapter" not in message


def test_an_all_padding_mask_warns_once_per_call_naming_the_convention() -> None:
    """A mask True at every position of every row (transformers' attention_mask of a batch with
    no padding, passed as it is) used to give all-zero output silently."""
    from ringdilated.core.plan.documents import PaddingMaskWarning

    q = torch.randn(2, 16, 2, 4)
    everywhere = torch.ones(2, 16, dtype=torch.bool)
    calls = {  # a planned layout reads the mask once, when it is built within the call
        "mask": lambda: ringdilated.dilated_attention(
            q, q, q, [4], [1], key_padding_mask=everywhere
        ),
        "layout": lambda: ringdilated.dilated_attention(
            q, q, q, [4], [1], layout=ringdilated.SequenceLayout(key_padding_mask=everywhere)
        ),
    }
    for call in calls.values():
        with pytest.warns(PaddingMaskWarning) as caught:
            out = call()
        assert torch.equal(out, torch.zeros_like(out))
        ours = [w for w in caught if w.category is PaddingMaskWarning]
        assert len(ours) == 1, [str(w.message) for w in ours]
        assert ours[0].filename == __file__  # the user's line
        message = str(ours[0].message)
        assert "True at every position of every row" in message
        assert "True = padding" in message and "attention_mask == 0" in message
    one_valid = everywhere.clone()
    one_valid[1, 5:] = False  # one row with tokens: a real batch, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", PaddingMaskWarning)
        ringdilated.dilated_attention(q, q, q, [4], [1], key_padding_mask=one_valid)


def test_query_longer_than_keys_is_rejected() -> None:
    q, k = torch.randn(1, 9, 2, 4), torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match=r"q may not be longer than k.*\(1, 9, 2, 4\)"):
        ringdilated.dilated_attention(q, k, k, [4], [1])
