"""The float64 dense oracle and the plain dense baseline (docs/spec.md, sections 2 and 4).

Deliberately independent of :mod:`ringdilated.core`: the mask is built position by position from
the rule in docs/spec.md (``(p % w) % r == offset``, same segment, causal ``k <= p``), with
explicit boolean tensors, in O(L^2) memory per head (O(L^2 D) when ``v`` holds NaN or infinity,
which is summed term by term: keep such tests short). Pattern mixing is a softmax over the
multiset union of the patterns' keys, so the dense form adds ``log(count)`` to each score of a
key the query sees (one pattern's key adds ``log 1 = 0``).

Exact for non-finite inputs (docs/spec.md, section 4): a key a query does not see takes no part at
all. Its score is replaced by ``-inf`` (never added to: ``NaN + -inf`` is NaN), and its value is
never multiplied by the zero weight (``0 * inf`` is NaN): when a value is not finite the weighted
sum runs over the seen keys only. So NaN or infinity reaches exactly the queries that see it.

:func:`masked_attention` (kernel layout, a boolean mask, optional ``log(count)`` weights) is the
one dense computation: :func:`dense_attention` calls it with the pattern's mask, and the kernel
conformance kit's :func:`ringdilated.testing.kernel_cases.dense` with a causal-offset mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "dense_attention",
    "masked_attention",
    "oracle",
    "pattern_weights",
    "scaled_scores",
]


def _head_offsets(
    num_heads: int, segment_lengths: Sequence[int], dilation_rates: Sequence[int], mode: str
) -> list[list[tuple[int, int, int]]]:
    """For each head, the ``(w, r, offset)`` of every pattern it uses."""
    G = len(segment_lengths)
    per_head: list[list[tuple[int, int, int]]] = [[] for _ in range(num_heads)]
    if mode == "head_groups":
        h = 0
        for i in range(G):
            size = num_heads // G + (1 if i < num_heads % G else 0)
            for _ in range(size):
                per_head[h].append((segment_lengths[i], dilation_rates[i], i % dilation_rates[i]))
                h += 1
    elif mode == "longnet":
        for h in range(num_heads):
            for w, r in zip(segment_lengths, dilation_rates, strict=True):
                per_head[h].append((w, r, (h * r) // num_heads))
    else:
        raise ValueError(f"mode must be 'head_groups' or 'longnet', got {mode!r}")
    return per_head


def pattern_weights(
    seq_len: int,
    num_heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    mode: str = "head_groups",
    causal: bool = False,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``(H, L, L)`` float64: how many of head ``h``'s patterns let query ``p`` see key ``j``."""
    p = torch.arange(seq_len, device=device)
    weights = torch.zeros(num_heads, seq_len, seq_len, dtype=torch.float64, device=device)
    for h, patterns in enumerate(_head_offsets(num_heads, segment_lengths, dilation_rates, mode)):
        for w, r, offset in patterns:
            selected = (p % w) % r == offset
            same_segment = (p // w).unsqueeze(1) == (p // w).unsqueeze(0)
            mask = selected.unsqueeze(1) & selected.unsqueeze(0) & same_segment
            if causal:
                mask &= p.unsqueeze(0) <= p.unsqueeze(1)
            weights[h] += mask.to(torch.float64)
    return weights


def scaled_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """``scale * q k^T`` in ``dtype``, kernel layout: ``q (N, H, Lq, D)``, ``k (N, Hkv, Lk, D)``
    with ``Hkv`` dividing ``H`` (query head ``h`` reads key head ``h // (H // Hkv)``)."""
    group = q.shape[1] // k.shape[1]
    return q.to(dtype) @ k.to(dtype).repeat_interleave(group, 1).transpose(-1, -2) * scale


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
    log_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense softmax attention in kernel layout over the keys each query sees: ``(out, lse)``.

    ``q (N, H, Lq, D)``, ``k, v (N, Hkv, Lk, D)``; ``seen`` is boolean, broadcastable to
    ``(N, H, Lq, Lk)``, ``True`` where query ``i`` sees key ``j``. ``log_weights`` (same
    broadcast) is added to the score of each seen key: ``log(count)`` for a key that ``count``
    patterns select, the multiset softmax of pattern mixing. ``out (N, H, Lq, D)`` and
    ``lse (N, H, Lq)`` are computed in ``dtype`` (differentiable); a query that sees no key gets
    ``out = 0`` and ``lse = -inf``.

    Exact for non-finite inputs: a key a query does not see takes no part. Its score is replaced
    by ``-inf`` (never added to, as ``NaN + -inf`` is NaN) and its value is never multiplied by
    the zero weight (``0 * inf`` is NaN), so NaN or infinity reaches exactly the queries that
    see it. Both references of the testing package, the pattern-level :func:`dense_attention`
    and the kernel-level :func:`ringdilated.testing.kernel_cases.dense`, are this function.
    """
    group = q.shape[1] // k.shape[1]
    vd = v.to(dtype).repeat_interleave(group, 1)
    raw = scaled_scores(q, k, scale, dtype)
    if log_weights is not None:
        raw = raw + log_weights.to(dtype)
    # A query with no key has an all -inf row: give it finite scores so neither the values nor
    # the gradients become NaN, then make its output 0 and its lse -inf.
    empty = ~seen.any(-1, keepdim=True)
    scores = torch.where(seen, raw, raw.new_full((), float("-inf"))).masked_fill(empty, 0.0)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(empty.squeeze(-1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)
    return _weighted_values(probs, vd, seen), lse


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    mode: str = "head_groups",
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain dense masked attention computed in ``dtype`` (default: the inputs'): ``(out, lse)``.

    ``out`` is ``(B, L, H, D)`` in ``dtype``, ``lse`` ``(B, H, L)`` in ``dtype``. This is both the
    oracle (``dtype=float64``) and the baseline whose error sets a dtype's tolerance. It is
    :func:`masked_attention` with the mask and ``log(count)`` weights of
    :func:`pattern_weights`.
    """
    dtype = dtype or q.dtype
    _, L, H, D = q.shape
    scale = D**-0.5 if scale is None else scale
    weights = pattern_weights(
        L, H, segment_lengths, dilation_rates, mode=mode, causal=causal, device=q.device
    )
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out, lse = masked_attention(qt, kt, vt, weights > 0, scale, dtype, weights.log())
    return out.transpose(1, 2), lse


def _weighted_values(probs: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``sum_j probs_ij v_j`` over the keys ``j`` query ``i`` sees; a matmul when ``v`` is finite,
    otherwise unseen keys are dropped before the product (``0 * inf`` would be NaN)."""
    if bool(torch.isfinite(v).all()):
        return torch.matmul(probs, v)
    terms = probs.unsqueeze(-1) * v.unsqueeze(-3)  # (B, H, Lq, Lk, D)
    return torch.where(seen.unsqueeze(-1), terms, terms.new_zeros(())).sum(-2)


def oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    mode: str = "head_groups",
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention as docs/spec.md defines it, evaluated densely in float64; differentiable.

    Same arguments and return convention as :func:`ringdilated.dilated_attention` (no dropout),
    results in float64.
    """
    out, lse = dense_attention(
        q,
        k,
        v,
        segment_lengths,
        dilation_rates,
        mode=mode,
        causal=causal,
        scale=scale,
        dtype=torch.float64,
    )
    return (out, lse) if return_lse else out
