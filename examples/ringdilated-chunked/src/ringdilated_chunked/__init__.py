"""Streaming attention over key chunks: the FlashAttention recurrence in plain PyTorch.

Forward keeps a running maximum ``m``, normaliser ``l`` and unnormalised output per query and
folds in one key chunk at a time, so no ``Lq x Lk`` score matrix is ever held. Backward follows
the ringdilated kernel contract: with the *final* merged ``out`` and ``lse`` it recomputes each
chunk's probabilities ``P = exp(scale * q k^T - lse)`` and accumulates the gradients.

NaN and infinity (the contract's non-finite rule, checked by the conformance kit's
``non-finite`` and ``non-finite-gradients`` checks) are handled by the math itself, on the
device, with no host read. Three details make it so:

- a row is empty (``out = 0``, ``lse = -inf``) because the causal mask hides every key from it,
  never because its normaliser is 0: a row whose visible scores are all ``-inf`` (an infinite
  query or key) divides ``0 / 0`` and is NaN, as softmax is;
- in backward, ``lse = +inf`` (a score of ``+inf``: softmax is NaN) and ``lse = -inf`` on a row
  that sees keys are made NaN, so ``exp(s - lse)`` cannot quietly weight the row by zero;
- hidden keys' scores are replaced by ``-inf`` with ``masked_fill`` (a NaN score goes too); a
  hidden NaN value still meets a zero weight in ``P @ V`` and makes NaN in its own problem, which
  the contract allows.
"""

from __future__ import annotations

import torch

from ringdilated.core import BlockOptions, Capabilities, KernelSpec, Target
from ringdilated.plugins import hookimpl

__all__ = ["CHUNKED_SPEC", "ChunkedKernel"]
__version__ = "0.1.0"

_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class ChunkedKernel:
    """``chunk`` keys per step (the last step may be shorter)."""

    def __init__(self, chunk: int = 128) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be a positive number of keys, got {chunk!r}")
        self.chunk = chunk

    def _scores(
        self, q: torch.Tensor, k: torch.Tensor, start: int, options: BlockOptions
    ) -> torch.Tensor:
        """Scaled, masked scores of ``q`` against the key chunk that begins at ``start``."""
        group = q.shape[1] // k.shape[1]
        keys = k.to(q.dtype).repeat_interleave(group, 1)
        scores = q @ keys.transpose(-1, -2) * options.scale
        if options.window.right is not None:
            rows = torch.arange(q.shape[-2], device=q.device).unsqueeze(1)
            cols = torch.arange(start, start + k.shape[-2], device=q.device)
            scores = scores.masked_fill(cols > rows + options.window.right, float("-inf"))
        return scores

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        work = _work_dtype(q.dtype)
        qw = q.to(work)
        group = q.shape[1] // k.shape[1]
        shape = q.shape[:-1]
        running_max = torch.full(shape, float("-inf"), dtype=work, device=q.device)
        normaliser = torch.zeros(shape, dtype=work, device=q.device)
        acc = torch.zeros(*shape, v.shape[-1], dtype=work, device=q.device)
        for start in range(0, k.shape[-2], self.chunk):
            stop = min(start + self.chunk, k.shape[-2])
            scores = self._scores(qw, k[..., start:stop, :], start, options)
            new_max = torch.maximum(running_max, scores.amax(-1))
            safe_max = torch.where(torch.isneginf(new_max), 0.0, new_max)
            rescale = torch.exp(running_max - safe_max)
            p = torch.exp(scores - safe_max.unsqueeze(-1))
            values = v[..., start:stop, :].to(work).repeat_interleave(group, 1)
            acc = acc * rescale.unsqueeze(-1) + p @ values
            normaliser = normaliser * rescale + p.sum(-1)
            running_max = new_max
        out = acc / normaliser.unsqueeze(-1)  # 0 / 0 = NaN where every visible score is -inf
        lse = running_max + torch.log(normaliser)
        options.mark_empty_rows(out, lse)  # rows the mask hides every key from: 0 and -inf
        return out.to(q.dtype), lse

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        work = _work_dtype(q.dtype)
        qw, dow = q.to(work), dout.to(work)
        group = q.shape[1] // k.shape[1]
        lse = lse.to(work)
        # +inf (softmax is NaN there) and -inf on a row that sees keys (every visible score is
        # -inf) become NaN; -inf on a row the mask hides every key from becomes 0 (P = 0).
        lse = torch.where(torch.isinf(lse), float("nan"), lse)
        empty = min(options.visible_rows_start(), lse.shape[-1])
        if empty:
            lse[..., :empty] = 0.0
        finite_lse = lse.unsqueeze(-1)
        delta = (dow * out.to(work)).sum(-1, keepdim=True)
        dq = torch.zeros_like(qw)
        dk = torch.zeros(*k.shape, dtype=work, device=k.device)
        dv = torch.zeros(*v.shape, dtype=work, device=v.device)
        for start in range(0, k.shape[-2], self.chunk):
            stop = min(start + self.chunk, k.shape[-2])
            keys = k[..., start:stop, :].to(work).repeat_interleave(group, 1)
            values = v[..., start:stop, :].to(work).repeat_interleave(group, 1)
            p = torch.exp(self._scores(qw, k[..., start:stop, :], start, options) - finite_lse)
            ds = p * (dow @ values.transpose(-1, -2) - delta) * options.scale
            dq += ds @ keys
            n, h, length, d = keys.shape
            dk[..., start:stop, :] = (
                (ds.transpose(-1, -2) @ qw).view(n, h // group, group, length, d).sum(2)
            )
            dv[..., start:stop, :] = (
                (p.transpose(-1, -2) @ dow).view(n, h // group, group, length, -1).sum(2)
            )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


CHUNKED_SPEC = KernelSpec(
    name="chunked",
    factory=ChunkedKernel,
    capabilities=Capabilities(
        targets=(Target("cpu", _FLOATS), Target("cuda", _FLOATS)),
        causal=True,
        backward=True,
        dropout=False,
        gqa=True,
    ),
    priority=-5,
    description="streaming online-softmax attention in plain PyTorch (example plugin)",
)


@hookimpl
def ringdilated_kernels() -> list[KernelSpec]:
    return [CHUNKED_SPEC]
