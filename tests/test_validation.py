"""Every input docs/spec.md rejects raises before any work, naming the value and the rule."""

from __future__ import annotations

import pytest
import torch

import ringdilated
from ringdilated import ResolutionError


def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


Q = t(2, 16, 4, 8)
KV = t(2, 16, 2, 8)

CASES = [
    ("q not a tensor", ([[1.0]], KV, KV), {}, TypeError, "q must be a torch.Tensor, got list"),
    (
        "wrong rank",
        (t(16, 4, 8), KV, KV),
        {},
        ValueError,
        r"q must be 4-D \(batch, seq_len, heads, head_dim\), got shape \(16, 4, 8\)",
    ),
    ("k rank", (Q, t(2, 16, 16), KV), {}, ValueError, "k must be 4-D"),
    (
        "k v shapes",
        (Q, KV, t(2, 16, 1, 8)),
        {},
        ValueError,
        r"k and v must have the same shape, got \(2, 16, 2, 8\) and \(2, 16, 1, 8\)",
    ),
    (
        "batch mismatch",
        (Q, t(1, 16, 2, 8), t(1, 16, 2, 8)),
        {},
        ValueError,
        r"must match q in batch, got q \(2, 16, 4, 8\) and k \(1, 16, 2, 8\)",
    ),
    (
        "q longer than k",
        (Q, t(2, 15, 2, 8), t(2, 15, 2, 8)),
        {},
        ValueError,
        r"q may not be longer than k.*got q \(2, 16, 4, 8\) and k \(2, 15, 2, 8\)",
    ),
    (
        "head dim mismatch",
        (Q, t(2, 16, 2, 4), t(2, 16, 2, 4)),
        {},
        ValueError,
        "head_dim must equal q's 8, got 4",
    ),
    (
        "hkv not dividing",
        (Q, t(2, 16, 3, 8), t(2, 16, 3, 8)),
        {},
        ValueError,
        r"key/value heads \(3\) must divide query heads \(4\)",
    ),
    ("empty", (t(2, 0, 4, 8), t(2, 0, 2, 8), t(2, 0, 2, 8)), {}, ValueError, "no empty dimension"),
    (
        "mixed dtypes",
        (Q, KV.double(), KV),
        {},
        TypeError,
        "q, k, v must share one dtype, got torch.float32, torch.float64",
    ),
    (
        "integer dtype",
        (Q.long(), KV.long(), KV.long()),
        {},
        TypeError,
        "q must be float16, bfloat16, float32 or float64, got torch.int64",
    ),
    ("meta device", (Q, KV.to("meta"), KV), {}, ValueError, "q, k, v must be on one device"),
    (
        "too few heads",
        (t(2, 16, 2, 8), t(2, 16, 2, 8), t(2, 16, 2, 8)),
        {"segment_lengths": [4, 8, 16], "dilation_rates": [1, 2, 4]},
        ValueError,
        r"needs num_heads >= 3, got 2",
    ),
    (
        "dilation above segment",
        (Q, KV, KV),
        {"segment_lengths": [4], "dilation_rates": [8]},
        ValueError,
        r"dilation_rates\[0\] = 8 exceeds segment_lengths\[0\] = 4",
    ),
    (
        "zero segment",
        (Q, KV, KV),
        {"segment_lengths": [0], "dilation_rates": [1]},
        ValueError,
        "segment_lengths must be positive, got 0",
    ),
    (
        "negative rate",
        (Q, KV, KV),
        {"segment_lengths": [4], "dilation_rates": [-2]},
        ValueError,
        "dilation_rates must be positive, got -2",
    ),
    (
        "count mismatch",
        (Q, KV, KV),
        {"segment_lengths": [4, 8], "dilation_rates": [1]},
        ValueError,
        "same length",
    ),
    ("unknown mode", (Q, KV, KV), {"mode": "dense"}, ValueError, "mode must be one of .*'dense'"),
    (
        "unknown kernel",
        (Q, KV, KV),
        {"kernel": "cuda-magic"},
        ValueError,
        "unknown kernel 'cuda-magic'",
    ),
    (
        "bad scale",
        (Q, KV, KV),
        {"scale": -1.0},
        ValueError,
        "scale must be a positive finite number, got -1.0",
    ),
    (
        "nan scale",
        (Q, KV, KV),
        {"scale": float("nan")},
        ValueError,
        "scale must be a positive finite number, got nan",
    ),
    (
        "scale too large for a float",
        (Q, KV, KV),
        {"scale": 10**400},
        ValueError,
        "scale must be a finite float, got 1000",
    ),
    (
        "scale type",
        (Q, KV, KV),
        {"scale": "0.1"},
        TypeError,
        "scale must be a float or None, got '0.1'",
    ),
    ("dropout range", (Q, KV, KV), {"dropout_p": 1.0}, ValueError, r"0 <= dropout_p < 1, got 1.0"),
    ("causal type", (Q, KV, KV), {"causal": 1}, TypeError, "causal must be a bool, got 1"),
    (
        "unknown communicator",
        (Q, KV, KV),
        {"communicator": "mpi"},
        ValueError,
        "unknown communicator 'mpi'; known communicators: allgather, hybrid, local, ringpass, "
        "ulysses",
    ),
    (
        "forced unfit kernel",
        (Q, KV, KV),
        {"kernel": "sdpa", "dropout_p": 0.1},
        ResolutionError,
        "kernel 'sdpa' .* no dropout on cpu",
    ),
]


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_invalid_input_raises_naming_the_value_and_rule(
    args: tuple, kwargs: dict, error: type, match: str
) -> None:
    kw = {"segment_lengths": [4, 8], "dilation_rates": [1, 2], **kwargs}
    with pytest.raises(error, match=match):
        ringdilated.dilated_attention(*args, **kw)


def test_module_rejects_bad_configuration_on_construction() -> None:
    with pytest.raises(ValueError, match="exceeds segment_lengths"):
        ringdilated.DilatedAttention([4], [8])
    with pytest.raises(ValueError, match="dropout_p must satisfy"):
        ringdilated.DilatedAttention([4], [1], dropout=1.5)
    with pytest.raises(ValueError, match="unknown kernel 'nope'; known kernels: "):
        ringdilated.DilatedAttention([4], [1], kernel="nope")
    # The kernel is chosen for the tensors of a call: a forced kernel that cannot serve a call
    # raises there, with its reasons.
    attn = ringdilated.DilatedAttention([4], [1], dropout=0.1, kernel="sdpa")
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ResolutionError, match="no dropout on cpu"):
        attn(q, q, q)
