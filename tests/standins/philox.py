"""The CUDA default generator's Philox state, modelled on the CPU generator the stand-ins use.

A CUDA generator is a seed and an offset: ``manual_seed`` sets the seed and resets the offset to 0,
and each kernel that draws takes the current ``(seed, offset)`` and moves the offset on
(``philox_cuda_state(n)``: by ``n`` rounded up to a multiple of 4). Its random numbers are a pure
function of ``(seed, offset)`` and the element's position. The stand-ins run on the CPU, whose
generator has no offset, so :func:`take` keeps one: 0 when the generator is exactly as
``manual_seed(initial_seed())`` left it, the offset the last take left when nothing has touched the
generator since, and an offset made from its state otherwise (someone else drew from it: the running
offset is unknown, but a function of the state). Each take also draws from the generator, so a
caller whose generator is not restored afterwards sees its stream move, as it would on a GPU.

:func:`uniform` gives the numbers a kernel draws for ``(seed, offset)``: a backward handed the
same pair regenerates the forward's mask, and any other pair gives another one. :func:`keep_mask`
is flash-attn's keep decision on them: ``flash_api.cpp`` keeps an element when its random byte is
at most ``floor((1 - p) * 255)`` (``p_dropout_in_uint8_t``).
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = ["keep_mask", "philox_state", "take", "uniform"]

#: Per generator (by identity): its state after the last take, and the offset that take left.
_TAKEN: dict[int, tuple[torch.Tensor, int]] = {}


def _fresh(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def _hash(*parts: object) -> int:
    text = ",".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def take(generator: torch.Generator, increment: int) -> tuple[int, int]:
    """``(seed, offset)`` for one kernel launch that draws ``increment`` numbers; the offset
    then moves on by ``increment`` rounded up to a multiple of 4, as ``philox_cuda_state`` moves
    it (torch's ``aten/src/ATen/cuda/CUDAGeneratorImpl.cpp``)."""
    seed = generator.initial_seed()
    state = generator.get_state()
    last = _TAKEN.get(id(generator))
    if torch.equal(state, _fresh(seed)):
        offset = 0
    elif last is not None and torch.equal(state, last[0]):
        offset = last[1]
    else:
        offset = 4 * (_hash(state.sum().item(), state.numel()) % (1 << 40)) + 4
    torch.rand((), generator=generator)
    step = -(-increment // 4) * 4  # philox_cuda_state rounds up to a multiple of 4
    _TAKEN[id(generator)] = (generator.get_state(), offset + step)
    return seed, offset


def uniform(seed: int, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float64 numbers in ``[0, 1)`` for each element of ``shape``: a pure function of
    ``(seed, offset)`` and the position."""
    generator = torch.Generator().manual_seed(_hash("philox", seed, offset))
    return torch.rand(shape, generator=generator, dtype=torch.float64)


def philox_state(generator: torch.Generator, increment: int) -> tuple[int, int]:
    """:func:`take`, with the seed as the int64 that holds its 64 bits (``rng_state``'s dtype in
    flash-attn 2)."""
    seed, offset = take(generator, increment)
    return (seed - (1 << 64) if seed >= 1 << 63 else seed), offset


def keep_mask(seed: int, offset: int, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """Which elements of ``shape`` an 8-bit Philox dropout keeps for ``(seed, offset)``: a random
    byte at most ``floor((1 - p) * 255)`` (flash-attn's rule, which torch's flash op shares)."""
    return (uniform(seed, offset, shape) * 256).floor() <= math.floor((1.0 - p) * 255)
