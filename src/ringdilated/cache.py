"""``DilatedKVCache``: decoding with a cache bounded by the pattern, not by the tokens decoded.

A query at position ``p`` sees, under pattern ``i``, only the selected positions of its own
segment (docs/spec.md, section 2). A future query therefore sees nothing before the current
segment of each pattern, and only that pattern's selected positions in it (in ``head_groups``
mode, only those of its own head group's offset). The cache keeps exactly those: for every run
of heads sharing a pattern and an offset, the keys and values at its selected positions of the
current segment, at most ``ceil((w_i - offset) / r_i)`` of them. Memory is bounded by
``sum_i w_i / r_i`` keys per run, whatever the number of tokens decoded, and so is the work per
token.

How a step is computed: the selected positions of a pattern, in order, form a sequence in which
every segment holds ``ceil((w_i - offset) / r_i)`` positions (the last one fewer if partial).
Attention under ``(w_i, r_i, offset)`` over the original positions is attention under
``([ceil((w_i - offset) / r_i)], [1])`` over that compacted sequence, causal or not. A step
appends the new tokens' selected positions to a run's cached ones (which start at a segment
boundary of the compacted sequence) and attends its new queries as a query suffix
(:func:`ringdilated.dilated_attention`), on any kernel. ``longnet`` mode merges the runs of a
head by their log-sum-exp, as the driver does.

Call flow::

    cache = DilatedKVCache([2048, 4096], [1, 2], num_heads=8, causal=True)
    out = cache.attend(q, k, v)        # prefill: q (B, m, H, D) at positions [0, m)
    out = cache.attend(q1, k1, v1)     # one decoded token at position m
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from ringdilated.core.kernel import Kernel
from ringdilated.core.pattern import DilationPattern, HeadRun, Mode
from ringdilated.core.validation import check_bool, check_options
from ringdilated.functional import attend

__all__ = ["DilatedKVCache"]


@attrs.frozen
class _Run:
    """Query heads ``heads`` under pattern ``index`` at ``offset``: segment ``w``, rate ``r``."""

    index: int
    heads: HeadRun
    w: int
    r: int
    offset: int

    @property
    def per_segment(self) -> int:
        """Selected positions in a full segment: the compacted segment length."""
        return -(-(self.w - self.offset) // self.r)

    def count_in_segment(self, start: int, stop: int) -> int:
        """Selected positions in ``[start, stop)``, which lie in one segment; O(1)."""
        base = start // self.w * self.w + self.offset
        first = base + max(0, -(-(start - base) // self.r)) * self.r
        return max(0, -(-(stop - first) // self.r))

    def selected(self, start: int, stop: int) -> list[int]:
        """The selected positions in ``[start, stop)``, in order (O(selected), not O(stop))."""
        first_segment = start // self.w
        positions: list[int] = []
        segment = first_segment
        while segment * self.w < stop:
            base = segment * self.w + self.offset
            j = max(0, -(-(start - base) // self.r))
            p = base + j * self.r
            end = min(stop, (segment + 1) * self.w)
            while p < end:
                positions.append(p)
                p += self.r
            segment += 1
        return positions


def _runs(pattern: DilationPattern, num_heads: int, num_kv_heads: int) -> tuple[_Run, ...]:
    """Every run of heads sharing a pattern and an offset (the pattern's blocks, deduplicated)."""
    seen: dict[tuple[int, HeadRun, int], _Run] = {}
    longest = max(pattern.segment_lengths)
    for block in pattern.blocks(longest, num_heads, num_kv_heads):
        key = (block.index, block.heads, block.selection.offset)
        w, r = pattern.segment_lengths[block.index], pattern.dilation_rates[block.index]
        seen.setdefault(key, _Run(block.index, block.heads, w, r, block.selection.offset))
    return tuple(seen.values())


class DilatedKVCache:
    """Keys and values that future queries can still see, and nothing more.

    ``attend(q, k, v)`` takes the next ``m`` tokens (``q`` ``(B, m, H, D)``, ``k``, ``v``
    ``(B, m, Hkv, D)``, at positions ``[length, length + m)``), adds their keys and values, and
    returns their attention over everything the cache has seen: exactly the last ``m`` rows of
    :func:`ringdilated.dilated_attention` over the whole sequence so far (with ``causal=False``,
    each step's queries see the keys of their segment up to the step's last position, as a query
    suffix does). Prefill is one call with the prompt; decoding, one call per token.

    The batch, heads, head dim, dtype and device are fixed by the first call. Rows are one
    sequence each, all at the same positions (no padding or packed documents yet).
    """

    def __init__(
        self,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        num_heads: int,
        num_kv_heads: int | None = None,
        mode: Mode = "head_groups",
        causal: bool = True,
        scale: float | None = None,
        kernel: str | Kernel = "auto",
    ) -> None:
        self.pattern = DilationPattern(segment_lengths, dilation_rates, mode)
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("num_heads", num_heads), ("num_kv_heads", kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        self.pattern.check_heads(num_heads, kv_heads)
        check_options(scale, 0.0)
        self.causal = check_bool("causal", causal)
        self.scale = scale
        self.kernel = kernel
        self.num_heads, self.num_kv_heads = num_heads, kv_heads
        self._runs = _runs(self.pattern, num_heads, kv_heads)
        self.length = 0
        self._keys: list[torch.Tensor | None] = [None] * len(self._runs)
        self._values: list[torch.Tensor | None] = [None] * len(self._runs)

    @property
    def cached_positions(self) -> int:
        """Key positions held, summed over the runs of heads (each run holds its own)."""
        return sum(0 if k is None else k.shape[1] for k in self._keys)

    @property
    def nbytes(self) -> int:
        """Bytes of storage the cached keys and values hold (each its own copy)."""
        tensors = [t for t in (*self._keys, *self._values) if t is not None]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def reset(self) -> None:
        """Forget every token (a new sequence starts at position 0)."""
        self.length = 0
        self._keys = [None] * len(self._runs)
        self._values = [None] * len(self._runs)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Add the next ``m`` tokens' keys and values and attend their queries: ``out``
        ``(B, m, H, D)`` (and ``lse`` ``(B, H, m)`` float32 with ``return_lse``)."""
        self._check(q, k, v)
        batch, m, heads, dim = q.shape
        start, stop = self.length, self.length + m
        exclusive = self.pattern.mode == "head_groups"
        out = q.new_zeros(batch, m, heads, dim) if exclusive else None
        lse = q.new_full((batch, heads, m), float("-inf"), dtype=torch.float32)
        parts: list[tuple[_Run, list[int], torch.Tensor, torch.Tensor]] = []
        # The new state is built aside and committed only once every run succeeded: a step that
        # raises (out of memory, a kernel error) leaves the cache as it was.
        kept_keys: list[torch.Tensor | None] = []
        kept_values: list[torch.Tensor | None] = []
        for i, run in enumerate(self._runs):
            new = run.selected(start, stop)
            rows = torch.tensor([p - start for p in new], dtype=torch.long, device=q.device)
            h, kv = run.heads, slice(run.heads.kv_start, run.heads.kv_stop)
            keys, values = k[:, :, kv].index_select(1, rows), v[:, :, kv].index_select(1, rows)
            held_k, held_v = self._keys[i], self._values[i]
            if held_k is not None and held_v is not None:
                keys, values = torch.cat([held_k, keys], 1), torch.cat([held_v, values], 1)
            if new:
                queries = q[:, :, h.q_start : h.q_stop].index_select(1, rows)
                run_out, run_lse, _ = attend(
                    ((run.per_segment,), (1,), "head_groups"),
                    queries,
                    keys,
                    values,
                    causal=self.causal,
                    scale=self.scale if self.scale is not None else dim**-0.5,
                    dropout_p=0.0,
                    kernel=self.kernel,
                    full_precision_lse=True,  # longnet merges it further
                )
                parts.append((run, new, run_out, run_lse))
            kept = self._keep(run, keys, values, stop)
            kept_keys.append(kept[0])
            kept_values.append(kept[1])
        if exclusive:
            assert out is not None
            for run, new, run_out, run_lse in parts:
                at = [p - start for p in new]
                h = run.heads
                out[:, at, h.q_start : h.q_stop] = run_out
                lse[:, h.q_start : h.q_stop, at] = run_lse.float()
        else:
            out, lse = self._merge(parts, q, start, lse)
        self._keys, self._values, self.length = kept_keys, kept_values, stop  # the step is done
        return (out, lse) if return_lse else out

    def _keep(
        self, run: _Run, keys: torch.Tensor, values: torch.Tensor, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The selected keys of the segment that position ``stop`` (the next query) lies in."""
        keep = run.count_in_segment(stop // run.w * run.w, stop)
        # Copies, not views: a view would keep the whole step's keys (a long prompt) alive.
        return (
            keys[:, keys.shape[1] - keep :].clone(),
            values[:, values.shape[1] - keep :].clone(),
        )

    @staticmethod
    def _merge(
        parts: list[tuple[_Run, list[int], torch.Tensor, torch.Tensor]],
        q: torch.Tensor,
        start: int,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``longnet``: every head's runs merged by their log-sum-exp (float32 state)."""
        batch, m, heads, dim = q.shape
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        state = torch.full((len(parts), batch, heads, m), float("-inf"), dtype=acc, device=q.device)
        outs = q.new_zeros((len(parts), batch, m, heads, dim), dtype=acc)
        for j, (run, new, run_out, run_lse) in enumerate(parts):
            rows = [p - start for p in new]
            h = run.heads
            state[j, :, h.q_start : h.q_stop, rows] = run_lse.to(acc)
            outs[j, :, rows, h.q_start : h.q_stop] = run_out.to(acc)
        total = torch.logsumexp(state, 0)
        seen = torch.isfinite(total)
        weights = torch.where(seen, torch.exp(state - total.masked_fill(~seen, 0)), 0.0)
        merged = (outs * weights.permute(0, 1, 3, 2).unsqueeze(-1)).sum(0)
        return merged.to(q.dtype), total.float().where(seen, lse)

    def _check(self, q: object, k: object, v: object) -> None:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"{name} must be a 4-D tensor (batch, tokens, heads, dim), got {got}"
                )
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
        assert isinstance(v, torch.Tensor)
        if q.shape[2] != self.num_heads or k.shape[2] != self.num_kv_heads:
            raise ValueError(
                f"the cache was built for {self.num_heads} query and {self.num_kv_heads} "
                f"key/value heads, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
            raise ValueError(
                f"q, k and v must share one dtype and device, got {q.dtype} on {q.device}, "
                f"{k.dtype} on {k.device}, {v.dtype} on {v.device}"
            )
        if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
            raise ValueError(
                "q, k and v must hold the same new tokens (q (B, m, H, D), k and v "
                f"(B, m, Hkv, D)), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        held = next((t for t in self._keys if t is not None), None)
        if held is not None and (
            held.shape[0] != k.shape[0]
            or held.shape[3] != k.shape[3]
            or held.dtype != k.dtype
            or held.device != k.device
        ):
            raise ValueError(
                f"this cache holds batch {held.shape[0]}, head dim {held.shape[3]}, "
                f"{held.dtype} on {held.device}; got k {tuple(k.shape)} {k.dtype} on "
                f"{k.device} (call reset() to start another sequence)"
            )
