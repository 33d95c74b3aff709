"""PyTorch's own fused attention kernels, called through their aten ops so the lse comes back.

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, which read every
  tensor through its real strides. A fully masked row comes back with ``lse = 0``; this kernel
  reports ``-inf`` as the contract says. No dropout (the op raises "Currently do not support
  dropout > 0").
- CUDA: ``aten._scaled_dot_product_efficient_attention`` and its backward
  (:class:`EfficientAttention`), the memory-efficient op: every fp16/fp32 GPU from sm50, bf16
  from sm80, and the fallback of torch's two faster CUDA ops, which are kernels of their own:
  ``torch_flash`` (:mod:`ringdilated.backends.torch_flash`, torch's FlashAttention 2 op, sm80 on)
  and ``cudnn`` (:mod:`ringdilated.backends.cudnn`, cuDNN's op). Not yet run on GPU hardware by
  this project: it is checked on FakeTensor ``cuda`` tensors and against a stand-in that reads
  memory the way the kernel does.

Causal blocks use the op's own diagonal mask when the offset is 0 and an additive mask otherwise;
a sliding window (a left bound) is always an additive mask, which the ops apply to every score
they compute: the driver hands a window's blocks over in row chunks holding only the keys their
rows see (:mod:`ringdilated.core.run.limited`), so the masked work stays about ``rows x window``.

Grouped-query heads: the CPU op takes ``k``, ``v`` with fewer heads (its backward runs one
thread per key/value head). The memory-efficient op checks equal head counts
(``_efficient_attention_forward`` and ``_efficient_attention_backward``: ``query.size(2) ==
key.size(2)``) but reads ``k``, ``v`` through their strides (``attention.cu`` and
``attention_backward.cu`` pass ``key.stride(0..2)`` as ``k_strideB/M/H``; the kernels address
``key_ptr + batch_id * k_strideB + head_id * k_strideH``; the only stride rules are a contiguous
last dimension and strides that are multiples of the alignment, which 0 is), and its backward
allocates its own dense ``grad_k = at::empty(key.sizes())``, one gradient per query head. So a
key/value head is handed over *expanded* to its group's query heads with stride 0
(:func:`~ringdilated.backends._heads.kv_groups`): a view, nothing repeated; one call per
key/value head (one call for a single key/value head), the results joined along heads and the
per-query-head ``dk``, ``dv`` summed over each group. Read in pytorch's
``aten/src/ATen/native/transformers/cuda/attention.cu``, ``attention_backward.cu`` and
``mem_eff_attention/kernel_forward.h``/``kernel_backward.h`` (``check_supported``) as stored
near the 2.13 release (an older, ``c10::optional``-era copy allocates ``grad_k`` the same way);
pytorch pull request 191085 reports the op matching the math backend's forward and gradients
on zero-stride expanded key/value views.

Dropout (CUDA): the memory-efficient op draws its mask from the CUDA default generator
(``philox_cuda_state``) and returns the Philox seed and offset as ``int64`` scalars on the host
(eager mode); its backward reads them there (``*philox_seed.data_ptr<int64_t>()``). So the
forward runs under :func:`~ringdilated.backends._philox.seeded_generator` with the block's
``dropout_seed`` and the backward gets :func:`~ringdilated.backends._philox.replay_scalars` of it
on the host: the mask is a function of the seed, as the contract asks. The keep test compares a
uniform float with ``p`` and kept values are scaled by ``1 / (1 - p)``. Grouped heads make one
call per key/value head under that one seeding; each draws ``N * r * Lq * Lk`` numbers, which
moves the offset on by that count rounded up to a multiple of 4
(:func:`~ringdilated.backends._philox.philox_increment`), so call ``g``'s backward replays from
``g`` times that.

Deterministic: the CPU backward parallelises over (batch, key/value head), each gradient element
written by one thread in a fixed order (``cpu_flash_attention_backward`` in
``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``); the memory-efficient backward sets
``num_splits_key = 1`` when ``torch.are_deterministic_algorithms_enabled()`` and not in warn-only
mode (``_efficient_attention_backward``, ``attention_backward.cu``), the strict switch
``ringdilated.core.deterministic_algorithms()`` reads.

Non-finite inputs (docs/spec.md, section 4). Neither op is exact for NaN or infinity, so their
results are repaired on the device, with no host read, each path by what its op gets wrong:

- The CPU flash op (torch 2.13, ``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``) keeps a
  running row maximum with ``std::max``, which drops NaN: a row whose visible scores are all NaN
  or ``-inf`` is taken for fully masked (``out = 0``, ``lse = 0``); and in bfloat16 its ``exp``
  approximation gives a ``+inf`` score zero weight (``lse = +inf``, a finite ``out``). Every
  other non-finite input reaches its rows through the op's own arithmetic (``v`` through
  ``P @ v``, where ``0 * inf`` is NaN even at zero weight; a row with some finite scores through
  ``exp(NaN - max)``). Both failures need a non-finite query row or a non-finite key in the
  problem (or finite scores that overflow float32 to ``-inf``, which no repair here detects:
  dense attention in that dtype overflows too), so the forward makes NaN the query's own row
  where it is non-finite and the whole problem where a key is, as the rule allows
  (:func:`_mark_rows_seeing_non_finite`; ``v`` is not read). The op's backward recomputes
  ``P = exp(s - lse)`` for every row and key it visits, so a merged ``lse`` handed over as NaN
  (:func:`_cpu_lse`, the one pass over the lse the op needs anyway) spreads the NaN to that
  row's ``dq`` and to the ``dk``, ``dv`` of the keys it sees; a non-finite ``dout`` spreads by
  the same arithmetic. That is the backward's whole repair.
- The memory-efficient CUDA kernel zeroes such rows too (``s_prime == 0`` in torch's
  ``epilogue_rescale_output.h``); not yet run on hardware, it keeps the general repair
  (:func:`~ringdilated.core.contract.kernel.mark_non_finite_rows`,
  :func:`~ringdilated.core.contract.kernel.mark_non_finite_problems`).

The conformance kit's ``non-finite`` and ``non-finite-gradients`` checks hold both paths to the
rule; the cost of the repair is measured by ``benchmarks/bench_non_finite.py`` and
``benchmarks/bench_overhead.py`` (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ringdilated.backends import _dense
from ringdilated.backends._heads import join_heads, kv_groups
from ringdilated.backends._memeff import packed_bmhk, padded_bias, padded_lse
from ringdilated.backends._philox import philox_increment, replay_scalars, seeded_generator
from ringdilated.core import (
    FUSED_GRID_LIMIT,
    BlockOptions,
    Capabilities,
    KernelSpec,
    Target,
    accumulation_dtype,
    mark_non_finite_problems,
    mark_non_finite_rows,
)

__all__ = ["SDPA_SPEC", "CpuFlashAttention", "EfficientAttention", "SdpaKernel"]

_aten = torch.ops.aten
_NAN = float("nan")


def _mask_args(
    q: torch.Tensor, k: torch.Tensor, options: BlockOptions
) -> tuple[bool, torch.Tensor | None]:
    """``(is_causal, additive (q_len, k_len) mask)`` for the block: the ops' own causal mask
    (top-left aligned in both, ``j <= i``, as the block's window is) for ``right = 0`` without a
    left bound, else an additive mask of the window, left bound first (a sliding window's band;
    its rows that see no key come back marked by :meth:`BlockOptions.mark_empty_rows`)."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    if not options.needs_mask(q_len, k_len):
        return False, None
    if options.window.left is None and options.window.right == 0:
        return True, None
    visible = _dense.visible_keys(q_len, k_len, options.window, q.device)
    assert visible is not None
    mask = torch.zeros(q_len, k_len, dtype=q.dtype, device=q.device)
    hidden = visible.logical_not()  # (~ has no fake-CUDA kernel)
    return False, mask.masked_fill_(hidden, float("-inf"))


def _mark_rows_seeing_non_finite(
    out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, options: BlockOptions
) -> None:
    """The CPU flash op's forward repair (module docstring), in place: ``x - x`` is 0 for a
    finite ``x`` and NaN otherwise, and a sum of zeros is exact, so ``(q - q)`` summed over each
    row plus ``(k - k)`` summed over the problem is 0 or NaN per row; it is added to ``out`` and
    ``lse``. Then the rows that see no key get ``out = 0``, ``lse = -inf`` again. (A matmul by
    zeros would do it in fewer passes, but torch 2.13's bfloat16 CPU matmul was seen to turn a
    finite row next to a NaN row into NaN: the conformance kit found it.)"""
    heads, kv_heads, k_len = q.shape[1], k.shape[1], k.shape[-2]
    if out.numel() and k_len:
        rows = (q - q).sum(-1, keepdim=True)  # (N, H, Lq, 1): 0, or NaN for a non-finite q row
        problems = (k - k).sum((-2, -1), keepdim=True)  # (N, Hkv, 1, 1)
        if kv_heads == heads:
            poison = rows.add_(problems)
        else:  # query head h reads key/value head h // (heads // kv_heads)
            grouped = rows.view(rows.shape[0], kv_heads, heads // kv_heads, *rows.shape[2:])
            poison = grouped.add_(problems.unsqueeze(2)).flatten(1, 2)
        out.add_(poison)
        lse.add_(poison.squeeze(-1))
    options.mark_empty_rows(out, lse, k_len)


def _cpu_lse(lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The merged ``lse`` as the CPU backward op takes it: ``-inf`` (a row that sees no key)
    becomes 0, the op's own value for it (``P = exp(-inf - 0) = 0``); ``+inf`` becomes NaN, so the
    row's gradients come out NaN rather than zero-weighted; NaN stays NaN."""
    return lse.to(dtype).nan_to_num(nan=_NAN, posinf=_NAN, neginf=0.0)


class CpuFlashAttention:
    """The CPU path: PyTorch's flash attention for CPU, through its aten ops."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if options.dropout_p:  # the spec refuses it; an instance called directly says so too
            raise NotImplementedError(
                f"sdpa has no dropout on cpu (dropout_p={options.dropout_p}): torch's CPU "
                "flash op refuses it"
            )
        is_causal, mask = _mask_args(q, k, options)
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=options.scale
        )
        _mark_rows_seeing_non_finite(out, lse, q, k, options)
        return out, lse

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
        is_causal, mask = _mask_args(q, k, options)
        lse = _cpu_lse(lse, accumulation_dtype(q.dtype))
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=options.scale
        )
        return dq, dk, dv


EfficientForward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
EfficientBackward = Callable[..., tuple[Any, Any, Any, Any]]


class EfficientAttention:
    """The CUDA path: ``aten._scaled_dot_product_efficient_attention`` and its backward.

    What the ops get follows torch's ``mem_eff_attention`` kernels (``kernel_backward.h``,
    ``attention_backward.cu``), not their docs: the backward reads ``out`` with a hard-coded row
    stride (``o_strideM() = head_dim_value * num_heads``), so the driver's strided ``out`` is
    packed (:func:`packed_bmhk`); the lse and the bias are laid out by :func:`padded_lse` and
    :func:`padded_bias`; the op makes ``dout`` contiguous itself, and reads ``q``, ``k``, ``v``
    through their strides (the kernel contract keeps their last dimension contiguous), so
    grouped heads reach it as stride-0 expansions, one call per key/value head (module
    docstring), each with its own packed ``out`` and padded lse.

    ``forward_op`` and ``backward_op`` default to the aten ops; tests pass stand-ins that read
    memory as the CUDA kernels do.
    """

    def __init__(
        self,
        forward_op: EfficientForward | None = None,
        backward_op: EfficientBackward | None = None,
    ) -> None:
        self._forward: EfficientForward = (
            forward_op or _aten._scaled_dot_product_efficient_attention
        )
        self._backward: EfficientBackward = (
            backward_op or _aten._scaled_dot_product_efficient_attention_backward
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        is_causal, mask = _mask_args(q, k, options)
        bias = padded_bias(mask, q)  # once: each group's is a view of its heads
        outs, lses = [], []
        with _drawing(q.device, options):  # the calls draw one after another
            for group in kv_groups(q, k, v):
                out, lse, _, _ = self._forward(
                    group.q,
                    group.k,
                    group.v,
                    None if bias is None else group.query_heads(bias),
                    True,
                    options.dropout_p,
                    is_causal,
                    scale=options.scale,
                )
                outs.append(out)
                lses.append(lse.narrow(-1, 0, q.shape[-2]))
        out, lse = join_heads(outs), join_heads(lses)
        mark_non_finite_rows(out, lse, q, k, v, options)
        return out, lse

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
        is_causal, mask = _mask_args(q, k, options)
        bias = padded_bias(mask, q)
        grads = []
        offset = 0  # where each call's draw started: the earlier calls' increments summed
        for group in kv_groups(q, k, v):
            philox_seed, philox_offset = _replayed(options, offset=offset)
            offset += philox_increment(
                group.q.shape[0] * group.q.shape[1] * q.shape[2] * k.shape[2]
            )
            dq, dk, dv, _ = self._backward(
                group.query_heads(dout),
                group.q,
                group.k,
                group.v,
                None if bias is None else group.query_heads(bias),
                packed_bmhk(group.query_heads(out)),
                padded_lse(group.query_heads(lse)),
                philox_seed,
                philox_offset,
                options.dropout_p,
                [True, True, True, False],
                is_causal,
                scale=options.scale,
            )
            grads.append((dq, group.kv_grad(dk), group.kv_grad(dv)))
        dq, dk, dv = (join_heads(part) for part in zip(*grads, strict=True))
        mark_non_finite_problems(
            dq, dk, dv, dout, q, k, v, lse, forward_marked=True, options=options
        )
        return dq, dk, dv


_HOST = torch.device("cpu")


def _drawing(
    device: torch.device, options: BlockOptions
) -> contextlib.AbstractContextManager[None]:
    """The generator state the forward draws its mask from (nothing to seed without dropout)."""
    if options.dropout_p == 0.0:
        return contextlib.nullcontext()
    return seeded_generator(device, options.dropout_seed)


def _replayed(options: BlockOptions, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(philox_seed, philox_offset)`` as the forward returns them in eager mode: ``int64``
    scalars on the host, ``(dropout_seed, offset)`` with dropout (unread without)."""
    if options.dropout_p == 0.0:
        unused = torch.empty((), dtype=torch.long)
        return unused, unused
    return replay_scalars(options.dropout_seed, _HOST, offset=offset)


class SdpaKernel:
    """PyTorch's fused attention kernels behind the kernel contract: the CPU flash op on CPU
    tensors, the memory-efficient op on CUDA tensors."""

    def __init__(
        self, cpu: CpuFlashAttention | None = None, cuda: EfficientAttention | None = None
    ) -> None:
        self._cpu = cpu or CpuFlashAttention()
        self._cuda = cuda or EfficientAttention()

    def _path(self, q: torch.Tensor) -> CpuFlashAttention | EfficientAttention:
        return self._cpu if q.is_cpu else self._cuda

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._path(q).forward(q, k, v, options)

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
        return self._path(q).backward(dout, q, k, v, out, lse, options)


SDPA_SPEC = KernelSpec(
    name="sdpa",
    factory=SdpaKernel,
    capabilities=Capabilities(
        targets=(
            Target(
                "cpu",
                frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
                note="flash attention for CPU",
                dropout=False,  # torch's CPU flash op has none
            ),
            Target(
                "cuda",
                frozenset({torch.float16, torch.float32}),
                min_capability=(5, 0),
                head_dim_multiple=8,
                note="memory-efficient attention",
            ),
            Target(
                "cuda",
                frozenset({torch.bfloat16}),
                min_capability=(8, 0),
                head_dim_multiple=8,
                note="memory-efficient attention, bfloat16",
            ),
        ),
        causal=True,
        sliding_window=True,
        backward=True,
        dropout=True,
        gqa=True,
        deterministic=True,
        batch_limit=FUSED_GRID_LIMIT,
    ),
    priority=100,
    description="PyTorch's fused attention ops (flash for CPU; memory-efficient on CUDA)",
)
