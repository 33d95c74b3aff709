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
is copied (:func:`~ringdilated.backends._layouts.aligned`). flash-attn's masks are
bottom-right aligned (below). Key/value heads are never repeated: ``flash_api.cpp``
takes ``num_heads_k`` dividing ``num_heads``.

Dropout is flash-attn's own (``flash_api.cpp``, 2.6.3 to 2.8.3): ``mha_fwd`` takes the Philox
``(seed, offset)`` from the device's default CUDA generator (``philox_cuda_state``, advancing it
by ``batch * heads * 32``) and its kernel writes them into the int64 ``rng_state`` of 2
elements it returns; ``mha_bwd`` reads ``rng_state[0]`` and ``rng_state[1]`` from the device
pointer it is given (no dtype or shape check) and replays the mask. Each native call runs under
:func:`~ringdilated.backends._philox.seeded_generator` with the seed of its piece of the block
(:func:`~ringdilated.core.contract.causal.piece_seed`: ``BlockOptions.dropout_seed`` and the
piece, :attr:`~ringdilated.backends._windows.WindowPiece.bottom_right`, so the block's calls draw
unrelated masks), and its backward is handed
:func:`~ringdilated.backends._philox.replay_state` of the same seed: the mask is a function of
the contract's seed, the caller's random stream does not move. The backward is deterministic
(``deterministic=True``, a per-split ``dq`` accumulator) whenever ``BlockOptions.deterministic``
(the plan's reading of torch's switch, strict: not in warn-only mode, as torch's own attention
backwards read it); the forward always is.

Key windows and softcapping, read at the tags v2.6.3, v2.7.4.post1 and v2.8.3
(``flash_attn/flash_attn_interface.py``; ``csrc/flash_attn/flash_api.cpp`` ``mha_fwd``,
``mha_bwd``, ``mha_varlen_fwd``, ``mha_varlen_bwd``, ``set_params_fprop``; ``src/mask.h``;
``src/flash_bwd_launch_template.h``). ``window_size`` exists from v2.3.0 and ``softcap`` from
v2.6.0, forward and backward (``Is_local``, ``Is_softcap`` kernels), so every supported release
has both. The window is aligned to the bottom right and each function rewrites it (a bound
``>= seqlen_k`` is dropped; next to a left bound an unbounded right becomes ``seqlen_k``): a
block's top-left window runs as at most three calls each of which the op computes exactly
(:mod:`ringdilated.backends._windows`), each given ``causal`` for a right bound of 0 and
``window_size_left`` for its left bound (``-1``: none; the right is always ``-1``), so a block
without a left bound makes exactly the calls it made before. ``softcap`` is passed as given
(``0.0``: none): ``set_params_fprop`` scales by ``softmax_scale / softcap`` inside ``tanh`` and by
``softcap`` outside, ``cap * tanh(s / cap)`` with ``s = scale * q . k``. Both ``mha_fwd`` and
``mha_bwd`` refuse softcap with dropout ("Softcapping does not support dropout for now"), so the
spec declines such requests (:func:`softcap_reasons`) and the kernel raises for them; alibi, which
the op also combines with softcap, is never passed.

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
from ringdilated.backends._layouts import aligned, dense_float32
from ringdilated.backends._upstream import check_parameters, distribution_version
from ringdilated.backends._versions import version_tuple
from ringdilated.backends._windows import WindowKernel, WindowPiece
from ringdilated.core import (
    FUSED_WINDOWED_GRID_LIMIT,
    BlockOptions,
    Capabilities,
    Environment,
    KernelSpec,
    PriorityRule,
    Request,
    Target,
    piece_seed,
)

__all__ = [
    "FLASH_SPEC",
    "MIN_VERSION",
    "FlashKernel",
    "backward_window_keywords",
    "softcap_reasons",
    "window_keywords",
]

MIN_VERSION = (2, 6)
#: The first version whose functions take ``window_size_left`` / ``window_size_right``.
SPLIT_WINDOW_VERSION = (2, 7)


#: What ``mha_fwd`` and ``mha_bwd`` say to softcap with dropout (2.6.0 to 2.8.3).
_SOFTCAP_DROPOUT = "Softcapping does not support dropout for now"


def window_keywords(version: tuple[int, ...], left: int | None = None) -> dict[str, Any]:
    """The window keywords of ``_flash_attn_forward`` and ``_flash_attn_backward`` in
    ``version`` for a left bound ``left`` (``None``: none) and no right bound: ``-1`` is
    unbounded in both conventions."""
    bound = -1 if left is None else left
    if version < SPLIT_WINDOW_VERSION:
        return {"window_size": (bound, -1)}
    return {"window_size_left": bound, "window_size_right": -1}


