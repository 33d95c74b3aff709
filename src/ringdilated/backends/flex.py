"""FlexAttention (``torch.nn.attention.flex_attention``) behind the kernel contract.

The key window (a causal offset, or a sliding window's two bounds) is a ``mask_mod`` with a block
mask, so blocks the window hides wholly are skipped by the kernel, and blocks it shows wholly run
without the ``mask_mod`` (a sliding window's band costs about ``rows x window``). The block mask
is built from the window by arithmetic on block numbers (:mod:`ringdilated.backends._flex_blocks`),
never from a dense mask: ``create_block_mask`` would evaluate the ``mask_mod`` over a dense
``q_len x k_len`` bool tensor per new block shape (16 GiB at 128k); this one holds
``O((L / 128)^2)`` int32 entries (4 MiB per index table at 128k) and equals
``create_block_mask``'s tensor by tensor. Forward asks for the lse with
``return_aux=AuxRequest(lse=True)`` (on a torch without it the factory fails and the resolver
moves on, with the reason). Backward differentiates a recomputed forward: with
``w = exp(lse_block - lse_final)`` per row, the gradients of ``(out_block, lse_block)`` fed
``(w * dout, w * (rowsum(dout * out_block) - rowsum(dout * out_final)))`` are exactly this
block's share of the merged gradient, which is the contract's backward rule.

Compiling. FlexAttention is only fused when compiled, and ``torch.compile`` specialises on what
it sees: past ``recompile_limit`` (8 by default, shared by every compiled ``flex_attention``) it
silently runs the unfused eager path, which materialises every score. So:

- the function is compiled once per kernel, with dynamic shapes and ``fullgraph=True`` (hitting
  the limit then raises instead of falling back silently), with a limit of its own where torch
  offers one (``recompile_limit`` and ``isolate_recompiles``, torch 2.13); with static shapes
  every new block length would be a recompile. Dynamic shapes also keep flex off its decoding
  kernel (it wants a static batch) for blocks under 128 queries: a trade of that kernel's speed
  on short blocks for one graph, not yet measured on a GPU;
- every block mask's ``mask_mod`` is the same code closing over a *tensor* offset (one code for
  a right bound alone, :func:`offset_mask`, one for a window bounded on the left,
  :func:`window_mask`), so dynamo's guards (on the code, and on an int's value until it marks
  the int dynamic) never see the bounds; block masks are cached per (lengths, bounds, device,
  block size), 256 at most, the bounds first saturated to the block (the same mask);
- if the limit is hit anyway, the call runs uncompiled and :class:`FlexFallbackWarning` says so,
  once per kernel; ``uncompiled_calls`` counts them.

Softcapping (``BlockOptions.softcap``, docs/spec.md, section 5) is a ``score_mod``,
``cap * tanh(score / cap)``: FlexAttention hands it the score already multiplied by ``scale``
and applies the ``mask_mod`` after it, forward and backward, and differentiates it for the
backward (its joint graph: torch 2.13, ``torch/_inductor/kernel/flex/templates/common.py.jinja``
and ``flex_backwards.py.jinja``, ``qk *= SM_SCALE`` then the score_mod, then ``grad_scores``
through it; ``torch/_higher_order_ops/flex_attention.py``, ``_math_attention_inner`` and
``sdpa_dense_backward``, the same on CPU). Like the masks, every cap shares one code closing
over a 0-dim tensor of the cap (in the accumulation dtype, never requiring a gradient: no
captured-buffer gradient, so no atomic add), cached per (cap, device, dtype), so a compiled
FlexAttention serves every cap without a guard on its value.

Declared, not discovered:

- CUDA: the compiled kernel, forward and backward; the limit on problems times key/value heads
  is the decoding kernel's ``gridDim.y``. Not yet run on GPU hardware by this project.
- Deterministic: inductor lowers FlexAttention to its Triton templates unless
  ``kernel_options={"BACKEND": "FLASH"}`` asks for the experimental CuTe kernel (never asked
  here). Their only atomic add is for gradients of tensors a ``score_mod`` captures (none here);
  otherwise each program writes its own rows: forward a query block, backward a query block's
  ``dq`` or a key block's ``dk``/``dv``, summed over query heads and blocks in a fixed order
  (torch 2.13: ``torch/_inductor/kernel/flex/flex_attention.py``, ``common.py``,
  ``flex_flash_attention.py``, ``templates/flex_backwards.py.jinja``). The unfused fallback and
  the CPU target are plain matmuls.
- CPU: forward only, eager and unfused (FlexAttention on CPU has no backward, and no lse under
  ``torch.compile``): ``explain()`` shows the target's note. Its priority is below the reference
  kernel; it exists so that inference can force it and so its forward is tested here.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Collection
from typing import Any

import torch

from ringdilated.backends._flex_blocks import (
    DEFAULT_BLOCK_SIZE,
    BlockSize,
    offset_block_mask,
    saturated_offset,
    saturated_window,
    window_block_mask,
)
from ringdilated.core import (
    FUSED_QUERY_ELEMENTS,
    GRID_LIMIT,
    BatchLimit,
    BlockOptions,
    Capabilities,
    KernelSpec,
    KeyWindow,
    PriorityRule,
    RingDilatedWarning,
    Target,
    accumulation_dtype,
    mark_non_finite_problems,
    mark_non_finite_rows,
)
from ringdilated.core.support.caller import user_stacklevel

__all__ = [
    "FLEX_SPEC",
    "FlexFallbackWarning",
    "FlexKernel",
    "compile_flex",
    "offset_mask",
    "softcap_score",
    "window_mask",
]

Attention = Callable[..., tuple[torch.Tensor, Any]]
Compile = Callable[[Attention], Attention]
#: A compiled FlexAttention's own recompile budget, where torch lets a call set one.
RECOMPILE_LIMIT = 64


class FlexFallbackWarning(RingDilatedWarning):
    """FlexAttention ran uncompiled (unfused, every score materialised) on a compiled target."""


def compile_flex(attention: Attention, backend: Any = "inductor") -> Attention:
    """``torch.compile`` for FlexAttention: dynamic shapes, ``fullgraph=True`` (the recompile
    limit raises rather than silently running eager), and an isolated limit where supported.
    ``backend`` is torch.compile's (tests pass a counting eager backend to watch dynamo)."""
    params = inspect.signature(torch.compile).parameters
    extra: dict[str, Any] = {"backend": backend}
    if "recompile_limit" in params:
        extra["recompile_limit"] = RECOMPILE_LIMIT
    if "isolate_recompiles" in params:
        extra["isolate_recompiles"] = True
    return torch.compile(attention, dynamic=True, fullgraph=True, **extra)


