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
  to cuDNN, unlike flash). A window bounded at ``right <= 0`` runs the rows from ``-right`` on
  with ``is_causal``; the rows before it see no key and get ``out = 0``, ``lse = -inf`` here. A
  bound ``0 < right < Lk - 1`` goes as an additive ``(Lq, Lk)`` bias of 0 and ``-inf`` in the
  query's dtype, which the op expands to ``(B, 1, Lq, Lk)``; no row of it is fully masked. So
  the op never sees a row with no key, whatever cuDNN would return for one.
- Grouped heads natively: the graph takes ``K``, ``V`` with their own head counts
  (``build_graph`` sets their dims from the tensors; ``sdp_utils.cpp`` admits GQA with
  ``check_batch_size_and_num_heads_dense<supports_gqa=true, ...>``) and the backward allocates
  ``dk``, ``dv`` like ``key``, ``value``. ``k``, ``v`` go with their ``Hkv`` heads.
- Layout: ``build_graph`` gives cuDNN every tensor's sizes and strides, so the driver's strided
  views go as they are (last dimension contiguous; with the head dim a multiple of 8, every
  row starts 16 bytes apart); a caller's view that is not 16-byte aligned is copied
  (:func:`~ringdilated.backends._layouts.aligned`). The backward declares ``logsumexp``'s
  sizes and strides as the float ``Stats`` tensor: it gets the merged lse as a contiguous
    float32 ``(B, H, Lq, 1)``, the layout the forward returns; ``grad_out`` is copied by the op only
  if its last stride is not 1.
- Calls that cuDNN does not serve run the dense math (:mod:`ringdilated.backends._dense`), which
  is exact: a key length of 1 (``check_cudnn_tensor_shapes``: "cudnn SDPA does not support
  key/value sequence length 1") and empty tensors (``run_cudnn_SDP_fprop`` returns without
  writing its outputs).
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
9.15.0 and ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is not 1, read when this module is imported.
There it gets priority 240: above ``sdpa`` (100), but below ``torch_flash`` (250) and the
flash-attn packages, unlike torch's order, because here cuDNN costs what a dense single call
does not: a graph built per new shape-and-stride signature (thread-local, so forward and
backward threads each build one; dilated blocks, documents and suffixes make many), and a dense
``(Lq, Lk)`` bias for a causal offset inside the keys (a query suffix, a crossing piece). Not
measured on a GPU yet: the measurement decides whether it moves up. Everywhere else torch tries
cuDNN last, after its math fallback: priority -5, below ``reference`` (0), so it runs when
named. It declares no deterministic mode (torch never picks it under the switch), so a
deterministic request ranks it after every kernel that has one.
Not yet run on GPU hardware by this project: checked on FakeTensor ``cuda`` tensors and against
a stand-in of the ops (tests/standins/cudnn.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import torch

from ringdilated.backends import _dense
from ringdilated.backends._layouts import aligned, dense_float32
from ringdilated.core import (
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
)

__all__ = [
    "CUDNN_SPEC",
    "CudnnCall",
    "CudnnKernel",
    "cudnn_priority_rules",
    "cudnn_reasons",
    "cudnn_spec",
    "runtime_version",
]

_aten = torch.ops.aten
_HALF = frozenset({torch.float16, torch.bfloat16})
#: Bias rows start this many bytes apart (the alignment cuDNN's loads assume of every row).
_ROW_BYTES = 16

CudnnForward = Callable[..., tuple[Any, ...]]
CudnnBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@attrs.frozen
class CudnnCall:
    """How one block goes to the op: its rows from ``first`` on, with the op's top-left causal
    mask or an additive ``bias``, or (``dense``) not at all."""

    first: int
    causal: bool
    bias: torch.Tensor | None = attrs.field(eq=False)
    dense: bool = False

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, options: BlockOptions) -> CudnnCall:
        n, heads, q_len = q.shape[:3]
        k_len = k.shape[-2]
        right = options.window.right
        if options.window.left is not None:
            raise NotImplementedError(f"{options.window!r}: cudnn serves no left bound")
        if not (n and heads and q_len) or k_len <= 1:
            return cls(0, False, None, dense=True)
        if right is None or right >= k_len - 1:
            return cls(0, False, None)
        if right <= 0:
            return cls(min(q_len, -right), True, None)
        return cls(0, False, _bias(q_len, k_len, right, q))

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.narrow(-2, self.first, x.shape[-2] - self.first)


