"""The key window: which keys a query sees, the one value that carries a call's mask.

Key ``j`` is visible to query ``i`` iff ``i - left <= j <= i + right``, both counted in the same
coordinates; ``None`` leaves that side unbounded. This is flash-attn's ``window_size`` convention
(there ``-1`` is unbounded; ``right = 0`` is causal), relative to the query's own position rather
than to the bottom-right corner. A call's window counts sequence positions (docs/spec.md, section
5); a block's window (:class:`~ringdilated.core.contract.kernel.BlockOptions`) counts the
block's selected keys: the call's, :meth:`KeyWindow.dilated` by the block's rate and
:meth:`KeyWindow.shifted` to its start, so a block on the diagonal of a causal call has
``right = 0`` and one whose keys start later has a negative ``right``.

Today a call's window is :data:`FULL` or :data:`CAUSAL`; a window with a ``left`` bound (a
sliding window) is for a later release and is refused by every kernel's capabilities.
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

    def sends(self, src: int, dst: int) -> bool:
        """The send rule between two ranks holding contiguous shards in rank order: whether a
        key of rank ``src`` may be visible to a query of rank ``dst`` (``src != dst``). Only
        toward later ranks when later keys are hidden; otherwise to every participant (exact
        for today's windows; a window bounded on the left could send less)."""
        return src < dst or not self.hides_later_keys

    def shifted(self, offset: int) -> KeyWindow:
        """This window in a block's coordinates: for queries starting at position ``a`` and keys
        at ``b`` (query ``i`` at ``a + i``, key ``j`` at ``b + j``), ``shifted(a - b)``."""
        return KeyWindow(
            None if self.left is None else self.left - offset,
            None if self.right is None else self.right + offset,
        )

    def dilated(self, rate: int) -> KeyWindow:
        """This window counted in selected keys of a selection with stride ``rate`` (queries
        and keys on the same grid): a bound of ``n`` positions reaches ``n // rate`` keys."""
        return KeyWindow(
            None if self.left is None else self.left // rate,
            None if self.right is None else self.right // rate,
        )

    def visible_rows_start(self) -> int:
        """First query row of a block that can see key 0 or later (rows before it see no key).
        Raises ``NotImplementedError`` for a left bound (rows at the end may see no key)."""
        if self.left is not None:
            raise NotImplementedError(f"{self!r}: a left bound (a sliding window) is not served")
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
