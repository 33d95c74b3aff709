"""Environment variables, read strictly: a value that is not understood raises, naming it.

Every ``RINGDILATED_*`` variable the package reads goes through one of these readers, so none is
ever silently taken as unset: a switch (:func:`env_flag`), or a list of names (:func:`env_names`)
that the caller checks against what exists, raising with :func:`unknown_names`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["FALSE_WORDS", "TRUE_WORDS", "env_flag", "env_names", "unknown_names"]

TRUE_WORDS = ("1", "true", "yes", "on")
"""The spellings of a switch that is on (compared after ``strip().lower()``)."""

FALSE_WORDS = ("0", "false", "no", "off")
"""The spellings of a switch that is off (as is an empty or unset variable)."""


def env_flag(name: str) -> bool:
    """The switch in environment variable ``name``: ``True`` for one of :data:`TRUE_WORDS`,
    ``False`` for one of :data:`FALSE_WORDS`, an empty value or an unset variable (any case,
    surrounding spaces ignored). Any other value raises ``ValueError`` naming the variable, the
    value and the accepted spellings."""
    raw = os.environ.get(name)
    if raw is None:
        return False
    text = raw.strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS or not text:
        return False
    raise ValueError(
        f"{name} must be one of {TRUE_WORDS + FALSE_WORDS} (any case), or empty or unset, "
        f"got {raw!r}"
    )


def env_names(name: str) -> tuple[str, ...] | None:
    """The comma-separated names in environment variable ``name``, each stripped of spaces,
    empty items dropped, in order; ``None`` when the variable is unset (an empty value gives
    ``()``). Checking the names against what exists is the caller's (:func:`unknown_names`)."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    return tuple(n.strip() for n in raw.split(",") if n.strip())


def unknown_names(name: str, unknown: Iterable[str], accepted: Iterable[str], what: str) -> str:
    """The message for names in environment variable ``name`` that are not ``what``: it quotes
    the variable's value, the names not understood and the ``accepted`` ones, sorted."""
    known = ", ".join(sorted(set(accepted))) or "none"
    bad = ", ".join(repr(n) for n in unknown)
    return (
        f"{name}={os.environ.get(name, '')!r} names {bad}, not {what}; accepted: {known} "
        f"(comma-separated)"
    )
