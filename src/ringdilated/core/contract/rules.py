"""Field rules for the spec values plugins build, and containment of the callables they carry.

A :class:`Rule` is an attrs validator: it checks one field when a frozen spec is constructed
(or evolved) and raises ``TypeError`` (wrong type) or ``ValueError`` (right type, value out of
range) with a message naming the class, the field, the rule and the value received, e.g.
``KernelSpec.priority must be an int (not a bool), got 'high' (a str)``. The same rules are
re-run by :func:`ringdilated.plugins.spec_validation.validate_spec` at registry time, for specs
built around the validators.

:func:`contained_reasons` calls a plugin's reason callable (``extra_reasons``,
``plan_reasons``) so that whatever it does (raise, return non-strings) becomes a reason against
its own backend and never an exception in the caller.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch

__all__ = [
    "Rule",
    "bools",
    "callables",
    "capability_bounds",
    "contained_reasons",
    "describe",
    "describe_exception",
    "floating_dtypes",
    "ints",
    "label",
    "names",
    "non_empty_str",
    "one_of",
    "optional",
    "positive_int",
    "requirements",
    "strs",
    "tuple_of",
]

_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 60


def describe(value: object) -> str:
    """``repr(value)``, shortened, and safe against a ``__repr__`` that raises."""
    try:
        return _REPR.repr(value)
    except Exception:  # a hostile object's repr may raise anything
        return f"<{type(value).__name__} object>"


def _a(value: object) -> str:
    name = type(value).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


@attrs.frozen
class Rule:
    """An attrs validator: a field's value passes when ``check(value)`` is true.

    Otherwise raises ``"<Class>.<field> must be <expected>, got <value> (a <type>)"``, the class
    being the instance's own (a subclass is named as such): a ``ValueError`` when the value has
    the right type (``kind(value)`` is true: ``0`` for a positive int) and a ``TypeError`` when
    it has not (``None``, ``"high"``, ``True`` for an int).
    """

    expected: str
    check: Callable[[Any], bool]
    kind: Callable[[Any], bool] | None = None

    def __call__(self, instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if self.check(value):
            return
        error = ValueError if self.kind is not None and self.kind(value) else TypeError
        got = "None" if value is None else f"{describe(value)} ({_a(value)})"
        raise error(
            f"{type(instance).__name__}.{attribute.name} must be {self.expected}, got {got}"
        )


def _is_int(value: object) -> bool:
    # Exactly int (not bool, not a subclass whose arithmetic or ordering a plugin overrode: the
    # resolver negates and sorts these values).
    return type(value) is int


def _is_str(value: object) -> bool:
    return type(value) is str  # exactly str: names are hashed, compared and sorted


def optional(rule: Rule) -> Rule:
    """``None``, or what ``rule`` accepts."""
    return Rule(f"None or {rule.expected}", lambda v: v is None or rule.check(v), rule.kind)


def one_of(values: tuple[str, ...]) -> Rule:
    """Exactly a str among ``values``."""
    return Rule(f"one of {values}", lambda v: _is_str(v) and v in values, _is_str)


def _tuple_of(kind: type | Callable[[Any], bool]) -> Callable[[Any], bool]:
    test = kind if not isinstance(kind, type) else (lambda item: isinstance(item, kind))
    return lambda v: isinstance(v, tuple) and all(test(item) for item in v)


def tuple_of(kind: type, expected: str, *, non_empty: bool = False) -> Rule:
    """A tuple (never a list: specs are frozen and hashable) whose items are ``kind``."""
    items = _tuple_of(kind)
    return Rule(
        f"a {'non-empty ' if non_empty else ''}tuple of {expected}",
        lambda v: items(v) and (bool(v) or not non_empty),
        items,
    )


ints = Rule("an int (not a bool)", _is_int)
bools = Rule("a bool", lambda v: isinstance(v, bool))
strs = Rule("a str", _is_str)
callables = Rule("callable", callable)
non_empty_str = Rule("a non-empty str", lambda v: _is_str(v) and bool(v.strip()), _is_str)
positive_int = Rule("a positive int (not a bool)", lambda v: _is_int(v) and v > 0, _is_int)
capability_bounds = optional(
    Rule(
        "a (major, minor) tuple of two non-negative ints",
        lambda v: _tuple_of(_is_int)(v) and len(v) == 2 and min(v) >= 0,
        _tuple_of(_is_int),
    )
)
floating_dtypes = Rule(
    "a non-empty frozenset of floating torch.dtype",
    lambda v: (
        isinstance(v, frozenset)
        and bool(v)
        and all(isinstance(d, torch.dtype) and d.is_floating_point for d in v)
    ),
    lambda v: isinstance(v, frozenset) and all(isinstance(d, torch.dtype) for d in v),
)
requirements = Rule(
    "a tuple of non-empty str (importable package names)",
    lambda v: _tuple_of(_is_str)(v) and all(p.strip() for p in v),
    _tuple_of(_is_str),
)


def _valid_name(value: object) -> bool:
    if type(value) is not str:
        return False
    return bool(value) and value != "auto" and "," not in value and not any(map(str.isspace, value))


#: A backend name: users pass it as ``kernel=``/``communicator=`` and in comma-separated
#: environment variables, so it is a non-empty str without whitespace or commas, never "auto".
names = Rule("a non-empty str without whitespace or commas, not 'auto'", _valid_name, _is_str)


def label(fn: object) -> str:
    """``module.qualname`` of a callable a spec carries (what a message names it by)."""
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or describe(fn)
    return f"{module}.{name}" if isinstance(module, str) and isinstance(name, str) else str(name)


def contained_reasons(field: str, fn: Callable[..., object], *args: object) -> tuple[str, ...]:
    """``fn(*args)`` as a tuple of reasons; never raises.

    ``fn`` (a spec's ``field``) returns an iterable of str. If it raises, or returns something
    else, the result is one reason naming the callable and what went wrong, so the backend that
    carries it is rejected with that reason and every other backend is unaffected.
    """
    try:
        got = fn(*args)
        if isinstance(got, (str, bytes)) or not isinstance(got, Iterable):
            return (f"{field} {label(fn)} returned {describe(got)}, not an iterable of str",)
        reasons = tuple(got)
    except Exception as exc:  # a plugin's callable may raise anything
        return (f"{field} {label(fn)} raised {type(exc).__name__}: {describe_exception(exc)}",)
    bad = [r for r in reasons if not isinstance(r, str)]
    if bad:
        return (f"{field} {label(fn)} returned {describe(bad[0])}, not a str, among its reasons",)
    return reasons


def describe_exception(exc: BaseException) -> str:
    """``str(exc)``, safe against a ``__str__`` that raises."""
    try:
        return str(exc)
    except Exception:  # a hostile exception's str may raise anything
        return f"<{type(exc).__name__}>"
