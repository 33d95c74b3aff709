"""How each flash op turns its ``causal`` flag and window arguments into a mask, exactly as read.

Every function returns the ``(q_len, k_len)`` bool mask the op's kernel applies (``None``: no
mask), after the op's own rewriting of its arguments, in the bottom-right convention of
:func:`tests.standins.math.bottom_right_window`:

- :func:`fa2_visible`: flash-attn 2.6.3 to 2.8.3 (``csrc/flash_attn/flash_api.cpp``: ``mha_fwd``,
  ``mha_bwd``, ``set_params_fprop``; ``src/mask.h``) and torch's vendored copy (pytorch/pytorch
  ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp`` at 03b7c19d, the same
  lines). ``mha_fwd``: a bound ``>= seqlen_k`` becomes ``-1``; ``seqlen_q == 1`` without alibi
  drops ``is_causal``; ``is_causal`` sets ``right = 0``. ``mha_bwd``: ``is_causal`` first, then
  the clamp. ``set_params_fprop``: an unbounded left beside a bounded right becomes
  ``seqlen_k``, and an unbounded right beside a bounded left becomes ``seqlen_k`` too (a
  *finite* bound: ``row + 1 + seqlen_k - seqlen_q + seqlen_k`` hides keys from the first rows
  when ``seqlen_q > seqlen_k + 1``); both negative: no mask.
- :func:`fa3_visible`: FlashAttention 3 (``hopper/flash_api.cpp`` at v2.7.4.post1, v2.8.3 and
  fa4-v4.0.0.beta27; ``hopper/mask.h``): ``left >= seqlen_k - 1`` and ``right >= seqlen_q - 1``
  become ``-1``, ``is_causal`` sets ``right = 0``, and an unbounded side is ``seqlen_k - 1``
  (left) or ``seqlen_q - 1`` (right), which hides nothing.
- :func:`fa4_visible`: FlashAttention 4 (``flash_attn/cute/interface.py``
  ``_resolve_causal_local_window`` at fa4-v4.0.0.beta5 and beta27; ``mask.py``): ``causal``
  sets ``right = 0``; two bounds summing below 0 are both dropped (no mask at all); ``None``
  is unbounded, any other value is taken as it is.
"""

from __future__ import annotations

import torch

from tests.standins.math import bottom_right_window

__all__ = ["fa2_visible", "fa3_visible", "fa4_visible"]


def fa2_visible(
    q_len: int, k_len: int, causal: bool, left: int, right: int, *, forward: bool
) -> torch.Tensor | None:
    """flash-attn 2's (and torch's flash op's) mask for ``window_size = (left, right)``."""
    if forward:
        left, right = (-1 if x >= k_len else x for x in (left, right))
        causal = causal and q_len != 1  # "causal=true is the same as causal=false in this case"
        right = 0 if causal else right
    else:
        right = 0 if causal else right
        left, right = (-1 if x >= k_len else x for x in (left, right))
    if left < 0 and right < 0:
        return None
    if left < 0:
        left = k_len
    if right < 0:
        right = k_len
    return bottom_right_window(q_len, k_len, left, right)


def fa3_visible(q_len: int, k_len: int, causal: bool, left: int, right: int) -> torch.Tensor | None:
    """FlashAttention 3's mask for ``window_size_left``/``_right`` (or the ``window_size`` pair)."""
    left = -1 if left >= k_len - 1 else left
    right = -1 if right >= q_len - 1 else right
    right = 0 if causal else right
    if left < 0 and right < 0:
        return None
    return bottom_right_window(
        q_len, k_len, k_len - 1 if left < 0 else left, q_len - 1 if right < 0 else right
    )


def fa4_visible(
    q_len: int, k_len: int, causal: bool, left: int | None, right: int | None
) -> torch.Tensor | None:
    """FlashAttention 4's mask for ``window_size_left``/``_right``."""
    right = 0 if causal else right
    if left is not None and right is not None and left + right < 0:
        left = right = None
    if left is None and right is None:
        return None
    return bottom_right_window(q_len, k_len, left, right)
