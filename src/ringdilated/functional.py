"""``dilated_attention``: the functional entry point.

Call flow::

    dilated_attention(q, k, v, segment_lengths, dilation_rates, ...)
      -> DilationPattern(...)                validated value, blocks cached per (L, H, Hkv)
      -> check_inputs / check_options        every error before any work
      -> default_resolver().resolve(request, kernel)     once per distinct request, cached
      -> DilatedAttentionFunction.apply(q, k, v, Run(...))

Under ``torch.compile`` a single-process call becomes one custom op (:mod:`ringdilated.compiled`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Literal, overload

import torch
import torch.distributed as dist

from ringdilated.compiled import dilated_attention_op
from ringdilated.core.agreement import CallSignature, agree
from ringdilated.core.capabilities import Environment, Request
from ringdilated.core.communicator import Communicator
from ringdilated.core.driver import DilatedAttentionFunction, Executor, pattern_run
from ringdilated.core.dtypes import warn_if_slow
from ringdilated.core.pattern import DilationPattern, Mode
from ringdilated.core.resolver import Plan, Resolver
from ringdilated.core.shard import ShardPlan, shard_plan
from ringdilated.core.sharded import ShardedRun
from ringdilated.core.validation import check_bool, check_inputs, check_options
from ringdilated.plugins.manager import load_registry

__all__ = ["attend", "default_resolver", "dilated_attention", "world_size"]


@functools.lru_cache(maxsize=1)
def default_resolver() -> Resolver:
    """The resolver over every loaded plugin's kernels. ``default_resolver.cache_clear()`` and
    ``load_registry.cache_clear()`` rebuild it (after changing plugin environment variables)."""
    registry = load_registry()
    return Resolver(
        registry.kernels.values(),
        env=Environment.from_environ(),
        plugin_failures=registry.failures,
        communicators=registry.communicators.values(),
    )


def world_size(process_group: object) -> int:
    """Ranks in ``process_group`` (``None``: one process)."""
    if process_group is None:
        return 1
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed.ProcessGroup or None, got {process_group!r}"
        )
    return dist.get_world_size(process_group)


PatternArgs = tuple[object, object, object]
"""``(segment_lengths, dilation_rates, mode)`` not yet validated."""


def _validate(
    pattern_args: DilationPattern | PatternArgs,
    q: object,
    k: object,
    v: object,
    *,
    causal: object,
    scale: object,
    dropout_p: object,
    return_lse: object,
    kernel: str,
    communicator: str,
    ranks: int,
    resolver: Resolver,
) -> tuple[DilationPattern, Plan, Communicator, tuple[ShardPlan, ...]]:
    """Every check of a call, the pattern's included; returns the pattern, the kernel plan, the
    communicator and every rank's shard plan (empty on one process)."""
    pattern = (
        pattern_args
        if isinstance(pattern_args, DilationPattern)
        else DilationPattern(*pattern_args)  # type: ignore[arg-type]
    )
    q, k, v = check_inputs(q, k, v, pattern)
    check_options(scale, dropout_p)
    causal = check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    request = Request.for_tensors(
        q,
        k,
        causal=causal,
        dropout=dropout_p > 0,  # type: ignore[operator]
        backward=backward,
        env=resolver.env,
    )
    plan = resolver.resolve(request, kernel)
    warn_if_slow(request)
    _, L, H, _ = q.shape
    shards = (
        tuple(shard_plan(pattern, L * ranks, H, k.shape[2], rank, ranks) for rank in range(ranks))
        if ranks > 1
        else ()
    )
    return pattern, plan, resolver.communicator_for(ranks, causal, communicator, shards), shards


