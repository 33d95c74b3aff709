"""The key window: which keys a query sees, the one value that carries a call's mask.

Key ``j`` is visible to query ``i`` iff ``i - left <= j <= i + right``, both counted in the same
coordinates; ``None`` leaves that side unbounded. This is flash-attn's ``window_size`` convention
(there ``-1`` is unbounded; ``right = 0`` is causal), relative to the query's own position rather
than to the bottom-right corner. A call's window counts sequence positions (docs/spec.md, section
5): ``dilated_attention(..., window=(left, right))``, ``causal=True`` being ``right = 0``, both
bounds ``>= 0`` there (:func:`~ringdilated.core.call.validation.check_window`). A block's window
(:class:`~ringdilated.core.contract.kernel.BlockOptions`) counts the block's selected keys: the
call's, :meth:`KeyWindow.dilated` by the block's rate and :meth:`KeyWindow.shifted` to its start,
so a block on the diagonal of a causal call has ``right = 0``, one whose keys start later has a
negative ``right``, and one whose keys start earlier (another rank's piece, a row chunk) a
smaller ``left``: any int, either sign, in a block.

The questions a block asks of its window are answered here, by arithmetic on lengths: which of
its rows see any key (:meth:`KeyWindow.visible_rows`: with a left bound, rows at the end may see
none, as rows at the start may with a negative right bound), which keys a run of rows sees
(:meth:`KeyWindow.visible_keys`: always one contiguous range, so a run of rows may be handed only
those keys), and whether it needs a mask at all (:meth:`KeyWindow.needs_mask`). Between ranks,
:meth:`KeyWindow.sends` is the coarse rule by rank order; a crossing segment's pieces are judged
exactly by their positions (:mod:`ringdilated.core.plan.shards`).
"""

from __future__ import annotations

import operator

import attrs

__all__ = ["CAUSAL", "FULL", "KeyWindow", "as_window"]


