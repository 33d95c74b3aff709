"""The float64 dense oracle and the plain dense baseline (docs/spec.md, sections 2 and 4).

Deliberately independent of :mod:`ringdilated.core`: the mask is built position by position from
the rule in docs/spec.md (``(p % w) % r == offset``, same segment, causal ``k <= p``), with
explicit boolean tensors, in O(L^2) memory per head (O(L^2 D) when ``v`` holds NaN or infinity,
which is summed term by term: keep such tests short). Pattern mixing is a softmax over the
multiset union of the patterns' keys, so the dense form adds ``log(count)`` to each score of a
key the query sees (one pattern's key adds ``log 1 = 0``).

Exact for non-finite inputs, forward and backward (:func:`masked_attention`, the one dense
computation). Kernels may be coarser (docs/spec.md allows NaN through a non-finite value in a
query's own kernel block): :func:`nan_allowed` says where, for a pattern.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringdilated.core.contract.kernel import check_softcap
from ringdilated.core.plan.window import KeyWindow

__all__ = [
    "dense_attention",
    "documents_of",
    "masked_attention",
    "nan_allowed",
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


def documents_of(
    seq_len: int,
    cu_seqlens: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(document, start)``, each ``(B', L)`` int64: position ``p``'s document number (``-1``
    for padding) and the first position of that document. ``B' = 1`` unless a padding mask gives
    each row its own (its valid positions are taken as one document, as docs/spec.md requires)."""
    p = torch.arange(seq_len, device=device)
    if key_padding_mask is not None:
        valid = ~key_padding_mask.to(device)
        first = torch.where(valid, p, seq_len).amin(1, keepdim=True)
        document = torch.where(valid, 0, -1)
        return document, first.expand(-1, seq_len)
    if cu_seqlens is None:
        return torch.zeros(1, seq_len, dtype=torch.int64, device=device), p.new_zeros(1, seq_len)
    bounds = cu_seqlens.to(device=device, dtype=torch.int64)
    document = torch.bucketize(p, bounds[1:], right=True)
    return document.unsqueeze(0), bounds[document].unsqueeze(0)