def attend(
    pattern: DilationPattern | PatternArgs,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    kernel: str,
    process_group: object = None,
    communicator: str = "auto",
    resolver: Resolver | None = None,
    return_lse: object = False,
) -> tuple[torch.Tensor, torch.Tensor, Plan | None]:
    """Validate (on every rank), resolve and run; returns ``(out, lse float32, plan)``.

    ``pattern`` is a :class:`DilationPattern` or its unvalidated arguments, which are then
    validated with everything else, inside the ranks' agreement (a bad pattern on one rank raises
    on every rank). Under ``torch.compile`` a single-process call validates, then runs as one
    custom op (:mod:`ringdilated.compiled`) and returns ``plan=None`` (the op resolves inside the
    graph).
    """
    if process_group is None and torch.compiler.is_compiling():
        if not isinstance(pattern, DilationPattern):
            pattern = DilationPattern(*pattern)  # type: ignore[arg-type]
        return _attend_compiled(
            pattern,
            q,
            k,
            v,
            causal=causal,
            scale=scale,
            dropout_p=dropout_p,
            kernel=kernel,
            return_lse=return_lse,
        )
    resolver = resolver or default_resolver()
    ranks = world_size(process_group)

    def validate() -> tuple[DilationPattern, Plan, Communicator, tuple[ShardPlan, ...]]:
        return _validate(
            pattern,
            q,
            k,
            v,
            causal=causal,
            scale=scale,
            dropout_p=dropout_p,
            return_lse=return_lse,
            kernel=kernel,
            communicator=communicator,
            ranks=ranks,
            resolver=resolver,
        )

    checked: DilationPattern | None = None
    plan: Plan | None = None
    comm: Communicator | None = None
    plans: tuple[ShardPlan, ...] = ()
    if ranks == 1:
        checked, plan, comm, _ = validate()
    else:
        assert isinstance(process_group, dist.ProcessGroup)
        error: Exception | None = None
        try:
            checked, plan, comm, plans = validate()
        except Exception as exc:  # any failure here must reach every rank, not strand them
            error = exc
        signature = CallSignature(
            pattern=(
                (checked.segment_lengths, checked.dilation_rates, checked.mode)
                if checked is not None
                else tuple(map(repr, pattern if isinstance(pattern, tuple) else (pattern,)))
            ),
            causal=causal,
            scale=scale,
            dropout_p=dropout_p,
            dtype=str(getattr(q, "dtype", None)),
            q_shape=tuple(getattr(q, "shape", ())),
            k_shape=tuple(getattr(k, "shape", ())),
            kernel=None if plan is None else plan.kernel_name,
            communicator=None if comm is None else type(comm).__name__,
        )
        agree(process_group, error, signature)
    assert checked is not None and plan is not None and comm is not None  # validate() returned
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item()) if dropout_p > 0 else 0
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    shards = None
    if ranks > 1:
        assert isinstance(process_group, dist.ProcessGroup)
        shards = plans[dist.get_rank(process_group)]
        comm.prepare(process_group, plans, causal)
    run = pattern_run(
        plan.kernel,
        checked,
        q,
        k,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        dropout_seed=seed,
        complete=shards is None,
        blocks=None if shards is None else shards.inner,
        batch_limit=plan.batch_limit,
        kernel_name=plan.kernel_name,
    )
    executor: Executor = run
    if shards is not None:
        executor = ShardedRun(inner=run, plan=shards, communicator=comm, group=process_group)
    out, lse = DilatedAttentionFunction.apply(q, k, v, executor)  # type: ignore[no-untyped-call]
    return out, lse.float(), plan


def _attend_compiled(
    pattern: DilationPattern,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    kernel: str,
    return_lse: object,
) -> tuple[torch.Tensor, torch.Tensor, None]:
    q, k, v = check_inputs(q, k, v, pattern)
    check_options(scale, dropout_p)
    causal = check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    seed = (
        torch.randint(0, 2**62, (), dtype=torch.int64)
        if dropout_p > 0
        else torch.zeros((), dtype=torch.int64)
    )
    out, lse = dilated_attention_op(
        q,
        k,
        v,
        seed,
        list(pattern.segment_lengths),
        list(pattern.dilation_rates),
        pattern.mode,
        causal,
        float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        float(dropout_p),
        kernel,
        backward,
    )
    return out, lse.float(), None


@overload
def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    mode: Mode = ...,
    causal: bool = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    return_lse: Literal[False] = ...,
    kernel: str = ...,
    process_group: object = ...,
    communicator: str = ...,
) -> torch.Tensor: ...


@overload
def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    mode: Mode = ...,
    causal: bool = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    return_lse: Literal[True],
    kernel: str = ...,
    process_group: object = ...,
    communicator: str = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    mode: Mode = "head_groups",
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    kernel: str = "auto",
    process_group: object = None,
    communicator: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention over ``q`` ``(B, L, H, D)`` and ``k``, ``v`` ``(B, L, Hkv, D)``.

    Semantics are SPEC.md: for pattern ``i`` a query at position ``p`` attends to the positions of
    its segment of length ``segment_lengths[i]`` selected with stride ``dilation_rates[i]``.

    - ``mode="head_groups"`` (default): heads are split into ``G`` contiguous groups, group ``i``
      using pattern ``i`` at offset ``i % r_i``; unselected positions give ``0`` (no ``1/G``
      factor). ``mode="longnet"``: every head uses every pattern, mixed by softmax denominators.
    - ``causal``: keys after the query are hidden. ``scale`` defaults to ``1/sqrt(D)``.
    - ``dropout_p``: attention-probability dropout, applied whenever ``> 0`` (pass ``0.0`` in
      evaluation, as with ``torch.nn.functional.scaled_dot_product_attention``).
    - ``return_lse``: also return ``lse`` ``(B, H, L)`` float32, ``-inf`` where a query sees no key.
      Gradients flow through ``out`` and ``lse``.
    - ``kernel``: ``"auto"`` (the resolver's choice, or ``RINGDILATED_KERNEL``) or a backend name,
      which must fit the request or a :class:`~ringdilated.core.ResolutionError` is raised.
    - ``process_group``: ``None`` (one process) or a ``torch.distributed`` group whose ranks each
      pass their contiguous shard ``(B, L / P, H, D)`` of the sequence and get back their slice of
      the single-process result; ``communicator``: ``"auto"``, ``"ringpass"`` or ``"local"``
      (one process). Inputs are checked on every rank and a rejection raises on every rank.

    Raises ``TypeError``/``ValueError`` naming the offending value before any work starts.
    """
    out, lse, _ = attend(
        (segment_lengths, dilation_rates, mode),
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        kernel=kernel,
        process_group=process_group,
        communicator=communicator,
        return_lse=return_lse,
    )
    return (out, lse) if return_lse else out
