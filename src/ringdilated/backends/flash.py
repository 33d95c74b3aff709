"""FlashAttention 2 (the ``flash-attn`` package, 2.6 to 2.8) behind the kernel contract.

Forward is ``flash_attn.flash_attn_interface._flash_attn_forward`` (``flash_attn_func`` does not
return the ``rng_state`` that dropout needs); backward is ``_flash_attn_backward`` fed the final
merged ``out`` and ``lse``, as the contract asks, writing into ``dq``, ``dk``, ``dv`` buffers it
is given. Their signatures changed, read from the released ``flash_attn_interface.py``:

- 2.6.x: plain functions taking ``window_size`` as a ``(left, right)`` tuple; the forward returns
  ``(out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)``, the backward
  ``(dq, dk, dv, softmax_d)``.
- 2.7 and 2.8: ``torch.library`` custom ops taking ``window_size_left`` / ``window_size_right``;
  the forward returns ``(out, softmax_lse, S_dmask, rng_state)``, the backward ``softmax_d``.

:class:`FlashKernel` picks the keywords by version and checks both functions' parameters at
construction, so an unknown signature fails there (the resolver falls back, with the reason)
rather than on the first call. ``flash_api.cpp`` reads ``softmax_lse`` as a dense float32
``(batch, heads, seqlen_q)`` array with no check, so it is passed contiguous; every other tensor
needs a contiguous last dimension and 16-byte alignment (its 128-bit loads): a misaligned view
is copied (:func:`~ringdilated.backends._layouts.aligned`). flash-attn's causal mask is
bottom-right aligned, so any causal offset runs as at most two calls
(:mod:`ringdilated.core.contract.causal`). Key/value heads are never repeated: ``flash_api.cpp``
takes ``num_heads_k`` dividing ``num_heads``.

Dropout is flash-attn's own (``flash_api.cpp``, 2.6.3 to 2.8.3): ``mha_fwd`` takes the Philox
``(seed, offset)`` from the device's default CUDA generator (``philox_cuda_state``, advancing it
by ``batch * heads * 32``) and its kernel writes them into the int64 ``rng_state`` of 2
elements it returns; ``mha_bwd`` reads ``rng_state[0]`` and ``rng_state[1]`` from the device
pointer it is given (no dtype or shape check) and replays the mask. Each native call runs under
:func:`~ringdilated.backends._philox.seeded_generator` with the seed of its piece of the block
(:func:`~ringdilated.core.contract.causal.piece_seed`: ``BlockOptions.dropout_seed`` and the
piece, so the block's at most two calls draw unrelated masks), and its backward is handed
:func:`~ringdilated.backends._philox.replay_state` of the same seed: the mask is a function of
the contract's seed, the caller's random stream does not move. The backward is deterministic
(``deterministic=True``, a per-split ``dq`` accumulator) whenever ``BlockOptions.deterministic``
(the plan's reading of torch's switch, strict: not in warn-only mode, as torch's own attention
backwards read it); the forward always is.

Declared (:data:`FLASH_SPEC`), with the reasons the spec cannot hold: 2.6.x takes compute
capability 8.x and 9.0 only, as its ``flash_api.cpp`` checks; the batch is ``gridDim.y``. Not yet
run on GPU hardware by this project.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from typing import Any

import torch

from ringdilated.backends import _philox
from ringdilated.backends._dense import GuardedBottomRightKernel
from ringdilated.backends._layouts import aligned, dense_float32
from ringdilated.backends._upstream import check_parameters, distribution_version
from ringdilated.backends._versions import version_tuple
from ringdilated.core import (
    FUSED_GRID_LIMIT,
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

__all__ = ["FLASH_SPEC", "MIN_VERSION", "FlashKernel", "backward_window_keywords"]

MIN_VERSION = (2, 6)
#: The first version whose functions take ``window_size_left`` / ``window_size_right``.
SPLIT_WINDOW_VERSION = (2, 7)


def backward_window_keywords(version: tuple[int, ...]) -> dict[str, Any]:
    """The "no sliding window" keywords of ``_flash_attn_forward`` and ``_flash_attn_backward``
    in ``version``."""
    if version < SPLIT_WINDOW_VERSION:
        return {"window_size": (-1, -1)}
    return {"window_size_left": -1, "window_size_right": -1}


class FlashKernel(GuardedBottomRightKernel):
    """flash-attn 2 kernels. Construction imports the package, checks its version and both
    functions' parameters; any mismatch raises ``ImportError`` with the reason."""

    serves_dropout = True

    def __init__(self) -> None:
        package = importlib.import_module("flash_attn")
        text = str(getattr(package, "__version__", "0"))
        version = version_tuple(text, 2)
        if version < MIN_VERSION:
            wanted = ".".join(map(str, MIN_VERSION))
            raise ImportError(f"flash-attn {text} is older than the {wanted} this kernel needs")
        interface = importlib.import_module("flash_attn.flash_attn_interface")
        self._forward: Any = interface._flash_attn_forward
        self._backward: Any = interface._flash_attn_backward
        #: 2.6.x returns 8 values with the lse 6th, 2.7+ 4 values with it 2nd.
        self._lse_index = 5 if version < SPLIT_WINDOW_VERSION else 1
        self._window = backward_window_keywords(version)
        common = {"dropout_p", "softmax_scale", "causal", "softcap", "alibi_slopes", *self._window}
        checks = (
            ("_flash_attn_forward", self._forward, {*common, "return_softmax"}),
            ("_flash_attn_backward", self._backward, {*common, "deterministic", "rng_state"}),
        )
        for name, function, needed in checks:
            check_parameters(
                function,
                name,
                needed,
                package=f"flash-attn {text}",
                known="the 2.6 to 2.8 signatures",
                trust_unreadable=True,
            )

    def native_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        dropout_p: float = 0.0,
        seed: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One ``_flash_attn_forward`` call; with ``dropout_p``, its mask drawn from the default
        generator seeded with ``seed``."""
        qt, kt, vt = (aligned(x.transpose(1, 2)) for x in (q, k, v))  # 128-bit loads
        keywords = {
            "dropout_p": dropout_p,
            "softmax_scale": scale,
            "causal": causal,
            "softcap": 0.0,
            "alibi_slopes": None,
            "return_softmax": False,
            **self._window,
        }
        if dropout_p:
            with _philox.seeded_generator(q.device, seed):
                results = self._forward(qt, kt, vt, **keywords)
        else:
            results = self._forward(qt, kt, vt, **keywords)
        return results[0].transpose(1, 2), results[self._lse_index]

    def native_backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
        dropout_p: float = 0.0,
        seed: int = 0,
        *,
        deterministic: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One ``_flash_attn_backward`` call; with ``dropout_p``, replaying the mask of a forward
        seeded with ``seed``."""
        dout_t, qt, kt, vt, out_t = (aligned(x.transpose(1, 2)) for x in (dout, q, k, v, out))
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (qt, kt, vt))
        rng_state = _philox.replay_state(seed, q.device, torch.int64) if dropout_p else None
        self._backward(
            dout_t,
            qt,
            kt,
            vt,
            out_t,
            dense_float32(lse),
            dq,
            dk,
            dv,
            dropout_p=dropout_p,
            softmax_scale=scale,
            causal=causal,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=deterministic,
            rng_state=rng_state,
            **self._window,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def forward_piece(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        piece: BottomRightPiece,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p = options.dropout_p
        seed = piece_seed(options.dropout_seed, piece) if p else 0
        return self.native_forward(q, k, v, piece.causal, options.scale, p, seed)

    def backward_piece(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        piece: BottomRightPiece,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p, scale = options.dropout_p, options.scale
        seed = piece_seed(options.dropout_seed, piece) if p else 0
        return self.native_backward(
            dout, q, k, v, out, lse, piece.causal, scale, p, seed,
            deterministic=options.deterministic,
        )  # fmt: skip


def _installed_version() -> tuple[int, ...] | None:
    """flash-attn's version without importing it (its CUDA extension loads on import)."""
    module = sys.modules.get("flash_attn")
    if module is not None:
        return version_tuple(str(getattr(module, "__version__", "0")), 2)
    text = distribution_version("flash-attn")
    return None if text is None else version_tuple(text, 2)


def _version_reasons(request: Request, env: Environment) -> Iterable[str]:
    """flash-attn 2.6.x's ``flash_api.cpp`` accepts compute capability 8.x and 9.0 only."""
    version = _installed_version()
    cc = request.compute_capability
    if version is not None and version < SPLIT_WINDOW_VERSION and cc is not None and cc > (9, 0):
        return (
            f"flash-attn {'.'.join(map(str, version))} supports compute capability 8.x and 9.0 "
            f"only (2.7 lifts it), device has {cc[0]}.{cc[1]}",
        )
    return ()


FLASH_SPEC = KernelSpec(
    name="flash",
    factory=FlashKernel,
    capabilities=Capabilities(
        targets=(
            Target(
                "cuda",
                frozenset({torch.float16, torch.bfloat16}),
                min_capability=(8, 0),
                max_head_dim=256,
                head_dim_multiple=8,
                note="flash-attn 2 needs Ampere or newer",
            ),
        ),
        causal=True,
        backward=True,
        dropout=True,
        gqa=True,
        deterministic=True,
        requires=("flash_attn",),
        batch_limit=FUSED_GRID_LIMIT,
    ),
    priority=0,
    priority_rules=(PriorityRule(300, "cuda", min_capability=(8, 0)),),
    description="FlashAttention 2 (flash-attn 2.6 to 2.8): Ampere and newer, fp16/bf16, dropout",
    extra_reasons=_version_reasons,
)
