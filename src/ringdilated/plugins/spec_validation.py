"""Registry-time validation of the specs a plugin returned.

The frozen spec classes validate their fields on construction, but a plugin can build a spec
around that (``object.__setattr__`` on a frozen instance, a subclass that overrides ``__init__``)
or nest a value that was changed the same way. :func:`validate_spec` re-runs every field rule
of the declared class, and of the values nested in it (``Capabilities``, each ``Target``,
``BatchLimit``, each ``PriorityRule``), on what the instance holds now. The plugin manager calls
it for each spec before registering it and skips (or, in strict mode, refuses) one that fails.
"""

from __future__ import annotations

from typing import Any

import attrs

from ringdilated.core.contract.rules import describe, describe_exception
from ringdilated.core.support.errors import SpecError

__all__ = ["SpecError", "spec_label", "validate_spec"]


def spec_label(spec: object, cls: type[Any]) -> str:
    """``KernelSpec 'name'``: the spec's class and its name, whatever the name is."""
    try:
        name = describe(spec.name)  # type: ignore[attr-defined]
    except Exception:  # a spec may lack a name, or a hostile one may raise reading it
        name = "(no name)"
    return f"{cls.__name__} {name}"


def validate_spec(spec: object, cls: type[Any]) -> None:
    """Raise :class:`SpecError` unless ``spec`` is a ``cls`` whose every field, nested values
    included, meets the rule ``cls`` declares for it."""
    if not isinstance(spec, cls):
        raise SpecError("(self)", f"expected a {cls.__name__}, got {describe(spec)}")
    _check(spec, cls, "")


def _check(value: object, cls: type[Any], path: str) -> None:
    for field in attrs.fields(cls):
        where = f"{path}{field.name}"
        try:
            item = getattr(value, field.name)
            if field.validator is not None:
                field.validator(value, field, item)
        except Exception as exc:  # a rule's error, or whatever a hostile attribute raises
            message = describe_exception(exc).removeprefix(f"field {field.name}: ")  # a SpecError
            if not isinstance(exc, (TypeError, ValueError)):
                message = f"reading it raised {type(exc).__name__}: {message}"
            raise SpecError(where, message) from exc
        nested = field.metadata.get("spec")
        if nested is not None:
            _check(item, nested, f"{where}.")
        items = field.metadata.get("items")
        if items is not None:
            for i, entry in enumerate(item):
                _check(entry, items, f"{where}[{i}].")
