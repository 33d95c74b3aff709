"""Hugging Face ``transformers`` adapter: ``attn_implementation="ringdilated"``.

``import ringdilated.hf`` registers, under the name ``"ringdilated"``, an attention function
with ``transformers.AttentionInterface`` and a mask function with
``transformers.AttentionMaskInterface`` (without the latter, transformers hands a custom
attention no mask at all, and padding would be silently ignored). Install with
``pip install -e '.[hf]'`` (transformers 5; tested with 5.23.0)::

    import ringdilated.hf  # registers "ringdilated"
    config = LlamaConfig(..., ringdilated_segment_lengths=[2048, 4096],
                         ringdilated_dilation_rates=[1, 2])
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("ringdilated")

The pattern comes from the model config (extra attributes are saved with it):

- ``ringdilated_segment_lengths``, ``ringdilated_dilation_rates``: required;
- ``ringdilated_mode``: ``"head_groups"`` (default) or ``"longnet"``;
- ``ringdilated_kernel``: default ``"auto"``.

What the adapter does with transformers' arguments:

- ``query`` ``(B, H, Lq, D)`` and ``key``, ``value`` ``(B, Hkv, L, D)`` (grouped-query heads are
  not repeated) are taken as ``(B, L, H, D)`` views; the result is ``(B, Lq, H, D)``, as
  transformers expects. Rotary embeddings are already applied to ``query`` and ``key``.
- The user's 2-D ``attention_mask`` (``1`` = token) becomes ``key_padding_mask``: each row's
  tokens must form one contiguous run (left or right padding), which is then its own document
  (positions counted from its first token, as transformers' ``position_ids`` count them).
- ``cu_seq_lens_k`` (packed inputs, e.g. ``DataCollatorWithFlattening``) becomes
  ``cu_seqlens``.
- With transformers' KV cache, ``key`` and ``value`` hold every cached position and ``query``
  the newest ones: a query suffix, computed for the current segments only. (The cache itself is
  transformers' and stores every position; :class:`ringdilated.DilatedKVCache` is the bounded
  cache of ringdilated's own modules.)
- Causality is the ``is_causal`` transformers passes, else the attention module's
  ``is_causal`` (``True`` for decoder models). Attention weights are never materialised:
  ``output_attentions`` gets ``None``.
- Packed inputs that transformers itself detects in ``position_ids`` (its packed-sequence mask:
  no mask and no cache) become ``cu_seqlens`` too, with transformers' boundaries.

What it refuses, with a ``ValueError``, rather than compute something else: a static or
sliding-window cache layout (the queries must be the last positions of the keys: use the default
dynamic cache), a custom 4-D mask, mask functions other than plain causal or bidirectional
(sliding windows, chunked or prefix overlays), ``config.sliding_window``, ``softcap`` and
attention sinks (``s_aux``).
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch

from ringdilated.core.sequence_layout import SequenceLayout
from ringdilated.functional import dilated_attention

__all__ = ["NAME", "KeyMask", "attention_forward", "padding_mask", "register"]

NAME = "ringdilated"


def _setting(config: object, name: str, default: object = None) -> Any:
    value = getattr(config, f"ringdilated_{name}", default)
    if value is None:
        raise ValueError(
            f"attn_implementation={NAME!r} needs config.ringdilated_{name} (the model config "
            "holds the dilation pattern: ringdilated_segment_lengths and "
            "ringdilated_dilation_rates)"
        )
    return value


class KeyMask(NamedTuple):
    """What the mask function hands every layer, made once per model forward: the 2-D padding
    mask over the keys (``True`` = token; ``None`` when nothing is padded); the packed-sequence
    ids transformers found in ``position_ids`` (``(B, L)``, one id per document; ``None`` when
    not packed); whether it asked for anything else (``overlay``: windows, chunks, prefix or
    bidirectional overlays); and, in eager mode, the batch's
    :class:`~ringdilated.SequenceLayout` made from them (read once here, for every layer; under
    ``torch.compile`` each layer's op reads the tensors instead). A named tuple, which
    ``torch.compile`` traces (a frozen attrs class it cannot build)."""

    padding: torch.Tensor | None
    documents: torch.Tensor | None
    overlay: bool
    layout: SequenceLayout | None = None


def _mask_kind(mask_function: object) -> tuple[torch.Tensor | None, bool]:
    """``(packed-sequence ids, overlay)`` of transformers' mask function: plain causal or
    bidirectional, the same made packed-sequence compatible (``and_masks`` of
    ``packed_sequence_mask_function`` and ``remap_positions_for_packed_sequence`` over a plain
    one, as ``create_causal_mask`` builds it), or anything else (an overlay)."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    plain = (None, causal_mask_function, bidirectional_mask_function)
    if mask_function in plain:
        return None, False
    if callable(mask_function) and getattr(mask_function, "__qualname__", "").startswith(
        "and_masks."
    ):
        parts = inspect.getclosurevars(mask_function).nonlocals.get("mask_functions", ())
        names = [getattr(f, "__qualname__", "") for f in parts]
        if (
            len(parts) == 2
            and names[0].startswith("packed_sequence_mask_function.")
            and names[1].startswith("remap_positions_for_packed_sequence.")
        ):
            ids = inspect.getclosurevars(parts[0]).nonlocals.get("packed_sequence_mask")
            base = inspect.getclosurevars(parts[1]).nonlocals.get("mask_function")
            if base in plain and isinstance(ids, torch.Tensor):
                return ids, False
    return None, True


def _bounds(ids: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` from packed-sequence ids ``(B, L)``, which every row must share."""
    if not bool((ids == ids[:1]).all()):
        raise ValueError(
            f"attn_implementation={NAME!r} packs documents the same way in every row "
            "(cu_seqlens); these position_ids pack the rows differently"
        )
    row = ids[0]
    starts = torch.nonzero(torch.diff(row, prepend=row[:1] - 1) != 0).flatten()
    return torch.cat([starts, torch.tensor([row.numel()], device=starts.device)]).cpu()


def padding_mask(
    *,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: object = 0,
    kv_offset: object = 0,
    mask_function: object = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> KeyMask:
    """transformers' mask function for ``"ringdilated"`` (see :class:`KeyMask`). Raises for a
    cache layout whose queries are not the last positions of the keys (a static or sliding
    cache), which ringdilated's query suffix cannot place."""
    start, offset = int(q_offset), int(kv_offset)  # type: ignore[call-overload]
    if offset != 0 or start + q_length != kv_length:
        raise ValueError(
            f"attn_implementation={NAME!r} needs the queries to be the last positions of the "
            f"keys (transformers' default dynamic cache); got queries [{start}, "
            f"{start + q_length}) of {kv_length} keys from position {offset} (a static or "
            "sliding-window cache)"
        )
    documents, overlay = _mask_kind(mask_function)
    mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attn_implementation={NAME!r} takes a 2-D attention_mask (1 = token, 0 = "
                f"padding), got shape {tuple(attention_mask.shape)}"
            )
        mask = attention_mask[:, -kv_length:].bool()
    if torch.compiler.is_compiling() or overlay:
        return KeyMask(mask, documents, overlay)
    # Eager: the batch's layout, read here once for every layer.
    if mask is not None and bool(mask.all()):
        mask = None
    layout = None
    if mask is not None:
        layout = SequenceLayout(key_padding_mask=mask.logical_not())
    elif documents is not None:
        layout = SequenceLayout(cu_seqlens=_bounds(documents))
    return KeyMask(mask, documents, overlay, layout)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function for ``"ringdilated"``: ``(attn_output (B, Lq, H, D),
    None)``."""
    config = getattr(module, "config", None)
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation={NAME!r} does not support {name}")
    window = getattr(config, "sliding_window", None)
    if window is not None:
        raise ValueError(
            f"attn_implementation={NAME!r} does not combine with config.sliding_window "
            f"({window}); the dilation pattern bounds what a query sees"
        )
    layout: dict[str, Any] = {}
    packed = kwargs.get("cu_seq_lens_k")
    if isinstance(attention_mask, KeyMask) and attention_mask.layout is not None:
        if packed is not None:  # transformers' own packed form takes precedence, as below
            attention_mask = attention_mask._replace(layout=None, padding=None)
        else:
            layout["layout"] = attention_mask.layout
    if attention_mask is not None and "layout" not in layout:
        if not isinstance(attention_mask, KeyMask):
            raise ValueError(
                f"attn_implementation={NAME!r} expects the mask its own mask function makes, got "
                f"{type(attention_mask).__name__} of shape {tuple(attention_mask.shape)} (a "
                "custom 4-D mask is not supported)"
            )
        if attention_mask.overlay:
            raise ValueError(
                f"attn_implementation={NAME!r} serves plain causal or bidirectional masks, "
                "padding and packed sequences; transformers asked for another mask (a sliding "
                "window, a chunked, prefix or bidirectional overlay)"
            )
        if attention_mask.padding is not None:
            layout["key_padding_mask"] = attention_mask.padding.logical_not()
        if packed is None and attention_mask.documents is not None:
            packed = _bounds(attention_mask.documents)  # packing transformers found
    if packed is not None:
        layout["cu_seqlens"] = packed
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    out = dilated_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        _setting(config, "segment_lengths"),
        _setting(config, "dilation_rates"),
        mode=_setting(config, "mode", "head_groups"),
        causal=causal,
        scale=scaling,
        dropout_p=dropout,
        kernel=_setting(config, "kernel", "auto"),
        cu_seqlens=layout.get("cu_seqlens"),
        key_padding_mask=layout.get("key_padding_mask"),
        layout=layout.get("layout"),
    )
    return out, None


def register(name: str = NAME) -> None:
    """Register the attention and mask functions with transformers under ``name`` (idempotent;
    done on import under ``"ringdilated"``)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)


register()
