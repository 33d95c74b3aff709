"""Input checks, run before any work: every error names the value and the rule it broke."""

from __future__ import annotations

import math
import numbers

import torch

from ringdilated.core.call.agreement import safe_repr
from ringdilated.core.contract.kernel import check_dropout
from ringdilated.core.plan.pattern import DilationPattern
from ringdilated.core.plan.window import CAUSAL, FULL, KeyWindow

__all__ = [
    "EMPTY_SHARD_RULE",
    "FLOAT_DTYPES",
    "as_softcap",
    "check_bool",
    "check_inputs",
    "check_options",
    "check_query_split",
    "check_shard_lengths",
    "check_shards",
    "check_sinks",
    "check_window",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

EMPTY_SHARD_RULE = "every rank's shard must hold at least one position"
"""How every error about an empty shard begins, on every rank."""


def check_inputs(
    q: object, k: object, v: object, pattern: DilationPattern, empty_queries: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check ``q`` ``(B, Lq, H, D)`` and ``k``, ``v`` ``(B, L, Hkv, D)``, ``Lq <= L`` (a query
    suffix when shorter; docs/spec.md, section 1). ``empty_queries``: ``Lq = 0`` is allowed (a
    rank of a process group before the suffix; :func:`check_query_split` checks the split)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    assert (
        isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.is_nested:
            raise TypeError(
                f"{name} must be a dense (strided) tensor, got a nested tensor; pad its "
                "sequences to one length, or pack them into one sequence"
            )
        if x.layout != torch.strided:
            raise TypeError(
                f"{name} must be a dense (strided) tensor, got layout {x.layout}; convert it with "
                f"{name}.to_dense()"
            )
        if x.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seq_len, heads, head_dim), got shape {tuple(x.shape)}"
            )
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
        sized = (*x.shape[:1], *x.shape[2:]) if name == "q" and empty_queries else x.shape
        if 0 in sized:
            raise ValueError(f"{name} must have no empty dimension, got shape {tuple(x.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    B, Lq, H, D = q.shape
    if k.shape[0] != B:
        raise ValueError(
            f"k and v must match q in batch, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if Lq > k.shape[1]:
        raise ValueError(
            f"q may not be longer than k: q holds the last Lq <= L positions of the sequence "
            f"(a query suffix), got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if k.shape[3] != D:
        raise ValueError(f"k and v head_dim must equal q's {D}, got {k.shape[3]}")
    pattern.check_heads(H, k.shape[2])
    return q, k, v


def check_bool(name: str, value: object) -> bool:
    """``value``, or ``TypeError`` naming ``name`` unless it is a bool (not merely truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


WINDOW_RULE = (
    "window must be None or a (left, right) pair, each bound an int >= 0 or None (unbounded)"
)
"""How every error about a call's ``window`` begins."""


def _window_bound(window: object, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{WINDOW_RULE}, got window={safe_repr(window)}")
    bound = int(value)
    if bound < 0:
        raise ValueError(
            f"{WINDOW_RULE}, got window={safe_repr(window)} (a negative bound is refused: "
            "flash-attn's -1 for unbounded is None here)"
        )
    return bound


def check_window(window: object, causal: object) -> KeyWindow:
    """A call's key window (docs/spec.md, section 5) from its ``window`` and ``causal``
    arguments: ``None``, or a ``(left, right)`` tuple or list of two bounds, each an int ``>= 0``
    (numpy's ints too, not a bool) or ``None`` (unbounded); ``causal=True`` is ``right = 0``, and
    with a window whose ``right`` is neither ``None`` nor ``0`` raises ``ValueError`` (one of the
    two would be ignored; the oracle's rule). Negative bounds are refused: with both bounds
    ``>= 0`` every selected query sees at least its own position (the float64 oracle evaluates
    negative bounds too, as plain arithmetic, but a call never needs them, and flash-attn's
    ``-1`` meaning "unbounded" would silently mean something else here). Returns
    :data:`~ringdilated.core.plan.window.FULL` or
    :data:`~ringdilated.core.plan.window.CAUSAL` for those windows."""
    check_bool("causal", causal)
    if window is None:
        return CAUSAL if causal else FULL
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"{WINDOW_RULE}, got window={safe_repr(window)}")
    left, right = (_window_bound(window, bound) for bound in window)
    if causal and right not in (None, 0):
        raise ValueError(
            f"causal=True asks for right = 0, but window={safe_repr(window)}: pass one"
        )
    found = KeyWindow(left, 0 if causal else right)
    return CAUSAL if found == CAUSAL else FULL if found == FULL else found


def _real(name: str, value: object, kind: str) -> float:
    # Any real number (int, float, numpy's float32, a Fraction), but not a bool.
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be {kind}, got {safe_repr(value)}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite float, got {safe_repr(value)}") from None


def check_options(scale: object, dropout_p: object) -> None:
    """``scale``: ``None`` or a positive finite real; ``dropout_p``: a real in ``[0, 1)``."""
    if scale is not None:
        value = _real("scale", scale, "a float or None")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    check_dropout(_real("dropout_p", dropout_p, "a float"), dropout_p)


def as_softcap(value: object) -> float | None:
    """``value`` as a float, or ``None`` for no cap (docs/spec.md, section 5): a real number
    (not a bool) that is finite and positive, the kernels' rule
    (:func:`~ringdilated.core.contract.kernel.check_softcap`); ``TypeError`` for anything not a
    real number, ``ValueError`` otherwise, naming the value."""
    if value is None:
        return None
    cap = _real("softcap", value, "a positive float or None")
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap must be None or a positive finite number, got {value!r}")
    return cap


def check_sinks(sinks: object, q: torch.Tensor) -> None:
    """Raise unless ``sinks`` is ``None`` or the call's attention sinks (docs/spec.md, section
    5): a dense floating tensor of shape ``(H,)``, one logit per query head of ``q``
    ``(B, Lq, H, D)`` (never broadcast: ``(1,)`` or ``(H, 1)`` raise), on ``q``'s device, that
    converts exactly to the dtype the call merges it in (float32; float64 for float64 inputs):
    float32, and float16 or bfloat16 (a module converted with ``.half()`` or ``.bfloat16()``
    holds its sinks so; widened without loss), or float64 only with float64 inputs (rounding it
    to float32 would lose precision silently). It may require a gradient. ``TypeError`` for
    what is no such tensor or dtype, ``ValueError`` for a wrong shape or device, each naming the
    value. Metadata only: no value is read."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(
            f"sinks must be a torch.Tensor of shape (H,) or None, got {safe_repr(sinks)}"
        )
    if sinks.is_nested or sinks.layout != torch.strided:
        kind = "a nested tensor" if sinks.is_nested else f"layout {sinks.layout}"
        raise TypeError(f"sinks must be a dense (strided) tensor, got {kind}")
    heads = q.shape[2]
    if sinks.shape != (heads,):
        raise ValueError(
            f"sinks must have shape ({heads},), one logit per query head of q {tuple(q.shape)} "
            f"(never broadcast), got shape {tuple(sinks.shape)}"
        )
    if sinks.dtype not in FLOAT_DTYPES:
        raise TypeError(f"sinks must be a float32 tensor (one logit per head), got {sinks.dtype}")
    if sinks.dtype == torch.float64 and q.dtype != torch.float64:
        raise TypeError(
            f"sinks is float64, but a {q.dtype} call merges sinks in float32, and rounding them "
            "would lose precision: pass sinks.float() (or float64 q, k, v)"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")


def check_shard_lengths(lengths: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless every rank's shard in ``lengths`` (in rank order) holds a
    position, naming every empty one: the same message on every rank that knows the lengths."""
    empty = [r for r, n in enumerate(lengths) if n < 1]
    if not empty:
        return
    holders = (
        f"rank {empty[0]} holds {lengths[empty[0]]}"
        if len(empty) == 1
        else f"ranks {', '.join(map(str, empty))} hold none"
    )
    raise ValueError(f"{EMPTY_SHARD_RULE}, got shard lengths {brief(lengths)} ({holders})")


def brief(lengths: tuple[int, ...]) -> str:
    """``lengths`` as a tuple, its middle elided beyond eight."""
    if len(lengths) <= 8:
        return str(tuple(lengths))
    return f"({', '.join(map(str, lengths[:4]))}, ..., {', '.join(map(str, lengths[-2:]))})"


def check_shards(lengths: tuple[int, ...] | None, rank: int | None, q: object, k: object) -> None:
    """On a process group, before anything else is checked: raise ``ValueError`` for an empty
    shard, naming its rank, worded alike wherever it is found. ``lengths``: every rank's shard
    length once the ranks have exchanged them (:func:`check_shard_lengths`: every rank raises
    the same message); else ``None``, and this ``rank``'s own ``k`` (when a 4-D tensor) must hold
    a position (its peers then raise ``rank <rank> rejected its input``, quoting this message,
    which names ``q`` where it is empty too; an empty ``q`` alone is a rank before a query
    suffix). Anything not a dense 4-D tensor is left to :func:`check_inputs`."""
    if lengths is not None:
        check_shard_lengths(lengths)
        return
    empty = [
        (name, x)
        for name, x in (("q", q), ("k", k))
        if isinstance(x, torch.Tensor) and not x.is_nested and x.dim() == 4 and x.shape[1] == 0
    ]
    if any(name == "k" for name, _ in empty):  # an empty q alone: a rank before a query suffix
        name, x = empty[0]
        raise ValueError(
            f"{EMPTY_SHARD_RULE}, got an empty shard on rank {rank}: {name} of shape "
            f"{tuple(x.shape)}"
        )


QUERY_SPLIT_RULE = (
    "with a process_group, the queries are the last Lq positions of the whole sequence (of "
    "length L, the shards' sum) and each rank's q holds those in its own shard [S_r, S_r + n_r): "
    "the last max(0, min(n_r, S_r + n_r - (L - Lq))) positions of it, and Lq >= 1"
)
"""How every error about the ranks' split of a query suffix begins, on every rank."""


def check_query_split(lengths: tuple[int, ...], query_lengths: tuple[int, ...]) -> int:
    """The query suffix's length ``Lq``: the sum of every rank's query length (``query_lengths``,
    in rank order, for shards of ``lengths``). Raises ``ValueError`` naming every rank's query
    length and the rule unless they form one suffix of the whole sequence (docs/spec.md,
    section 3); every rank, given the same lengths, raises the same message."""
    total = sum(query_lengths)
    start, end = sum(lengths) - total, 0
    expected = []
    for n in lengths:
        end += n
        expected.append(max(0, min(n, end - start)))
    if total < 1 or tuple(expected) != tuple(query_lengths):
        raise ValueError(
            f"{QUERY_SPLIT_RULE}; got q lengths {brief(query_lengths)} on shards of "
            f"{brief(lengths)} (Lq = {total}, so rank by rank {brief(tuple(expected))})"
        )
    return total
