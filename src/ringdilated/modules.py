"""``DilatedAttention``: the functional API as an ``nn.Module`` with a resolved plan."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ringdilated.core.capabilities import Request
from ringdilated.core.pattern import DilationPattern, Mode
from ringdilated.core.resolver import Plan
from ringdilated.core.validation import check_options
from ringdilated.functional import attend, default_resolver, world_size

__all__ = ["DilatedAttention"]


class DilatedAttention(nn.Module):
    """Dilated attention over given ``q``, ``k``, ``v``; no parameters.

    ``forward(q, k, v)`` returns ``out`` (``return_lse=True`` also returns ``lse``), with the
    semantics of :func:`ringdilated.dilated_attention`. ``dropout`` applies in training mode only.

    ``plan`` says which kernel serves the module and why the others were rejected
    (``print(attn.plan.explain())``). It is resolved on construction for the default device and
    dtype (CPU, ``torch.get_default_dtype()``), so a forced ``kernel`` that cannot serve the
    module fails here, and re-resolved (cached) whenever a call's device, dtype or head dim differ.

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
        scale: float | None = None,
        dropout: float = 0.0,
        kernel: str = "auto",
        process_group: object = None,
        communicator: str = "auto",
    ) -> None:
        super().__init__()
        self.pattern = DilationPattern(segment_lengths, dilation_rates, mode)
        check_options(scale, dropout)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        default_resolver().communicator_for(world_size(process_group), causal, communicator)
        self.causal = causal
        self.scale = scale
        self.dropout = float(dropout)
        self.kernel = kernel
        self.process_group = process_group
        self.communicator = communicator
        request = Request(
            dtype=torch.get_default_dtype(), causal=causal, dropout=self.dropout > 0, backward=True
        )
        self.plan: Plan = default_resolver().resolve(request, kernel)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out, lse, plan = attend(
            self.pattern,
            q,
            k,
            v,
            causal=self.causal,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            kernel=self.kernel,
            process_group=self.process_group,
            communicator=self.communicator,
        )
        if plan is not None:  # None under torch.compile, where the op resolves in the graph
            self.plan = plan
        return (out, lse) if return_lse else out

    def explain(self) -> str:
        """The kernel plan and the communicator choice for this module's process group."""
        ranks = world_size(self.process_group)
        return (
            self.plan.explain()
            + "\n"
            + default_resolver().explain_communicator(ranks, self.causal, self.communicator)
        )

    def extra_repr(self) -> str:
        p = self.pattern
        return (
            f"segment_lengths={p.segment_lengths}, dilation_rates={p.dilation_rates}, "
            f"mode={p.mode!r}, causal={self.causal}, dropout={self.dropout}, kernel={self.kernel!r}"
        )
