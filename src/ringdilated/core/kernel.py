"""The kernel interface: the one contract every attention backend implements.

A kernel solves a batch of independent softmax-attention problems and returns the log-sum-exp
with the output, so partial results can be merged exactly (:mod:`ringdilated.core.accumulator`).
Its backward takes the **final, merged** ``out`` and ``lse`` of each query, not the kernel's own
partial ones: with ``P = exp(scale * q k^T - lse_final)`` and ``D = rowsum(dout * out_final)``
each block's gradient is its exact share of the full gradient. That one rule lets any kernel
serve a ring or a pattern mix with exact gradients.

Shapes (kernel layout, ``N`` independent problems)::

    q:   (N, Hq, Lq, D)        k, v: (N, Hkv, Lk, D)     Hkv divides Hq; query head h reads
    out: (N, Hq, Lq, D) q.dtype                           key/value head h // (Hq // Hkv)
    lse: (N, Hq, Lq) float32 (float64 for float64 inputs), -inf where a query sees no key

Inputs may be strided views (the driver passes dilated selections without copying); the last
dimension is contiguous. A kernel never modifies its inputs.

Non-finite inputs: NaN and infinity must reach exactly the outputs dense masked attention gives
them to (a key a query does not see takes no part, and a hidden value is never multiplied by a
zero weight; a row whose visible scores are all ``-inf`` gives NaN ``out`` with ``lse = -inf``),
never fewer and never more. Fused kernels are not exact for them; the usual remedy is to run
exact dense math for a call whose inputs are not all finite. :func:`inputs_finite` says which:
``BlockOptions.finite`` when the driver already checked the whole call, else one summing pass.
The conformance kit's ``non-finite`` check holds every kernel to this.
"""

from __future__ import annotations

import hashlib
from typing import Protocol, runtime_checkable

import attrs
import torch

__all__ = ["BlockOptions", "Kernel", "all_finite", "derive_seed", "inputs_finite"]


def derive_seed(seed: int, *path: int | str) -> int:
    """A seed for the part ``path`` of a call seeded with ``seed``: distinct parts get unrelated
    seeds in every bit. (Adding an offset is not enough: torch's CPU generator keeps only the low
    32 bits of a seed, so ``seed + (1 << 40)`` draws the same mask as ``seed``.)"""
    text = ",".join(map(str, (seed, *path))).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def _check_dropout(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"dropout_p must satisfy 0 <= dropout_p < 1, got {value!r}")


@attrs.frozen
class BlockOptions:
    """Everything about one block besides its tensors.

    - ``scale``: multiplies ``q . k`` before the softmax.
    - ``causal_offset``: ``None`` for no causal mask; otherwise key ``j`` is visible to query
      ``i`` (both counted from the block's start) iff ``j <= i + causal_offset``. ``0`` is the
      usual diagonal block; a block wholly below the diagonal never needs a mask and is passed
      with ``None``.
    - ``dropout_p`` and ``dropout_seed``: attention probabilities are zeroed with probability
      ``dropout_p`` and the rest scaled by ``1 / (1 - dropout_p)``. The mask is a pure function of
      the seed and the block's shape and device, so backward regenerates the same mask.
    - ``finite``: ``True`` when the caller checked that the block's inputs (and ``dout`` in
      backward) hold no NaN or infinity, ``False`` when some may, ``None`` when unknown (the
      kernel checks itself if it needs to; see :func:`inputs_finite`).
    """

    scale: float
    causal_offset: int | None = None
    dropout_p: float = attrs.field(default=0.0, validator=_check_dropout)
    dropout_seed: int = 0
    finite: bool | None = None

    def visible_rows_start(self) -> int:
        """First query row that sees at least one key (rows before it are empty)."""
        return 0 if self.causal_offset is None else max(0, -self.causal_offset)

    def mark_empty_rows(self, out: torch.Tensor | None, lse: torch.Tensor) -> None:
        """Give the rows that see no key (those before :meth:`visible_rows_start`) the
        contract's ``lse = -inf`` (and ``out = 0`` when ``out`` is given), in place: for kernels
        whose op reports something else for them (``lse = 0``, or NaN)."""
        empty = min(self.visible_rows_start(), lse.shape[-1])
        if empty:
            lse.narrow(-1, 0, empty).fill_(float("-inf"))
            if out is not None:
                out.narrow(-2, 0, empty).zero_()

    def needs_mask(self, q_len: int, k_len: int) -> bool:
        """Whether any key is hidden from any query of a ``q_len x k_len`` block."""
        return self.causal_offset is not None and self.causal_offset < k_len - 1


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether no element of ``tensors`` is NaN or infinite: one summing pass and one host read
    (a sum is non-finite whenever an element is; a sum of finite values that overflows only
    answers ``False`` wrongly, which sends a call to an exact, slower path)."""
    if not tensors:
        return True
    totals = [
        t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32) for t in tensors
    ]
    return bool(torch.isfinite(torch.stack(totals)).all())


def inputs_finite(options: BlockOptions, *tensors: torch.Tensor) -> bool:
    """``options.finite`` when the caller knows, else :func:`all_finite` of ``tensors``."""
    return options.finite if options.finite is not None else all_finite(*tensors)


@runtime_checkable
class Kernel(Protocol):
    """An attention kernel. See the module docstring for shapes and the backward rule."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(out, lse)`` for the block; rows with no visible key give ``0`` and ``-inf``."""
        ...

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
        """Return ``(dq, dk, dv)`` shaped like ``(q, k, v)``.

        ``out`` and ``lse`` are the final merged values of these queries; ``lse`` is float32 or
        float64 and may be ``-inf`` (that row's gradients are zero).
        """
        ...
