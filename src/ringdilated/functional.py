"""``dilated_attention``: the functional entry point.

Call flow::

    dilated_attention(q, k, v, segment_lengths, dilation_rates, ..., layout=None)
      -> attend(...)
           the call's SequenceLayout               the one passed; else one built for the call
           layout.plans[plan_key(...)]             a planned call with this signature, or
             prepare_call(...)                     validate (inside the ranks' agreement),
                                                   resolve the kernel, plan the shards, build
                                                   the executors, and keep the plan
           plan.apply(q, k, v, CallState(...))     kernels and the data exchange only

Under ``torch.compile`` a one-process call with a named kernel becomes one custom op
(:mod:`ringdilated.compiled`); a sharded call, or one with a kernel instance, runs eagerly behind
a graph break.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, overload

import torch

from ringdilated.compiled import dilated_attention_op
from ringdilated.core.call import (
    CallOptions,
    CallPlan,
    PatternArgs,
    as_process_group,
    group_size,
    plan_key,
    prepare_call,
)
from ringdilated.core.communicator import Communicator, TransferStats
from ringdilated.core.driver import CallState, draw_seed
from ringdilated.core.dtypes import autocast_inputs
from ringdilated.core.kernel import Kernel
from ringdilated.core.pattern import DilationPattern, Mode
from ringdilated.core.resolver import Resolver
from ringdilated.core.sequence_layout import SequenceLayout
from ringdilated.core.validation import check_bool, check_inputs, check_options
from ringdilated.registry import default_resolver

__all__ = ["attend", "default_resolver", "dilated_attention", "world_size"]

_INT64_MAX = 2**63 - 1

world_size = group_size
"""Ranks in a process group (``None``: one process); :func:`ringdilated.core.call.group_size`."""


def attend(
    pattern: DilationPattern | PatternArgs,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    kernel: str | Kernel,
    process_group: object = None,
    communicator: str | Communicator = "auto",
    resolver: Resolver | None = None,
    return_lse: object = False,
    transfer_stats: TransferStats | None = None,
    cu_seqlens: object = None,
    key_padding_mask: object = None,
    layout: object = None,
    full_precision_lse: bool = False,
    lse_needed: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, CallPlan | None]:
    """Validate (on every rank), resolve and run; returns ``(out, lse float32, plan)``, ``plan``
    the call's :class:`~ringdilated.core.call.CallPlan` (``full_precision_lse``: the lse in the
    accumulation dtype, float64 for float64 inputs, for callers that merge results further).
    ``lse`` carries a gradient only with ``return_lse=True`` (every rank then exchanges it).
    ``lse_needed=False``: the caller discards ``lse`` (it may then come back ``None`` from a
    call that runs no backward).

    ``layout``: the batch's :class:`~ringdilated.SequenceLayout`; a call with the signature of
    an earlier call on it is not checked or agreed again (see
    :mod:`ringdilated.core.sequence_layout`). Without one, a one-process call with neither
    ``cu_seqlens`` nor ``key_padding_mask`` uses a process-wide layout of whole sequences (its
    plans kept, so a steady-state call is planned once), and any other call builds its own.

    ``pattern`` is a :class:`DilationPattern` or its unvalidated arguments, which are then
    validated with everything else, inside the ranks' agreement (a bad pattern on one rank raises
    on every rank). ``transfer_stats`` collects the bytes a sharded call moves. Under
    ``torch.compile`` a one-process call with a named kernel validates, then runs as one custom
    op (:mod:`ringdilated.compiled`) and returns ``plan=None`` (the op resolves inside the graph);
    anything else runs eagerly behind a graph break.
    """
    q, k, v = autocast_inputs(q, k, v)  # type: ignore[assignment]
    # A dict, not yet a CallOptions: dynamo cannot construct a frozen attrs class in traced code.
    options = dict(
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        return_lse=return_lse,
        kernel=kernel,
        communicator=communicator,
        transfer_stats=transfer_stats,
        cu_seqlens=cu_seqlens,
        key_padding_mask=key_padding_mask,
    )
    if (
        isinstance(kernel, str)
        and process_group is None
        and layout is None
        and resolver is None
        and torch.compiler.is_compiling()
    ):
        out, lse, _ = _attend_compiled(pattern, q, k, v, options, kernel)
        return out, lse if full_precision_lse else lse.float(), None
    out, lse, plan = _attend_eager(
        pattern, q, k, v, options, resolver, process_group, layout, lse_needed
    )
    return out, lse if full_precision_lse or lse is None else lse.float(), plan


_WHOLE_SEQUENCES = SequenceLayout(agree_every_call=False)
"""The layout of one-process calls made without documents, padding or a layout: every call's
plan is kept in it, keyed by the call's signature (shapes included)."""


