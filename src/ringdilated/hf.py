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
- Causality is the attention module's ``is_causal`` (``True`` for decoder models). Attention
  weights are never materialised: ``output_attentions`` gets ``None``.
"""

from __future__ import annotations

from typing import Any

import torch

from ringdilated.functional import dilated_attention

__all__ = ["NAME", "attention_forward", "padding_mask", "register"]

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


def padding_mask(
    *,
    batch_size: int,
    q_length: int,
    kv_length: int,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor | None:
    """transformers' mask function for ``"ringdilated"``: the user's 2-D mask over the keys
    ``(B, kv_length)``, bool, ``True`` = token (``None`` when nothing is padded)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attn_implementation={NAME!r} takes a 2-D attention_mask (1 = token, 0 = padding), "
            f"got shape {tuple(attention_mask.shape)}"
        )
    mask = attention_mask[:, -kv_length:].bool()
    return None if bool(mask.all()) else mask


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
    layout: dict[str, torch.Tensor] = {}
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.dtype != torch.bool:
            raise ValueError(
                f"attn_implementation={NAME!r} expects the 2-D bool padding mask its own mask "
                f"function makes, got {attention_mask.dtype} of shape "
                f"{tuple(attention_mask.shape)} (a custom 4-D mask is not supported)"
            )
        layout["key_padding_mask"] = attention_mask.logical_not()
    packed = kwargs.get("cu_seq_lens_k")
    if packed is not None:
        layout["cu_seqlens"] = packed
    out = dilated_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        _setting(config, "segment_lengths"),
        _setting(config, "dilation_rates"),
        mode=_setting(config, "mode", "head_groups"),
        causal=bool(getattr(module, "is_causal", True)),
        scale=scaling,
        dropout_p=dropout,
        kernel=_setting(config, "kernel", "auto"),
        cu_seqlens=layout.get("cu_seqlens"),
        key_padding_mask=layout.get("key_padding_mask"),
    )
    return out, None


def register(name: str = NAME) -> None:
    """Register the attention and mask functions with transformers under ``name`` (idempotent;
    done on import under ``"ringdilated"``)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)


register()
