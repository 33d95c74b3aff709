"""torch's own FlashAttention 2 op behind the kernel contract (``torch_flash``).

``aten._scaled_dot_product_flash_attention`` and its backward, the CUDA ops PyTorch's context
parallelism drives: the forward returns the lse and the backward takes ``out`` and ``lse``, so the
backward gets the final merged ones, as the contract asks. What the ops do, read from
pytorch/pytorch (the 2.13 wheel's schemas and meta kernels; ``attention.cu``,
``attention_backward.cu``, ``flash_attn/flash_api.cpp``, ``sdp_utils.cpp``; the revisions read
are listed in tests/standins/torch_flash.py):

- Forward returns ``(output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused,
  debug_attn_mask)``: ``output`` ``(B, H, Lq, D)``, ``logsumexp`` float32 ``(B, H, Lq)``, the
  cumulative lengths undefined (``None``) for dense inputs, ``rng_state`` ``uint64[2]`` on the
  device (the meta kernel's "BC breaking change to flash seed/offset").
- ``is_causal`` is FA2's mask, aligned to the bottom right: ``mha_fwd`` sets
  ``window_size_right = 0`` (``sdp_utils.cpp``'s ``check_flash_causal_non_square_seqlens``
  keeps SDPA off it when ``Lq != Lk`` for that reason). A block's window runs as at most three
  calls (:mod:`ringdilated.backends._windows`), none of which holds a row that sees no key, so
  the op's value for such rows (``lse = +inf``) never reaches the contract.
- Key windows with a left bound: the SDPA-level op takes none, so a call with a left bound goes
  to the ops it wraps, ``aten._flash_attention_forward`` and ``_flash_attention_backward``
  (``(B, L, H, D)`` views of the same tensors, as ``attention.cu`` hands them over), whose
  ``window_size_left``/``window_size_right`` (2.13 schema: ``SymInt?``, ``None`` read as ``-1``:
  ``attention.cu`` ``window_size_left.value_or(-1)``, ``attention_backward.cu`` likewise) reach
  ``mha_fwd``/``mha_bwd`` of torch's vendored FlashAttention 2, which rewrite them as flash-attn
  2.6+ does (``flash_attn/flash_api.cpp``); every other call keeps the SDPA-level op, as before.
  No softcap: both ops pass ``softcap = 0.0`` to ``mha_fwd``/``mha_bwd`` and their schemas
  take none (the spec declines it, :func:`torch_flash_reasons`, and the kernel raises).
- Grouped heads natively: ``mha_fwd``/``mha_bwd`` check ``num_heads % num_heads_k == 0`` and the
  backward sums ``dk``, ``dv`` over each group, so ``k``, ``v`` go with their ``Hkv`` heads.
- ``q``, ``k``, ``v`` need a contiguous last dimension (``mha_fwd`` reads their strides) and
  16-byte alignment (128-bit loads): a misaligned view is copied (``_layouts.aligned``);
  ``_flash_attention_backward`` makes ``grad_out`` and ``out`` contiguous itself; ``mha_bwd``
  reads ``softmax_lse`` by address as dense float32 ``(B, H, Lq)`` with no check, so the merged
  lse is handed over as a dense float32 copy. The head dim is a multiple of 8 (``mha_fwd``:
  "ensured by padding", which SDPA does and the op does not) and at most 256.
- Dropout: ``mha_fwd`` takes ``(seed, offset)`` from the CUDA default generator
  (``philox_cuda_state``) and its kernel writes them into ``rng_state``; ``mha_bwd`` reads
  ``philox_seed.data_ptr<uint64_t>()`` as that state (``philox_offset`` is unused). Each call
  therefore runs under :func:`~ringdilated.backends._philox.seeded_generator` with its piece's
  seed (:func:`~ringdilated.core.contract.causal.piece_seed`: ``dropout_seed`` and the piece, so
  the two pieces of one block draw unrelated masks), and its backward gets
  :func:`~ringdilated.backends._philox.replay_state` of that seed. The keep
  test is on 8 bits (``p_dropout_in_uint8_t = floor((1 - p) * 255)``) while kept values are
  scaled by exactly ``1 / (1 - p)``: each probability is 0 or ``P / (1 - p)``, as the contract
  asks, and the drop rate is ``p`` to within 1/256.
- Deterministic: ``_flash_attention_backward`` passes ``deterministic = true`` to ``mha_bwd``
  whenever ``torch.are_deterministic_algorithms_enabled()`` (not in warn-only mode), which then
  reduces ``dq`` over fixed splits. The op takes no such argument: it reads torch's switch when
  it runs, so ``BlockOptions.deterministic`` (the plan's reading of the same switch) cannot be
  passed on; a backward run after the switch was flipped follows the switch, not the plan.

Non-finite inputs: FA2 returns zeros and ``lse = +inf`` for a row whose scores are all ``-inf``
(an infinite query or key), so the results get the general repair
(:func:`~ringdilated.core.mark_non_finite_rows`,
:func:`~ringdilated.core.mark_non_finite_problems`), as :mod:`ringdilated.backends.flash` does.

:func:`torch.nn.attention.activate_flash_attention_impl` (``"FA3"``, ``"FA4"``) replaces the op's
CUDA kernels (``torch/nn/attention/_fa3.py``, ``_fa4.py``): same arguments and results, but no
dropout, and FA3 runs on 9.x only, FA4 on 9.x and 10.x; the spec says so while one is active.

Declared (:data:`TORCH_FLASH_SPEC`): ``sdp_utils.cpp``'s ``check_flash_attention_hardware_support``
(sm80 to sm121) and ``check_dtypes_low_precision`` (fp16, bf16); head dims as above; training
with a head dim in (192, 224], or above 224 with dropout, refused on sm86-sm89 and sm120-sm121
(``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``); the batch is the
launch grid's ``gridDim.y``. Priority 250 on its targets: above ``sdpa`` (torch's dispatcher
tries flash before the memory-efficient op), below the flash-attn package (newer FA2 kernels).
Not yet run on GPU hardware by this project: checked on FakeTensor ``cuda`` tensors and against
a stand-in of the ops (tests/standins/torch_flash.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ringdilated.backends._layouts import aligned, dense_float32
from ringdilated.backends._philox import replay_state, seeded_generator
from ringdilated.backends._windows import WindowKernel, WindowPiece
from ringdilated.core import (
    FUSED_WINDOWED_GRID_LIMIT,
    BlockOptions,
    BottomRightPiece,
    Capabilities,
    Environment,
    KernelSpec,
    PriorityRule,
    Request,
    Target,
    piece_seed,
)

__all__ = ["TORCH_FLASH_SPEC", "TorchFlashKernel", "torch_flash_reasons"]

_aten = torch.ops.aten

FlashForward = Callable[..., tuple[Any, ...]]
FlashBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class TorchFlashKernel(WindowKernel):
    """torch's flash attention op per block. ``forward_op`` and ``backward_op`` default to the
    SDPA-level aten ops, ``window_forward_op`` and ``window_backward_op`` (for calls with a left
    bound) to ``_flash_attention_forward`` and ``_flash_attention_backward``; tests pass
    stand-ins that follow their signatures and checks."""

    serves_dropout = True

    def __init__(
        self,
        forward_op: FlashForward | None = None,
        backward_op: FlashBackward | None = None,
        window_forward_op: FlashForward | None = None,
        window_backward_op: FlashBackward | None = None,
    ) -> None:
        self._forward: FlashForward = forward_op or _aten._scaled_dot_product_flash_attention
        self._backward: FlashBackward = (
            backward_op or _aten._scaled_dot_product_flash_attention_backward
        )
        self._window_forward = window_forward_op or _aten._flash_attention_forward
        self._window_backward = window_backward_op or _aten._flash_attention_backward
        self._replays_dropout = _replays_rng_state()  # asked of the meta kernel once

    def forward_piece(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        piece: WindowPiece,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _refuse_softcap(options)
        q, k, v = (aligned(x) for x in (q, k, v))  # the rare misaligned caller view: a copy
        if options.dropout_p and not self._replays_dropout:  # the spec refuses it too
            raise NotImplementedError(
                f"torch_flash cannot replay dropout (dropout_p={options.dropout_p}) on this "
                "torch: its flash op does not report its dropout state as one uint64[2] rng_state"
            )
        p, scale = options.dropout_p, options.scale
        with _drawing(q.device, options, piece.bottom_right):
            if piece.left is None:
                out, lse, *_ = self._forward(q, k, v, p, piece.causal, False, scale=scale)
                return out, lse
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            out, lse, *_ = self._window_forward(
                qt, kt, vt, None, None, qt.shape[1], kt.shape[1], p, piece.causal, False,
                scale=scale, window_size_left=piece.left, window_size_right=None,
            )  # fmt: skip
        return out.transpose(1, 2), lse

    def backward_piece(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        piece: WindowPiece,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _refuse_softcap(options)
        rng_state, unused = _replayed(q.device, options, piece.bottom_right)
        dout, q, k, v, out = (aligned(x) for x in (dout, q, k, v, out))
        lse = dense_float32(lse)  # read by address
        rows, keys, p = q.shape[-2], k.shape[-2], options.dropout_p
        if piece.left is None:
            return self._backward(
                dout, q, k, v, out, lse, None, None, rows, keys, p, piece.causal, rng_state,
                unused, scale=options.scale,
            )  # fmt: skip
        dq, dk, dv = self._window_backward(
            *(x.transpose(1, 2) for x in (dout, q, k, v, out)), lse, None, None, rows, keys, p,
            piece.causal, rng_state, unused, scale=options.scale, window_size_left=piece.left,
            window_size_right=None,
        )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


#: Why the ops take no softcap (``attention.cu``, ``attention_backward.cu``).
_NO_SOFTCAP = "its flash ops pass softcap = 0.0 to mha_fwd/mha_bwd and their schemas take none"


def _refuse_softcap(options: BlockOptions) -> None:
    if options.softcap is not None:
        raise NotImplementedError(
            f"torch_flash has no softcap (softcap={options.softcap}): torch {torch.__version__}'s "
            + _NO_SOFTCAP
        )


def _drawing(
    device: torch.device, options: BlockOptions, piece: BottomRightPiece
) -> contextlib.AbstractContextManager[None]:
    """The generator state a forward call draws its mask from (nothing to seed without dropout)."""
    if options.dropout_p == 0.0:
        return contextlib.nullcontext()
    return seeded_generator(device, piece_seed(options.dropout_seed, piece))


def _replayed(
    device: torch.device, options: BlockOptions, piece: BottomRightPiece
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(philox_seed, philox_offset)`` for the backward: the ``rng_state`` the forward reported
    (``[seed, 0]``, ``uint64``) and the unused scalar; uninitialised without dropout, as the
    forward leaves them (``mha_bwd`` reads them only when ``p > 0``)."""
    unused = torch.empty((), dtype=torch.uint64, device=device)
    if options.dropout_p == 0.0:
        return torch.empty(2, dtype=torch.uint64, device=device), unused
    seed = piece_seed(options.dropout_seed, piece)
    return replay_state(seed, device, torch.uint64), unused


