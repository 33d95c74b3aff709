"""The kernel interface: the one contract every attention backend implements.

A kernel solves a batch of independent softmax-attention problems and returns the log-sum-exp
with the output, so partial results can be merged exactly
(:mod:`ringdilated.core.contract.accumulator`).
Its backward takes the **final, merged** ``out`` and ``lse`` of each query, not the kernel's own
partial ones: with ``P = exp(scale * q k^T - lse_final)`` and ``D = rowsum(dout * out_final)``
each block's gradient is its exact share of the full gradient. That one rule lets any kernel
serve a ring or a pattern mix with exact gradients.

Shapes (kernel layout, ``N`` independent problems)::

    q:   (N, Hq, Lq, D)        k, v: (N, Hkv, Lk, D)     Hkv divides Hq; query head h reads
    out: (N, Hq, Lq, D) q.dtype                           key/value head h // (Hq // Hkv)
    lse: (N, Hq, Lq) float32 (float64 for float64 inputs), -inf where a query sees no key

Inputs may be strided views (the driver passes dilated selections without copying); the last
dimension is contiguous. A kernel never modifies its inputs.

Optional: the lse's gradient in the same call (:class:`LseGradientKernel`). When the caller
differentiates through the lse (``dilated_attention(..., return_lse=True)``), each block also
owes the gradient of ``sum(dlse * lse)``, ``dlse`` shaped like ``lse``. ``d lse_i / d s_ij =
P_ij``, so it adds ``dlse_i * P_ij`` to ``dS``: the backward's ``D`` becomes ``D - dlse``. A
kernel whose op takes that term (FlashAttention 4's ``dlse=``) implements
``backward_with_lse(dout, dlse, q, k, v, out, lse, options)``, returning ``(dq, dk, dv)`` of
``sum(dout * out) + sum(dlse * lse)`` under every rule of ``backward`` (``dlse`` is one more
input of its problem, in the non-finite rule; the lse does not depend on dropout, so only the
``out`` term goes through a dropout mask). Where the kernel has it, the driver calls it instead
of ``backward`` for each kernel call (a block, a row chunk, a piece) whose lse has a gradient;
for any other kernel it makes a second ``backward`` call that gives the same gradient
(:func:`ringdilated.core.contract.lse.lse_gradient`). The method is found by its name: a
subclass that overrides ``backward`` of a kernel that has it must override it too. The plain
:class:`Kernel` is unchanged.

Non-finite inputs (docs/spec.md, section 4). A *problem* is one ``n`` and one key/value head
``g`` with the query heads that read it; its inputs are ``q[n, heads of g]``, ``k[n, g]``,
``v[n, g]`` (and in backward ``dout[n, heads of g]`` and the ``lse`` handed in). A kernel must:

- never turn NaN or infinity into finite numbers: every entry of ``out``, ``lse`` (and ``dq``,
  ``dk``, ``dv``) that exact dense attention over the visible keys makes non-finite is
  non-finite (NaN will do). A NaN query or visible key makes its rows NaN;
- keep every other entry exact, except that it may be NaN when its problem holds a non-finite
  input: in forward, the query row itself or any ``k``/``v`` of the problem (a hidden key's
  value multiplied by a zero weight, ``0 * inf``, as fused kernels and dense attention do); in
  backward, any input of the problem. NaN never crosses from one problem to another;
- keep rows that see no key at ``out = 0``, ``lse = -inf``;
- find all this out on the device: never read a tensor's values on the host (no ``.item()``,
  ``bool(tensor)``, ``.tolist()``, ``nonzero``), so a call stays asynchronous on a GPU.

Fused kernels get most of this for free (``0 * inf`` is NaN in any matmul) but not all of it:
flash-style kernels treat a row whose scores are all ``-inf`` as fully masked and return zeros,
and PyTorch's CPU flash op returns zeros or finite gradients for some rows holding infinity.
:func:`mark_non_finite_rows` (forward) and :func:`mark_non_finite_problems` (backward) repair
any kernel's results in place with a few reductions over its inputs, no host read: the
conservative remedy the rule allows, which the built-in fused kernels apply (a kernel that knows
its op's failures may repair less: ``sdpa``'s CPU path, ``ringdilated.backends.sdpa``). The
conformance kit's ``non-finite`` and ``non-finite-gradients`` checks hold every kernel to the
rule.

:func:`all_finite` and :func:`inputs_finite` read the host: for code that wants a yes/no answer
off the hot path.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from typing import Protocol, runtime_checkable

import attrs
import torch

from ringdilated.core.contract import rules
from ringdilated.core.plan.window import FULL, KeyWindow

__all__ = [
    "BlockOptions",
    "Kernel",
    "LseGradientKernel",
    "all_finite",
    "check_dropout",
    "derive_seed",
    "finite_along",
    "inputs_finite",
    "mark_non_finite_problems",
    "mark_non_finite_rows",
]

_INF = float("inf")
_UNSET = object()


def derive_seed(seed: int, *path: int | str) -> int:
    """A seed for the part ``path`` of a call seeded with ``seed``: distinct parts get unrelated
    seeds in every bit. (Adding an offset is not enough: torch's CPU generator keeps only the low
    32 bits of a seed, so ``seed + (1 << 40)`` draws the same mask as ``seed``.) Exactly: ``seed``
    and the parts as text joined by commas, hashed with BLAKE2b to 8 bytes, read little-endian
    and shifted right by one (a non-negative int64), so masks can be reproduced elsewhere."""
    text = ",".join(map(str, (seed, *path))).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def check_dropout(value: float, given: object = None) -> None:
    """Raise ``ValueError`` unless ``0 <= value < 1``, naming ``given`` (what a caller passed,
    ``value`` being it as a float) or else ``value``: the one dropout-range rule."""
    if not 0.0 <= value < 1.0:
        shown = value if given is None else given
        raise ValueError(f"dropout_p must satisfy 0 <= dropout_p < 1, got {shown!r}")


def check_softcap(value: object, name: str = "softcap") -> None:
    """Raise unless ``value`` is ``None`` or a positive finite float (an int too, not a bool):
    the one softcap rule."""
    if value is None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):  # type: ignore[arg-type,operator]
        raise ValueError(f"{name} must be None or a positive finite number, got {value!r}")


def _check_softcap(_: object, __: object, value: float | None) -> None:
    check_softcap(value)


@attrs.frozen(init=False)
class BlockOptions:
    """Everything about one block besides its tensors.

    - ``scale``: multiplies ``q . k`` before the softmax.
    - ``window``: the keys each query sees, in the block's coordinates (both counted from the
      block's start; :class:`~ringdilated.core.plan.window.KeyWindow`): key ``j`` is visible to
      query ``i`` iff ``i - left <= j <= i + right``. :data:`~ringdilated.core.plan.window.FULL`
      (no mask) by default; ``right = 0`` is the usual causal diagonal block, and a block
      wholly below the diagonal never needs a mask and is passed with ``FULL``. ``left`` is
      bounded only for kernels declaring ``Capabilities.sliding_window`` (a call's window with
      a left bound); a block's bounds are any ints, so some of its rows may see no key, at the
      start (``right < 0``) or at the end (``left`` below the rows' reach,
      :meth:`~ringdilated.core.plan.window.KeyWindow.visible_rows`). Kernels check the left
      bound first when they build their masks (a kernel that reads only ``right`` would serve
      a sliding window wrongly).
    - ``dropout_p`` and ``dropout_seed``: attention probabilities are zeroed with probability
      ``dropout_p`` and the rest scaled by ``1 / (1 - dropout_p)``. The mask is a pure function of
      the seed and the block's shape and device, so backward regenerates the same mask.
    - ``finite``: deprecated, kept for one release for plugins that read it: always ``None``
      (unknown); a kernel meets the non-finite rule on the device (module docstring).
    - ``deterministic`` (keyword only): the call asks for bitwise-reproducible results (torch's
      switch, strict, :func:`~ringdilated.core.select.capabilities.deterministic_algorithms`,
      as the call's plan read it: ``Request.deterministic``). A kernel with a deterministic mode
      uses it when this is ``True`` (flash-attn's ``deterministic=True`` backward) and reads
      it here, not torch's switch: the driver sets it from the plan, so a block runs as its
      call was planned, backward included. ``False`` by default (a kernel called directly runs
      in its default mode unless asked). Kernels built on torch's own attention ops cannot
      pass it on: those ops read torch's switch themselves when they run.

    - ``softcap`` (keyword only): every score ``s = scale * q . k`` becomes
      ``softcap * tanh(s / softcap)`` before the softmax (docs/spec.md, section 5), gradients
      through it; ``None`` (the default) is no cap. A positive finite float; only kernels
      declaring ``Capabilities.softcap`` get one.

    ``causal_offset`` (0.1: ``window.right``, an int or ``None``) is accepted and read for one
    release with a ``DeprecationWarning``.
    """

    scale: float
    window: KeyWindow = FULL
    dropout_p: float = attrs.field(default=0.0, validator=lambda _, __, p: check_dropout(p))
    dropout_seed: int = 0
    finite: bool | None = None
    deterministic: bool = attrs.field(default=False, validator=rules.bools, kw_only=True)
    softcap: float | None = attrs.field(default=None, validator=_check_softcap, kw_only=True)

    def __init__(
        self,
        scale: float,
        window: KeyWindow | int | None = FULL,
        dropout_p: float = 0.0,
        dropout_seed: int = 0,
        finite: bool | None = None,
        *,
        deterministic: bool = False,
        softcap: float | None = None,
        causal_offset: object = _UNSET,
    ) -> None:
        if causal_offset is not _UNSET or not isinstance(window, KeyWindow):
            if causal_offset is not _UNSET and window != FULL:
                raise TypeError(f"BlockOptions got window={window!r} and causal_offset: pass one")
            _deprecated_offset()
            window = KeyWindow(None, window if causal_offset is _UNSET else causal_offset)
        self.__attrs_init__(
            scale,
            window,
            dropout_p,
            dropout_seed,
            finite,
            deterministic=deterministic,
            softcap=softcap,
        )

    @property
    def causal_offset(self) -> int | None:
        """Deprecated: ``window.right``."""
        _deprecated_offset()
        return self.window.right

    def visible_rows_start(self) -> int:
        """First query row that sees at least one key (rows before it are empty), for a window
        without a left bound (:meth:`visible_rows` answers for any)."""
        return self.window.visible_rows_start()

    def visible_rows(self, q_len: int, k_len: int) -> tuple[int, int]:
        """``(start, stop)``: the rows of a ``q_len x k_len`` block that see at least one key
        (:meth:`~ringdilated.core.plan.window.KeyWindow.visible_rows`)."""
        return self.window.visible_rows(q_len, k_len)

    def mark_empty_rows(
        self, out: torch.Tensor | None, lse: torch.Tensor, k_len: int | None = None
    ) -> None:
        """Give the rows that see no key the contract's ``lse = -inf`` (and ``out = 0`` when
        ``out`` is given), in place: for kernels whose op reports something else for them
        (``lse = 0``, or NaN). ``k_len``: the block's key count, which a window with a left
        bound needs (rows at the end may see no key; ``ValueError`` without it); without it
        (0.1's call) the empty rows are those before :meth:`visible_rows_start`."""
        q_len = lse.shape[-1]
        if k_len is not None:
            start, stop = self.window.visible_rows(q_len, k_len)
        elif self.window.left is None:
            start, stop = min(self.visible_rows_start(), q_len), q_len
        else:
            raise ValueError(
                f"mark_empty_rows needs k_len for {self.window!r}: with a left bound, rows at "
                "the end may see no key"
            )
        for first, count in ((0, start), (stop, q_len - stop)):
            if count > 0:
                lse.narrow(-1, first, count).fill_(float("-inf"))
                if out is not None:
                    out.narrow(-2, first, count).zero_()

    def needs_mask(self, q_len: int, k_len: int) -> bool:
        """Whether any key is hidden from any query of a ``q_len x k_len`` block."""
        return self.window.needs_mask(q_len, k_len)


def _deprecated_offset() -> None:
    warnings.warn(
        "BlockOptions.causal_offset is deprecated: use window=KeyWindow(None, offset) and "
        "window.right (ringdilated.core.KeyWindow)",
        DeprecationWarning,
        stacklevel=3,
    )


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether no element of ``tensors`` is NaN or infinite: one summing pass and **one host
    read** (a sum is non-finite whenever an element is; a sum of finite values that overflows
    answers ``False`` wrongly). Not for the hot path (:func:`finite_along` tests on the device)."""
    if not tensors:
        return True
    totals = [
        t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32) for t in tensors
    ]
    return bool(torch.isfinite(torch.stack(totals)).all())


def inputs_finite(options: BlockOptions, *tensors: torch.Tensor) -> bool:
    """``options.finite`` when set, else :func:`all_finite` of ``tensors`` (a host read).
    Deprecated with ``BlockOptions.finite``."""
    return options.finite if options.finite is not None else all_finite(*tensors)


def finite_along(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``x`` reduced over ``dims`` to booleans, on ``x``'s device: ``True`` where every element
    is finite. Two reductions, ``amax`` and ``amin`` (both propagate NaN; a NaN compares false),
    so it never reads the host and, unlike a sum, is never fooled by large finite values."""
    axes = {d % x.dim() for d in dims}
    if any(x.shape[d] == 0 for d in axes):
        shape = [n for i, n in enumerate(x.shape) if i not in axes]
        return torch.ones(shape, dtype=torch.bool, device=x.device)
    return (x.amax(dims) < _INF) & (x.amin(dims) > -_INF)


#: Below this many elements :func:`_poison` reduces ``x - x`` (fewest operations: tiny blocks
#: pay per operation); above it, ``amax`` and ``amin`` (two reads, no temporary). Measured on
#: CPU, the cross-over is between 1 and 4 million elements.
_SMALL = 1 << 21


def _poison(tensors: tuple[torch.Tensor, ...], dims: tuple[int, ...]) -> torch.Tensor:
    """``0`` where every element of every tensor (reduced over ``dims``; the tensors share the
    other dimensions) is finite, NaN where one is not. ``x - x`` is 0 for finite ``x`` and NaN
    for infinite or NaN ``x``, and a sum of zeros never overflows, so adding the result to an
    output leaves its finite values exact and makes the rest NaN. Large tensors go through
    ``amax`` and ``amin`` first (both propagate NaN; infinities survive them)."""
    total: torch.Tensor | None = None
    for x in tensors:
        if x.numel() <= _SMALL:
            part = (x - x).sum(dims)
        else:
            extremes = torch.stack((x.amax(dims), x.amin(dims)))
            part = extremes.sub_(extremes).sum(0)
        total = part if total is None else total + part
    assert total is not None
    return total


def _empty(x: torch.Tensor, dims: tuple[int, ...]) -> bool:
    return any(x.shape[d] == 0 for d in dims)


def mark_non_finite_rows(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: BlockOptions | None = None,
) -> None:
    """Make ``out`` and ``lse`` NaN, in place, in every row whose query holds NaN or infinity
    and in every row of a problem whose ``k`` or ``v`` does: what a fused kernel's forward
    needs to meet the non-finite rule (module docstring) whatever it does with such rows. No
    host read: one reduction of ``q`` per row and of ``k``, ``v`` per problem, and one addition
    of 0 or NaN to ``out`` and ``lse`` (finite values stay exact). With ``options``, rows that
    see no key are then given ``out = 0``, ``lse = -inf`` again
    (:meth:`BlockOptions.mark_empty_rows`)."""
    n, heads, q_len = q.shape[:3]
    kv_heads = k.shape[1]
    # Without problems or query rows there is nothing to mark (and no grouping to divide).
    if n and heads and kv_heads and q_len and not _empty(q, (-1,)):
        poison = _poison((q,), (-1,))  # (N, H, Lq)
        if not _empty(k, (-2, -1)):
            per_problem = _poison((k, v), (-2, -1)).view(n, kv_heads, 1, 1)
            grouped = poison.view(n, kv_heads, heads // kv_heads, q_len) + per_problem
            poison = grouped.view(n, heads, q_len)
        out.add_(poison.unsqueeze(-1))
        lse.add_(poison)
    if options is not None:
        options.mark_empty_rows(out, lse, k.shape[-2])


def mark_non_finite_problems(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    *,
    forward_marked: bool = False,
    options: BlockOptions | None = None,
    dlse: torch.Tensor | None = None,
) -> None:
    """Make gradients NaN, in place, where a fused kernel's backward may leave finite numbers
    that the exact math makes NaN, without reaching another problem: what a fused kernel's
    backward needs to meet the non-finite rule. No host read; finite gradients stay exact.

    - Every gradient of a problem any of whose inputs (``dout``, and ``q``, ``k``, ``v`` unless
      ``forward_marked``) holds NaN or infinity: the problem's own input.
    - With ``dlse`` (``(N, Hq, Lq)``, the lse's gradient of
      :meth:`LseGradientKernel.backward_with_lse`): the ``dq`` and ``dk`` of a problem whose
      ``dlse`` holds NaN or infinity (its ``dv`` does not depend on the lse), as a second
      backward call with ``dout = dlse e_0`` makes them
      (:func:`ringdilated.core.contract.lse.lse_gradient`).
    - For a row whose ``lse`` is NaN or ``+inf`` (a merged lse: the non-finite value may be in
      another problem, another pattern's block or another rank's piece): its ``dq`` row, and the
      ``dk``, ``dv`` of the keys it sees (key ``j`` of query ``i`` when ``i - left <= j <= i
      + right``, ``options.window``; every key without one). Fused backwards weight a row whose lse
      is ``+inf`` by zero, turning its NaN into finite gradients.

    ``forward_marked=True`` when the lse comes from forwards that applied
    :func:`mark_non_finite_rows` (as the built-in fused kernels do): every row that sees keys of
    a problem with a non-finite ``q`` row, ``k`` or ``v`` then has a NaN lse already, so only
    ``dout`` and ``lse`` are read, not ``q``, ``k``, ``v`` again. (A problem whose every row
    sees no key has exactly zero gradient, whatever it holds.)"""
    heads = q.shape[1]
    n, kv_heads = k.shape[:2]
    dims = (-2, -1)
    if not (n and heads and kv_heads) or _empty(dout, dims):
        return
    group = heads // kv_heads
    per_head = _poison((dout,) if forward_marked else (dout, q), dims)  # (N, H)
    poison = per_head.view(n, kv_heads, group).sum(-1)  # (N, Hkv)
    if not forward_marked and not _empty(k, dims):
        poison = poison + _poison((k, v), dims)

    def query_heads(per_kv: torch.Tensor) -> torch.Tensor:
        """``(N, Hkv)`` to ``(N, H, 1, 1)``: query head h gets key/value head h // group's
        (expand, not repeat_interleave: its tensor form reads the host)."""
        return per_kv.unsqueeze(-1).expand(n, kv_heads, group).reshape(n, heads, 1, 1)

    q_poison = query_heads(poison)
    kv_poison = poison.view(n, kv_heads, 1, 1)  # view, not [..., None]: fake CUDA tensors
    dk_poison = kv_poison
    if dlse is not None and dlse.shape[-1]:
        lse_term = _poison((dlse,), (-1,)).view(n, kv_heads, group).sum(-1)  # (N, Hkv)
        q_poison = q_poison + query_heads(lse_term)
        dk_poison = kv_poison + lse_term.view(n, kv_heads, 1, 1)
    q_len, k_len = lse.shape[-1], k.shape[-2]
    if q_len and k_len:
        seen = lse.clamp(min=0)  # -inf (no key) becomes 0; NaN and +inf stay
        rows = seen.sub_(seen)  # (N, H, Lq): 0, or NaN for a row whose lse is NaN or +inf
        q_poison = q_poison + rows.unsqueeze(-1)
        per_kv = rows.view(n, kv_heads, group, q_len).sum(2)  # (N, Hkv, Lq)
        window = FULL if options is None else options.window
        if window == FULL:  # every row sees every key
            keys = per_kv.sum(-1, keepdim=True)  # (N, Hkv, 1)
        else:  # key j: the rows j - right <= i <= j + left, a run of rows
            j = torch.arange(k_len, device=lse.device)
            first = torch.zeros_like(j) if window.right is None else j - window.right
            first = first.clamp(0, q_len)
            if window.left is None:  # a suffix of the rows: suffix sums (none past the last)
                after = per_kv.flip(-1).cumsum(-1).flip(-1)
                after = torch.cat([after, after.new_zeros(n, kv_heads, 1)], -1)  # (.., Lq + 1)
                keys = after.index_select(-1, first)  # (N, Hkv, Lk)
            else:  # a run: counts of NaN rows before each row, differenced (sums would let
                # the NaN of rows before the run reach it)
                bad = per_kv.isnan().to(per_kv.dtype).cumsum(-1)
                before = torch.cat([bad.new_zeros(n, kv_heads, 1), bad], -1)  # (.., Lq + 1)
                past = torch.maximum((j + window.left + 1).clamp(0, q_len), first)
                count = before.index_select(-1, past) - before.index_select(-1, first)
                nan = per_kv.new_full((), float("nan"))
                keys = torch.where(count > 0, nan, per_kv.new_zeros(()))  # (N, Hkv, Lk)
        kv_poison = kv_poison + keys.unsqueeze(-1)
        dk_poison = dk_poison + keys.unsqueeze(-1)
    dq.add_(q_poison)
    dk.add_(dk_poison)
    dv.add_(kv_poison)


@runtime_checkable
class Kernel(Protocol):
    """An attention kernel. See the module docstring for shapes and the backward rule."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(out, lse)`` for the block; rows with no visible key give ``0`` and ``-inf``."""
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``(dq, dk, dv)`` shaped like ``(q, k, v)``.

        ``out`` and ``lse`` are the final merged values of these queries; ``lse`` is float32 or
        float64 and may be ``-inf`` (that row's gradients are zero).
        """
        ...


@runtime_checkable
class LseGradientKernel(Protocol):
    """A :class:`Kernel` whose backward also takes the lse's gradient (the module docstring's
    "Optional"): one call per block instead of two where the caller differentiates the lse."""

    def backward_with_lse(
        self,
        dout: torch.Tensor,
        dlse: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``(dq, dk, dv)`` of ``sum(dout * out) + sum(dlse * lse)`` through this block,
        shaped and typed like ``(q, k, v)``, by :meth:`Kernel.backward`'s rules.

        ``dlse`` is ``(N, Hq, Lq)`` in ``lse``'s dtype, possibly a strided view, never modified;
        a finite ``dlse`` of a row that sees no key (its ``lse`` is the constant ``-inf``) adds
        nothing, and a non-finite one is an input of its problem like any other (the non-finite
        rule: NaN allowed in that problem's gradients, never beyond).
        """
        ...
