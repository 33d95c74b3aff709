"""cuDNN's fused attention op behind the kernel contract (``cudnn``).

``aten._scaled_dot_product_cudnn_attention`` and its backward, the ops PyTorch's context
parallelism drives on cuDNN: the forward returns the lse and the backward takes ``out`` and
``lse``. What they do, read from pytorch/pytorch (the 2.13 wheel's schemas and meta kernels;
``attention.cu`` ``_cudnn_attention_forward``, ``attention_backward.cu``
``_cudnn_attention_backward``, ``cudnn/MHA.cpp``, ``sdp_utils.cpp``; the revisions read are
listed in tests/standins/cudnn.py):

- Forward returns ``(output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed,
  philox_offset, debug_attn_mask)``: ``output`` ``(B, H, Lq, D)`` laid out like ``query``,
  ``logsumexp`` float32 ``(B, H, Lq, 1)`` (squeezed here), the seeds ``int64`` scalars.
- ``is_causal`` is cuDNN's ``set_causal_mask``, aligned to the top left (key ``j`` visible to
  query ``i`` iff ``j <= i``: SDPA's own meaning; ``sdp_utils.cpp`` sends non-square causal calls
  to cuDNN, unlike flash). A block's window bounded at ``right`` (:class:`CudnnCall`) goes as:

  - ``right`` unset or ``>= Lk - 1``: one call, no mask;
  - ``right <= 0``: the rows from ``-right`` on, one ``is_causal`` call on every key; the rows
    before see no key and get ``out = 0``, ``lse = -inf`` here;
  - ``0 < right < Lk - 1``, an offset inside the keys: keys ``[0, right)`` are visible to every
    row (one call, no mask) and keys ``[right, Lk)``, counted from ``right``, are visible to row
    ``i`` iff ``j - right <= i``: one ``is_causal`` call (rows whose prefix is shorter than the
    piece, when ``Lk - right > Lq``, are what top-left gives). The two results merge exactly by
    log-sum-exp (:func:`~ringdilated.core.merge_partials`), on the device; each backward call
    gets the block's final ``out`` and ``lse`` (the kernel contract), ``dq`` is the sum of both
    (in float32), ``dk`` and ``dv`` the two pieces side by side.

  No piece holds a row that sees no key, so the op never does, whatever cuDNN returns for one;
  and no call allocates anything of ``Lq x Lk`` size.
- Grouped heads natively: the graph takes ``K``, ``V`` with their own head counts
  (``build_graph`` sets their dims from the tensors; cuDNN's frontend admits any count dividing
  the query's) and the backward allocates ``dk``, ``dv`` like ``key``, ``value``
  (``empty_like``) and declares them so to the graph. ``k``, ``v`` go with their ``Hkv`` heads.
- Layout: ``build_graph`` gives cuDNN every tensor's sizes and strides, so the driver's strided
  views (and a piece's keys, a narrowed view of them) go as they are (last dimension contiguous;
  with the head dim a multiple of 8, every row starts 16 bytes apart); a caller's view that is
  not 16-byte aligned is copied (:func:`~ringdilated.backends._layouts.aligned`). The backward
  declares ``logsumexp``'s sizes and strides as the float ``Stats`` tensor: it gets the merged
  lse as a contiguous float32 ``(B, H, Lq, 1)``, the layout the forward returns; ``grad_out`` is
  copied by the op only if its last stride is not 1.
- Calls and pieces that cuDNN does not serve run the dense math
  (:mod:`ringdilated.backends._dense`), which is exact: a key length of 1
  (``check_cudnn_tensor_shapes``: "cudnn SDPA does not support key/value sequence length 1"; a
  block's, or the unmasked piece of ``right = 1``), empty tensors (``run_cudnn_SDP_fprop``
  returns without writing its outputs), and one query row on SM 10.x and 11.x with cuDNN 9.19 to
  9.25.0 but 9.24.1 (``check_cudnn_sdpa_decode``: decoding there gives silently wrong results,
  pytorch#193893; :func:`decode_refused`, asked of the device once).
- No key window bounded on the left and no softcap: ``_scaled_dot_product_cudnn_attention``
  and its backward (2.13 schemas) take ``attn_bias`` and ``is_causal`` only, and ``MHA.cpp``
  builds its graph from those (a left bound as a bias would be a dense ``Lq x Lk`` tensor, which
  this kernel never makes): the spec declines both with the reason (:func:`cudnn_reasons`), and
  the kernel raises ``NotImplementedError`` if handed them.
- No dropout: cuDNN's probability must be a multiple of 1/16 (``check_cudnn_dropout``), cuDNN
  9.11 to 9.13 has none, and a request carries no probability to check it against.
- Not deterministic: ``_cudnn_attention_backward`` only warns in warn-only mode, and torch's
  dispatcher never picks cuDNN under ``torch.use_deterministic_algorithms(True)``
  (``check_cudnn_deterministic``).

Non-finite inputs: cuDNN's behaviour for them is not documented, so the results get the general
repair (:func:`~ringdilated.core.mark_non_finite_rows`,
:func:`~ringdilated.core.mark_non_finite_problems`).

Declared (:func:`cudnn_spec`): ``check_cudnn_hardware_support`` (sm80 to sm121),
``check_dtypes_low_precision`` (fp16, bf16), head dims a multiple of 8 and at most 128, or 256
on sm90 and sm10x with cuDNN newer than 9.22 (``check_cudnn_tensor_shapes``), whose backward
takes 256 but nothing between 128 and 256 (``check_cudnn_d256_bprop_head_dim``); batch and heads
at most 65535. Priority by torch 2.13's own dispatcher order (``sdp_utils.cpp``
``priority_order``, ``check_prefer_cudnn_attention``; ``ATen/Context.h``): cuDNN first on
sm90 and sm100/sm103 (any 9.x and 10.x with CUDA 13) when the runtime cuDNN is newer than
9.15.0 and ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is not 1. Both are read when the resolver ranks
the kernel (:attr:`~ringdilated.core.KernelSpec.priority_rules_for`), never when this module is
imported: importing it loads no cuDNN and reads no environment variable. There it gets priority
240: above ``sdpa`` (100), but below ``torch_flash`` (250) and the flash-attn packages, unlike
torch's order, because here cuDNN costs what a dense single call does not: a graph built per new
shape-and-stride signature (thread-local, so forward and backward threads each build one;
dilated blocks, documents and suffixes make many, and an offset inside the keys makes two calls,
so two signatures, of one block). Not measured on a GPU yet: the measurement decides whether it
moves up. Everywhere else torch tries cuDNN last, after its math fallback: priority -5, below
``reference`` (0), so it runs when named. It declares no deterministic mode (torch never picks
it under the switch), so a deterministic request ranks it after every kernel that has one.
Not yet run on GPU hardware by this project: checked on FakeTensor ``cuda`` tensors and against
a stand-in of the ops (tests/standins/cudnn.py).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import torch

from ringdilated.backends import _dense
from ringdilated.backends._layouts import aligned, dense_float32
from ringdilated.core import (
    CAUSAL,
    FULL,
    FUSED_GRID_LIMIT,
    BlockOptions,
    Capabilities,
    Environment,
    KernelSpec,
    PriorityRule,
    Request,
    Target,
    accumulation_dtype,
    mark_non_finite_problems,
    mark_non_finite_rows,
    merge_partials,
)

__all__ = [
    "CUDNN_SPEC",
    "CudnnCall",
    "CudnnKernel",
    "CudnnPiece",
    "CudnnPriorityRules",
    "cudnn_priority_rules",
    "cudnn_reasons",
    "cudnn_spec",
    "runtime_version",
]

_aten = torch.ops.aten
_HALF = frozenset({torch.float16, torch.bfloat16})

CudnnForward = Callable[..., tuple[Any, ...]]
CudnnBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@attrs.frozen
class CudnnPiece:
    """One op call of a block: query rows ``[first, Lq)`` against keys ``[start, stop)``, with
    the op's top-left ``is_causal`` (counted from both starts) or no mask. A piece of one key
    runs the dense math (:attr:`dense`): cuDNN refuses a key length of 1."""

    first: int
    start: int
    stop: int
    causal: bool

    @property
    def dense(self) -> bool:
        return self.stop - self.start == 1

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s rows of this piece (``x``: ``(..., Lq, D)`` or an lse ``(..., Lq, 1)``)."""
        return x.narrow(-2, self.first, x.shape[-2] - self.first)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        return x.narrow(-2, self.start, self.stop - self.start)