# -- what the spec cannot hold as data -------------------------------------------------------------


def _built_with_flash() -> bool:
    probe = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return bool(probe()) if probe is not None else False


def _active_override() -> str | None:
    """The flash attention impl activated into torch's dispatcher (``None``: torch's own)."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    return current() if current is not None else None


@functools.cache
def _takes_window_bounds() -> bool:
    """Whether this torch's ``_flash_attention_forward`` and ``_backward`` take
    ``window_size_left``/``window_size_right`` (keywords of their schemas in 2.5 and later, read
    from the ops themselves once per process), which a window with a left bound needs."""
    ops = (_aten._flash_attention_forward, _aten._flash_attention_backward)
    return all(
        {"window_size_left", "window_size_right"} <= {a.name for a in op.default._schema.arguments}
        for op in ops
    )


@functools.cache
def _replays_rng_state() -> bool:
    """Whether this torch's flash op reports its dropout state as one ``uint64[2]`` tensor (what
    :func:`_replayed` builds), asked of its own meta kernel once per process; torch before the
    "BC breaking change to flash seed/offset" reported two ``int64`` scalars instead."""
    q = torch.empty(1, 1, 8, 8, dtype=torch.float16, device="meta")
    try:
        rng_state = _aten._scaled_dot_product_flash_attention(q, q, q, 0.5)[6]
    except (RuntimeError, NotImplementedError):
        return False
    return isinstance(rng_state, torch.Tensor) and (rng_state.dtype, rng_state.numel()) == (
        torch.uint64,
        2,
    )


_BACKWARD_HEAD_DIM_LIMITED = (((8, 6), (8, 9)), ((12, 0), (12, 1)))
_OVERRIDE_CAPABILITIES = {"FA3": ((9, 0), (9, 9)), "FA4": ((9, 0), (10, 9))}


def _training_head_dim_reasons(request: Request) -> Iterator[str]:
    """``sdp_utils.cpp``: on sm86-sm89 and sm120-sm121 the backward takes a head dim up to 192,
    or above 224 without dropout (the kernels' shared memory)."""
    cc, head_dim = request.compute_capability, request.head_dim
    if not request.backward or cc is None or head_dim is None or head_dim <= 192:
        return
    if not any(low <= cc <= high for low, high in _BACKWARD_HEAD_DIM_LIMITED):
        return
    if head_dim <= 224 or request.dropout:
        yield (
            f"gradients for head_dim {head_dim}{' with dropout' if request.dropout else ''} "
            f"need sm80 or sm90 (device has {cc[0]}.{cc[1]}; torch's "
            "check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120)"
        )


def _override_reasons(request: Request) -> Iterator[str]:
    impl = _active_override()
    if impl is None:
        return
    where = f"torch's flash op runs {impl} (torch.nn.attention.activate_flash_attention_impl)"
    if impl not in _OVERRIDE_CAPABILITIES:
        yield f"{where}, whose behaviour this kernel does not know"
        return
    if request.dropout:
        yield f"{where}, which takes no dropout"
    low, high = _OVERRIDE_CAPABILITIES[impl]
    cc = request.compute_capability
    if cc is not None and not low <= cc <= high:
        yield f"{where}, which does not run on compute capability {cc[0]}.{cc[1]}"


def torch_flash_reasons(request: Request, env: Environment) -> Iterable[str]:
    """The reasons against a CUDA request that depend on this torch build and its state."""
    if request.device_type != "cuda":
        return ()
    reasons = []
    if not _built_with_flash():
        reasons.append(
            f"torch {torch.__version__} was built without flash attention "
            "(torch.backends.cuda.is_flash_attention_available() is False)"
        )
    if request.dropout and not _replays_rng_state():
        reasons.append(
            f"torch {torch.__version__}'s flash op reports its dropout state in a form this "
            "kernel does not replay (it replays rng_state, uint64[2])"
        )
    if request.softcap is not None:
        reasons.append(f"torch {torch.__version__}: {_NO_SOFTCAP}")
    if request.window.left is not None and not _takes_window_bounds():
        reasons.append(
            f"torch {torch.__version__}'s _flash_attention_forward/_backward take no "
            f"window_size_left, which a window with a left bound ({request.window.left}) needs"
        )
    reasons.extend(_training_head_dim_reasons(request))
    reasons.extend(_override_reasons(request))
    return tuple(reasons)


TORCH_FLASH_SPEC = KernelSpec(
    name="torch_flash",
    factory=TorchFlashKernel,
    capabilities=Capabilities(
        targets=(
            Target(
                "cuda",
                frozenset({torch.float16, torch.bfloat16}),
                min_capability=(8, 0),
                max_capability=(12, 1),
                max_head_dim=256,
                head_dim_multiple=8,
                note="torch's flash attention: sm80 to sm121",
            ),
        ),
        causal=True,
        sliding_window=True,
        backward=True,
        dropout=True,
        gqa=True,
        deterministic=True,
        batch_limit=FUSED_WINDOWED_GRID_LIMIT,
    ),
    priority=0,
    priority_rules=(PriorityRule(250, "cuda", min_capability=(8, 0), max_capability=(12, 1)),),
    description="torch's FlashAttention 2 op: sm80 to sm121, fp16/bf16, dropout, deterministic, "
    "sliding windows",
    extra_reasons=torch_flash_reasons,
)
