"""Hugging Face ``transformers`` adapter: ``attn_implementation="ringdilated"``.

``import ringdilated.hf`` registers, under the name ``"ringdilated"``, an attention function
with ``transformers.AttentionInterface`` and a mask function with
``transformers.AttentionMaskInterface`` (without the latter, transformers hands a custom
attention no mask at all, and padding would be silently ignored). Install with
``pip install -e '.[hf]'`` (declared ``transformers>=5.23,<6``; the tests run on 5.23.0, the pinned
version, and 5.24.0, the newest 5.x when last checked: ``tox -e hf-latest``)::

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
- The user's 2-D ``attention_mask`` keeps transformers' convention, ``1`` = token, ``0`` =
  padding (the inverse of ringdilated's ``key_padding_mask``, ``True`` = padding, which the
  adapter makes from it): shape ``(batch, cached + new positions)``, one column per key, as
  transformers' own attention reads it. Each row's tokens must form one contiguous run (left or
  right padding), which is then its own document (positions counted from its first token, as
  transformers' ``position_ids`` count them).
- ``cu_seq_lens_k`` (packed inputs, e.g. ``DataCollatorWithFlattening``) becomes ``cu_seqlens``.
- With transformers' KV cache, ``key`` and ``value`` hold every cached position and ``query``
  the newest ones: a query suffix, computed for the current segments only. (The cache itself is
  transformers' and stores every position; :class:`ringdilated.DilatedKVCache` is the bounded
  cache of ringdilated's own modules.)
- Causality is the ``is_causal`` transformers passes, else the attention module's
  ``is_causal`` (``True`` for decoder models); it must agree with the mask function
  transformers made (causal or bidirectional, from ``config.is_causal``), else ``ValueError``
  naming both: eager attention follows the mask, sdpa and flash-attention the flag, so a model
  whose two disagree (Gemma-2's ``use_bidirectional_attention`` without ``config.is_causal =
  False``) has no one answer. Attention weights are never materialised:
  ``output_attentions`` gets ``None``.
- Packed inputs that transformers itself detects in ``position_ids`` (its packed-sequence mask:
  no mask and no cache) become ``cu_seqlens`` too, with transformers' boundaries. The adapter
  recognises that mask function by how transformers builds it, ``and_masks`` of
  ``packed_sequence_mask_function`` and ``remap_positions_for_packed_sequence`` over plain
  causal or bidirectional, in either order (5.23 puts the packed-sequence mask first, 5.24
  second).

Sequence parallelism: inside ``with ringdilated.hf.sequence_parallel(shard.layout):`` every layer
of a forward runs on the batch's :class:`~ringdilated.SequenceLayout` (from
:func:`ringdilated.shard_batch`), each rank passing its shard of ``input_ids`` and the batch's
global ``position_ids``, and getting its slice of the logits; the loss is
:func:`ringdilated.sharded_cross_entropy` of them and the shard's labels (pass no ``labels=`` to
the model: transformers would shift each shard on its own). The documents and padding are then
the layout's; a shard's ``attention_mask``, ``cu_seq_lens_k`` and ``position_ids`` are only
checked against it (see :func:`sequence_parallel`'s module, ``ringdilated._hf_sequence_parallel``,
for what each check reads, what it costs, and where it raises: on every rank, or on the failing
one alone). Outside the block nothing changes, but for one refusal: the mask function raises
in a backward's recompute while a layout that a sharded forward ran on lives (a checkpointed
region that made the mask under the block, recomputed after it).

What it refuses, with a ``ValueError``, rather than compute something else: an
``attention_mask`` whose length is not the key length (e.g. 25 columns for 20 tokens, or a
shorter all-ones mask: never cut to its last columns nor taken as no padding) or whose row's
tokens are not one run, both named in its convention; a static or sliding-window cache layout
(the queries must be the last positions of the keys: use the default dynamic cache); a custom
4-D mask; any mask function other than those above and the sliding windows below (chunked,
prefix or bidirectional overlays, or one it does not recognise: the error names how it was
built, e.g. ``and_masks(causal_mask_function, chunked_overlay(...))``); a layer whose
``sliding_window`` keyword is not the window its mask was made with (both named).

Sliding-window layers (Mistral's ``config.sliding_window``, Gemma-2's and gpt-oss's
``"sliding_attention"`` entries of ``config.layer_types``) get
:func:`ringdilated.dilated_attention`'s ``window=`` on top of the dilation pattern, on one
process and under :func:`sequence_parallel` alike: the layer's ``sliding_window=w`` keyword
(``None`` on global layers) must be the ``w`` of transformers' sliding-window mask function,
``and_masks(sliding_window_overlay(w), causal_mask_function)``, ``kv > q - w`` and ``kv <= q``,
which is ``window=(w - 1, 0)``; or, with ``config.is_causal`` false,
``sliding_window_bidirectional_overlay(w)``, ``abs(q - kv) <= w``, which is ``window=(w, w)``
(alone or made packed-sequence compatible, as above; see :func:`_features`). Their default
cache (``DynamicCache(config=...)``) keeps only the window on sliding layers, whose decode steps
are refused as a sliding-window cache layout: generate with ``past_key_values=DynamicCache()``.

A model's logit cap (``softcap=``, Gemma 2's ``attn_logit_softcapping``) and attention sinks
(``s_aux=``, gpt-oss's ``sinks`` parameter, one logit per query head) are passed on as
:func:`ringdilated.dilated_attention`'s ``softcap`` and ``sinks`` (transformers 5.23:
``models/gemma2/modeling_gemma2.py`` and ``models/gpt_oss/modeling_gpt_oss.py`` pass them to
the attention function by these names).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch

from ringdilated._hf_sequence_parallel import (
    SequenceParallel,
    ShardedForward,
    active,
    refuse_unsharded_recompute,
    sequence_parallel,
)
from ringdilated.core.call import SequenceLayout
from ringdilated.functional import dilated_attention

__all__ = [
    "NAME",
    "KeyMask",
    "SequenceParallel",
    "attention_forward",
    "padding_mask",
    "register",
    "sequence_parallel",
]

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
    """What the mask function hands every layer, made once per model forward: the 2-D padding mask
    over the keys (``True`` = token, transformers' convention; ``None`` when nothing is padded); the
    packed-sequence ids transformers found in ``position_ids`` (``(B, L)``, one id per document;
    ``None`` when not packed); ``overlay``, how transformers built a mask function the adapter does
    not serve (``None`` when it serves it), which every layer's call then reports; and, in eager
    mode, the batch's :class:`~ringdilated.SequenceLayout` made from them (read once here, for every
    layer; under ``torch.compile`` each layer's op reads the tensors instead). Under
    :func:`sequence_parallel`: ``padding`` and ``documents`` ``None``, ``layout`` the setting's, and
    ``sharded`` the forward's record (what its checks found; they run once). For a sliding-window
    mask function (see :func:`_mask_kind`), ``sliding_window`` is the ``w`` it captured and
    ``window`` the ``(left, right)`` :func:`dilated_attention` takes for it (``None`` both
    otherwise); ``causal`` is whether the mask function is causal (``None``: not read). A named
    tuple, which ``torch.compile`` traces (a frozen attrs class it cannot build)."""

    padding: torch.Tensor | None
    documents: torch.Tensor | None
    overlay: str | None
    layout: SequenceLayout | None = None
    sharded: ShardedForward | None = None
    sliding_window: int | None = None
    window: tuple[int, int] | None = None
    causal: bool | None = None


_MASKING = "transformers.masking_utils"


def _maker(function: object) -> str | None:
    """The ``transformers.masking_utils`` function whose closure ``function`` is (``"and_masks"``
    for what ``and_masks(...)`` returns), else ``None``."""
    if getattr(function, "__module__", None) != _MASKING:
        return None
    maker, nested, _ = str(getattr(function, "__qualname__", "")).partition(".<locals>.")
    return maker if nested else None


def _captured(function: object) -> dict[str, object]:
    """The variables a closure captured, by name (empty for anything else)."""
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    if code is None or cells is None:
        return {}
    captured: dict[str, object] = {}
    for name, cell in zip(code.co_freevars, cells, strict=True):
        with contextlib.suppress(ValueError):  # an empty cell
            captured[name] = cell.cell_contents
    return captured


def _functions(combination: object) -> tuple[object, ...]:
    """The mask functions ``and_masks(...)`` or ``or_masks(...)`` combined (empty for others)."""
    functions = _captured(combination).get("mask_functions")
    return tuple(functions) if isinstance(functions, tuple) else ()


def _operands(function: object) -> list[object]:
    """The mask functions ``function`` intersects: ``and_masks(...)``'s operands, nested ones
    flattened (an intersection in any grouping and order is the same mask); else ``[function]``."""
    if _maker(function) != "and_masks":
        return [function]
    return [part for f in _functions(function) for part in _operands(f)]


def _describe(function: object, depth: int = 0) -> str:
    """How a mask function was built, for error messages, e.g. ``and_masks(causal_mask_function,
    sliding_window_overlay(...))``; a function from elsewhere by its module and name."""
    maker = _maker(function)
    if maker is None:
        name = getattr(function, "__qualname__", None) or type(function).__name__
        module = getattr(function, "__module__", None)
        return name if module in (None, _MASKING) else f"{module}.{name}"
    captured = _captured(function)
    inner = (captured["mask_function"],) if "mask_function" in captured else _functions(function)
    if not inner or depth >= 8:
        return f"{maker}(...)"
    return f"{maker}({', '.join(_describe(f, depth + 1) for f in inner)})"


class MaskKind(NamedTuple):
    """What :func:`_mask_kind` read in a mask function: the packed-sequence ids (``None`` when
    not packed), how it was built when the adapter does not serve it (``overlay``, else
    ``None``), its sliding window: transformers' ``w`` and the ``(left, right)`` it means
    (``None`` both without one), and whether it is causal (``None`` for an overlay or no mask
    function)."""

    documents: torch.Tensor | None
    overlay: str | None
    sliding_window: int | None = None
    window: tuple[int, int] | None = None
    causal: bool | None = None


def _base_window(function: object) -> MaskKind | None:
    """What a mask function without packing asks for, ``None`` when the adapter does not serve
    it: plain causal or bidirectional (no window), or transformers' sliding-window masks
    (transformers v5.23.0 masking_utils.py): ``and_masks(sliding_window_overlay(w),
    causal_mask_function)``, ``kv_idx > q_idx - w`` and ``kv_idx <= q_idx``, is ``window=(w - 1,
    0)`` (``w >= 1``); ``and_masks(sliding_window_bidirectional_overlay(w),
    bidirectional_mask_function)``, ``abs(q_idx - kv_idx) <= w``, is ``window=(w, w)`` (``w >=
    0``). The operands may come in any order and grouping (an intersection is the same mask)."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    plain = (causal_mask_function, bidirectional_mask_function)
    if function in plain:
        return MaskKind(None, None, causal=function is causal_mask_function)
    operands = _operands(function)
    bases = [f for f in operands if f in plain]
    overlays = [f for f in operands if f not in plain]
    if len(bases) != 1 or len(overlays) != 1:
        return None
    kind = (bases[0] is causal_mask_function, _maker(overlays[0]))
    w = _captured(overlays[0]).get("sliding_window")
    if type(w) is not int:
        return None
    if kind == (True, "sliding_window_overlay") and w >= 1:
        return MaskKind(None, None, w, (w - 1, 0), causal=True)
    if kind == (False, "sliding_window_bidirectional_overlay") and w >= 0:
        return MaskKind(None, None, w, (w, w), causal=False)
    return None


def _mask_kind(mask_function: object) -> MaskKind:
    """What transformers' mask function asks for (:class:`MaskKind`): plain causal or
    bidirectional, or a causal or bidirectional sliding window (:func:`_base_window`), alone or
    made packed-sequence compatible (the module docstring says how); anything else is an
    overlay, reported by how it was built."""
    if mask_function is None:
        return MaskKind(None, None)
    kind = _base_window(mask_function)
    if kind is not None:
        return kind
    operands = sorted(_operands(mask_function), key=lambda f: str(_maker(f)))
    if [_maker(f) for f in operands] == [
        "packed_sequence_mask_function",
        "remap_positions_for_packed_sequence",
    ]:
        ids = _captured(operands[0]).get("packed_sequence_mask")
        kind = _base_window(_captured(operands[1]).get("mask_function"))
        if kind is not None and isinstance(ids, torch.Tensor):
            return kind._replace(documents=ids)
    return MaskKind(None, _describe(mask_function))


def _read_fields(kind: MaskKind) -> dict[str, Any]:
    """:class:`KeyMask`'s window and causality fields from what :func:`_mask_kind` read."""
    return {"sliding_window": kind.sliding_window, "window": kind.window, "causal": kind.causal}


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


def _check_mask(mask: torch.Tensor, batch_size: int, cached: int, new: int) -> None:
    """Raise ``ValueError`` unless transformers' 2-D ``attention_mask`` (``1`` = token, ``0`` =
    padding) has one row per batch row and one column per key: the ``cached`` positions then
    the ``new`` ones (transformers' dynamic cache; ``cached = 0`` without a cache)."""
    convention = "(1 = token, 0 = padding)"
    if mask.dim() != 2:
        raise ValueError(
            f"attn_implementation={NAME!r} takes a 2-D attention_mask {convention}, got shape "
            f"{tuple(mask.shape)}"
        )
    rows, columns = mask.shape
    if columns != cached + new:
        raise ValueError(
            f"attn_implementation={NAME!r} needs one attention_mask column per key {convention}: "
            f"{cached + new} keys ({cached} cached + {new} new positions), got an attention_mask "
            f"of {columns} columns"
        )
    if rows != batch_size:
        raise ValueError(
            f"attn_implementation={NAME!r} needs one attention_mask row per batch row "
            f"{convention}: {batch_size} rows, got {rows}"
        )


def _padding_layout(mask: torch.Tensor) -> SequenceLayout:
    """The batch's layout from ``mask`` (``True`` = token): ``SequenceLayout`` reads the padding
    on the host once and checks that every row's tokens are one contiguous run, as left or right
    padding leaves them; its ``ValueError`` (worded for ``key_padding_mask``, ``True`` =
    padding, which the user never passed) is raised again in transformers' convention, from a
    second read of the mask on that error path only."""
    try:
        return SequenceLayout(key_padding_mask=mask.logical_not())
    except ValueError as error:  # a row of several runs (the shape fits: the mask is its own)
        for row, tokens in enumerate(mask.tolist()):
            columns = [column for column, token in enumerate(tokens) if token]
            if columns and columns[-1] - columns[0] + 1 != len(columns):
                raise ValueError(
                    f"attn_implementation={NAME!r} needs each attention_mask row's tokens (1 = "
                    "token, 0 = padding) in one contiguous run (left or right padding); row "
                    f"{row} has {len(columns)} tokens between columns {columns[0]} and "
                    f"{columns[-1]}"
                ) from error
        raise


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _sharded_mask(
    setting: SequenceParallel,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
    attention_mask: torch.Tensor | None,
    mask_function: object,
    config: object,
) -> KeyMask:
    """:func:`padding_mask` under :func:`sequence_parallel`: the setting's layout and the
    forward's record; packed documents transformers found in the shard's ``position_ids`` are
    not read (the layout's are)."""
    from transformers.masking_utils import bidirectional_mask_function

    mask = None if attention_mask is None else attention_mask.bool()
    sharded = ShardedForward.begin(
        setting, config=config, bidirectional=mask_function is bidirectional_mask_function,
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, attention_mask=mask,
    )  # fmt: skip
    kind = _mask_kind(mask_function)
    return KeyMask(None, None, kind.overlay, setting.layout, sharded, **_read_fields(kind))


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
    """transformers' mask function for ``"ringdilated"`` (see :class:`KeyMask`): raises the
    ``ValueError`` the module docstring names for an ``attention_mask`` (any nonzero value is a
    token) or a cache layout it refuses (a row's tokens not in one run: in eager mode; compiled
    calls check it in the layer's op). A mask function it does not serve is reported in
    :attr:`KeyMask.overlay`, for the attention call to raise. Under :func:`sequence_parallel`
    the batch's layout replaces what transformers passes (see that function's module), which
    says what raises here and what at the first attention call."""
    start, offset = int(q_offset), int(kv_offset)  # type: ignore[call-overload]
    setting = active()
    if setting is not None:
        sharded: KeyMask = _sharded_mask(
            setting, batch_size, q_length, kv_length, start, offset, attention_mask,
            mask_function, kwargs.get("config"),
        )  # fmt: skip
        return sharded
    refuse_unsharded_recompute()
    keys = start + q_length  # what a dynamic cache holds: the cached positions, then the new
    if attention_mask is not None and (
        attention_mask.dim() != 2
        # Without a cache transformers takes kv_length from the mask itself: a mask that does
        # not fit the keys shows here as kv_length == its length != keys.
        or (offset == 0 and kv_length in (keys, attention_mask.shape[-1]))
    ):
        _check_mask(attention_mask, batch_size, start, q_length)
    if offset != 0 or keys != kv_length:
        raise ValueError(
            f"attn_implementation={NAME!r} needs the queries to be the last positions of the "
            f"keys, every cached position kept; got queries [{start}, {keys}) of {kv_length} "
            f"keys from position {offset} (a static cache, or a sliding-window cache such as "
            "the default DynamicCache(config=...) of a model with sliding layers): pass "
            "past_key_values=transformers.DynamicCache() (no config: it keeps every position)"
        )
    kind = _mask_kind(mask_function)
    documents, overlay, window = kind.documents, kind.overlay, _read_fields(kind)
    mask = None if attention_mask is None else attention_mask.bool()
    if torch.compiler.is_compiling() or overlay is not None:
        return KeyMask(mask, documents, overlay, **window)
    # Eager: the batch's layout, read here once for every layer (and once for mask.all()).
    if mask is not None and not bool(mask.all()):
        return KeyMask(mask, documents, overlay, _padding_layout(mask), **window)
    layout = None if documents is None else SequenceLayout(cu_seqlens=_bounds(documents))
    return KeyMask(None, documents, overlay, layout, **window)


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _sharded_attention(
    mask: KeyMask,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Any,
    rates: Any,
    pattern: dict[str, Any],
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """One layer's call under :func:`sequence_parallel`, on the forward's layout (its first
    call checks what the forward passed)."""
    assert mask.sharded is not None
    return mask.sharded.attend(mask.overlay, q, k, v, segments, rates, pattern, kwargs)


def _what(mask: object) -> str:
    """A mask for error messages: ``None``, or its type and shape."""
    shape = getattr(mask, "shape", None)
    return repr(mask) if shape is None else f"{type(mask).__name__} of shape {tuple(shape)}"


def _features(config: object, kwargs: dict[str, Any], mask: object) -> dict[str, object]:
    """:func:`dilated_attention`'s keyword arguments for the attention features a model passes
    beside the mask: ``window``, ``softcap`` and ``sinks``. Raises ``ValueError`` when the
    layer's ``sliding_window`` keyword is not the window of the mask function transformers made
    for it (``mask``, the layer's :class:`KeyMask`), naming both.

    How transformers 5.23 passes them, each per layer as a keyword of the attention call, and
    what each becomes (docs/spec.md section 5; read in transformers v5.23.0:
    models/mistral/modeling_mistral.py, models/gemma2/modeling_gemma2.py,
    models/gpt_oss/modeling_gpt_oss.py, masking_utils.py, modeling_flash_attention_utils.py):

    - ``kwargs["sliding_window"] = w``: Mistral passes ``config.sliding_window`` to every layer;
      Gemma-2 and gpt-oss pass it to their ``"sliding_attention"`` layers
      (``config.layer_types``) and ``None`` to the others, so the keyword is read, not the
      config. The mask transformers builds for such a layer (``create_sliding_window_causal_mask``)
      is ``and_masks(sliding_window_overlay(w), causal_mask_function)``, ``kv_idx > q_idx - w``
      and ``kv_idx <= q_idx``: ``window=(w - 1, 0)``. With ``config.is_causal`` false it is
      ``and_masks(sliding_window_bidirectional_overlay(w), bidirectional_mask_function)``,
      ``abs(q_idx - kv_idx) <= w``: ``window=(w, w)`` (transformers' flash-attention path
      passes ``window_size=(w - 1, w - 1)`` in both cases: one apart from its own mask when
      bidirectional; the adapter follows the mask, which eager and sdpa compute). The window
      is the mask's (:func:`_mask_kind` reads ``w`` from the overlay's closure); the keyword
      must equal the ``w`` it captured, and ``None`` must meet a mask without a window.
    - ``kwargs["softcap"] = c`` (Gemma-2: ``config.attn_logit_softcapping``, default 50.0, every
      layer): eager computes ``c * tanh(s / c)`` of ``s = q.k * scaling`` (``scaling`` =
      ``config.query_pre_attn_scalar ** -0.5``, passed as ``scaling``) before the mask:
      ``softcap=float(c)``. (``config.final_logit_softcapping`` caps the logits, not attention.)
    - ``kwargs["s_aux"]`` (gpt-oss: ``module.sinks``, a parameter of shape
      ``(num_attention_heads,)`` in the model's dtype, every layer): eager appends it as one more
      logit per query after the scaled, masked scores, softmaxes and drops its column, so it
      joins each query's denominator once with a zero value: ``sinks=s_aux`` (passed as is).
    """
    keyword = kwargs.get("sliding_window")
    window: tuple[int, int] | None = None
    if isinstance(mask, KeyMask):
        if mask.overlay is None and keyword != mask.sliding_window:
            raise ValueError(
                f"attn_implementation={NAME!r}: this layer passes sliding_window={keyword!r} but "
                f"transformers made its mask with sliding_window={mask.sliding_window!r} (the "
                "model gave the layer another mask than its sliding_window keyword's)"
            )
        window = mask.window
    elif keyword is not None and mask is None and active() is None:  # else refused below
        raise ValueError(
            f"attn_implementation={NAME!r}: this layer passes sliding_window={keyword!r} with "
            f"{_what(mask)} as its mask, not one made by transformers' mask functions (which "
            "carries the window the adapter checks the keyword against)"
        )
    return {"window": window, "softcap": kwargs.get("softcap"), "sinks": kwargs.get("s_aux")}


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
    features = _features(config, kwargs, attention_mask)
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if isinstance(attention_mask, KeyMask) and attention_mask.causal not in (None, causal):
        made = "causal" if attention_mask.causal else "bidirectional"
        raise ValueError(
            f"attn_implementation={NAME!r}: transformers made this layer a {made} mask (from "
            f"config.is_causal={getattr(config, 'is_causal', None)!r}), but the layer is "
            f"{'causal' if causal else 'bidirectional'} (is_causal={is_causal!r}, the "
            f"module's is_causal={getattr(module, 'is_causal', None)!r}): eager attention follows "
            "the mask, sdpa and flash-attention the flag when no mask is needed. Make them agree "
            "(e.g. Gemma-2's use_bidirectional_attention=True needs config.is_causal=False too)"
        )
    pattern: dict[str, Any] = {
        "mode": _setting(config, "mode", "head_groups"),
        "causal": causal,
        "scale": scaling,
        "dropout_p": dropout,
        "kernel": _setting(config, "kernel", "auto"),
        **features,
    }
    segments, rates = _setting(config, "segment_lengths"), _setting(config, "dilation_rates")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if isinstance(attention_mask, KeyMask) and attention_mask.sharded is not None:
        return _sharded_attention(attention_mask, q, k, v, segments, rates, pattern, kwargs), None
    if active() is not None:
        raise ValueError(
            f"attn_implementation={NAME!r} under sequence_parallel needs the mask its own mask "
            f"function makes (which carries the layout), got {_what(attention_mask)}: a hook "
            "replaced it (accelerate's context parallelism, Accelerator.prepare with cp_size > "
            "1, sets every self_attn's attention_mask to None: shard with ringdilated instead), "
            "or the model builds no mask through transformers' create_causal_mask or "
            "create_bidirectional_mask"
        )
    packed = kwargs.get("cu_seq_lens_k")
    key_padding_mask: torch.Tensor | None = None
    layout: SequenceLayout | None = None
    if isinstance(attention_mask, KeyMask) and attention_mask.layout is not None:
        if packed is None:  # else transformers' own packed form takes precedence, as below
            layout = attention_mask.layout
    elif attention_mask is not None:
        if not isinstance(attention_mask, KeyMask):
            raise ValueError(
                f"attn_implementation={NAME!r} expects the mask its own mask function makes, got "
                f"{type(attention_mask).__name__} of shape {tuple(attention_mask.shape)} (a "
                "custom 4-D mask is not supported)"
            )
        if attention_mask.overlay is not None:
            raise ValueError(
                f"attn_implementation={NAME!r} serves transformers' causal_mask_function or "
                "bidirectional_mask_function, or their sliding windows, alone or made "
                "packed-sequence compatible (and_masks of packed_sequence_mask_function and "
                "remap_positions_for_packed_sequence over one of them); transformers asked for "
                f"{attention_mask.overlay}"
            )
        if attention_mask.padding is not None:
            key_padding_mask = attention_mask.padding.logical_not()
        if packed is None and attention_mask.documents is not None:
            packed = _bounds(attention_mask.documents)  # packing transformers found
    out = dilated_attention(
        q,
        k,
        v,
        segments,
        rates,
        cu_seqlens=packed,
        key_padding_mask=key_padding_mask,
        layout=layout,
        **pattern,
    )
    return out, None


def register(name: str = NAME) -> None:
    """Register the attention and mask functions with transformers under ``name`` (idempotent;
    done on import under ``"ringdilated"``)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)


register()