@attrs.frozen
class CudnnCall:
    """How one block goes to the op: its :class:`CudnnPiece` calls (none: no row sees a key),
    or (``dense``) none at all, the dense math serving the whole block. Several pieces each
    take every row and split the keys between them, in order."""

    pieces: tuple[CudnnPiece, ...]
    dense: bool = False

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, options: BlockOptions) -> CudnnCall:
        n, heads, q_len = q.shape[:3]
        k_len = k.shape[-2]
        right = options.window.right
        if options.window.left is not None:
            raise NotImplementedError(f"{options.window!r}: cudnn serves no left bound")
        if options.softcap is not None:
            raise NotImplementedError(f"cudnn serves no softcap (softcap={options.softcap})")
        if not (n and heads and q_len) or k_len <= 1:
            return cls((), dense=True)
        if q_len + min(0, right or 0) == 1 and decode_refused(q.device):
            return cls((), dense=True)  # one row for cuDNN: torch refuses it there (see above)
        if right is None or right >= k_len - 1:
            return cls((CudnnPiece(0, 0, k_len, causal=False),))
        if right <= 0:  # rows before -right see no key
            first = min(q_len, -right)
            return cls((CudnnPiece(first, 0, k_len, causal=True),) if first < q_len else ())
        # Keys before `right` are visible to every row; the rest, counted from `right`, top-left.
        return cls((CudnnPiece(0, 0, right, causal=False), CudnnPiece(0, right, k_len, True)))


