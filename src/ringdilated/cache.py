"""``DilatedKVCache``: decoding with fixed buffers bounded by the pattern, positions on the device.

A query at position ``p`` sees, under pattern ``i`` (segment ``w``, rate ``r``) at offset ``o``,
only the selected positions of its own segment (docs/spec.md, section 2): ``p`` itself must be
selected (``(p % w) % r == o``) and its keys are the positions ``base + o + j * r <= p``, ``base =
p - p % w``. A future query therefore sees nothing before the current segment of each pattern.
For every run of heads sharing a pattern and an offset the cache keeps exactly those keys and
values, in a fixed buffer of ``ceil((w - o) / r)`` slots: the key at position ``t`` lives in slot
``(t % w) // r`` while ``t``'s segment is the current one. Memory is bounded by the pattern, never
by the tokens decoded, and it is allocated once, at the first call.

**A one-token step makes no host read and no copy from Python data**, and every tensor it reads
or writes keeps its shape, strides and storage from step to step (what CUDA-graph capture
needs): each row's position lives in a ``(B,)`` int64 tensor on the device, and everything the
step needs follows from it by arithmetic there. The new key and value go to their slot in every
run that selects the token (a run that does not writes them to a scratch slot nobody sees); slot
``j`` of a run is visible to the query exactly when the run selects ``p`` and ``o + j * r <= p %
w``, so nothing needs clearing when a segment ends (the stale slots of the last segment are
invisible until overwritten). Then one dense masked attention in float32 (float64 for float64
inputs) runs over the slots of every run that covers each query head: in ``head_groups`` mode a
head's one run; in ``longnet`` mode the concatenation of its patterns' runs, whose single softmax
is LongNet's weighting by softmax denominators (a softmax over the multiset union of the
patterns' keys). A head that sees no key gets ``out = 0`` and ``lse = -inf``. The step scans
every slot, visible or not: its cost is the capacity, like a static cache's.

The buffers hold, per key/value head, one range of slots per run reading that head (a run's
range starts at the same slot on each of its heads), each as long as the largest run's capacity
plus one scratch slot, so a step's visibility mask is one broadcast comparison: keys as
``(B, Hkv, D, S)``, values as ``(B, Hkv, S, D)``, the layouts the two products read fastest.

Non-finite values (docs/spec.md, section 4): every output the exact math makes NaN is NaN, and a
token's value never reaches a run that does not select it (the scratch slot receives 0). As in a
fused kernel, whose masked keys' values meet a zero probability, a NaN or infinite value can make
NaN the outputs of the runs that selected it for the rest of its segment and in their next
segment until its slot is overwritten; never another row, and never the next sequence
(:meth:`DilatedKVCache.reset` zeroes the buffers).

A key window ``(left, right)`` (docs/spec.md, section 5; ``window=``) hides from the one-token
step every slot more than ``left`` positions before the query (one more comparison in the same
mask; its right bound hides nothing a cache holds: no key lies after the newest query), and a
step of several tokens passes it on, in a run's compacted sequence dilated by the run's rate.
The buffers keep their size: a slot the window hides still holds its key until overwritten (a
cache bounded by the window instead of the pattern, for a long segment under a short window,
is not built yet).

A step of several tokens (a prompt, chunked prefill) is planned on the host: the first call
attends the prompt with :func:`ringdilated.dilated_attention`'s machinery, with the real pattern
(and ``key_padding_mask``, read once); a later one reads the rows' positions and attends, per
run, its new selected tokens over the cached ones as a query suffix in the compacted sequence of
selected positions (the selected positions of a pattern, in order, are a sequence in which every
segment holds ``ceil((w - o) / r)`` positions, so a run is one rate-1 call on any kernel;
``longnet`` runs are merged by their log-sum-exp). Either then writes the last segment's selected
keys into the buffers.

**Rows of different lengths.** A padded prompt (the first call's ``key_padding_mask``) puts each
row's valid tokens at positions ``0..n_b - 1``; every later call gives each row its next tokens,
at its own positions. Ownership, dropout and autograd: see :class:`DilatedKVCache`.

Call flow::

    cache = DilatedKVCache([2048, 4096], [1, 2], num_heads=8, causal=True)
    out = cache.attend(q, k, v, key_padding_mask=mask)  # prefill: (B, m, H, D), padded rows
    out = cache.attend(q1, k1, v1)  # one token per row, each at its own position
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from ringdilated.core import DilationPattern, HeadRun, Kernel, Mode, accumulation_dtype
from ringdilated.core.call import as_softcap, check_options, check_sinks, check_window
from ringdilated.core.plan import check_readable, read_padding, split_by_kv
from ringdilated.core.run import effective_scale, merge_sinks
from ringdilated.functional import attend
from ringdilated.registry import default_resolver

__all__ = ["DilatedKVCache"]

_NEVER = 2**62
"""The in-segment position from which a query head sees a slot it never sees."""


@attrs.frozen
class _Run:
    """Query heads ``heads`` under pattern ``index`` at ``offset`` (segment ``w``, rate ``r``);
    its slots are ``[start, start + capacity)`` on each of its key/value heads."""

    index: int
    heads: HeadRun
    w: int
    r: int
    offset: int
    start: int

    @property
    def capacity(self) -> int:
        """Selected positions in a full segment: the run's slots, and its compacted segment."""
        return -(-(self.w - self.offset) // self.r)

    def held(self, position: int) -> int:
        """Selected positions before ``position`` in its segment: the slots a step starting at
        ``position`` finds filled (slots ``0 .. held - 1``)."""
        return max(0, -(-(position % self.w - self.offset) // self.r))

    def selected(self, start: int, stop: int) -> list[int]:
        """The selected positions in ``[start, stop)``, in order (O(selected), not O(stop))."""
        positions: list[int] = []
        for segment in range(start // self.w, -(-stop // self.w)):  # the segments it meets
            base = segment * self.w + self.offset
            p = base + max(0, -(-(start - base) // self.r)) * self.r
            positions.extend(range(p, min(stop, (segment + 1) * self.w), self.r))
        return positions


def _runs(
    pattern: DilationPattern, num_heads: int, num_kv_heads: int
) -> tuple[tuple[_Run, ...], int, int]:
    """Every run of heads sharing a pattern and an offset (split where a key/value head
    begins), each in the first of the ``entries`` ranges of ``span`` slots free on all of its
    key/value heads: ``(runs, entries, span)``, the buffers' layout of the module docstring."""
    group = num_heads // num_kv_heads
    placed: list[tuple[_Run, int]] = []  # each run at slot 0, and its entry
    taken = [0] * num_kv_heads
    for index, offset, first, stop in pattern.head_offsets(num_heads):
        w, r = pattern.segment_lengths[index], pattern.dilation_rates[index]
        for heads in split_by_kv(first, stop, group):
            kv = range(heads.kv_start, heads.kv_stop)
            entry = max(taken[h] for h in kv)
            for h in kv:
                taken[h] = entry + 1
            placed.append((_Run(index, heads, w, r, offset, 0), entry))
    span = max(run.capacity for run, _ in placed) + 1
    runs = tuple(attrs.evolve(run, start=entry * span) for run, entry in placed)
    return runs, max(taken), span


@attrs.frozen
class _Tables:
    """What a one-token step reads besides the buffers, made once at allocation (device).

    Per key/value head and entry (a range of ``span`` slots, ``(Hkv, E)``): the run's ``w``,
    ``r``, ``offset``, first slot and scratch slot (an unused entry selects nothing).
    ``first`` ``(Hkv, H / Hkv, E, span)``: for query head ``(kv head, j)`` and slot ``i``
    of an entry, ``offset + i * r``, the in-segment position from which the query sees the slot,
    when the query head belongs to the entry's run, else never (the scratch slot: never).
    ``member`` ``(Hkv, H / Hkv, E)``: whether a query head belongs to an entry's run; ``None``
    when every query head has a run of rate 1 (it then sees a key at every position)."""

    w: torch.Tensor
    r: torch.Tensor
    offset: torch.Tensor
    start: torch.Tensor
    scratch: torch.Tensor
    first: torch.Tensor
    member: torch.Tensor | None


def _tables(
    runs: tuple[_Run, ...],
    num_heads: int,
    num_kv_heads: int,
    entries: int,
    span: int,
    device: torch.device,
) -> _Tables:
    group = num_heads // num_kv_heads
    shape = (num_kv_heads, entries)
    w, r, offset = (torch.ones(shape, dtype=torch.int64) for _ in range(3))
    start = (span * torch.arange(entries)).expand(shape).clone()
    first = torch.full((num_kv_heads, group, entries, span), _NEVER, dtype=torch.int64)
    member = torch.zeros((num_kv_heads, group, entries), dtype=torch.bool)
    always = torch.zeros(num_heads, dtype=torch.bool)
    for run in runs:
        e = run.start // span
        for h in range(run.heads.kv_start, run.heads.kv_stop):
            w[h, e], r[h, e], offset[h, e] = run.w, run.r, run.offset
        for head in range(run.heads.q_start, run.heads.q_stop):
            kv, j = head // group, head % group
            first[kv, j, e, : run.capacity] = run.offset + run.r * torch.arange(run.capacity)
            member[kv, j, e] = True
            always[head] |= run.r == 1
    w, r, offset, start, scratch, first = (
        t.to(device) for t in (w, r, offset, start, start + span - 1, first)
    )
    member_on = None if bool(always.all()) else member.to(device)
    return _Tables(w, r, offset, start, scratch, first, member_on)


def _named(module: object) -> str:
    """A module in an error: its class and address (to search ``named_modules()`` for)."""
    return f"{type(module).__name__} at {id(module):#x}"


def _shown(value: object) -> str:
    """A field's value in an error: dtypes and devices as torch prints them, the rest repr."""
    return str(value) if isinstance(value, (torch.dtype, torch.device)) else repr(value)


class DilatedKVCache:
    """Keys and values that future queries can still see, in buffers of fixed size.

    ``attend(q, k, v)`` takes each row's next ``m`` tokens (``q`` ``(B, m, H, D)``, ``k``, ``v``
    ``(B, m, Hkv, D)``), adds their keys and values, and returns their attention over everything
    the cache has seen in that row: exactly the last ``m`` rows of
    :func:`ringdilated.dilated_attention` over that row's whole sequence so far (with
    ``causal=False``, each step's queries see the keys of their segment up to the step's last
    position, as a query suffix does). Prefill is one call with the prompt (``key_padding_mask``
    for rows of different lengths); decoding, one call per token, which runs on the device alone
    (see the module docstring).

    The batch, heads, head dim, dtype and device are fixed by the first call, which allocates
    the buffers; :meth:`reset` starts every row over at position 0 and keeps them (a call of
    another batch, head dim, dtype or device after a reset allocates new ones).

    ``softcap``: the logit cap of :func:`ringdilated.dilated_attention` (``None``: none), applied
    to every score of every step (the one-token step caps its scores on the device).
    ``window``: the key window ``(left, right)`` of the module it serves (checked as
    :func:`ringdilated.dilated_attention` checks it, and kept with ``causal`` applied).

    ``kernel`` (``"auto"``, a known kernel's name or a Kernel) is checked on construction; it
    serves the steps of several tokens, whose results do not depend on it (up to the tolerance
    rule), so a module does not compare it (:meth:`bind`).

    **No dropout.** :meth:`attend` drops no attention probability, in any mode; a module in
    training mode with ``dropout > 0`` refuses a cache rather than silently decode without it
    (call ``.eval()`` for decoding).

    **Decoding is inference: run it under** ``torch.no_grad()`` **or**
    ``torch.inference_mode()``. Under autograd (``k`` or ``v`` requiring grad, as a module's
    projections give with grad enabled) every write into the buffers is recorded on them: a step
    is differentiable exactly (gradients reach every earlier token still held) until the next
    step writes the buffers in place (a backward through an older step then raises), and the
    buffers hold the graph of every step since construction or :meth:`reset`, each step's keys
    and values with everything they were computed from: **memory grows with every token**.
    :meth:`reset` drops that graph (the buffers are detached, their storage kept).

    **Its module** (:attr:`owner`, see :meth:`bind`) **survives** ``copy.deepcopy``: a copy
    made in the same ``deepcopy`` as its module, after it (``copy.deepcopy((model, caches))``,
    or a model holding its caches), belongs to the module's copy; any other copy (``deepcopy(
    cache)``, to branch a decode) belongs to the same module as the original, so copies swapped
    between layers are refused as the originals are. (Copied before its module, as in
    ``deepcopy((caches, model))``, a cache keeps the original module and the copied model
    refuses it: copy the model first.) **Pickling drops it**: a cache saved with
    ``torch.save`` (a weak reference to a module is not saved) loads belonging to no module,
    and then belongs to the first module it is passed to.
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
        window: tuple[int | None, int | None] | None = None,
        scale: float | None = None,
        kernel: str | Kernel = "auto",
        softcap: float | None = None,
    ) -> None:
        self.pattern = DilationPattern(segment_lengths, dilation_rates, mode)
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("num_heads", num_heads), ("num_kv_heads", kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        self.pattern.check_heads(num_heads, kv_heads)
        check_options(scale, 0.0)
        default_resolver().check_kernel_name(kernel)
        self._key_window = check_window(window, causal)
        self.causal: bool = causal
        self.window = None if window is None else (self._key_window.left, self._key_window.right)
        self.scale = scale
        self.softcap = as_softcap(softcap)
        self.kernel = kernel
        self.num_heads, self.num_kv_heads = num_heads, kv_heads
        self._runs, self._entries, self._span = _runs(self.pattern, num_heads, kv_heads)
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._tables: _Tables | None = None
        self._step_shapes: tuple[torch.Size, torch.Size] | None = None
        self._dtype: torch.dtype | None = None
        self._device: torch.device | None = None
        self._work = torch.float32  # the one-token step's arithmetic (float64 for float64)
        self._scale = 1.0
        self._started = False  # a prompt was attended since construction or reset()
        self._owner: weakref.ReferenceType[object] | None = None  # see bind()
        self._owner_name = ""

    @property
    def lengths(self) -> tuple[int, ...]:
        """Each row's tokens so far (its next position; ``()`` before the first call). Reads
        :attr:`positions` on the host: for bookkeeping, not for the decoding loop."""
        if not self._started or self._positions is None:
            return ()
        return tuple(int(p) for p in self._positions.tolist())

    @property
    def length(self) -> int:
        """The longest row's tokens so far (every row's, without padding); 0 before the first
        call. Reads :attr:`positions` on the host, as :attr:`lengths` does."""
        return max(self.lengths, default=0)

    @property
    def positions(self) -> torch.Tensor | None:
        """Each row's next position, ``(B,)`` int64 on the device (``None`` before the first
        call). The cache advances it in place every step; do not write to it."""
        return self._positions

    @property
    def capacity(self) -> int:
        """Key positions the cache can hold, summed over the runs of heads: one segment's
        selected positions per run (``ceil((w - offset) / r)``)."""
        return sum(run.capacity for run in self._runs)

    @property
    def cached_positions(self) -> int:
        """Key positions a future query can still see, summed over the runs of heads (each run
        holds its own), in the row that holds the most."""
        return max((sum(run.held(p) for run in self._runs) for p in self.lengths), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers, fixed from the first call (their layout: see the
        module docstring)."""
        buffers = [t for t in (self._keys, self._values) if t is not None]
        return sum(t.untyped_storage().nbytes() for t in buffers)

    def reset(self) -> None:
        """Start every row over at position 0. The buffers' storage is kept, zeroed in place (no
        NaN or infinity of the last sequence reaches the next) and detached, which releases the
        autograd graph recorded on them. The cache's module (:attr:`owner`) stays."""
        if self._keys is not None and self._values is not None:
            self._keys = self._keys.detach().zero_()
            self._values = self._values.detach().zero_()
        if self._positions is not None:
            self._positions.zero_()
        self._started = False

    def __getstate__(self) -> dict[str, object]:
        """Pickling keeps everything but the owner, a weak reference (see the class docstring;
        ``copy.copy`` and ``copy.deepcopy`` keep it)."""
        return {**self.__dict__, "_owner": None, "_owner_name": ""}

    def __copy__(self) -> DilatedKVCache:
        """A shallow copy shares this cache's buffers, so it keeps its owner too: only the same
        module may write into them (through either object)."""
        copied = type(self).__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __deepcopy__(self, memo: dict[int, Any]) -> DilatedKVCache:
        """A copy of every buffer, owned by the owner's copy when ``memo`` holds one, else by
        the same owner (see the class docstring): never by the first module it reaches."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in self.__getstate__().items():
            setattr(copied, name, copy.deepcopy(value, memo))
        owner = self.owner
        twin = None if owner is None else memo.get(id(owner))
        if twin is not None:
            copied._owner, copied._owner_name = weakref.ref(twin), _named(twin)
        else:  # the same module (or the same one that no longer exists)
            copied._owner, copied._owner_name = self._owner, self._owner_name
        return copied

    @property
    def owner(self) -> object | None:
        """The module this cache serves (see :meth:`bind`): ``None`` before one made it or used
        it, or once that module no longer exists."""
        return None if self._owner is None else self._owner()

    def bind(
        self,
        module: object,
        *,
        pattern: DilationPattern,
        causal: bool,
        scale: float | None,
        window: tuple[int | None, int | None] | None = None,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype | None,
        softcap: float | None = None,
    ) -> None:
        """Make this cache ``module``'s, or raise ``ValueError`` naming every field in which it
        does not fit ``module`` (both values) and the module that owns it.

        It fits when its pattern (``segment_lengths``, ``dilation_rates``, ``mode``),
        ``causal``, key ``window`` (as :func:`~ringdilated.core.call.validation.check_window`
        reads it with ``causal``), ``softcap``, effective scale
        (:func:`~ringdilated.core.run.local.effective_scale`) and head counts are the module's;
        when, holding a sequence, that sequence's head dim, device and
        (unless ``dtype`` is ``None``: not known before the projections, as under autocast)
        dtype are the module's; and when it belongs to no module or to ``module``. A cache
        belongs to the first module bound to it for its whole life (``make_cache()`` binds
        the cache it makes; :meth:`reset` keeps the owner): a cache of identical configuration
        used by another module holds that module's keys and values (per-layer caches swapped),
        and one whose module no longer exists holds a deleted module's. Changes nothing when it
        raises. The modules call it before any work; a direct :meth:`attend` needs no owner."""
        p, given = self.pattern, pattern
        made: list[tuple[str, object, object]] = [
            ("segment_lengths", p.segment_lengths, given.segment_lengths),
            ("dilation_rates", p.dilation_rates, given.dilation_rates),
            ("mode", p.mode, given.mode),
            ("causal", self.causal, causal),
            ("softcap", self.softcap, softcap),
            ("window", self.window, window if window is None else tuple(window)),
            ("scale", effective_scale(self.scale, head_dim), effective_scale(scale, head_dim)),
            ("num_heads", self.num_heads, num_heads),
            ("num_kv_heads", self.num_kv_heads, num_kv_heads),
        ]  # fmt: skip
        holds: list[tuple[str, object, object]] = []
        if self._started and self._values is not None:
            held = self._values
            holds += [("head_dim", held.shape[3], head_dim), ("device", held.device, device)]
            if dtype is not None:
                holds.append(("dtype", held.dtype, dtype))
        problems = []
        for fields, rule in (
            (made, "a cache serves only a module of its pattern, mode, causality, window, softcap, "
                   "scale "
                   "and head counts: make it with the module's make_cache()"),
            (holds, "the sequence it holds must be in the module's head dim, device and dtype: "
                    "reset() it to start another"),
        ):  # fmt: skip
            differ = [f"{name}: the cache's {_shown(a)}, the module's {_shown(b)}"
                      for name, a, b in fields if a != b]  # fmt: skip
            if differ:
                problems.append("; ".join(differ) + f" ({rule})")
        named = _named(module)
        owner = self.owner
        if self._owner is not None and owner is not module:
            whose = (
                f"another module, {self._owner_name} (per-layer caches swapped? [name for name, "
                f"m in model.named_modules() if id(m) == {id(owner):#x}] names it)"
                if owner is not None
                else f"a module that no longer exists, {self._owner_name}"
            )
            problems.append(
                f"it belongs to {whose}, and a cache serves one module for its life: the one "
                "whose make_cache() made it, or else the first one it was passed to (make one "
                "per module)"
            )
        if problems:
            raise ValueError(f"this DilatedKVCache does not fit {named}: " + "; ".join(problems))
        if self._owner is None:
            self._owner, self._owner_name = weakref.ref(module), named

    def rotary_positions(
        self, tokens: int, device: torch.device, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Positions of the next ``tokens`` of each row, ``(B or 1, tokens)`` int64 on
        ``device``, for rotary embeddings: counted from each row's start (with a first call's
        ``key_padding_mask``, from each row's first valid token; a padded position gets 0 before
        the valid run and the last valid position after it: padding is nobody's key, so its
        angle does not matter). Computed on the device."""
        if key_padding_mask is not None:
            mask = key_padding_mask
            if mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[1] != tokens:
                raise ValueError(
                    f"key_padding_mask must be a (batch, {tokens}) bool tensor (True = padding) "
                    f"for {tokens} new tokens, got {mask.dtype} of shape {tuple(mask.shape)}"
                )
            check_readable("key_padding_mask", mask)  # a meta mask: named, not torch's error
            return (mask.logical_not().cumsum(1) - 1).clamp_min(0).to(device)
        if self._positions is None or not self._started:
            return torch.arange(tokens, device=device).unsqueeze(0)
        if tokens == 1:
            return self._positions.unsqueeze(1).clone()
        return self._positions.unsqueeze(1) + torch.arange(tokens, device=device)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_lse: bool = False,
        *,
        key_padding_mask: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Add each row's next ``m`` tokens' keys and values and attend their queries: ``out``
        ``(B, m, H, D)`` (and ``lse`` ``(B, H, m)`` float32 with ``return_lse``).

        ``key_padding_mask`` ``(B, m)`` bool (``True`` = padding, one contiguous valid run per
        row), on the first call after construction or :meth:`reset` only: each row's prompt is
        its valid tokens; padded positions give ``out = 0`` and ``lse = -inf``, with or without
        sinks (padding is no query).

        ``sinks``: attention sinks ``(H,)``, :func:`ringdilated.dilated_attention`'s, checked as
        it checks them (metadata only: a one-token step still reads nothing on the host) and
        merged into every step's results once, in the accumulation dtype; differentiable."""
        shapes = self._step_shapes
        if (
            shapes is not None
            and key_padding_mask is None
            and q.shape == shapes[0]
            and k.shape == shapes[1]
            and v.shape == shapes[1]
            and self._started
            and q.dtype == k.dtype == v.dtype == self._dtype
            and q.device == k.device == v.device == self._device
        ):
            check_sinks(sinks, q)
            out, lse = self._step(q, k, v, return_lse or sinks is not None)  # the steady state
        else:
            self._check(q, k, v, key_padding_mask)
            check_sinks(sinks, q)
            if q.shape[1] == 1 and key_padding_mask is None and self._started:
                out, lse = self._step(q, k, v, return_lse or sinks is not None)
            elif not self._started:  # a call of the library's: it merges the sinks itself
                out, lse = self._prefill(q, k, v, key_padding_mask, sinks)
                sinks = None
            else:
                out, lse = self._chunk(q, k, v)
        if sinks is not None:
            assert lse is not None
            out, lse = merge_sinks(out, lse, sinks)
        if return_lse:
            assert lse is not None
            return out, lse.float()
        return out

    # -- the one-token step, on the device ------------------------------------------------------

    def _step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        keys, values, positions, t = self._keys, self._values, self._positions, self._tables
        assert keys is not None and values is not None and positions is not None and t is not None
        batch, _, heads, dim = q.shape
        kv_heads, width = t.w.shape
        group = heads // kv_heads
        # Where each run reading a key/value head puts the token, and up to which in-segment
        # position it sees its slots (-1: the run does not select this position).
        inside = positions.view(batch, 1, 1) % t.w
        selects = inside % t.r == t.offset
        slot = torch.where(selects, t.start + inside // t.r, t.scratch)
        seen_to = torch.where(selects, inside, -1)
        # Write first (the token sees itself); a step that raises later leaves only its own
        # slot written, which no query sees before this position is written again.
        keys.scatter_(
            3,
            slot.unsqueeze(2).expand(batch, kv_heads, dim, width),
            k.reshape(batch, kv_heads, dim, 1).expand(-1, -1, -1, width),
        )
        # A value goes to the scratch slot as 0: an unselected token's NaN or infinity must not
        # meet a zero probability there (0 * NaN is NaN).
        values.scatter_(
            2,
            slot.unsqueeze(3).expand(batch, kv_heads, width, dim),
            torch.where(selects.unsqueeze(3), v.reshape(batch, kv_heads, 1, dim), 0.0),
        )
        reach = seen_to.view(batch, kv_heads, 1, width, 1)
        hidden = t.first > reach
        left = self._key_window.left
        if left is not None:  # a sliding window: slots more than ``left`` positions back too
            hidden |= t.first < reach - left
        hidden = hidden.view(batch, kv_heads, group, width * self._span)
        work = self._work
        query = q.reshape(batch, kv_heads, group, dim).to(work) * self._scale
        scores = torch.matmul(query, keys.to(work))
        if self.softcap is not None:  # docs/spec.md, section 5: before the mask and softmax
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, -1)
        out = torch.matmul(probs, values.to(work))
        # A head that sees no key (none of its runs selects the position; none has a run of rate
        # 1) has a row of -inf scores, whose softmax is NaN: its output is 0 and its lse -inf.
        seen = None
        if t.member is not None:
            seen = (selects.unsqueeze(2) & t.member).any(-1, keepdim=True)
            out = torch.where(seen, out, 0.0)
        lse = None
        if return_lse:  # max + log(1 / the top probability): no exp of the masked scores
            lse = scores.amax(-1, keepdim=True) - probs.amax(-1, keepdim=True).log()
            if seen is not None:
                lse = torch.where(seen, lse, float("-inf"))
            lse = lse.view(batch, heads, 1)  # in the step's arithmetic (float64 for float64)
        positions.add_(1)
        return out.to(q.dtype).view(batch, 1, heads, dim), lse

    # -- steps of several tokens, planned on the host ------------------------------------------

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first call: the prompt attended with the real pattern (and ``sinks``), then its
        last segments written into the buffers."""
        batch, m = q.shape[:2]
        self._allocate(k)
        assert self._positions is not None
        out, lse, _ = attend(
            self.pattern,
            q,
            k,
            v,
            causal=self.causal,
            window=self.window,
            scale=self.scale,
            dropout_p=0.0,
            kernel=self.kernel,
            key_padding_mask=key_padding_mask,
            return_lse=True,  # read (and differentiable): the caller may ask for it
            softcap=self.softcap,
            sinks=sinks,
        )
        if key_padding_mask is None:
            prompts = [(b, 0, 0, m) for b in range(batch)]
        else:  # one read of the mask, here only
            prompts = []
            for rows in read_padding(key_padding_mask, batch, m):
                start, stop = rows.documents[0] if rows.documents else (0, 0)
                prompts.extend((b, 0, start, stop - start) for b in range(rows.start, rows.stop))
        self._write(k, v, prompts)
        self._positions.copy_(torch.tensor([n for _, _, _, n in prompts], dtype=torch.int64))
        self._started = True
        return out, lse

    def _chunk(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A later step of several tokens (see the module docstring), rows at one position
        together; the buffers are written once every run succeeded (a step that raises leaves
        the cache as it was)."""
        batch, m, heads, dim = q.shape
        assert self._positions is not None
        lengths = self.lengths
        groups: dict[int, list[int]] = {}
        for b, position in enumerate(lengths):
            groups.setdefault(position, []).append(b)
        if len(groups) == 1:
            out, lse = self._chunk_rows(q, k, v, lengths[0], slice(None))
        else:
            out = q.new_zeros(batch, m, heads, dim)
            acc = accumulation_dtype(q.dtype)
            lse = q.new_full((batch, heads, m), float("-inf"), dtype=acc)
            for position, members in groups.items():
                rows = torch.tensor(members, device=q.device)
                out[rows], lse[rows] = self._chunk_rows(q[rows], k[rows], v[rows], position, rows)
        self._write(k, v, [(b, p, 0, m) for b, p in enumerate(lengths)])
        self._positions.add_(m)
        return out, lse

    def _chunk_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start: int,
        rows: slice | torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``rows`` of the buffers, all at position ``start``: their next tokens' attention
        (``lse`` in the accumulation dtype)."""
        assert self._keys is not None and self._values is not None
        batch, m, heads, dim = q.shape
        acc = accumulation_dtype(q.dtype)
        lse = q.new_full((batch, heads, m), float("-inf"), dtype=acc)
        parts: list[tuple[_Run, list[int], torch.Tensor, torch.Tensor]] = []
        for run in self._runs:
            new = [p - start for p in run.selected(start, start + m)]  # columns of q, k, v
            if not new:
                continue
            at = torch.tensor(new, dtype=torch.long, device=q.device)
            h, kv = run.heads, slice(run.heads.kv_start, run.heads.kv_stop)
            held = slice(run.start, run.start + run.held(start))
            new_k, new_v = (x[:, :, kv].index_select(1, at) for x in (k, v))
            keys = torch.cat([self._keys[rows, kv, :, held].permute(0, 3, 1, 2), new_k], 1)
            values = torch.cat([self._values[rows, kv, held].transpose(1, 2), new_v], 1)
            queries = q[:, :, h.q_start : h.q_stop].index_select(1, at)
            run_out, run_lse, _ = attend(
                ((run.capacity,), (1,), "head_groups"),
                queries,
                keys,
                values,
                causal=self.causal,
                window=self._compacted_window(run.r),
                scale=effective_scale(self.scale, dim),
                dropout_p=0.0,
                kernel=self.kernel,
                return_lse=True,  # read, and differentiated through the merge below
                full_precision_lse=True,  # longnet merges it further
                softcap=self.softcap,
            )
            parts.append((run, new, run_out, run_lse))
        if self.pattern.mode == "longnet":
            return self._merge(parts, q, lse)
        out = q.new_zeros(batch, m, heads, dim)
        for run, columns, run_out, run_lse in parts:
            h = run.heads
            out[:, columns, h.q_start : h.q_stop] = run_out
            lse[:, h.q_start : h.q_stop, columns] = run_lse.to(acc)
        return out, lse

    def _compacted_window(self, rate: int) -> tuple[int | None, int | None] | None:
        """The key window in a run's compacted sequence of selected positions (stride ``rate``,
        queries and keys on one grid): :meth:`~ringdilated.core.plan.window.KeyWindow.dilated`."""
        if self.window is None:
            return None
        keys = self._key_window.dilated(rate)
        return keys.left, keys.right

    @staticmethod
    def _merge(
        parts: list[tuple[_Run, list[int], torch.Tensor, torch.Tensor]],
        q: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``longnet``: every head's runs merged by their log-sum-exp (in accumulation_dtype)."""
        batch, m, heads, dim = q.shape
        acc = accumulation_dtype(q.dtype)
        state = torch.full((len(parts), batch, heads, m), float("-inf"), dtype=acc, device=q.device)
        outs = q.new_zeros((len(parts), batch, m, heads, dim), dtype=acc)
        for j, (run, at, run_out, run_lse) in enumerate(parts):
            h = run.heads
            state[j, :, h.q_start : h.q_stop, at] = run_lse.to(acc)
            outs[j, :, at, h.q_start : h.q_stop] = run_out.to(acc)
        total = torch.logsumexp(state, 0)
        seen = torch.isneginf(total).logical_not()  # NaN and +inf stay: never "no key"
        weights = torch.where(seen, torch.exp(state - total.masked_fill(~seen, 0)), 0.0)
        merged = (outs * weights.permute(0, 1, 3, 2).unsqueeze(-1)).sum(0)
        return merged.to(q.dtype), total.where(seen, lse)

    def _write(
        self, k: torch.Tensor, v: torch.Tensor, rows: list[tuple[int, int, int, int]]
    ) -> None:
        """For each ``(row, position, column, count)``: the row's tokens at columns
        ``[column, column + count)`` hold positions ``[position, position + count)``; write the
        selected ones of the segment the row's next position lies in into their slots."""
        assert self._keys is not None and self._values is not None
        device = k.device
        for run in self._runs:
            batch_index, columns, slots = [], [], []
            for b, position, column, count in rows:
                stop = position + count
                for p in run.selected(max(position, stop - stop % run.w), stop):
                    batch_index.append(b)
                    columns.append(column + p - position)
                    slots.append(run.start + p % run.w // run.r)
            if not batch_index:
                continue
            at_b, at_c, at_s = (
                torch.tensor(x, dtype=torch.long, device=device).unsqueeze(1)
                for x in (batch_index, columns, slots)
            )
            kv = torch.arange(run.heads.kv_start, run.heads.kv_stop, device=device)
            self._keys.transpose(2, 3).index_put_((at_b, kv, at_s), k[at_b, at_c, kv])
            self._values.index_put_((at_b, kv, at_s), v[at_b, at_c, kv])

    # -- allocation and checks -------------------------------------------------------------------

    def _fits(self, k: torch.Tensor) -> bool:
        """Whether buffers are held, in ``k``'s batch, head dim, dtype and device."""
        held = self._values
        return (
            held is not None
            and held.shape[0] == k.shape[0]
            and held.shape[3] == k.shape[3]
            and held.dtype == k.dtype
            and held.device == k.device
        )

    def _allocate(self, k: torch.Tensor) -> None:
        """The buffers and tables, unless the ones held fit ``k`` (:meth:`_fits`)."""
        batch, _, kv_heads, dim = k.shape
        if self._fits(k):
            assert self._positions is not None
            self._positions.zero_()
            return
        self._tables = _tables(
            self._runs, self.num_heads, self.num_kv_heads, self._entries, self._span, k.device
        )
        slots = self._entries * self._span
        # Zeros, not empty: an unwritten slot's value meets probability 0, and 0 * NaN is NaN.
        self._keys = torch.zeros((batch, kv_heads, dim, slots), dtype=k.dtype, device=k.device)
        self._values = torch.zeros((batch, kv_heads, slots, dim), dtype=k.dtype, device=k.device)
        self._positions = torch.zeros(batch, dtype=torch.int64, device=k.device)
        self._dtype, self._device = k.dtype, k.device
        self._work = accumulation_dtype(k.dtype)
        self._scale = effective_scale(self.scale, dim)
        self._step_shapes = (
            torch.Size((batch, 1, self.num_heads, dim)),
            torch.Size((batch, 1, kv_heads, dim)),
        )

    def _check(
        self, q: object, k: object, v: object, key_padding_mask: torch.Tensor | None
    ) -> None:
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
        if q.shape[1] < 1:
            raise ValueError(f"a step must add at least one token, got q {tuple(q.shape)}")
        held = self._values
        if self._started and held is not None and not self._fits(k):
            raise ValueError(
                f"this cache holds batch {held.shape[0]}, head dim {held.shape[3]}, "
                f"{held.dtype} on {held.device}; got k {tuple(k.shape)} {k.dtype} on "
                f"{k.device} (call reset() to start another sequence)"
            )
        if key_padding_mask is not None and self._started:
            lengths = self.lengths
            shown = ", ".join(map(str, lengths[:4])) + (", ..." if len(lengths) > 4 else "")
            raise ValueError(
                "key_padding_mask is taken by the first call only (the prompt; afterwards every "
                f"row gets its next tokens at its own position), but the rows are at "
                f"positions ({shown}): pass key_padding_mask=None, or reset() first"
            )