def _bias(q_len: int, k_len: int, right: int, q: torch.Tensor) -> torch.Tensor:
    """``(q_len, k_len)``: 0 where key ``j <= i + right``, ``-inf`` elsewhere, in ``q``'s dtype,
    rows ``_ROW_BYTES`` apart."""
    per_row = max(1, _ROW_BYTES // q.element_size())
    padded = -(-k_len // per_row) * per_row
    bias = torch.zeros(q_len, padded, dtype=q.dtype, device=q.device).narrow(1, 0, k_len)
    visible = _dense.visible_keys(q_len, k_len, right, q.device)
    assert visible is not None
    return bias.masked_fill_(visible.logical_not(), float("-inf"))


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
        if call.first == q.shape[-2]:  # no row sees a key
            out = q.new_zeros(*q.shape[:-1], v.shape[-1])
            return out, q.new_full(q.shape[:-1], float("-inf"), dtype=accumulation_dtype(q.dtype))
        qa, ka, va = (aligned(x) for x in (call.rows(q), k, v))  # a misaligned view: a copy
        part, part_lse, *_ = self._forward(
            qa, ka, va, call.bias, True, 0.0, call.causal, False, scale=options.scale
        )
        part_lse = part_lse.squeeze(-1)
        if call.first:  # rows before it see no key: 0 and -inf
            out = q.new_zeros(*q.shape[:-1], v.shape[-1])
            lse = q.new_zeros(q.shape[:-1], dtype=part_lse.dtype)
            lse.narrow(-1, 0, call.first).fill_(float("-inf"))
            # Added into zeros: copy_ has no fake-CUDA kernel in a CPU-only torch.
            call.rows(out).add_(part)
            lse.narrow(-1, call.first, part_lse.shape[-1]).add_(part_lse)
        else:
            out, lse = part, part_lse
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
        _dense.refuse_dropout("cudnn", options)
        call = CudnnCall.of(q, k, options)
        if call.dense:
            return _dense.backward(dout, q, k, v, out, lse, options)
        rows = q.shape[-2] - call.first
        if not rows:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        stats = dense_float32(call.rows(lse.unsqueeze(-1)))  # (B, H, rows, 1)
        unused = torch.empty((), dtype=torch.int64, device=q.device)  # philox: no dropout
        dout_a, qa, ka, va, out_a = (
            aligned(x) for x in (call.rows(dout), call.rows(q), k, v, call.rows(out))
        )
        dq_rows, dk, dv = self._backward(
            dout_a,
            qa,
            ka,
            va,
            out_a,
            stats,
            unused,
            unused,
            call.bias,
            None,
            None,
            rows,
            k.shape[-2],
            0.0,
            call.causal,
            scale=options.scale,
        )
        if call.first:
            dq = torch.zeros_like(q)
            call.rows(dq).add_(dq_rows)
        else:
            dq = dq_rows
        mark_non_finite_problems(
            dq, dk, dv, dout, q, k, v, lse, forward_marked=True, options=options
        )
        return dq, dk, dv


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


def cudnn_reasons(request: Request, env: Environment) -> Iterable[str]:
    """The reasons against a CUDA request that depend on the cuDNN torch runs with."""
    if request.device_type != "cuda":
        return ()
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


def cudnn_spec(
    version: int | None = None, cuda: str | None = None, deprioritized: bool | None = None
) -> KernelSpec:
    """The ``cudnn`` spec for a runtime cuDNN ``version``, a CUDA ``cuda`` version string and
    ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` (each ``None``: this process's)."""
    if version is None:
        version = runtime_version()
    if cuda is None:
        cuda = torch.version.cuda
    if deprioritized is None:
        deprioritized = os.environ.get(DEPRIORITIZED_ENV_VAR) == "1"
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
        priority_rules=cudnn_priority_rules(version, cuda, deprioritized),
        description="cuDNN's fused attention op: sm80 to sm121, fp16/bf16; torch's first choice "
        "on sm90/sm100 with cuDNN newer than 9.15",
        extra_reasons=cudnn_reasons,
    )


CUDNN_SPEC = cudnn_spec()
