"""Dropout in fused kernels that draw their own mask: make it a function of the contract's seed.

flash-attn and torch's fused CUDA attention ops draw the dropout mask from the device's default
generator: a Philox seed and the generator's running offset (``philox_cuda_state``), which the op
reports so its backward can replay the mask. The kernel contract's backward gets no such state: the
mask must be a pure function of ``BlockOptions.dropout_seed``
(:class:`~ringdilated.core.contract.kernel.BlockOptions`). So the forward runs with the generator
seeded by that seed (its offset then starts at 0, as ``manual_seed`` resets it) and restored
afterwards (the caller's random stream does not move), and the backward is handed ``(seed, 0)`` in
the form its op reads, built without reading anything back from the device:

- :func:`replay_state`: one 2-element tensor on the device, ``[seed, offset]`` (torch's flash op
  at 2.13 returns ``rng_state``, ``uint64[2]``, and its backward reads it as ``philox_seed``);
- :func:`replay_scalars`: two 0-d tensors, seed and offset (torch's memory-efficient op returns
  ``int64`` scalars on the host in eager mode and its backward reads them there).

A forward that makes several op calls under one seeding (the memory-efficient op's grouped
heads, one call per key/value head) moves the offset on with each: call ``i`` starts at the sum
of the earlier calls' :func:`philox_increment`, and its backward is handed that offset.

Limits: the generator is the process's, so two threads running dropout on one device at once
would see each other's seed (torch's own dropout shares that generator the same way); and torch
refuses to reseed a CUDA generator while a CUDA graph is being captured, so a fused kernel's
dropout cannot be captured (it raises; without dropout nothing here runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "default_generator",
    "philox_increment",
    "replay_scalars",
    "replay_state",
    "seeded_generator",
]


def default_generator(device: torch.device) -> torch.Generator:
    """The generator a fused kernel on ``device`` draws from: the CUDA device's default one, or
    torch's CPU generator (for stand-ins that run on the CPU)."""
    if device.type == "cpu":
        return torch.default_generator
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


@contextlib.contextmanager
def seeded_generator(device: torch.device, seed: int) -> Iterator[None]:
    """``device``'s default generator seeded with ``seed`` (offset 0) inside the block, its
    state restored on exit. The state is host memory (a seed and an offset): no device sync."""
    generator = default_generator(device)
    state = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(state)


def replay_state(seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[seed, 0]`` as a 2-element ``dtype`` tensor on ``device`` (what a forward run under
    :func:`seeded_generator` reports as its ``rng_state``), made by fills on the device."""
    state = torch.zeros(2, dtype=dtype, device=device)
    state.narrow(0, 0, 1).fill_(seed)
    return state


def philox_increment(count: int) -> int:
    """How far an op that draws ``count`` numbers moves its generator's offset:
    ``philox_cuda_state(count)`` rounds the increment up to a multiple of 4 (torch's
    ``aten/src/ATen/cuda/CUDAGeneratorImpl.cpp``, "Why enforce RNG offset % 4 == 0?")."""
    return -(-count // 4) * 4


def replay_scalars(
    seed: int, device: torch.device, dtype: torch.dtype = torch.int64, *, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seed, offset)`` as two 0-d ``dtype`` tensors on ``device``: the Philox seed and offset
    a forward run under :func:`seeded_generator` reports as separate scalars (``offset`` 0 for
    its first draw), made by fills."""
    return (
        torch.zeros((), dtype=dtype, device=device).fill_(seed),
        torch.zeros((), dtype=dtype, device=device).fill_(offset),
    )
