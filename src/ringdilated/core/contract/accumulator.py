"""Exact log-sum-exp merging of partial attention results.

A partial result over a subset of a query's keys is ``(out, lse)``: the softmax-weighted mean of
those keys' values and the log of their softmax denominator. Two partials over disjoint key sets
(or over the same keys counted twice, as LongNet's pattern mixing does) merge into the result over
the union::

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

The merge is associative and commutative, so ring steps and patterns may arrive in any order. It
runs in float32 (float64 for float64 inputs), is stable for scores of any magnitude (only
differences of ``lse`` are exponentiated) and treats ``lse = -inf`` (a block in which the query
sees no key, or sees keys whose scores are all ``-inf``) as the identity: such a partial's
``out`` (0, or NaN for ``-inf`` scores, as softmax gives) takes no part in a merge with a live
partial, and two of them merge into the sum of their outputs (so NaN survives only when every
partial is dead and one of them saw keys: exactly when softmax over the union is NaN).
"""

from __future__ import annotations

import torch

__all__ = ["Accumulator", "accumulation_dtype", "merge_partials"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax state is kept in for inputs of ``dtype``: float32 (float64 for float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    lse = torch.logaddexp(lse_a, lse_b)
    # Where both are -inf the merged lse is -inf; use 0 there so exp(-inf - 0) = 0, not NaN.
    dead = torch.isneginf(lse)
    finite = torch.where(dead, torch.zeros_like(lse), lse)
    return lse, torch.exp(lse_a - finite), torch.exp(lse_b - finite)


def _term(
    out: torch.Tensor, weight: torch.Tensor, lse_part: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    """``weight * out``, except 0 for a dead partial (``lse_part = -inf``) next to a live one:
    its ``out`` (possibly NaN) is not part of the union's softmax."""
    drop = torch.isneginf(lse_part) & torch.isneginf(lse).logical_not()
    term = out * weight.unsqueeze(-1)
    return torch.where(drop.unsqueeze(-1), torch.zeros_like(term), term)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results into a new ``(out, lse)``; nothing is modified in place.

    ``out_*`` are ``(..., L, D)`` and ``lse_*`` the matching ``(..., L)``. The result is in the
    accumulation dtype of ``out_a`` (float32, or float64 for float64 inputs).
    """
    dtype = accumulation_dtype(out_a.dtype)
    lse_a, lse_b = lse_a.to(dtype), lse_b.to(dtype)
    lse, w_a, w_b = _weights(lse_a, lse_b)
    out = _term(out_a.to(dtype), w_a, lse_a, lse) + _term(out_b.to(dtype), w_b, lse_b, lse)
    return out, lse


class Accumulator:
    """A running ``(out, lse)`` that partial results are merged into, in place.

    Starts empty (``out = 0``, ``lse = -inf``). :meth:`add` takes views of the running state, so
    a partial result over any strided selection of queries merges without a gather.
    """

    def __init__(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        if out.dtype not in (torch.float32, torch.float64) or lse.dtype != out.dtype:
            raise TypeError(
                f"accumulator state must be float32 or float64 and share a dtype, got out "
                f"{out.dtype} and lse {lse.dtype}"
            )
        self.out = out.zero_()
        self.lse = lse.fill_(float("-inf"))

    @classmethod
    def empty(
        cls,
        out_shape: tuple[int, ...],
        lse_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> Accumulator:
        """A new empty accumulator for inputs of ``dtype`` (state in its accumulation dtype)."""
        acc = accumulation_dtype(dtype)
        return cls(
            torch.empty(out_shape, dtype=acc, device=device),
            torch.empty(lse_shape, dtype=acc, device=device),
        )

    @staticmethod
    def add(
        out_view: torch.Tensor, lse_view: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
    ) -> None:
        """Merge ``(out, lse)`` into the state views ``(out_view, lse_view)`` in place."""
        lse = lse.to(lse_view.dtype)
        merged, w_state, w_new = _weights(lse_view, lse)
        state = _term(out_view, w_state, lse_view, merged)
        out_view.copy_(state + _term(out.to(out_view.dtype), w_new, lse, merged))
        lse_view.copy_(merged)