def offset_mask(offset: torch.Tensor) -> Callable[..., Any]:
    """The ``mask_mod`` for a key window bounded on the right by ``offset``: key ``j`` visible
    to query ``i`` iff ``j <= i + offset``. Every mask shares this code and closes over a
    tensor, so a compiled FlexAttention serves every offset with one graph."""

    def visible(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx <= q_idx + offset

    return visible


def softcap_score(cap: torch.Tensor) -> Callable[..., Any]:
    """The ``score_mod`` for a logit cap: ``cap * tanh(score / cap)``, ``cap`` a 0-dim tensor.
    Every cap shares this code (as every mask shares :func:`offset_mask`'s)."""

    def capped(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return cap * torch.tanh(score / cap)

    return capped


@functools.lru_cache(maxsize=64)
def _softcap_score(cap: float, device: str, dtype: torch.dtype) -> Callable[..., Any]:
    """The cached ``score_mod`` of ``cap`` on ``device``, its tensor in ``dtype`` (the scores')."""
    return softcap_score(torch.full((), cap, dtype=dtype, device=device))  # a fill: no host copy


def window_mask(left: torch.Tensor, right: torch.Tensor) -> Callable[..., Any]:
    """The ``mask_mod`` for a key window bounded on both sides (a sliding window): key ``j``
    visible to query ``i`` iff ``i - left <= j <= i + right``, left bound first. Like
    :func:`offset_mask`, one code closing over tensors, so one compiled graph serves every
    window (an unbounded right side is passed saturated, :func:`saturated_window`)."""

    def visible(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)

    return visible


def _block_mask(
    q_len: int,
    k_len: int,
    window: KeyWindow | int,
    device: str,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
) -> Any:
    """The cached ``BlockMask`` of a ``q_len x k_len`` block with key ``window`` (an int: 0.1's
    causal offset, ``window.right``)."""
    if not isinstance(window, KeyWindow):
        window = KeyWindow(None, window)
    if window.left is None:
        assert window.right is not None
        right = saturated_offset(q_len, k_len, window.right)
        return _cached_block_mask(q_len, k_len, None, right, device, block_size)
    left, right = saturated_window(q_len, k_len, window.left, window.right)
    return _cached_block_mask(q_len, k_len, left, right, device, block_size)


@functools.lru_cache(maxsize=256)
def _cached_block_mask(
    q_len: int, k_len: int, left: int | None, right: int, device: str, block_size: BlockSize
) -> Any:
    high = torch.full((), right, device=device)  # a fill: no host copy
    if left is None:
        return offset_block_mask(q_len, k_len, right, offset_mask(high), device, block_size)
    mask_mod = window_mask(torch.full((), left, device=device), high)
    return window_block_mask(q_len, k_len, left, right, mask_mod, device, block_size)


def _recompile_limit_errors() -> tuple[type[BaseException], ...]:
    from torch._dynamo import exc

    return tuple(
        getattr(exc, name)
        for name in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
        if hasattr(exc, name)
    )


def _distinct(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` and ``v`` as tensor objects distinct from ``q`` and each other (a view where one
    is passed twice, as in self-attention called with ``(x, x, x)``). FlexAttention runs under
    dynamo, whose guards require its tensor arguments to be distinct objects; when that guard
    fails against a cached graph whose ``score_mod`` closed over a tensor and the new call's
    ``score_mod`` has no closure (a capped call, then an uncapped one with ``(x, x, x)``),
    torch 2.13 raises a ``TypeError`` while wording the recompile's reason
    (``torch/_dynamo/guards.py``, ``recompilation_reason_for_no_tensor_aliasing_guard``
    evaluates ``args[3].__closure__[0]`` of the new call). The driver's calls always pass
    distinct views; a direct call may not."""
    if k is q:
        k = k.view(k.shape)
    if v is q or v is k:
        v = v.view(v.shape)
    return k, v


class FlexKernel:
    """FlexAttention per block.

    ``attention`` replaces ``flex_attention`` (tests pass a differentiable stand-in with the same
    signature to check the backward rule on CPU); ``compile`` replaces :func:`compile_flex`;
    ``compiled_devices`` are the device types that run the compiled function (CUDA; tests add
    CPU with an eager-backend compile to watch dynamo's guards); ``block_size`` is the block
    mask's (query rows, key columns) per block, torch's 128 by default (the compiled kernel's
    tiles must divide it; tests pass small blocks so short problems span many).
    """

    def __init__(
        self,
        attention: Attention | None = None,
        compile: Compile = compile_flex,
        compiled_devices: Collection[str] = ("cuda",),
        block_size: BlockSize = DEFAULT_BLOCK_SIZE,
    ) -> None:
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        self._aux = AuxRequest(lse=True)
        self._eager: Attention = attention or flex_attention
        self._compile = compile
        self._compiled_devices = frozenset(compiled_devices)
        self._block_size = block_size
        self._compiled: Attention | None = None
        self.uncompiled_calls = 0

    def _call(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        with warnings.catch_warnings():
            # Eager FlexAttention warns that it is unfused: the CPU target declares it, and a
            # compiled target's fallback gets its own warning below.
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch")
            if q.device.type in self._compiled_devices:
                if self._compiled is None:
                    self._compiled = self._compile(self._eager)
                try:
                    return self._compiled(q, *args, **kwargs)
                except _recompile_limit_errors() as error:
                    self._fell_back(error)
            return self._eager(q, *args, **kwargs)

    def _fell_back(self, error: BaseException) -> None:
        if not self.uncompiled_calls:
            warnings.warn(
                "FlexAttention hit torch.compile's recompile limit and runs uncompiled (unfused, "
                f"every score materialised) for these shapes: {str(error).splitlines()[0]}",
                FlexFallbackWarning,
                stacklevel=user_stacklevel(),
            )
        self.uncompiled_calls += 1

    def _run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q_len, k_len = q.shape[-2], k.shape[-2]
        mask = None
        if options.needs_mask(q_len, k_len):
            mask = _block_mask(q_len, k_len, options.window, str(q.device), self._block_size)
        score_mod = None
        if options.softcap is not None:
            dtype = accumulation_dtype(q.dtype)
            score_mod = _softcap_score(options.softcap, str(q.device), dtype)
        gqa = q.shape[1] != k.shape[1]
        k, v = _distinct(q, k, v)
        out, aux = self._call(
            q, k, v, score_mod=score_mod, block_mask=mask, scale=options.scale, enable_gqa=gqa,
            return_aux=self._aux,
        )  # fmt: skip
        return out, aux.lse

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = self._run(q, k, v, options)
        lse = lse.to(accumulation_dtype(q.dtype))
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
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        with torch.enable_grad():
            block_out, block_lse = self._run(qg, kg, vg, options)
        dtype = lse.dtype
        block_lse_d = block_lse.detach().to(dtype)
        live = torch.isfinite(lse) & torch.isfinite(block_lse_d)
        weight = torch.where(live, torch.exp(block_lse_d - torch.where(live, lse, 0.0)), 0.0)
        d = dout.to(dtype)
        grad_out = (weight.unsqueeze(-1) * d).to(block_out.dtype)
        own = (d * block_out.detach().to(dtype)).sum(-1)
        grad_lse = weight * (own - (d * out.to(dtype)).sum(-1))
        dq, dk, dv = torch.autograd.grad(
            (block_out, block_lse), (qg, kg, vg), (grad_out, grad_lse.to(block_lse.dtype))
        )
        mark_non_finite_problems(
            dq, dk, dv, dout, q, k, v, lse, forward_marked=True, options=options
        )
        return dq, dk, dv


FLEX_SPEC = KernelSpec(
    name="flex",
    factory=FlexKernel,
    capabilities=Capabilities(
        targets=(
            Target(
                "cuda",
                frozenset({torch.float16, torch.bfloat16, torch.float32}),
                min_capability=(8, 0),
                max_head_dim=256,
                head_dim_multiple=16,
                note="compiled FlexAttention",
            ),
            Target(
                "cpu",
                frozenset({torch.float32, torch.float64}),
                backward=False,
                note="eager FlexAttention: forward only, unfused",
                batch_limit=BatchLimit(),  # eager flex materialises every score: the default bound
            ),
        ),
        causal=True,
        sliding_window=True,
        backward=True,
        dropout=False,
        gqa=True,
        softcap=True,
        deterministic=True,
        batch_limit=BatchLimit(
            problems=GRID_LIMIT,
            problems_x_kv_heads=GRID_LIMIT,
            query_elements=FUSED_QUERY_ELEMENTS,
            skips_hidden_keys=True,  # the block mask skips the blocks a window hides
        ),
    ),
    priority=-10,
    priority_rules=(PriorityRule(20, "cuda"),),
    description=(
        "FlexAttention with the key window (causal offset, sliding window) as a block mask, "
        "softcap as a score_mod"
    ),
)