def backward_window_keywords(version: tuple[int, ...]) -> dict[str, Any]:
    """The "no sliding window" keywords of ``_flash_attn_forward`` and ``_flash_attn_backward``
    in ``version``."""
    return window_keywords(version)


class FlashKernel(WindowKernel):
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
        self._version = version
        window = window_keywords(version)
        common = {"dropout_p", "softmax_scale", "causal", "softcap", "alibi_slopes", *window}
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
        *,
        window_left: int | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One ``_flash_attn_forward`` call (``causal`` and ``window_left``: the op's
        bottom-right mask); with ``dropout_p``, its mask drawn from the default generator seeded
        with ``seed``."""
        _refuse_softcap_dropout(softcap, dropout_p)
        qt, kt, vt = (aligned(x.transpose(1, 2)) for x in (q, k, v))  # 128-bit loads
        keywords = {
            "dropout_p": dropout_p,
            "softmax_scale": scale,
            "causal": causal,
            "softcap": softcap or 0.0,
            "alibi_slopes": None,
            "return_softmax": False,
            **window_keywords(self._version, window_left),
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
        window_left: int | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One ``_flash_attn_backward`` call; with ``dropout_p``, replaying the mask of a forward
        seeded with ``seed``."""
        _refuse_softcap_dropout(softcap, dropout_p)
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
            softcap=softcap or 0.0,
            alibi_slopes=None,
            deterministic=deterministic,
            rng_state=rng_state,
            **window_keywords(self._version, window_left),
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def forward_piece(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        piece: WindowPiece,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p = options.dropout_p
        seed = piece_seed(options.dropout_seed, piece.bottom_right) if p else 0
        return self.native_forward(
            q, k, v, piece.causal, options.scale, p, seed,
            window_left=piece.left, softcap=options.softcap,
        )  # fmt: skip

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
        p, scale = options.dropout_p, options.scale
        seed = piece_seed(options.dropout_seed, piece.bottom_right) if p else 0
        return self.native_backward(
            dout, q, k, v, out, lse, piece.causal, scale, p, seed,
            deterministic=options.deterministic, window_left=piece.left, softcap=options.softcap,
        )  # fmt: skip


def _refuse_softcap_dropout(softcap: float | None, dropout_p: float) -> None:
    """``NotImplementedError`` for softcap with dropout, which ``mha_fwd`` and ``mha_bwd``
    refuse (the spec declines such requests: :func:`softcap_reasons`)."""
    if softcap and dropout_p:
        raise NotImplementedError(
            f"flash-attn 2 takes no softcap ({softcap}) with dropout_p={dropout_p} "
            f"(mha_fwd, mha_bwd: {_SOFTCAP_DROPOUT!r})"
        )


def _installed_version() -> tuple[int, ...] | None:
    """flash-attn's version without importing it (its CUDA extension loads on import)."""
    module = sys.modules.get("flash_attn")
    if module is not None:
        return version_tuple(str(getattr(module, "__version__", "0")), 2)
    text = distribution_version("flash-attn")
    return None if text is None else version_tuple(text, 2)


def softcap_reasons(request: Request) -> tuple[str, ...]:
    """Softcap with dropout: ``mha_fwd`` and ``mha_bwd`` of every supported release refuse it."""
    if request.softcap is None or not request.dropout:
        return ()
    version = _installed_version()
    text = "2.6 to 2.8" if version is None else ".".join(map(str, version))
    return (f"flash-attn {text} takes no softcap with dropout (mha_fwd: {_SOFTCAP_DROPOUT!r})",)


def _version_reasons(request: Request, env: Environment) -> Iterable[str]:
    """flash-attn 2.6.x's ``flash_api.cpp`` accepts compute capability 8.x and 9.0 only; no
    release takes softcap with dropout (:func:`softcap_reasons`)."""
    version = _installed_version()
    cc = request.compute_capability
    reasons = list(softcap_reasons(request))
    if version is not None and version < SPLIT_WINDOW_VERSION and cc is not None and cc > (9, 0):
        reasons.append(
            f"flash-attn {'.'.join(map(str, version))} supports compute capability 8.x and 9.0 "
            f"only (2.7 lifts it), device has {cc[0]}.{cc[1]}"
        )
    return tuple(reasons)


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
        sliding_window=True,
        softcap=True,
        backward=True,
        dropout=True,
        gqa=True,
        deterministic=True,
        requires=("flash_attn",),
        batch_limit=FUSED_WINDOWED_GRID_LIMIT,
    ),
    priority=0,
    priority_rules=(PriorityRule(300, "cuda", min_capability=(8, 0)),),
    description="FlashAttention 2 (flash-attn 2.6 to 2.8): Ampere and newer, fp16/bf16, dropout, "
    "sliding windows, softcap",
    extra_reasons=_version_reasons,
)
