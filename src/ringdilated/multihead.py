"""``MultiheadDilatedAttention``: projections, dilated attention, MAGNETO sub-layer norm.

Batch-first like ``nn.MultiheadAttention(batch_first=True)``: ``forward(query, key, value)``
takes ``(B, L, embed_dim)`` and returns ``(out, None)``. As in LongNet (after MAGNETO, Wang et
al. 2022): a LayerNorm on the attention output before the output projection (``layer_norm``),
and Xavier-normal initialisation with gain ``gamma_init`` on the value and output projections
(gain 1 on query and key), biases zero.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ringdilated.auto_dtype import AutoDtype
from ringdilated.cache import DilatedKVCache
from ringdilated.compiled import shard_positions
from ringdilated.core import Communicator, Kernel, KernelChoice, Mode
from ringdilated.core.call import Grid, SequenceLayout, check_bool, grid, shard_lengths
from ringdilated.core.plan import read_layout
from ringdilated.core.select import autocast_enabled
from ringdilated.modules import DilatedAttention
from ringdilated.rotary import Rotary

__all__ = [
    "MultiheadDilatedAttention",
    "check_dtype",
    "check_tokens",
    "positive_float",
    "positive_int",
]


def positive_int(name: str, value: object) -> int:
    """``value``, or an error naming ``name`` unless it is an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def positive_float(name: str, value: object) -> float:
    """``value`` as a float, or an error naming ``name`` unless it is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def check_tokens(name: str, x: object, embed_dim: int) -> None:
    """Raise, naming ``name``, unless ``x`` is a dense ``(batch, seq_len, embed_dim)`` tensor."""
    if isinstance(x, torch.Tensor) and (x.is_nested or x.layout != torch.strided):
        raise TypeError(
            f"{name} must be a dense (strided) tensor, got "
            f"{'a nested tensor' if x.is_nested else f'layout {x.layout}'}"
        )
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != embed_dim:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be (batch, seq_len, embed_dim={embed_dim}), got {shape}")


def check_dtype(name: str, x: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise ``TypeError``, naming ``name`` and both dtypes, unless ``x`` is in ``dtype`` (the
    parameters') or, with ``torch.autocast`` on for its device, in the autocast dtype."""
    kind = x.device.type
    autocast = autocast_enabled(kind) and x.dtype == torch.get_autocast_dtype(kind)
    if x.dtype != dtype and not autocast:
        raise TypeError(
            f"{name} is {x.dtype} but the module's parameters are {dtype} (dtype='auto' "
            "chose it for the device; convert the input, pass dtype=, or run under "
            "torch.autocast)"
        )