def _bound(value: object) -> int | None:
    """``None``, or ``value`` as an int (anything ``operator.index`` takes, a numpy int or a
    0-d integer tensor included, but not a bool)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"a KeyWindow bound must be an int or None, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"a KeyWindow bound must be an int or None, got {value!r}") from None


@attrs.frozen
class KeyWindow:
    """``(left, right)``: key ``j`` visible to query ``i`` iff ``i - left <= j <= i + right``
    (``None``: unbounded on that side)."""

    left: int | None = attrs.field(default=None, converter=_bound)
    right: int | None = attrs.field(default=None, converter=_bound)

    def __bool__(self) -> bool:
        raise TypeError("a KeyWindow is no causal flag: test window.hides_later_keys")

    @property
    def hides_later_keys(self) -> bool:
        """Whether no query sees a key after its own position (``right <= 0``)."""
        return self.right is not None and self.right <= 0

    @property
    def hides_earlier_keys(self) -> bool:
        """Whether no query sees a key before its own position (``left <= 0``)."""
        return self.left is not None and self.left <= 0

    @property
    def sees_own_position(self) -> bool:
        """Whether every query sees the key at its own position (both bounds ``>= 0`` or
        unbounded): true of every call's window, so in a call every selected query sees at
        least itself."""
        return (self.left is None or self.left >= 0) and (self.right is None or self.right >= 0)

    def sends(self, src: int, dst: int) -> bool:
        """The send rule by rank order alone, between two ranks holding contiguous shards in
        rank order (``src != dst``): whether a key of rank ``src`` may be visible to a query of
        rank ``dst``. Toward later ranks unless earlier keys are hidden (``left <= 0``), toward
        earlier ranks unless later keys are hidden (``right <= 0``). How far a bound reaches
        needs positions: :meth:`~ringdilated.core.plan.shards.Crossing.sends` applies it to a
        crossing's pieces."""
        if src < dst:
            return not self.hides_earlier_keys
        return src == dst or not self.hides_later_keys

    def shifted(self, offset: int) -> KeyWindow:
        """This window in a block's coordinates: for queries starting at position ``a`` and keys
        at ``b`` (query ``i`` at ``a + i``, key ``j`` at ``b + j``), ``shifted(a - b)``."""
        return KeyWindow(
            None if self.left is None else self.left - offset,
            None if self.right is None else self.right + offset,
        )

    def dilated(self, rate: int) -> KeyWindow:
        """This window counted in selected keys of a selection with stride ``rate`` (queries
        and keys on the same grid): a bound of ``n`` positions reaches ``n // rate`` keys
        (floor division, also for a negative bound: key ``j`` with ``rate * j >= rate * i -
        n`` is ``j >= i - n // rate``)."""
        return KeyWindow(
            None if self.left is None else self.left // rate,
            None if self.right is None else self.right // rate,
        )

    def visible_rows(self, q_len: int, k_len: int) -> tuple[int, int]:
        """``(start, stop)``: the query rows of a ``q_len x k_len`` block that see at least one
        key are exactly ``[start, stop)`` (``start == stop``: none). Rows before ``-right`` see
        no key (their window ends before key 0), rows from ``k_len + left`` on see none (it
        starts after the last key), and with ``left + right < 0`` no row sees any."""
        start = 0 if self.right is None else max(0, -self.right)
        stop = q_len if self.left is None else max(0, min(q_len, k_len + self.left))
        if k_len <= 0 or (
            self.left is not None and self.right is not None and self.left + self.right < 0
        ):
            stop = 0
        start = min(start, q_len)
        return start, max(start, stop)

    def visible_keys(self, row_start: int, row_stop: int, k_len: int) -> tuple[int, int]:
        """``(start, stop)``: the keys of a block with ``k_len`` keys that rows ``[row_start,
        row_stop)`` see between them, one contiguous range (each visible row sees a range one
        key further than the row before it, and at least one key); ``(0, 0)`` when none sees
        any. Rows handed exactly these keys, with the window :meth:`shifted` by ``start``
        (``shifted(row_start - start)`` in the rows' own coordinates), compute what they
        computed over every key."""
        first, last = self.visible_rows(row_stop, k_len)
        first = max(first, row_start)
        if first >= last:
            return 0, 0
        start = 0 if self.left is None else max(0, first - self.left)
        stop = k_len if self.right is None else min(k_len, last + self.right)
        return start, stop

    def sees_any(self, q_len: int, k_len: int) -> bool:
        """Whether some query of a ``q_len x k_len`` block sees some key (a block that does not
        is not computed at all)."""
        start, stop = self.visible_rows(q_len, k_len)
        return stop > start

    def visible_rows_start(self) -> int:
        """First query row of a block that can see key 0 or later (rows before it see no key),
        for a window without a left bound; :meth:`visible_rows` answers for any window. Raises
        ``NotImplementedError`` for a left bound (rows at the end may see no key too)."""
        if self.left is not None:
            raise NotImplementedError(
                f"{self!r}: with a left bound (a sliding window) rows at the end may see no key "
                "too: ask visible_rows(q_len, k_len)"
            )
        return 0 if self.right is None else max(0, -self.right)

    def needs_mask(self, q_len: int, k_len: int) -> bool:
        """Whether any key is hidden from any query of a ``q_len x k_len`` block."""
        hidden_right = self.right is not None and self.right < k_len - 1
        return hidden_right or (self.left is not None and self.left < q_len - 1)


FULL = KeyWindow()
"""Every key visible: a non-causal call."""

CAUSAL = KeyWindow(None, 0)
"""Keys up to the query's own position: a causal call."""


def as_window(mask: KeyWindow | bool) -> KeyWindow:
    """``mask`` itself, or for a bool ``causal`` flag :data:`CAUSAL` or :data:`FULL`."""
    if isinstance(mask, KeyWindow):
        return mask
    if not isinstance(mask, bool):
        raise TypeError(f"expected a KeyWindow or a bool causal flag, got {mask!r}")
    return CAUSAL if mask else FULL
