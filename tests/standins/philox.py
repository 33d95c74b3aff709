"""The device generator's Philox ``(seed, offset)`` and a fused kernel's dropout mask, emulated on
the CPU generator so dropout stand-ins fail where the real kernels would.

``CUDAGeneratorImpl::philox_cuda_state(increment)`` returns the generator's seed and its running
offset, then advances the offset; ``manual_seed`` resets the offset to 0. torch's CPU generator
(Mersenne twister) has no offset, so :func:`philox_state` derives one from its state: 0 exactly
when the generator is as ``manual_seed`` left it, otherwise a nonzero value fixed by the state;
it then advances the generator, as the real call does. A wrapper that does not seed before a
fused call therefore gets a mask it cannot replay from the seed alone, and one that does not
restore the generator moves the caller's random stream: both show here.

:func:`keep_mask` is a pure function of ``(seed, offset)``, the shape and the probability, as
flash-attn's Philox mask is: ``flash_api.cpp`` keeps an element when its random byte is at most
``floor((1 - p) * 255)`` (``p_dropout_in_uint8_t``) and scales kept ones by ``1 / (1 - p)``.
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = ["keep_mask", "philox_state"]


def _digest(*parts: object, bits: int = 60) -> int:
    text = ",".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> (64 - bits)


def philox_state(generator: torch.Generator) -> tuple[int, int]:
    """``(seed, offset)`` of ``generator`` as a fused kernel's launch reads them (each as the
    int64 that holds its 64 bits in ``rng_state``), then the generator advanced (as
    ``philox_cuda_state`` advances its offset)."""
    seed = generator.initial_seed()
    seed = seed - (1 << 64) if seed >= 1 << 63 else seed
    state = generator.get_state()
    fresh = torch.Generator().manual_seed(seed).get_state()
    offset = 0 if torch.equal(state, fresh) else 4 * (_digest(state.numpy().tobytes()) + 1)
    torch.randint(0, 2, (1,), generator=generator)
    return seed, offset


def keep_mask(seed: int, offset: int, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """flash-attn's keep decision for attention probabilities of ``shape``: a function of
    ``(seed, offset)``, the shape and ``p`` only."""
    generator = torch.Generator().manual_seed(_digest(seed, offset))
    random_bytes = torch.randint(0, 256, shape, generator=generator)
    return random_bytes <= math.floor((1.0 - p) * 255)
