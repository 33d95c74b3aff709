"""Reading a tensor's memory the way a CUDA kernel does: from its data pointer, with the element
type, sizes and strides the *kernel* assumes, whatever the tensor's own metadata says.

This is what lets a stand-in be wrong exactly where the real kernel is: a kernel that hard-codes
a stride reads other elements than the ones the tensor's strides name, and a stand-in that reads
through :func:`read_as` gets those same elements.
"""

from __future__ import annotations

import torch

__all__ = ["OutOfBoundsReadError", "read_as"]


class OutOfBoundsReadError(IndexError):
    """A kernel's assumed addressing reaches past the tensor's storage (on a GPU: garbage or a
    fault)."""


def read_as(
    x: torch.Tensor,
    sizes: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The elements a kernel reads from ``x``'s data pointer with ``sizes`` and ``strides`` (in
    elements of ``dtype``, default ``x.dtype``); a copy. Raises :class:`OutOfBoundsReadError`
    when the addressing leaves ``x``'s storage."""
    dtype = dtype or x.dtype
    item = torch.empty((), dtype=dtype).element_size()
    start_bytes = x.storage_offset() * x.element_size()
    if start_bytes % item:
        raise OutOfBoundsReadError(f"data pointer not aligned to {dtype}")
    start = start_bytes // item
    last = start + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True) if n > 0)
    capacity = x.untyped_storage().nbytes() // item
    if any(n == 0 for n in sizes):
        return torch.empty(sizes, dtype=dtype, device=x.device)
    if last >= capacity:
        raise OutOfBoundsReadError(
            f"reading {sizes} with strides {strides} from element {start} reaches element {last} "
            f"of a {capacity}-element storage"
        )
    view = torch.empty(0, dtype=dtype, device=x.device)
    view.set_(x.untyped_storage(), start, sizes, strides)
    return view.clone()