class CudnnKernel:
    """cuDNN's attention op per block. ``forward_op`` and ``backward_op`` default to the aten
    ops; tests pass stand-ins that follow their signatures and checks."""

    def __init__(
        self, forward_op: CudnnForward | None = None, backward_op: CudnnBackward | None = None
    ) -> None:
        self._forward: CudnnForward = forward_op or _aten._scaled_dot_product_cudnn_attention
        self._backward: CudnnBackward = (
            backward_op or _aten._scaled_dot_product_cudnn_attention_backward
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _dense.refuse_dropout("cudnn", options)
        call = CudnnCall.of(q, k, options)
        if call.dense:
            return _dense.forward(q, k, v, options)
        parts = [self._forward_piece(q, k, v, piece, options.scale) for piece in call.pieces]
        if len(parts) > 1:  # an offset inside the keys: the pieces merge exactly, on the device
            out, lse = parts[0]
            for part in parts[1:]:
                out, lse = merge_partials(out, lse, *part)
            out = out.to(q.dtype)
        elif parts and not call.pieces[0].first:
            out, lse = parts[0]
        else:  # rows before the first piece's (all, without one) see no key: 0 and -inf
            out, lse = _with_empty_rows(q, v, call.pieces[0].first if parts else None, parts)
        mark_non_finite_rows(out, lse, q, k, v, options)
        return out, lse

    def _forward_piece(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, piece: CudnnPiece, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of ``piece``'s rows over its keys; ``lse`` ``(N, H, rows)``."""
        q_rows, k_keys, v_keys = piece.rows(q), piece.keys(k), piece.keys(v)
        if piece.dense:
            return _dense.forward(q_rows, k_keys, v_keys, _options(piece, scale))
        qa, ka, va = (aligned(x) for x in (q_rows, k_keys, v_keys))  # misaligned: a copy
        out, lse, *_ = self._forward(qa, ka, va, None, True, 0.0, piece.causal, False, scale=scale)
        return out, lse.squeeze(-1)

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
        _dense.refuse_dropout("cudnn", options)
        call = CudnnCall.of(q, k, options)
        if call.dense:
            return _dense.backward(dout, q, k, v, out, lse, options)
        if not call.pieces:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        # The merged lse as the forward lays it out, (B, H, rows, 1) float32, once per row range.
        stats = {p.first: dense_float32(p.rows(lse.unsqueeze(-1))) for p in call.pieces}
        grads = [
            self._backward_piece(dout, q, k, v, out, stats[p.first], p, options.scale)
            for p in call.pieces
        ]
        dq_rows, dk, dv = grads[0]
        if len(grads) > 1:  # an offset inside the keys: every piece holds every row
            total = dq_rows.float()
            for g in grads[1:]:
                total.add_(g[0])
            dq_rows = total.to(q.dtype)  # each piece's rounded by the op, their sum once more
            dk, dv = (torch.cat([g[i] for g in grads], dim=-2) for i in (1, 2))
        piece = call.pieces[0]
        if piece.first:
            dq = torch.zeros_like(q)
            piece.rows(dq).add_(dq_rows)
        else:
            dq = dq_rows
        mark_non_finite_problems(
            dq, dk, dv, dout, q, k, v, lse, forward_marked=True, options=options
        )
        return dq, dk, dv

    def _backward_piece(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        stats: torch.Tensor,
        piece: CudnnPiece,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of ``piece``: its rows' ``dq``, its keys' ``dk``, ``dv``, given the
        block's final ``out`` and its lse ``stats`` (``(N, H, rows, 1)``)."""
        dout_rows, q_rows, out_rows = (piece.rows(x) for x in (dout, q, out))
        k_keys, v_keys = piece.keys(k), piece.keys(v)
        if piece.dense:
            return _dense.backward(
                dout_rows, q_rows, k_keys, v_keys, out_rows, stats.squeeze(-1),
                _options(piece, scale),
            )  # fmt: skip
        unused = torch.empty((), dtype=torch.int64, device=q.device)  # philox: no dropout
        dout_a, qa, ka, va, out_a = (
            aligned(x) for x in (dout_rows, q_rows, k_keys, v_keys, out_rows)
        )
        rows, keys = q_rows.shape[-2], k_keys.shape[-2]
        return self._backward(
            dout_a, qa, ka, va, out_a, stats, unused, unused, None, None, None, rows, keys, 0.0,
            piece.causal, scale=scale,
        )  # fmt: skip


def _with_empty_rows(
    q: torch.Tensor,
    v: torch.Tensor,
    first: int | None,
    parts: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a block whose rows before ``first`` (every row: ``None``) see no key,
    ``0`` and ``-inf`` there, and ``parts[0]`` in the rows from ``first`` on."""
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    lse = q.new_zeros(q.shape[:-1], dtype=accumulation_dtype(q.dtype))
    empty = q.shape[-2] if first is None else first
    lse.narrow(-1, 0, empty).fill_(float("-inf"))
    if first is not None:
        part, part_lse = parts[0]
        # Added into zeros: copy_ has no fake-CUDA kernel in a CPU-only torch.
        out.narrow(-2, first, part.shape[-2]).add_(part)
        lse.narrow(-1, first, part_lse.shape[-1]).add_(part_lse)
    return out, lse


def _options(piece: CudnnPiece, scale: float) -> BlockOptions:
    """The dense math's options for ``piece`` (its rows and keys counted from their starts)."""
    return BlockOptions(scale, CAUSAL if piece.causal else FULL)


# -- what the spec cannot hold as data -------------------------------------------------------------

#: ``sdp_utils.cpp``: D256 needs cuDNN newer than this, on sm90 and sm10x.
D256_AFTER = 92200
#: ``check_prefer_cudnn_attention``: torch prefers cuDNN only with cuDNN newer than this.
PREFERRED_AFTER = 91500
#: cuDNN's priority where torch prefers it: below torch_flash (module docstring).
PREFERRED_PRIORITY = 240
#: ``can_use_cudnn_attention``: torch's cuDNN attention needs cuDNN 9.0.
MIN_VERSION = 90000
DEPRIORITIZED_ENV_VAR = "TORCH_CUDNN_SDPA_DEPRIORITIZED"


def runtime_version() -> int | None:
    """The cuDNN version torch runs with (``None``: no cuDNN)."""
    backend: Any = torch.backends.cudnn  # untyped functions
    version = backend.version() if backend.is_available() else None
    return None if version is None else int(version)


#: ``check_cudnn_sdpa_decode`` (pytorch#193893, #194927): "cuDNN SDPA decode is disabled for
#: cuDNN versions 9.19-9.25.0 (except 9.24.1) on SM 10.x and 11.x" (silently wrong results).
DECODE_BROKEN = (91900, 92500)
DECODE_FIXED = frozenset({92401})


def decode_broken(capability: tuple[int, int], version: int | None) -> bool:
    """Whether cuDNN ``version`` on a device of ``capability`` gives wrong results for one query
    row (``check_cudnn_sdpa_decode``)."""
    low, high = DECODE_BROKEN
    in_range = version is not None and low <= version <= high and version not in DECODE_FIXED
    return capability[0] in (10, 11) and in_range


@functools.cache
def _device_decode_broken(index: int) -> bool:
    return decode_broken(torch.cuda.get_device_capability(index), runtime_version())


def decode_refused(device: torch.device) -> bool:
    """:func:`decode_broken` for ``device`` and this process's cuDNN, asked once per device (no
    CUDA device, as on fake ``cuda`` tensors in a CPU-only torch: ``False``)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _device_decode_broken(
        torch.cuda.current_device() if device.index is None else device.index
    )


def _d256_capable(cc: tuple[int, int], version: int) -> bool:
    """``check_cudnn_tensor_shapes``: sm90 or sm10x, cuDNN newer than 9.22, and not sm107 with
    cuDNN 9.25.0 or older (the frontend's D256 support, a build-time condition, is assumed)."""
    arch = cc == (9, 0) or cc[0] == 10
    return arch and version > D256_AFTER and not (cc == (10, 7) and version <= 92500)


def _head_dim_reasons(request: Request, version: int) -> Iterator[str]:
    head_dim, cc = request.head_dim, request.compute_capability
    if head_dim is None or cc is None or head_dim <= 128:
        return
    if not _d256_capable(cc, version):
        yield (
            f"head_dim {head_dim} over 128 needs sm90 or sm10x with cuDNN newer than 9.22.0 "
            f"(device has {cc[0]}.{cc[1]}, cuDNN {version})"
        )
    elif request.backward and head_dim < 256:
        yield (
            f"cuDNN's backward takes head_dim up to 128 or exactly 256, not {head_dim} "
            "(torch's check_cudnn_d256_bprop_head_dim)"
        )


#: Why torch's cuDNN op serves no sliding window or softcap.
_NO_WINDOW = (
    "torch's _scaled_dot_product_cudnn_attention takes no key window (its schema: attn_bias and "
    "is_causal only; a left bound would need a dense Lq x Lk bias)"
)
_NO_SOFTCAP = "torch's _scaled_dot_product_cudnn_attention takes no softcap"


def cudnn_reasons(request: Request, env: Environment) -> Iterable[str]:
    """The reasons against a CUDA request that depend on the cuDNN torch runs with, and what its
    op's schema lacks (a left window bound, softcap)."""
    if request.device_type != "cuda":
        return ()
    missing = [_NO_WINDOW] if request.sliding_window else []
    if request.softcap is not None:
        missing.append(_NO_SOFTCAP)
    return (*missing, *_runtime_reasons(request))


def _runtime_reasons(request: Request) -> Iterable[str]:
    """The reasons that depend on the cuDNN torch runs with."""
    version = runtime_version()
    if version is None:
        return ("torch has no cuDNN here (torch.backends.cudnn.is_available() is False)",)
    if version < MIN_VERSION:
        return (f"cuDNN {version} is older than the 9.0.0 torch's cuDNN attention needs",)
    return tuple(_head_dim_reasons(request, version))


def cudnn_priority_rules(
    version: int | None, cuda: str | None, deprioritized: bool
) -> tuple[PriorityRule, ...]:
    """Where torch 2.13 tries cuDNN before its flash op (``check_prefer_cudnn_attention``):
    cuDNN newer than 9.15.0, not deprioritized, on sm90 and sm100/sm103 (CUDA before 13; torch
    tests ``major`` 9 or 10 with ``minor`` 0 or 3) or any 9.x and 10.x (CUDA 13 on)."""
    if deprioritized or version is None or version <= PREFERRED_AFTER:
        return ()
    if cuda is not None and int(cuda.split(".")[0]) >= 13:
        return (PriorityRule(PREFERRED_PRIORITY, "cuda", (9, 0), (10, 9)),)
    return tuple(
        PriorityRule(PREFERRED_PRIORITY, "cuda", min_capability=cc, max_capability=cc)
        for cc in ((9, 0), (9, 3), (10, 0), (10, 3))
    )


def _deprioritized() -> bool:
    """``TORCH_CUDNN_SDPA_DEPRIORITIZED`` as torch reads it (``c10::utils::check_env``): only
    ``1`` turns the switch on."""
    return os.environ.get(DEPRIORITIZED_ENV_VAR) == "1"


@attrs.frozen
class CudnnPriorityRules:
    """The spec's ``priority_rules_for``: :func:`cudnn_priority_rules` for a cuDNN ``version``, a
    CUDA ``cuda`` version string and ``deprioritized``, each ``None`` read from this process
    (:func:`runtime_version`, ``torch.version.cuda``, ``TORCH_CUDNN_SDPA_DEPRIORITIZED``) each
    time the resolver ranks the kernel, never before."""

    version: int | None = None
    cuda: str | None = None
    deprioritized: bool | None = None

    def __call__(self, env: Environment) -> tuple[PriorityRule, ...]:
        return cudnn_priority_rules(
            runtime_version() if self.version is None else self.version,
            torch.version.cuda if self.cuda is None else self.cuda,
            _deprioritized() if self.deprioritized is None else self.deprioritized,
        )


def cudnn_spec(
    version: int | None = None, cuda: str | None = None, deprioritized: bool | None = None
) -> KernelSpec:
    """The ``cudnn`` spec for a runtime cuDNN ``version``, a CUDA ``cuda`` version string and
    ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` (each ``None``: this process's, read when the resolver
    ranks the kernel: :class:`CudnnPriorityRules`). Building it reads nothing."""
    wide = "cuDNN attention, head_dim over 128: sm90 and sm10x"
    return KernelSpec(
        name="cudnn",
        factory=CudnnKernel,
        capabilities=Capabilities(
            targets=(
                Target("cuda", _HALF, (8, 0), (12, 1), 128, 8, "cuDNN attention: sm80 to sm121"),
                Target("cuda", _HALF, (9, 0), (9, 0), 256, 8, wide),
                Target("cuda", _HALF, (10, 0), (10, 9), 256, 8, wide),
            ),
            causal=True,
            backward=True,
            dropout=False,
            gqa=True,
            deterministic=False,
            batch_limit=FUSED_GRID_LIMIT,
        ),
        priority=-5,
        priority_rules_for=CudnnPriorityRules(version, cuda, deprioritized),
        description="cuDNN's fused attention op: sm80 to sm121, fp16/bf16; torch's first choice "
        "on sm90/sm100 with cuDNN newer than 9.15",
        extra_reasons=cudnn_reasons,
    )


CUDNN_SPEC = cudnn_spec()
"""The built-in spec: nothing about this process's cuDNN is read until the resolver asks."""