def pattern_weights(
    seq_len: int,
    num_heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    mode: str = "head_groups",
    causal: bool = False,
    device: torch.device | str = "cpu",
    cu_seqlens: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    window: tuple[int | None, int | None] | KeyWindow | None = None,
) -> torch.Tensor:
    """``(B', H, L, L)`` float64: how many of head ``h``'s patterns let query ``p`` see key ``j``
    (``B' = 1`` unless ``key_padding_mask`` gives every row its own). Positions count from
    their document's start (:func:`documents_of`), and a query sees only its own document.
    ``window``: ``(left, right)`` (docs/spec.md, section 5; ``None`` unbounded on that side):
    key ``j`` only when ``p - left <= j <= p + right``, in positions (not selected keys);
    ``causal=True`` is ``right = 0``; with a window it asks for a window whose ``right`` is 0
    or ``None`` (anything else raises ``ValueError``: one of the two would be ignored; the rule
    of the library's calls)."""
    left, right = _window_bounds(window, causal)
    p = torch.arange(seq_len, device=device)
    document, start = documents_of(seq_len, cu_seqlens, key_padding_mask, device)
    rel = p - start  # (B', L): position within its document
    same_document = (document.unsqueeze(2) == document.unsqueeze(1)) & (document >= 0).unsqueeze(2)
    weights = torch.zeros(
        document.shape[0], num_heads, seq_len, seq_len, dtype=torch.float64, device=device
    )
    for h, patterns in enumerate(_head_offsets(num_heads, segment_lengths, dilation_rates, mode)):
        for w, r, offset in patterns:
            selected = (rel % w) % r == offset
            same_segment = (rel // w).unsqueeze(2) == (rel // w).unsqueeze(1)
            mask = selected.unsqueeze(2) & selected.unsqueeze(1) & same_segment & same_document
            if right is not None:
                mask &= p.unsqueeze(0) <= p.unsqueeze(1) + right
            if left is not None:
                mask &= p.unsqueeze(0) >= p.unsqueeze(1) - left
            weights[:, h] += mask.to(torch.float64)
    return weights


def _window_bounds(window: object, causal: bool) -> tuple[int | None, int | None]:
    """``(left, right)`` of ``window`` (a pair, or anything with ``left`` and ``right``, like
    :class:`~ringdilated.core.KeyWindow`), each ``None`` or an int (not a bool, not a float);
    ``None``: unbounded; ``causal`` makes ``right`` 0 (a right bound other than ``None`` or 0
    then raises). ``None`` is the only unbounded
    side: flash-attn's ``-1`` is a bound here (hiding the query's own position, and more)."""
    if window is None:
        return None, 0 if causal else None
    if hasattr(window, "left") and hasattr(window, "right"):
        pair: tuple[object, object] = (window.left, window.right)
    elif isinstance(window, (tuple, list)) and len(window) == 2:
        pair = (window[0], window[1])
    else:
        raise TypeError(f"window must be (left, right) or a KeyWindow, got {window!r}")
    bounds = KeyWindow(*pair)  # ints or None, bools refused, naming the value
    if causal and bounds.right not in (None, 0):
        raise ValueError(f"causal=True asks for right = 0, but window={window!r}: pass one")
    return bounds.left, 0 if causal else bounds.right


def _check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Raise unless ``sinks`` is ``None`` or a floating tensor of shape ``(H,)`` on ``q``'s
    device, ``H`` = ``q.shape[1]`` (kernel layout): no broadcasting of one sink to every head."""
    if sinks is None:
        return
    heads = q.shape[1]
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks must be a floating tensor of shape ({heads},), got {sinks!r}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"sinks must have shape ({heads},), one logit per query head, got {tuple(sinks.shape)}"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on the queries' device {q.device}, got {sinks.device}")


def scaled_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """``scale * q k^T`` in ``dtype``, kernel layout: ``q (N, H, Lq, D)``, ``k (N, Hkv, Lk, D)``
    with ``Hkv`` dividing ``H`` (query head ``h`` reads key head ``h // (H // Hkv)``)."""
    group = q.shape[1] // k.shape[1]
    return q.to(dtype) @ k.to(dtype).repeat_interleave(group, 1).transpose(-1, -2) * scale


class _SeenScores(torch.autograd.Function):
    """``scale * q k^T`` (``k`` already repeated to ``q``'s heads) whose gradient runs through
    the pairs a query sees only: exactly 0 through a hidden pair, whatever ``q`` and ``k`` hold.
    (Autograd through a plain matmul multiplies a hidden pair's zero gradient by the other
    operand, and ``0 * inf`` is NaN: a gradient the exact math keeps at 0.)"""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, kd: torch.Tensor, seen: torch.Tensor, scale: float
    ) -> torch.Tensor:
        ctx.save_for_backward(q, kd, seen)
        ctx.scale = scale
        return q @ kd.transpose(-1, -2) * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, kd, seen = ctx.saved_tensors
        seen = seen.expand(grad.shape)
        grad = torch.where(seen, grad, grad.new_zeros(())) * ctx.scale
        if bool(torch.isfinite(q).all()) and bool(torch.isfinite(kd).all()):
            return grad @ kd, grad.transpose(-1, -2) @ q, None, None
        zero = grad.new_zeros(())
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(kd)
        for i in range(q.shape[-2]):  # one query row at a time: (N, H, Lk, D) in memory
            pair = seen[..., i, :].unsqueeze(-1)
            g = grad[..., i, :].unsqueeze(-1)
            dq[..., i, :] = torch.where(pair, g * kd, zero).sum(-2)
            dk += torch.where(pair, g * q[..., i, :].unsqueeze(-2), zero)
        return dq, dk, None, None


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
    log_weights: torch.Tensor | None = None,
    drop: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense softmax attention in kernel layout over the keys each query sees: ``(out, lse)``.

    docs/spec.md, section 5: ``softcap`` ``c > 0`` makes every score ``s`` (``scale * q . k``)
    ``c * tanh(s / c)`` before ``log_weights`` are added; ``sinks`` ``(H,)`` adds ``exp(s_h)``
    to every query's softmax denominator with a zero value: one more score per query, softmaxed
    with the keys' and weighing nothing (``lse = log(sum_j exp(score_j) + exp(s_h))``), so a
    query that sees no key, or whose every seen score is ``-inf``, has ``out = 0`` and ``lse =
    s_h`` exactly; differentiable in ``s_h``; a sink of ``-inf`` is no sink.

    ``q (N, H, Lq, D)``, ``k, v (N, Hkv, Lk, D)``; ``seen`` is boolean, broadcastable to
    ``(N, H, Lq, Lk)``, ``True`` where query ``i`` sees key ``j``. ``log_weights`` (same
    broadcast) is added to the score of each seen key: ``log(count)`` for a key that ``count``
    patterns select, the multiset softmax of pattern mixing. ``drop`` (same broadcast) scales
    each probability before it weighs its value: a dropout mask, ``keep / (1 - p)``; the lse is
    the undropped one, as kernels report it. ``out (N, H, Lq, D)`` and ``lse (N, H, Lq)`` are
    computed in ``dtype`` (differentiable); a query that sees no key gets ``out = 0`` and
    ``lse = -inf``.

    Exact for non-finite inputs: a key a query does not see takes no part. Its score is replaced
    by ``-inf`` (never added to, as ``NaN + -inf`` is NaN) and its value is never multiplied by
    the zero weight (``0 * inf`` is NaN), so NaN or infinity reaches exactly the queries that
    see it. Both references of the testing package, the pattern-level :func:`dense_attention`
    and the kernel-level :func:`ringdilated.testing.kernel_cases.dense`, are this function.
    """
    check_softcap(softcap)
    _check_sinks(sinks, q)
    group = q.shape[1] // k.shape[1]
    vd = v.to(dtype).repeat_interleave(group, 1)
    kd = k.to(dtype).repeat_interleave(group, 1)
    raw: torch.Tensor = _SeenScores.apply(q.to(dtype), kd, seen, scale)  # type: ignore[no-untyped-call]
    if softcap is not None:
        raw = softcap * torch.tanh(raw / softcap)
    if log_weights is not None:
        raw = raw + log_weights.to(dtype)
    masked = torch.where(seen, raw, raw.new_full((), float("-inf")))
    if sinks is not None:  # the sink: one more score per query, with a zero value
        sink = sinks.to(dtype).view(1, -1, 1, 1).expand(*masked.shape[:-1], 1)
        masked = torch.cat([masked, sink], dim=-1)
        seen = torch.cat([seen.expand(*masked.shape[:-1], -1), ~sink.isneginf()], dim=-1)
        # A sink of +inf outweighs every finite score: weights 0, lse +inf (softmax's own
        # inf - inf would make them NaN). Against a key score of +inf or NaN it stays NaN.
        keys = masked[..., :-1]
        overwhelmed = sink.isposinf() & ~(keys.isposinf() | keys.isnan()).any(-1, keepdim=True)
        masked = torch.where(
            overwhelmed,
            torch.cat([torch.full_like(keys, float("-inf")), torch.zeros_like(sink)], -1),
            masked,
        )
    # A query with no key (and no sink) has an all -inf row: give it finite scores so neither
    # the values nor the gradients become NaN, then make its output 0 and its lse -inf.
    empty = ~seen.any(-1, keepdim=True)
    scores = masked.masked_fill(empty, 0.0)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(empty.squeeze(-1), float("-inf"))
    if sinks is not None:
        lse = lse.masked_fill(overwhelmed.squeeze(-1), float("inf"))
    # An unseen key's probability is exactly 0, also in a row whose softmax is NaN (a score of
    # +inf, or only -inf scores): its value and key then get exactly 0 gradient from that row.
    probs = torch.where(seen, torch.softmax(scores, dim=-1), raw.new_zeros(()))
    undefined = None
    if sinks is not None:  # the sink's column weighs a zero value: drop it (a NaN stays)
        undefined = probs[..., -1:].isnan()
        probs, seen = probs[..., :-1], seen[..., :-1]
    if drop is not None:
        probs = probs * drop.to(dtype)
    out = _weighted_values(probs, vd, seen)
    if undefined is not None:
        out = torch.where(undefined, out.new_full((), float("nan")), out)
    return out, lse


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
    cu_seqlens: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    window: tuple[int | None, int | None] | KeyWindow | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain dense masked attention computed in ``dtype`` (default: the inputs'): ``(out, lse)``.

    ``out`` is ``(B, Lq, H, D)`` in ``dtype``, ``lse`` ``(B, H, Lq)`` in ``dtype``; ``q`` may hold
    the last ``Lq`` of ``k``'s ``L`` positions. This is both the oracle (``dtype=float64``) and
    the baseline whose error sets a dtype's tolerance. It is :func:`masked_attention` with the
    mask and ``log(count)`` weights of :func:`pattern_weights`; ``window``, ``softcap`` and
    ``sinks`` (``(H,)``, one logit per query head, joining the union once in ``longnet`` mode)
    as docs/spec.md, section 5 defines them. With sinks, every query position gets the sink in
    its denominator (one that sees no key, or that its head's pattern does not select: ``out =
    0``, ``lse = s_h``), except padding, which is no query (``out = 0``, ``lse = -inf``).
    """
    dtype = dtype or q.dtype
    _, Lq, H, D = q.shape
    L = k.shape[1]
    scale = D**-0.5 if scale is None else scale
    weights = pattern_weights(
        L,
        H,
        segment_lengths,
        dilation_rates,
        mode=mode,
        causal=causal,
        device=q.device,
        cu_seqlens=cu_seqlens,
        key_padding_mask=key_padding_mask,
        window=window,
    )[:, :, L - Lq :]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out, lse = masked_attention(
        qt, kt, vt, weights > 0, scale, dtype, weights.log(), softcap=softcap, sinks=sinks
    )
    if sinks is not None and key_padding_mask is not None:  # padding is no query: no sink
        padding = key_padding_mask[:, L - Lq :].to(q.device).unsqueeze(1)
        lse = lse.masked_fill(padding, float("-inf"))
        out = out.masked_fill(padding.unsqueeze(-1), 0.0)  # a NaN sink's too
    return out.transpose(1, 2), lse


class _SeenValues(torch.autograd.Function):
    """``probs @ v`` (``v`` finite, ``probs`` exactly 0 at the pairs a query does not see) whose
    gradient for ``v`` runs through the pairs a query sees only: a key no query sees gets exactly
    0 from a row whose ``dout`` is NaN or infinite. (Autograd through the plain matmul computes
    ``probs^T @ dout``, and ``0 * inf`` is NaN: a gradient the exact math keeps finite.)"""

    @staticmethod
    def forward(ctx: Any, probs: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(probs, v, seen)
        return probs @ v

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        probs, v, seen = ctx.saved_tensors
        dprobs = grad @ v.transpose(-1, -2)  # unseen pairs: masked by the caller's where()
        if bool(torch.isfinite(grad).all()):
            return dprobs, probs.transpose(-1, -2) @ grad, None
        seen = seen.expand(probs.shape)
        zero = grad.new_zeros(())
        dv = torch.zeros(probs.shape[:-2] + v.shape[-2:], dtype=v.dtype, device=v.device)
        for i in range(probs.shape[-2]):  # one query row at a time: (N, H, Lk, D) in memory
            pair = seen[..., i, :].unsqueeze(-1)
            dv += torch.where(
                pair, probs[..., i, :].unsqueeze(-1) * grad[..., i, :].unsqueeze(-2), zero
            )
        return dprobs, dv, None


def _weighted_values(probs: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``sum_j probs_ij v_j`` over the keys ``j`` query ``i`` sees; a matmul when ``v`` is finite
    (:class:`_SeenValues`), otherwise unseen keys are dropped before the product (``0 * inf``
    would be NaN)."""
    if bool(torch.isfinite(v).all()):
        return _SeenValues.apply(probs, v, seen)  # type: ignore[no-untyped-call,no-any-return]
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
    cu_seqlens: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    window: tuple[int | None, int | None] | KeyWindow | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention as docs/spec.md defines it, evaluated densely in float64; differentiable.

    Same arguments and return convention as :func:`ringdilated.dilated_attention` (no dropout;
    documents, padding and a query suffix included), results in float64; and section 5's key
    ``window`` ``(left, right)``, ``softcap`` and per-head ``sinks`` (see
    :func:`dense_attention`); the library's calls take ``softcap`` and ``sinks`` too.
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
        cu_seqlens=cu_seqlens,
        key_padding_mask=key_padding_mask,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )
    return (out, lse) if return_lse else out


def nan_allowed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    mode: str = "head_groups",
    cu_seqlens: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(B, Lq, H)`` bool: which outputs of :func:`ringdilated.dilated_attention` (and their
    lse) docs/spec.md, section 4 lets be NaN although the exact result is finite, because a
    non-finite input sits in their own kernel block (a key hidden by the causal mask, say,
    weighted ``0 * inf``).

    Entry ``(b, p, h)`` may be NaN when ``q[b, p, h]`` holds NaN or infinity, or when, for a
    pattern (and offset) of head ``h`` that selects ``p`` (``longnet``: any of them, as their
    partial results are merged), the segment of ``p`` holds a NaN or infinite ``k`` or ``v`` (of
    ``h``'s key/value head) at a position that pattern selects. Same arguments as :func:`oracle`
    (causal masking does not matter: a hidden key is in the block). Pair it with
    :func:`ringdilated.testing.assert_non_finite_rule`.
    """
    Lq, H = q.shape[1:3]
    L = k.shape[1]
    sees = pattern_weights(  # (B', H, L, L): some pattern of head h lets query p see key j
        L,
        H,
        segment_lengths,
        dilation_rates,
        mode=mode,
        device=q.device,
        cu_seqlens=cu_seqlens,
        key_padding_mask=key_padding_mask,
    ).gt(0)
    kv_bad = (~torch.isfinite(k)).any(-1) | (~torch.isfinite(v)).any(-1)  # (B, L, Hkv)
    bad = kv_bad.repeat_interleave(H // k.shape[2], dim=2).transpose(1, 2)  # (B, H, L)
    reached = (sees & bad.unsqueeze(2)).any(-1).transpose(1, 2)  # (B, L, H)
    q_bad = (~torch.isfinite(q)).any(-1)  # (B, Lq, H)
    return reached[:, L - Lq :] | q_bad
