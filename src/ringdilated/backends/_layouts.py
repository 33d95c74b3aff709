"""What the flash-attention kernels assume of the memory they are handed.

The lse their backwards read: float32 and dense (FlashAttention 2 and 3 read it by address as a
``(batch, heads, seqlen_q)`` array, whatever its strides): :func:`dense_float32`.

The inputs of the TMA-based kernels (FlashAttention 3 and 4): a 16-byte aligned start and row
strides that are multiples of 16 bytes. A Hopper tensor map
(``cuTensorMapEncodeTiled``) refuses anything else, and FlashAttention 4 compiles its kernels
with that divisibility assumed (``assumed_align=16``, strides ``divisibility=8`` for 2-byte
types, ``flash_attn/cute/interface.py`` of 4.0.0b5). ``flash_api.cpp`` of FlashAttention 3 does
not check it. The driver's views meet it whenever the head dim is a multiple of 8 and the
caller's tensor starts aligned; :func:`aligned` copies the rare view that does not. The
flash-attn 2, torch flash and cuDNN wrappers apply it too: their kernels load 128 bits at a time
(``cp.async`` in flash-attn 2) and cuDNN's descriptors assume the same alignment.

:func:`is_aligned` and :func:`aligned` read only metadata (storage offset and strides), never
the device; :func:`aligned` and :func:`dense_float32` copy with ``clone(memory_format=...)``,
not ``contiguous()``, so they also run on FakeTensor ``cuda``
tensors in a CPU-only torch (whose ``contiguous()`` of a strided fake ``cuda`` tensor fails).
"""

from __future__ import annotations

import torch

__all__ = ["ALIGNMENT", "aligned", "dense_float32", "is_aligned"]

#: Bytes: the alignment of a tensor map's global address and of its strides.
ALIGNMENT = 16


def is_aligned(x: torch.Tensor) -> bool:
    """Whether ``x`` starts ``ALIGNMENT`` bytes into an aligned allocation (PyTorch's allocators
    align every allocation to more than that) and steps by multiples of ``ALIGNMENT`` bytes
    along every dimension but the last (which is contiguous); dimensions of one element are
    never stepped along."""
    size = x.element_size()
    if x.stride(-1) != 1 or (x.storage_offset() * size) % ALIGNMENT:
        return False
    strides = zip(x.shape[:-1], x.stride()[:-1], strict=True)
    return all((stride * size) % ALIGNMENT == 0 for n, stride in strides if n > 1)


def aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` when :func:`is_aligned`, else a contiguous copy (which is, for a last dimension of
    ``ALIGNMENT`` bytes' multiple)."""
    return x if is_aligned(x) else x.clone(memory_format=torch.contiguous_format)


def dense_float32(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` as float32 with a contiguous layout (itself when it already is)."""
    lse = lse.to(torch.float32)
    return lse if lse.is_contiguous() else lse.clone(memory_format=torch.contiguous_format)
