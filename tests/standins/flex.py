"""``flex_attention`` in differentiable float64 math, with its 2.13 signature (CPU FlexAttention
has no backward): kernel layout ``(B, H, L, D)``, ``lse`` through ``return_aux`` (float32;
float64 for float64 inputs, as torch 2.13 returns it), ``-inf`` and zeros on rows with no
visible key.

A ``BlockMask`` is read the way the Triton kernels read it (torch 2.13,
``torch/_inductor/kernel/flex/templates/flex_attention.py.jinja`` and
``flex_backwards.py.jinja``): a score is computed only in a block its query block lists, with the
``mask_mod`` in a partial block (``kv_num_blocks``/``kv_indices``) and without it in a full one
(``full_kv_*``); the backward's key-block view (``q_*``, ``full_q_*``, which the ``dk``/``dv``
programs walk) must list the same blocks. Their preconditions are asserted: int32 contiguous
tables of the block grid's shape, every entry a valid block number (the kernels load a row's
first entry even when it lists none), no block both partial and full, lengths equal to
``seq_lengths``. Anything else (``block_mask.mask_mod`` alone, as the tests' dense references
pass) is evaluated densely.

A ``score_mod`` is applied as the kernels apply it (torch 2.13,
``torch/_inductor/kernel/flex/templates/common.py.jinja``: ``qk *= SM_SCALE``, then the
``score_mod`` on every score with its ``(b, h, q_idx, kv_idx)``, then the ``mask_mod`` sets
hidden scores to ``-inf``), and differentiated by autograd, as the kernels' joint graph
differentiates it.
"""

from __future__ import annotations

import types

import torch
from torch.nn.attention.flex_attention import BlockMask

__all__ = ["kernel_visibility", "math_flex_attention"]


def _listed(num: torch.Tensor, indices: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """The ``(rows, width)`` blocks one table pair lists, checked as the kernels need them."""
    assert num.dtype == indices.dtype == torch.int32, (num.dtype, indices.dtype)
    assert num.is_contiguous() and indices.is_contiguous(), "the kernels assume contiguous tables"
    assert num.shape == (1, 1, rows) and indices.shape == (1, 1, rows, width), (
        num.shape,
        indices.shape,
    )
    assert bool(((indices >= 0) & (indices < width)).all()), "an entry is no block number"
    assert bool(((num >= 0) & (num <= width)).all()), num
    counted = torch.arange(width) < num.view(rows, 1)  # the entries a kernel reads
    listed = torch.zeros(rows, width + 1, dtype=torch.bool)
    listed.scatter_(1, torch.where(counted, indices.view(rows, width), width).long(), True)
    listed = listed[:, :width]
    assert torch.equal(listed.sum(1), num.view(rows).long()), "a row lists a block twice"
    return listed


def kernel_visibility(block_mask: BlockMask, q_len: int, k_len: int) -> torch.Tensor:
    """The ``(q_len, k_len)`` scores the kernels compute for ``block_mask``."""
    assert tuple(block_mask.seq_lengths) == (q_len, k_len), (block_mask.seq_lengths, q_len, k_len)
    bq, bk = block_mask.BLOCK_SIZE
    nq, nk = -(-q_len // bq), -(-k_len // bk)
    partial = _listed(block_mask.kv_num_blocks, block_mask.kv_indices, nq, nk)
    full = _listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nq, nk)
    assert not bool((partial & full).any()), "a block is both partial and full"
    assert block_mask.q_num_blocks is not None and block_mask.full_q_num_blocks is not None
    for view, forward in (
        (_listed(block_mask.q_num_blocks, block_mask.q_indices, nk, nq), partial),
        (_listed(block_mask.full_q_num_blocks, block_mask.full_q_indices, nk, nq), full),
    ):
        assert torch.equal(view.T, forward), "the backward's key-block view lists other blocks"
    rows, cols = torch.arange(q_len), torch.arange(k_len)
    in_partial = partial[rows // bq][:, cols // bk]
    in_full = full[rows // bq][:, cols // bk]
    masked = block_mask.mask_mod(None, None, rows.view(-1, 1), cols.view(1, -1))
    return in_full | (in_partial & masked)


def math_flex_attention(
    query,
    key,
    value,
    score_mod=None,
    block_mask=None,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    kernel_options=None,
    *,
    return_aux=None,
):  # type: ignore[no-untyped-def]
    assert not return_lse and return_aux.lse
    assert enable_gqa == (query.shape[1] != key.shape[1]), "enable_gqa must match the heads"
    assert query.shape[-2] == (query.shape[-2] if block_mask is None else block_mask.shape[-2])
    group = query.shape[1] // key.shape[1]
    kd, vd = (x.double().repeat_interleave(group, 1) for x in (key, value))
    s = query.double() @ kd.transpose(-1, -2) * scale
    if score_mod is not None:
        index = [torch.arange(n).view([-1 if i == d else 1 for i in range(4)]) for d, n in
                 enumerate(s.shape)]  # fmt: skip
        s = score_mod(s, *index).double()
    if isinstance(block_mask, BlockMask):
        visible = kernel_visibility(block_mask, query.shape[-2], key.shape[-2])
        s = s.masked_fill(~visible, float("-inf"))
    elif block_mask is not None:
        rows = torch.arange(query.shape[-2]).view(-1, 1)
        cols = torch.arange(key.shape[-2]).view(1, -1)
        s = s.masked_fill(~block_mask.mask_mod(None, None, rows, cols), float("-inf"))
    empty = torch.isneginf(s).all(-1, keepdim=True)
    lse = torch.logsumexp(s.masked_fill(empty, 0.0), -1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ vd
    out = out.masked_fill(empty, 0.0)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    lse = lse.masked_fill(empty.squeeze(-1), float("-inf")).to(lse_dtype)
    return out.to(query.dtype), types.SimpleNamespace(lse=lse)
