"""``dilated_attention``: the functional entry point.

Call flow::

    dilated_attention(q, k, v, segment_lengths, dilation_rates, ..., layout=None)
      -> attend(...)
           the call's SequenceLayout               the one passed; else one built for the call
           layout.plans[plan_key(...)]             a planned call with this signature, or
             prepare_call(...)                     validate (inside the ranks' agreement),
                                                   resolve the kernel, plan the shards, build
                                                   the executors, and keep the plan
           execute(plan, q, k, v, ...)             kernels and the data exchange only

Under ``torch.compile`` a one-process call with a named kernel becomes one custom op
(:mod:`ringdilated.compiled`); a sharded call, or one with a kernel instance, runs eagerly behind
a graph break.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch
import torch.distributed as dist

from ringdilated.compiled import (
    NO_STATS,
    attention_op,
    dilated_attention_op,
    group_names,
    last_plan,
)
from ringdilated.core import Communicator, DilationPattern, Kernel, Mode, Resolver, TransferStats
from ringdilated.core.call import (
    WHOLE_SEQUENCES,
    CallPlan,
    Grid,
    PatternArgs,
    SequenceLayout,
    as_process_group,
    execute,
    group_size,
    plan_for,
    wants_gradients,
)
from ringdilated.core.run import effective_scale
from ringdilated.core.select import autocast_inputs
from ringdilated.registry import default_resolver

__all__ = ["attend", "default_resolver", "dilated_attention", "world_size"]

world_size = group_size
"""Ranks in a process group (``None``: one process): :func:`~ringdilated.core.call.group_size`."""


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
    softcap: object = None,
    sinks: object = None,
    window: object = None,
) -> tuple[torch.Tensor, torch.Tensor, CallPlan | None]:
    """Validate (on every rank), resolve and run; returns ``(out, lse float32, plan)``, ``plan``
    the call's :class:`~ringdilated.core.call.prepare.CallPlan` (``full_precision_lse``: the lse in
    the accumulation dtype, float64 for float64 inputs, for callers that merge results further).
    ``lse`` carries a gradient only with ``return_lse=True`` (every rank then exchanges it).
    ``lse_needed=False``: the caller discards ``lse`` (it may then come back ``None`` from a
    call that runs no backward).

    Without a ``layout``, a one-process call with neither ``cu_seqlens`` nor
    ``key_padding_mask`` uses a process-wide layout of whole sequences (its plans kept, so a
    steady-state call is planned once), and any other call builds its own. ``pattern`` is a
    :class:`DilationPattern` or its unvalidated arguments, which are then validated with
    everything else, inside the ranks' agreement (a bad pattern on one rank raises on every
    rank). A call that runs as an op (see the module docstring) returns ``plan=None`` under
    ``torch.compile`` (the op resolves inside the graph). The other arguments are
    :func:`dilated_attention`'s.
    """
    q, k, v = autocast_inputs(q, k, v)  # type: ignore[assignment]
    # A dict, not yet a CallOptions: dynamo cannot construct a frozen attrs class in traced code.
    options = dict(
        causal=causal,
        window=window,
        scale=scale,
        dropout_p=dropout_p,
        return_lse=return_lse,
        kernel=kernel,
        communicator=communicator,
        transfer_stats=transfer_stats,
        cu_seqlens=cu_seqlens,
        key_padding_mask=key_padding_mask,
        softcap=softcap,
        sinks=sinks,
    )
    compiling = torch.compiler.is_compiling()
    routed = None
    if compiling or process_group is not None or getattr(layout, "world_size", 1) > 1:
        # Under torch.compile, and for a sharded call in eager mode too: one registered op.
        routed = _attend_op(pattern, q, k, v, options, resolver, process_group, layout, compiling)
    out, lse, plan = routed or _attend_eager(
        pattern, q, k, v, options, resolver, process_group, layout, lse_needed
    )
    return out, lse if full_precision_lse or lse is None else lse.float(), plan


def _op_pattern(pattern: DilationPattern | PatternArgs) -> tuple[list[int], list[int], str] | None:
    """The pattern as the ops take it (``int[]``, ``int[]``, ``str``), or ``None`` where it does
    not fit their schema (the eager path then rejects it with its own message)."""
    segments, rates, mode = (
        (pattern.segment_lengths, pattern.dilation_rates, pattern.mode)
        if isinstance(pattern, DilationPattern)
        else pattern
    )
    if not (isinstance(segments, (list, tuple)) and isinstance(rates, (list, tuple))):
        return None
    if not isinstance(mode, str):
        return None
    if any(type(x) is not int or not -(2**63) <= x < 2**63 for x in (*segments, *rates)):  # int64
        return None
    return list(segments), list(rates), mode


def _op_window(window: object) -> tuple[int | None, int | None] | None:
    """The window as the ops take it (``window_left``, ``window_right``: ``int?`` each;
    ``(None, None)`` for no window), or ``None`` where it does not fit their schema (the eager
    path then checks it and names what is wrong)."""
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        return None
    if any(x is not None and (type(x) is not int or not -(2**63) <= x < 2**63) for x in window):
        return None
    return window[0], window[1]


def _seed(dropout_p: float) -> torch.Tensor:
    """The dropout seed an op takes: drawn from torch's CPU generator now, or 0 without
    dropout (drawn only once the call is known to run as an op)."""
    if dropout_p > 0:
        return torch.randint(1, 2**62, (), dtype=torch.int64)
    return torch.zeros((), dtype=torch.int64)


def _plain(x: object) -> bool:
    """Whether ``x`` is a dense tensor with data: what reaches the op's own implementation on
    every rank (a nested, sparse or meta tensor would be dispatched elsewhere on its rank alone,
    stranding its peers: the eager path rejects it on every rank)."""
    return type(x) is torch.Tensor and _dense_data(x)


def _dense_data(x: torch.Tensor) -> bool:
    """Whether ``x`` (a tensor or a subclass such as ``nn.Parameter``) is dense, with data."""
    return not x.is_nested and x.layout == torch.strided and x.device.type != "meta"


def _attend_op(
    pattern: DilationPattern | PatternArgs,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: dict[str, object],
    resolver: Resolver | None,
    process_group: object,
    layout: object,
    compiling: bool,
) -> tuple[torch.Tensor, torch.Tensor, CallPlan | None] | None:
    """The call as one registered op (:mod:`ringdilated.compiled`), or ``None`` where it cannot
    be one (a kernel or communicator instance, a resolver, an argument the op's schema cannot
    take, or a torch without opaque types): the caller then runs it eagerly (under
    ``torch.compile``, behind a graph break). The op validates everything as the eager path
    does, on every rank. Returns the plan too in eager mode (for ``explain()``)."""
    kernel, communicator = options["kernel"], options["communicator"]
    scale, dropout_p = options["scale"], options["dropout_p"]
    causal, return_lse, softcap = options["causal"], options["return_lse"], options["softcap"]
    cu_seqlens, key_padding_mask = options["cu_seqlens"], options["key_padding_mask"]
    documents = cu_seqlens is not None or key_padding_mask is not None
    if not (isinstance(kernel, str) and isinstance(communicator, str) and resolver is None):
        return None
    if type(causal) is not bool or type(return_lse) is not bool:
        return None
    if scale is not None and type(scale) not in (int, float):
        return None
    if type(dropout_p) not in (int, float):
        return None
    if softcap is not None and type(softcap) not in (int, float):
        return None
    sinks = options["sinks"]
    if sinks is not None and not (isinstance(sinks, torch.Tensor) and _dense_data(sinks)):
        return None
    fields = _op_pattern(pattern)
    if fields is None or not (compiling or all(_plain(x) for x in (q, k, v))):
        return None
    window = _op_window(options["window"])
    if window is None:
        return None
    stats = options["transfer_stats"]
    if stats is not None and not isinstance(stats, TransferStats):
        return None
    backward = wants_gradients(q, k, v, sinks)
    dropout = float(dropout_p)  # type: ignore[arg-type]
    scale_value = None if scale is None else float(scale)  # type: ignore[arg-type]
    cap = None if softcap is None else float(softcap)  # type: ignore[arg-type]
    if layout is None and process_group is None and documents:
        given = (cu_seqlens, key_padding_mask)
        if not compiling or any(x is not None and not isinstance(x, torch.Tensor) for x in given):
            return None
        out, lse = dilated_attention_op(
            q,
            k,
            v,
            _seed(dropout),
            sinks,
            cu_seqlens,
            key_padding_mask,
            *fields,
            causal,
            *window,
            effective_scale(scale_value, q.shape[-1]),
            dropout,
            cap,
            kernel,
            backward,
        )
        return out, lse, None
    # Documents with a layout, or a sharded call's: its own layout, read per call (eager).
    if attention_op is None or documents:
        return None
    layout = WHOLE_SEQUENCES if layout is None else layout
    if not isinstance(layout, SequenceLayout):
        return None
    group = as_process_group(process_group)
    # (dynamo answers isinstance(group, ProcessGroup) wrongly: checked in eager mode only; a
    # traced module's group was checked when the module was built)
    if not compiling and group is not None and not isinstance(group, (dist.ProcessGroup, Grid)):
        return None  # the eager path names what it is instead
    # The op checks a process group passed with a layout against the layout's own.
    out, lse = attention_op(
        q,
        k,
        v,
        _seed(dropout),
        sinks,
        layout,
        stats if stats is not None else NO_STATS,
        *group_names(group),
        *fields,
        causal,
        *window,
        scale_value,
        dropout,
        cap,
        kernel,
        communicator,
        return_lse,
        backward,
    )
    return out, lse, None if compiling else last_plan()


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _attend_eager(
    pattern: DilationPattern | PatternArgs,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    arguments: dict[str, object],
    resolver: Resolver | None,
    process_group: object,
    layout: object,
    lse_needed: bool,
) -> tuple[torch.Tensor, torch.Tensor, CallPlan]:
    """The eager path: the call's plan (found on its layout, or made), then its kernels and
    exchanges, under one autograd node. Never traced by dynamo (the resolver, the plan and the
    process group are Python state), so from inside a compiled region it is a graph break; and
    never entered by dynamo's frame callback either, which a compiled region's eager fallback
    would otherwise run on every function it calls."""
    plan = plan_for(
        pattern, q, k, v, arguments, resolver or default_resolver, process_group, layout
    )
    sinks = arguments["sinks"]
    assert sinks is None or isinstance(sinks, torch.Tensor)  # plan_for checked it
    stats = arguments["transfer_stats"]
    out, lse = execute(plan, q, k, v, stats, lse_needed=lse_needed, sinks=sinks)
    return out, lse, plan


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
    window: tuple[int | None, int | None] | None = ...,
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
    softcap: float | None = ...,
    sinks: torch.Tensor | None = ...,
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
    window: tuple[int | None, int | None] | None = ...,
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
    softcap: float | None = ...,
    sinks: torch.Tensor | None = ...,
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
    window: tuple[int | None, int | None] | None = None,
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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention over ``q`` ``(B, Lq, H, D)`` and ``k``, ``v`` ``(B, L, Hkv, D)``.

    Semantics (docs/spec.md): for pattern ``i`` a query at position ``p`` attends to the
    positions of its segment of length ``segment_lengths[i]`` selected with stride
    ``dilation_rates[i]``.

    - ``mode="head_groups"`` (default): heads are split into ``G`` contiguous groups, group ``i``
      using pattern ``i`` at offset ``i % r_i``; unselected positions give ``0`` (no ``1/G``
      factor). ``mode="longnet"``: every head uses every pattern, mixed by softmax denominators.
    - ``causal``: keys after the query are hidden. ``scale`` defaults to ``1/sqrt(D)``.
    - ``softcap``: logit softcapping (docs/spec.md, section 5): every score ``s = scale * q . k``
      becomes ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2's attention), with
      gradients through it; a positive finite number, or ``None`` (no cap). Only kernels that
      declare it serve it (``Capabilities.softcap``: ``reference`` and ``flex`` here; ``sdpa``
      does not, and ``explain()`` says so), so on CPU ``"auto"`` falls to ``reference`` (with
      a :class:`~ringdilated.SlowFeatureWarning` once: pass ``kernel="reference"`` to choose
      it knowingly).
    - ``sinks``: attention sinks (docs/spec.md, section 5; gpt-oss's): a tensor ``(H,)``, one
      logit per query head, that joins every query's softmax denominator with a zero value,
      ``lse = log(sum exp(score) + exp(sinks[h]))`` (in ``longnet`` mode once per query, over
      the union of the patterns), ``out`` scaled down to match; a query that sees no key then
      gets ``out = 0`` and ``lse = sinks[h]`` (a padded position, no query, keeps ``lse =
      -inf``). Gradients flow to
      ``sinks`` as to ``q``, ``k``, ``v``. float32 (float16 and bfloat16 are widened exactly,
      so a module in half precision may keep them so; float64 only with float64 inputs, as a
      float32 merge would round it), exactly ``(H,)`` (never broadcast), on ``q``'s device;
      anything else raises before any work. Every kernel serves them: they are merged once
      per query after the call's own lse is final, on the device, with no host read and no
      collective. On a process group every rank passes the same sinks (shape and dtype are
      agreed, values are not read: keep them equal, as any parameter); each rank's gradient
      is its positions' share, summed across ranks like every parameter's.
    - ``window``: a key window ``(left, right)`` on top of the pattern (docs/spec.md, section
      5; flash-attn's ``window_size``, with ``None`` where flash-attn has ``-1``): a query at
      position ``p`` sees a key of its own selection at ``k`` only when ``p - left <= k <= p +
      right``, counted in positions of its document (with a dilation rate ``r``, ``left``
      positions reach ``left // r`` selected keys). Each bound an int ``>= 0`` or ``None``
      (unbounded). ``causal=True`` is ``right = 0``; with a window whose right bound is neither
      ``None`` nor ``0`` it raises ``ValueError``. One segment covering the sequence at rate 1
      with ``window=(w, 0)`` is a causal sliding-window layer, computed in about ``L x w``
      scores (the reference and ``sdpa`` kernels get bands of rows with only the keys they
      see; ``flex`` skips hidden blocks). Kernels declare it (``sliding_window``): ``auto``
      picks one that has it.
    - ``dropout_p``: attention-probability dropout, applied whenever ``> 0`` (pass ``0.0`` in
      evaluation, as with ``torch.nn.functional.scaled_dot_product_attention``).
    - ``return_lse``: also return ``lse`` ``(B, H, Lq)`` float32, ``-inf`` where a query sees no
      key (a view whose memory is position-major, ``(B, Lq, H)``: not contiguous). Gradients
      flow through ``out`` and ``lse``.
    - Query suffix: ``q`` may be shorter than ``k``, ``v`` (``Lq <= L``); it holds the last ``Lq``
      positions (bottom-right aligned, as with a KV cache), and its rows equal those rows of the
      full-length call. With a ``process_group`` (sharded chunked prefill) the suffix is the
      whole sequence's: each rank passes its shard of ``k``, ``v`` and, as ``q``, the suffix
      positions inside that shard, the last ``max(0, min(n_r, S_r + n_r - (L - Lq)))`` of it
      (so ranks before the suffix pass an empty ``q``, ``(B, 0, H, D)``, and get an empty
      ``out``, and a zero ``dq``, while their keys still serve the later ranks). The ranks learn
      the suffix in their agreement; a split that is not one suffix raises ``ValueError`` on
      every rank naming every rank's query length. A ``layout`` keeps the split of its first
      call: a later call on it with another ``q`` length raises. ``ringpass`` and ``allgather``
      serve it (sending only the keys the suffix's queries see); ``ulysses`` and ``hybrid``
      raise ``ValueError``, and ``auto`` does not pick them.
    - ``cu_seqlens``: a 1-D integer tensor ``[0, e_1, ..., L]``, strictly increasing, shared by
      every batch row: packed documents, each attended as its own sequence (positions and
      segments restart at its start; no query sees another document's keys).
    - ``key_padding_mask``: ``(B, L)`` bool, ``True`` = padding (the convention of
      ``torch.nn.MultiheadAttention``; the opposite of a Hugging Face ``attention_mask``, where
      1 = token: pass ``attention_mask == 0``). Each row's valid (``False``) positions must form
      one contiguous run (left or right padding), attended as its one document; padded
      positions are nobody's keys and give ``out = 0``, ``lse = -inf``; a row of padding only
      gives zeros. An inverted mask is mostly valid (a right-padded row's negation reads as a
      left-padded one, an unpadded row's as all padding) and then silently attends the padding
      instead of the tokens: it raises only where a row's valid positions are not one run. Not
      with ``cu_seqlens``. Both are read to the host once per call (the blocks are planned
      there), so they must hold data (a ``meta`` tensor raises ``ValueError`` naming it): for
      many layers of one batch, pass them once to a ``layout`` instead.
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
      differ; they are exchanged in the ranks' agreement), and get back their slice of the
      single-process result. Also a 1-D ``DeviceMesh``, or ``(mesh, "cp")`` for one dimension
      of a larger mesh (its existing group; nothing is created). ``communicator``: ``"auto"``
      (the least modelled exchange time, see docs/choosing.md), a name (``"ringpass"``,
      ``"allgather"``) or a :class:`~ringdilated.core.contract.communicator.Communicator`
      instance (described by the registered spec whose factory builds its class). Inputs are
      checked on every rank and a rejection raises on every rank; every shard must hold at
      least one position (an empty one raises on every rank, naming its rank).
      ``dist.group.WORLD`` is ``None`` until ``torch.distributed.init_process_group()``: passed
      before it, the call runs as one process over the rank's own shard. A one-process call in
      a process whose environment says ``WORLD_SIZE > 1`` (a launcher such as ``torchrun``)
      while ``torch.distributed`` is not initialised warns with
      :class:`~ringdilated.DistributedNotInitializedWarning`, once per process.
    - ``transfer_stats``: a :class:`~ringdilated.core.contract.communicator.TransferStats` to
      which a sharded call adds the bytes this rank sends and receives (forward, and backward
      when it runs).

    Raises ``TypeError``/``ValueError`` naming the offending value before any work starts.
    """
    out, lse, _ = attend(
        (segment_lengths, dilation_rates, mode),
        q,
        k,
        v,
        causal=causal,
        window=window,
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
        softcap=softcap,
        sinks=sinks,
    )
    return (out, lse) if return_lse else out