def call_layout(
    layout: object, process_group: object, cu_seqlens: object, key_padding_mask: object
) -> SequenceLayout | None:
    """The layout a call runs on: ``layout`` (which nothing else the call passes may
    contradict), the process-wide one of whole sequences for a plain one-process call, or
    ``None``: the call builds its own (and agrees on it with its signature). Raises
    ``TypeError``/``ValueError`` naming what contradicts the layout."""
    if layout is None:
        if process_group is None and cu_seqlens is None and key_padding_mask is None:
            return _WHOLE_SEQUENCES
        return None
    if not isinstance(layout, SequenceLayout):
        raise TypeError(
            f"layout must be a ringdilated.SequenceLayout or None, got {type(layout).__name__}"
        )
    for name, value in (("cu_seqlens", cu_seqlens), ("key_padding_mask", key_padding_mask)):
        if value is not None:
            raise ValueError(
                f"pass {name} to the SequenceLayout, not with layout= (the layout holds the "
                "batch's documents and padding)"
            )
    if process_group is not None and as_process_group(process_group) != layout.group:
        raise ValueError(
            f"process_group {process_group!r} contradicts the layout's process group "
            f"{layout.group!r}: build the SequenceLayout on the call's process group"
        )
    return layout


def _kv_operand(x: torch.Tensor, query_suffix: bool) -> torch.Tensor:
    """``k`` or ``v`` as the driver reads it: as it is when contiguous, when a query suffix
    reads a few segments of it (decoding from a cache: copying it would cost O(L) per token),
    or when it has one batch row; else contiguous (so batch rows and segments merge into one
    kernel call)."""
    if query_suffix or x.shape[0] == 1 or x.is_contiguous():
        return x if x.stride(-1) == 1 else x.contiguous()
    return x.contiguous()


def _attend_planned(
    pattern: DilationPattern | PatternArgs,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    arguments: dict[str, object],
    resolver: Resolver | None,
    process_group: object,
    layout: object,
    lse_needed: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, CallPlan]:
    """The eager path: the call's plan (found on its layout, or made), then its kernels and
    exchanges."""
    on = call_layout(layout, process_group, arguments["cu_seqlens"], arguments["key_padding_mask"])
    chosen = resolver or default_resolver()
    key = None
    plan = None
    if on is not None and not on.agree_every_call:
        key = plan_key(pattern, q, k, v, arguments, chosen, on)
        if key is not None:
            plan = on.plans.get(key)  # type: ignore[assignment]
    if plan is None:
        group = on.group if on is not None else as_process_group(process_group)
        options = CallOptions(**arguments)
        plan = prepare_call(pattern, q, k, v, options, chosen, group, layout=on)
        if key is not None:
            on.plans.put(key, plan)  # type: ignore[union-attr]
    else:
        plan.check_shard(q, k, v)
    suffix = q.shape[1] != k.shape[1]
    q, k, v = q.contiguous(), _kv_operand(k, suffix), _kv_operand(v, suffix)
    stats = arguments["transfer_stats"]
    needed = lse_needed or plan.lse_used
    if plan.dropout_p == 0.0 and stats is None:
        call = _NO_DROPOUT[plan.lse_used, needed]
    else:
        call = CallState(
            draw_seed(plan.dropout_p),
            stats,  # type: ignore[arg-type]
            plan.lse_used,
            needed,
        )
    out, lse = plan.apply(q, k, v, call)
    return out, lse, plan


