"""A LongNet-style pre-norm transformer block with MAGNETO sub-layer norms.

``x + attn(LN(x))`` then ``x + ffn(LN(x))``, where the attention carries its own sub-LN before
its output projection and the feed-forward network a sub-LN before its second linear layer.
Every operation but attention is per token, so under a ``process_group`` each rank runs the
block on its contiguous shard of the sequence and only attention communicates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from ringdilated.auto_dtype import AutoDtype
from ringdilated.cache import DilatedKVCache
from ringdilated.core import Communicator, Kernel, Mode
from ringdilated.core.call import SequenceLayout
from ringdilated.multihead import (
    MultiheadDilatedAttention,
    check_dtype,
    check_tokens,
    positive_float,
    positive_int,
)
from ringdilated.rotary import Rotary

__all__ = ["DilatedTransformerBlock"]


class DilatedTransformerBlock(AutoDtype):
    """One block over ``(B, L, embed_dim)``; see the module docstring.

    ``ffn_dim`` defaults to ``4 * embed_dim``; ``gamma_init`` scales the initialisation of the
    value/output projections and both feed-forward layers (MAGNETO; 1.0 is plain Xavier).
    ``window``: the attention's key window ``(left, right)`` (see
    :class:`~ringdilated.MultiheadDilatedAttention`; ``(w, 0)`` with one segment covering the
    sequence at rate 1 is a sliding-window layer).
    ``rotary``: rotary position embeddings for the attention's ``q`` and ``k`` (see
    :class:`~ringdilated.MultiheadDilatedAttention` and :mod:`ringdilated.rotary`).
    ``dtype="auto"`` is the block's, decided once for all its parameters, the attention's
    included (see :mod:`ringdilated.auto_dtype`). ``softcap``: the attention's logit cap;
    ``sinks=True``: its learnable attention sinks, ``attn.sinks`` (see
    :class:`~ringdilated.MultiheadDilatedAttention`).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        ffn_dim: int | None = None,
        num_kv_heads: int | None = None,
        mode: Mode = "head_groups",
        causal: bool = False,
        window: tuple[int | None, int | None] | None = None,
        dropout: float = 0.0,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        process_group: object = None,
        kernel: str | Kernel = "auto",
        communicator: str | Communicator = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | Literal["auto"] | None = "auto",
        rotary: Rotary | None = None,
        softcap: float | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        embed_dim = positive_int("embed_dim", embed_dim)
        factory: dict[str, Any] = {"device": device, "dtype": self._init_dtype(dtype, device)}
        ffn_dim = 4 * embed_dim if ffn_dim is None else positive_int("ffn_dim", ffn_dim)
        layer_norm_eps = positive_float("layer_norm_eps", layer_norm_eps)
        gamma_init = positive_float("gamma_init", gamma_init)
        self.attn_norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory)
        self.attn = MultiheadDilatedAttention(
            embed_dim,
            num_heads,
            segment_lengths=segment_lengths,
            dilation_rates=dilation_rates,
            num_kv_heads=num_kv_heads,
            mode=mode,
            causal=causal,
            window=window,
            dropout=dropout,
            layer_norm_eps=layer_norm_eps,
            gamma_init=gamma_init,
            process_group=process_group,
            kernel=kernel,
            communicator=communicator,
            device=device,
            dtype=factory["dtype"],
            rotary=rotary,
            softcap=softcap,
            sinks=sinks,
        )
        self.ffn_norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory)
        up = nn.Linear(embed_dim, ffn_dim, **factory)
        down = nn.Linear(ffn_dim, embed_dim, **factory)
        for layer in (up, down):
            nn.init.xavier_normal_(layer.weight, gain=gamma_init)
            nn.init.zeros_(layer.bias)
        sub_norm = nn.LayerNorm(ffn_dim, eps=layer_norm_eps, **factory)
        self.ffn = nn.Sequential(up, nn.GELU(), nn.Dropout(dropout), sub_norm, down)
        self.dropout = nn.Dropout(dropout)

    def make_cache(self) -> DilatedKVCache:
        """An empty cache for decoding with this block, which belongs to its attention
        (:meth:`~ringdilated.MultiheadDilatedAttention.make_cache`): make one per block."""
        return self.attn.make_cache()

    def forward(
        self,
        x: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        cache: DilatedKVCache | None = None,
        layout: SequenceLayout | None = None,
    ) -> torch.Tensor:
        """``x`` ``(B, L, embed_dim)`` to the block's output, same shape. ``cu_seqlens``,
        ``key_padding_mask``, ``cache`` (from :meth:`make_cache`: ``x`` then holds each row's
        next tokens) and ``layout`` are those of :meth:`MultiheadDilatedAttention.forward
        <ringdilated.MultiheadDilatedAttention.forward>`, which states what each takes and when
        a cache is refused (before any work; one that belongs to another block too). Padded
        positions come out of the attention as 0 and pass through the block's residual and
        feed-forward like any position: mask them in your loss."""
        with contextlib.ExitStack() as checked:
            try:
                if cache is not None:  # checked before the norm, once: the attention skips it
                    checked.enter_context(
                        self.attn._check_cache_first(cache, key_padding_mask, cu_seqlens, layout)
                    )
                check_tokens("x", x, self.attn.embed_dim)
                self._check_dtype_decided(x.device)
                check_dtype("x", x, self.attn.dtype)
                h = self.attn_norm(x)
            except Exception as error:
                # Before the attention's agreement: on a process group, every rank raises.
                self.attn.attention.reject(error, layout)
            attended = self.attn(
                h, h, h, key_padding_mask, cu_seqlens=cu_seqlens, cache=cache, layout=layout
            )[0]
        x = x + self.dropout(attended)
        out: torch.Tensor = x + self.dropout(self.ffn(self.ffn_norm(x)))
        return out
