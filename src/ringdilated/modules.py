"""``DilatedAttention``: the functional API as an ``nn.Module`` with a resolved plan."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from ringdilated.core import Communicator, DilationPattern, Kernel, KernelChoice, Mode
from ringdilated.core.call import (
    CallPlan,
    Grid,
    SequenceLayout,
    agree,
    agreed,
    as_process_group,
    as_softcap,
    check_options,
    check_window,
    group_size,
    warn_if_launched_alone,
)
from ringdilated.functional import attend
from ringdilated.registry import default_resolver

__all__ = ["DilatedAttention"]


class DilatedAttention(nn.Module):
    """Dilated attention over given ``q``, ``k``, ``v``; no parameters.

    ``forward(q, k, v)`` returns ``out`` (``return_lse=True`` also returns ``lse``), with the
    semantics of :func:`ringdilated.dilated_attention`, including its ``cu_seqlens``,
    ``key_padding_mask``, ``layout`` (whose process group must be the module's) and query
    suffix. ``dropout`` applies in training mode only. ``softcap``: the logit cap of every call
    (:func:`ringdilated.dilated_attention`'s; ``None``: none), checked at construction.
    ``forward(..., sinks=)``: attention sinks ``(H,)`` for that call (the functional
    ``sinks``); this module owns no parameters, so a module that learns them holds them
    (:class:`~ringdilated.MultiheadDilatedAttention` ``(sinks=True)`` does). ``window``: the
    key window ``(left,
    right)`` of every call (docs/spec.md, section 5), checked here (each bound an int ``>= 0``
    or ``None``; with ``causal=True`` the right bound ``None`` or ``0``) and kept as
    ``(left, right)`` with ``causal`` applied (``None``: no window).

    ``plan`` says which kernel served the last call and why the others were rejected
    (``print(attn.plan.explain())``); it is ``None`` before the first call. ``call`` is the last
    call's whole :class:`~ringdilated.core.call.prepare.CallPlan`; ``explain()`` shows both, with
    what each communicator would move for the last call's shards. The kernel is chosen for the
    tensors a call actually passes (device, dtype, head dim, whether gradients are needed), and
    chosen again (a cached lookup) whenever they change, so a module built with a GPU-only
    ``kernel="flash"`` is constructed anywhere and serves CUDA bfloat16 inputs; a call the
    forced kernel cannot serve raises :class:`~ringdilated.core.ResolutionError` with its
    reasons. Construction checks only that ``kernel`` names a known backend (or ``"auto"``).

    Built with ``process_group=None`` in a process a launcher started as one of several ranks
    (``WORLD_SIZE > 1``) before ``torch.distributed.init_process_group()``, it warns
    (:class:`~ringdilated.DistributedNotInitializedWarning`, once per process, at construction):
    ``process_group=dist.group.WORLD`` is ``None`` then, and the module keeps it, so every rank
    would attend over its own shard as the whole sequence even once the group exists.
    :class:`~ringdilated.MultiheadDilatedAttention` and
    :class:`~ringdilated.DilatedTransformerBlock` warn through it.

    ``torch.compile(attn, fullgraph=True)`` works on the single-process path: the call becomes one
    custom op (:mod:`ringdilated.compiled`); ``plan`` then keeps the last eager resolution.
    """

    def __init__(
        self,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        mode: Mode = "head_groups",
        causal: bool = False,
        window: tuple[int | None, int | None] | None = None,
        scale: float | None = None,
        dropout: float = 0.0,
        kernel: str | Kernel = "auto",
        process_group: object = None,
        communicator: str | Communicator = "auto",
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.pattern = DilationPattern(segment_lengths, dilation_rates, mode)
        check_options(scale, dropout)
        self.softcap = as_softcap(softcap)
        self.key_window = check_window(window, causal)
        self.causal: bool = causal
        self.window = None if window is None else (self.key_window.left, self.key_window.right)
        resolver = default_resolver()
        resolver.check_kernel_name(kernel)
        resolver.check_communicator_name(communicator)
        process_group = as_process_group(process_group)
        group_size(process_group)  # a process group, or None
        if process_group is None:  # fixed now: dist.group.WORLD before init is None for good
            warn_if_launched_alone("this module runs every call")
        self.scale = scale
        self.dropout = float(dropout)
        self.kernel = kernel
        self.process_group = process_group
        self.communicator = communicator
        self.plan: KernelChoice | None = None
        self.call: CallPlan | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_lse: bool = False,
        *,
        cu_seqlens: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        layout: SequenceLayout | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out, lse, call = attend(
            self.pattern,
            q,
            k,
            v,
            causal=self.causal,
            window=self.window,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            kernel=self.kernel,
            process_group=self.process_group,
            communicator=self.communicator,
            return_lse=return_lse,
            cu_seqlens=cu_seqlens,
            key_padding_mask=key_padding_mask,
            layout=layout,
            lse_needed=return_lse is True,
            softcap=self.softcap,
            sinks=sinks,
        )
        # None under torch.compile, where the op resolves in the graph; the same plan object in
        # steady state (nn.Module's __setattr__ costs microseconds: skip it then).
        if call is not None and call is not self.call:
            self.plan, self.call = call.kernel, call
        return (out, lse) if return_lse else out

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def reject(self, error: Exception, layout: object = None) -> NoReturn:
        """Raise ``error``, a check made before this module's call (a wrapping module's), such
        that on a process group every rank raises: the peers, which passed their checks, are
        waiting in the call's agreement (:func:`~ringdilated.core.call.agreement.agree`) and raise a
        ``ValueError`` naming this rank's error. An error that came out of an agreement already
        (:func:`~ringdilated.core.call.agreement.agreed`) is raised as it is. On a ``layout`` that
        has planned any call (not checked every call) the error is raised at once, on this rank
        only: its peers may be in a planned call's data exchange, which an agreement here would
        pair with (undefined results), or in a new signature's agreement, which the backend's
        timeout then ends. Only on a layout that has planned nothing are the peers surely in
        their first call's agreement."""
        steady = (
            isinstance(layout, SequenceLayout)
            and not layout.agree_every_call
            and len(layout.plans) > 0
        )
        if self.process_group is not None and not agreed(error) and not steady:
            assert isinstance(self.process_group, (dist.ProcessGroup, Grid))  # checked in __init__
            agree(self.process_group, error, None)
        raise error

    def explain(self) -> str:
        """The kernel plan and the communicator choice for this module's process group."""
        ranks = group_size(self.process_group)
        kernel = (
            self.plan.explain()
            if self.plan is not None
            else f"kernel: {self.kernel!r}, chosen for the tensors of the first call (none yet)"
        )
        if self.call is not None and self.call.shards:  # what the last call's shards move
            communicator = self.call.explain_communicator(default_resolver(), self.communicator)
        else:
            grid_shape = self.process_group.shape if isinstance(self.process_group, Grid) else None
            communicator = default_resolver().explain_communicator(
                ranks, self.key_window, self.communicator, grid=grid_shape
            )
        return f"{kernel}\n{communicator}"

    def extra_repr(self) -> str:
        p = self.pattern
        return (
            f"segment_lengths={p.segment_lengths}, dilation_rates={p.dilation_rates}, "
            f"mode={p.mode!r}, causal={self.causal}, "
            + (f"window={self.window}, " if self.window is not None else "")
            + f"dropout={self.dropout}, kernel={self.kernel!r}"
            + ("" if self.softcap is None else f", softcap={self.softcap}")
        )