_NO_DROPOUT = {
    (used, needed): CallState(0, None, used, needed)
    for used in (False, True)
    for needed in (False, True)
}
"""The calls without dropout or byte counting differ in nothing else: one state each."""


_attend_eager = torch.compiler.disable(_attend_planned)
"""The eager path as every caller reaches it: never traced by dynamo (the resolver, the plan and
the process group are Python state), so from inside a compiled region it is a graph break; and
never entered by dynamo's frame callback either, which a compiled region's eager fallback
would otherwise run on every function it calls."""


def _attend_compiled(
    pattern: DilationPattern | PatternArgs,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: dict[str, object],
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, None]:
    """The traced path: the checks dynamo can trace (no resolver here, and not the values of
    ``cu_seqlens`` or the padding mask, which the op checks), then the custom op."""
    if not isinstance(pattern, DilationPattern):
        pattern = DilationPattern(*pattern)  # type: ignore[arg-type]
    q, k, v = check_inputs(q, k, v, pattern)
    scale, dropout = options["scale"], options["dropout_p"]
    check_options(scale, dropout)
    causal = check_bool("causal", options["causal"])
    check_bool("return_lse", options["return_lse"])
    stats = options["transfer_stats"]
    if stats is not None and not isinstance(stats, TransferStats):
        raise TypeError(
            f"transfer_stats must be a ringdilated.TransferStats or None, got {stats!r}"
        )
    for name, values in (
        ("segment_lengths", pattern.segment_lengths),
        ("dilation_rates", pattern.dilation_rates),
    ):
        if max(values) > _INT64_MAX:
            raise ValueError(
                f"under torch.compile, {name} must fit in int64 (the custom op takes int[]), "
                f"got {max(values)}; make this call outside the compiled region"
            )
    layout: list[torch.Tensor | None] = []
    for name in ("cu_seqlens", "key_padding_mask"):
        value = options[name]
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")
        layout.append(value)
    dropout_p = float(dropout)  # type: ignore[arg-type]
    backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    seed = (
        torch.randint(1, 2**62, (), dtype=torch.int64)
        if dropout_p > 0
        else torch.zeros((), dtype=torch.int64)
    )
    out, lse = dilated_attention_op(
        q,
        k,
        v,
        seed,
        *layout,
        list(pattern.segment_lengths),
        list(pattern.dilation_rates),
        pattern.mode,
        causal,
        float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]),  # type: ignore[arg-type]
        dropout_p,
        kernel,
        backward,
    )
    return out, lse, None


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
    kernel: str | Kernel = ...,
    process_group: object = ...,
    communicator: str | Communicator = ...,
    transfer_stats: TransferStats | None = ...,
    cu_seqlens: torch.Tensor | None = ...,
    key_padding_mask: torch.Tensor | None = ...,
    layout: SequenceLayout | None = ...,
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
    kernel: str | Kernel = ...,
    process_group: object = ...,
    communicator: str | Communicator = ...,
    transfer_stats: TransferStats | None = ...,
    cu_seqlens: torch.Tensor | None = ...,
    key_padding_mask: torch.Tensor | None = ...,
    layout: SequenceLayout | None = ...,
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
    kernel: str | Kernel = "auto",
    process_group: object = None,
    communicator: str | Communicator = "auto",
    transfer_stats: TransferStats | None = None,
    cu_seqlens: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    layout: SequenceLayout | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention over ``q`` ``(B, Lq, H, D)`` and ``k``, ``v`` ``(B, L, Hkv, D)``.

    Semantics (docs/spec.md): for pattern ``i`` a query at position ``p`` attends to the
    positions of its segment of length ``segment_lengths[i]`` selected with stride
    ``dilation_rates[i]``.

    - ``mode="head_groups"`` (default): heads are split into ``G`` contiguous groups, group ``i``
      using pattern ``i`` at offset ``i % r_i``; unselected positions give ``0`` (no ``1/G``
      factor). ``mode="longnet"``: every head uses every pattern, mixed by softmax denominators.
    - ``causal``: keys after the query are hidden. ``scale`` defaults to ``1/sqrt(D)``.
    - ``dropout_p``: attention-probability dropout, applied whenever ``> 0`` (pass ``0.0`` in
      evaluation, as with ``torch.nn.functional.scaled_dot_product_attention``).
    - ``return_lse``: also return ``lse`` ``(B, H, Lq)`` float32, ``-inf`` where a query sees no
      key. Gradients flow through ``out`` and ``lse``.
    - Query suffix: ``q`` may be shorter than ``k``, ``v`` (``Lq <= L``); it holds the last ``Lq``
      positions (bottom-right aligned, as with a KV cache), and its rows equal those rows of the
      full-length call.
    - ``cu_seqlens``: a 1-D integer tensor ``[0, e_1, ..., L]``, strictly increasing, shared by
      every batch row: packed documents, each attended as its own sequence (positions and
      segments restart at its start; no query sees another document's keys).
    - ``key_padding_mask``: ``(B, L)`` bool, ``True`` = padding. Each row's valid positions must
      form one contiguous run (left or right padding), attended as its one document; padded
      positions are nobody's keys and give ``out = 0``, ``lse = -inf``. Not with ``cu_seqlens``.
      Both are read to the host once per call (the blocks are planned there): for many layers
      of one batch, pass them once to a ``layout`` instead.
    - ``layout``: the batch's :class:`~ringdilated.SequenceLayout` (documents, padding, process
      group and shard lengths, read and agreed once per batch). A call on a layout is planned and
      agreed at its first call with each signature; later ones read nothing from the device and
      make no collective but the data exchange. Not with ``cu_seqlens`` or
      ``key_padding_mask``; a ``process_group`` must be the layout's.
    - Under ``torch.autocast``, ``q``, ``k``, ``v`` are cast to the autocast dtype and ``out``
      comes back in it, as with ``scaled_dot_product_attention``.
    - ``kernel``: ``"auto"`` (the resolver's choice, or ``RINGDILATED_KERNEL``), a backend name,
      which must fit the request or a :class:`~ringdilated.core.ResolutionError` is raised, or a
      :class:`~ringdilated.core.Kernel` instance, used as it is.
    - ``process_group``: ``None`` (one process) or a ``torch.distributed`` group whose ranks each
      pass their contiguous shard ``(B, n_r, H, D)`` of the sequence, in rank order (lengths may
      differ; they are exchanged in the ranks' agreement), and get back their slice of
      the single-process result. Also a 1-D ``DeviceMesh``, or ``(mesh, "cp")`` for one
      dimension of a larger mesh (its existing group; nothing is created). ``communicator``:
      ``"auto"`` (the least modelled exchange time, see docs/choosing.md), a name
      (``"ringpass"``, ``"allgather"``) or a
      :class:`~ringdilated.core.communicator.Communicator` instance.
      Inputs are checked on every rank and a rejection raises on every rank.
    - ``transfer_stats``: a :class:`~ringdilated.core.communicator.TransferStats` to which a
      sharded call adds the bytes this rank sends and receives (forward, and backward when it
      runs).

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
        transfer_stats=transfer_stats,
        cu_seqlens=cu_seqlens,
        key_padding_mask=key_padding_mask,
        layout=layout,
        lse_needed=return_lse is True,
    )
    return (out, lse) if return_lse else out