class MultiheadDilatedAttention(AutoDtype):
    """Multi-head dilated attention with its own projections.

    Inputs are in the parameters' dtype, or, under ``torch.autocast``, in the autocast dtype (as
    ``nn.MultiheadAttention`` accepts them); the attention then computes in the autocast dtype.

    ``num_kv_heads`` (default ``num_heads``) must divide ``num_heads``: key and value project to
    ``num_kv_heads`` heads (grouped-query attention). ``dtype="auto"`` (the parameters' dtype):
    :func:`ringdilated.recommended_dtype` of the device the module runs on, decided once, at
    construction for a given ``device`` (other than CPU or ``meta``), else by the first
    ``.to(device)``, ``.cuda()`` or ``.to_empty(device=)`` onto such a device; a dtype you set
    (``.to(dtype)``, ``.half()``) is kept (see :mod:`ringdilated.auto_dtype`). The pattern
    arguments are keyword-only, so ``segment_lengths`` and ``dilation_rates`` cannot be swapped
    by position.

    ``window``: the attention's key window ``(left, right)`` (docs/spec.md, section 5; see
    :func:`ringdilated.dilated_attention`), on top of the pattern; a cache it makes
    (:meth:`make_cache`) applies it too.

    ``rotary`` (e.g. :func:`ringdilated.rotary.rotary_embedding`): rotary position embeddings,
    applied to ``q`` and ``k`` after the projections, with positions counted from each document's
    start (padding and packed documents restart at 0; on a process group, global positions; with
    a cache, from each row's position in it, on the device). See :mod:`ringdilated.rotary`.

    ``softcap``: logit softcapping, ``softcap * tanh(score / softcap)`` on every score
    (:func:`ringdilated.dilated_attention`'s; Gemma 2 uses 50.0), in every call and in decoding
    with :meth:`make_cache`.

    ``sinks=True``: learnable attention sinks, as in gpt-oss: a parameter ``sinks``
    ``(num_heads,)``, one logit per query head, joining every query's softmax denominator with
    a zero value (:func:`ringdilated.dilated_attention`'s ``sinks``), in every call and in
    decoding. It is made in the parameters' dtype and follows their conversions (the call
    widens float16 and bfloat16 exactly to float32) and starts at 0 (as if each query had one
    more key of score 0 and value 0; :meth:`reset_parameters`). On a process group its gradient
    on each rank is that rank's positions' share: reduce it across the ranks as every other
    parameter's (data or context parallelism does). ``sinks=False`` (default): no parameter.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        num_kv_heads: int | None = None,
        mode: Mode = "head_groups",
        causal: bool = False,
        window: tuple[int | None, int | None] | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        layer_norm: bool = True,
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
        if rotary is not None and not callable(rotary):
            raise TypeError(f"rotary must be callable or None, got {type(rotary).__name__}")
        self.rotary = rotary
        embed_dim = positive_int("embed_dim", embed_dim)
        num_heads = positive_int("num_heads", num_heads)
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        kv_heads = num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        if num_heads % kv_heads:
            raise ValueError(f"num_kv_heads ({kv_heads}) must divide num_heads ({num_heads})")
        flags = (("bias", bias), ("layer_norm", layer_norm), ("causal", causal), ("sinks", sinks))
        for name, flag in flags:
            check_bool(name, flag)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, kv_heads
        self.head_dim = embed_dim // num_heads
        self.gamma_init = positive_float("gamma_init", gamma_init)
        layer_norm_eps = positive_float("layer_norm_eps", layer_norm_eps)
        factory: dict[str, Any] = {"device": device, "dtype": self._init_dtype(dtype, device)}
        kv_dim = kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory) if layer_norm else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.sinks = nn.Parameter(torch.empty(num_heads, **factory)) if sinks else None
        self.attention = DilatedAttention(
            segment_lengths,
            dilation_rates,
            mode=mode,
            causal=causal,
            window=window,
            dropout=dropout,
            kernel=kernel,
            process_group=process_group,
            communicator=communicator,
            softcap=softcap,
        )
        self.reset_parameters()

    @property
    def dtype(self) -> torch.dtype:
        return self.q_proj.weight.dtype

    @property
    def plan(self) -> KernelChoice | None:
        """The kernel plan of the last call (``None`` before the first; see :meth:`explain`)."""
        return self.attention.plan

    def reset_parameters(self) -> None:
        """MAGNETO initialisation: Xavier-normal, gain ``gamma_init`` on value and output."""
        projections = (self.q_proj, self.k_proj, self.v_proj, self.out_proj)
        gains = (1.0, 1.0, self.gamma_init, self.gamma_init)
        for proj, gain in zip(projections, gains, strict=True):
            nn.init.xavier_normal_(proj.weight, gain=gain)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)

    _checked_call: tuple[object, ...] = ()
    """What :meth:`_check_cache_first` has checked, which :meth:`forward` then does not check."""

    @contextlib.contextmanager
    def _check_cache_first(
        self, cache: object, key_padding_mask: object, cu_seqlens: object, layout: object
    ) -> Iterator[None]:
        """Run :meth:`_check_cache` now, before a caller's own work (a block's norm), and let
        the :meth:`forward` inside this context that receives these same objects skip it (a
        decode step pays for the check once)."""
        self._check_cache(cache, key_padding_mask, cu_seqlens, layout)
        self._checked_call = (cache, key_padding_mask, cu_seqlens, layout)
        try:
            yield
        finally:
            del self._checked_call

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        cu_seqlens: torch.Tensor | None = None,
        cache: DilatedKVCache | None = None,
        layout: SequenceLayout | None = None,
    ) -> tuple[torch.Tensor, None]:
        """``(out (B, Lq, embed_dim), None)``, ``torch.nn.MultiheadAttention``'s signature.

        ``query`` may be a query suffix (shorter than ``key`` and ``value``); ``key_padding_mask``
        ``(B, L)`` and ``cu_seqlens`` are :func:`ringdilated.dilated_attention`'s. ``attn_mask``
        and ``need_weights=True`` raise (no arbitrary masks, no materialised weights); causality
        is the module's ``causal``.

        ``cache`` (from :meth:`make_cache`): decoding. ``query``, ``key`` and ``value`` are then
        each row's next tokens (the same ones, as in self-attention), which the cache adds before
        attending them over everything it has seen in that row; no ``cu_seqlens``, no process
        group, ``key_padding_mask`` on its first call only (a padded prompt batch). A one-token
        step reads nothing on the host. A cache that does not fit this module (each field that
        differs is named: :meth:`DilatedKVCache.bind <ringdilated.DilatedKVCache.bind>`), or
        any cache while the module is in training mode with ``dropout > 0``, raises
        ``ValueError`` before any work. Decode under ``torch.no_grad()``: under autograd the
        cache keeps every step's graph (see :class:`~ringdilated.DilatedKVCache`).

        ``layout``: the batch's :class:`~ringdilated.SequenceLayout` (documents, padding, the
        process layout, made once per batch for every layer), instead of ``key_padding_mask``
        and ``cu_seqlens``; rotary positions then come from it too.
        """
        try:
            self._check_call(query, key, value, need_weights, attn_mask, is_causal)
            given = (cache, key_padding_mask, cu_seqlens, layout)
            checked = self._checked_call  # () or the very objects checked (identity, not equality)
            if cache is not None and not (checked and all(map(operator.is_, checked, given))):
                self._check_cache(*given)
            b, length, _ = query.shape
            q = self.q_proj(query).view(b, length, self.num_heads, self.head_dim)
            kv_shape = (self.num_kv_heads, self.head_dim)
            k = self.k_proj(key).view(*key.shape[:2], *kv_shape)
            v = self.v_proj(value).view(*value.shape[:2], *kv_shape)
            if self.rotary is not None:
                q, k = self._rotate(q, k, key_padding_mask, cu_seqlens, cache, layout)
        except Exception as error:
            # Anything that fails before the attention's own agreement (these checks, or the
            # projections: an input on another device than the weights, a hook) must reach every
            # rank: the peers are waiting in that agreement.
            self.attention.reject(error, layout)
        if cache is not None:
            out = cache.attend(q, k, v, key_padding_mask=key_padding_mask, sinks=self.sinks)
        else:
            out = self.attention(
                q, k, v, cu_seqlens=cu_seqlens, key_padding_mask=key_padding_mask, layout=layout,
                sinks=self.sinks,
            )  # fmt: skip
        assert isinstance(out, torch.Tensor)
        out = out.reshape(b, length, self.embed_dim)
        if self.norm is not None:
            out = self.norm(out)
        return self.out_proj(out), None

    def _check_call(
        self,
        query: object,
        key: object,
        value: object,
        need_weights: bool,
        attn_mask: object,
        is_causal: bool,
    ) -> None:
        """Raise ``TypeError``/``ValueError`` for arguments this module cannot take."""
        if need_weights:
            raise ValueError(
                "need_weights=True is not supported: dilated attention never materialises the "
                "attention weights; pass need_weights=False"
            )
        if attn_mask is not None:
            raise ValueError(
                "attn_mask is not supported yet; causal masking is MultiheadDilatedAttention"
                "(causal=True)"
            )
        if is_causal and not self.attention.causal:
            raise ValueError(
                "is_causal=True needs a module built with causal=True (the pattern is fixed at "
                "construction)"
            )
        for name, x in (("query", query), ("key", key), ("value", value)):
            check_tokens(name, x, self.embed_dim)
            assert isinstance(x, torch.Tensor)
            self._check_dtype_decided(x.device)
            check_dtype(name, x, self.dtype)

    def _rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        key_padding_mask: object,
        cu_seqlens: object,
        cache: DilatedKVCache | None,
        layout: SequenceLayout | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``, ``k`` rotated at their positions (see the class docstring)."""
        assert self.rotary is not None
        length, q_len = k.shape[1], q.shape[1]
        if cache is not None:  # each row's own positions, computed on the device
            mask = key_padding_mask if isinstance(key_padding_mask, torch.Tensor) else None
            positions = cache.rotary_positions(q_len, q.device, mask)
            return self.rotary(q, positions), self.rotary(k, positions)
        group = self.attention.process_group
        if layout is not None:  # made once per layout, device and shard length
            positions = shard_positions(layout, q.shape[0], length, q.device)
        elif group is None and cu_seqlens is None and key_padding_mask is None:
            positions = torch.arange(length, device=q.device).unsqueeze(0)  # traceable
        else:
            start, total = 0, length
            if group is not None:  # where this rank's shard starts: shards may differ in length
                assert isinstance(group, (dist.ProcessGroup, Grid))
                lengths = shard_lengths(group, length)
                start, total = sum(lengths[: grid.rank(group)]), sum(lengths)
            documents = read_layout(q, k, cu_seqlens, key_padding_mask, length=total)
            positions = documents.positions(q.device)[:, start : start + length]
        return self.rotary(q, positions[:, length - q_len :]), self.rotary(k, positions)

    def make_cache(self) -> DilatedKVCache:
        """An empty :class:`~ringdilated.DilatedKVCache` for this module's pattern, heads,
        causality, key window, scale and kernel, to pass to ``forward(..., cache=)`` while
        decoding. It belongs to this module (:meth:`~ringdilated.DilatedKVCache.bind`): another
        module refuses it, so make one per layer."""
        a = self.attention
        cache = DilatedKVCache(
            a.pattern.segment_lengths,
            a.pattern.dilation_rates,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            mode=a.pattern.mode,
            causal=a.causal,
            window=a.window,
            scale=a.scale,
            kernel=a.kernel,
            softcap=a.softcap,
        )
        self._bind_cache(cache)
        return cache

    def _bind_cache(self, cache: DilatedKVCache) -> None:
        """:meth:`DilatedKVCache.bind <ringdilated.DilatedKVCache.bind>` with this module's
        pattern, causality, key window, scale, heads, head dim, parameter device, and the dtype
        its projections give where that is known before them (no autocast on the parameters'
        device, no rotary callable, which may return another dtype); otherwise the cache's own
        check compares the dtype, after the projections and before the cache changes."""
        a, weight = self.attention, self.q_proj.weight
        known = self.rotary is None and not autocast_enabled(weight.device.type)
        cache.bind(
            self,
            pattern=a.pattern,
            causal=a.causal,
            window=a.window,
            scale=a.scale,
            softcap=a.softcap,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            device=weight.device,
            dtype=weight.dtype if known else None,
        )

    def _check_cache(
        self, cache: object, key_padding_mask: object, cu_seqlens: object, layout: object
    ) -> None:
        """Raise unless ``cache`` can serve this call, then bind it (:meth:`_bind_cache`)."""
        if not isinstance(cache, DilatedKVCache):
            raise TypeError(f"cache must be a DilatedKVCache, got {type(cache).__name__}")
        if self.attention.training and self.attention.dropout > 0:
            raise ValueError(
                f"this module is in training mode with dropout={self.attention.dropout}, and a "
                "cache applies no attention dropout (its steps would silently drop none): call "
                ".eval() to decode, or build the module with dropout=0.0"
            )
        if layout is not None:
            raise ValueError("a cache decodes without a layout: pass layout=None")
        if cu_seqlens is not None:
            raise ValueError(
                "a cache holds one sequence per row, not packed documents: pass cu_seqlens=None "
                "with cache= (rows of different lengths: key_padding_mask on the first call)"
            )
        if key_padding_mask is not None and not isinstance(key_padding_mask, torch.Tensor):
            raise TypeError(
                "key_padding_mask must be a (B, L) bool torch.Tensor, got "
                f"{type(key_padding_mask).__name__}"
            )
        if self.attention.process_group is not None:
            raise ValueError("cache= is for decoding on one process; this module is sharded")
        self._bind_cache(cache)

    def explain(self) -> str:
        """Which kernel and communicator serve this module, and why the others were rejected."""
        return self.attention.explain()

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, gamma_init={self.gamma_init}"
            + (", sinks=True" if self.sinks is not None else "")
        )
