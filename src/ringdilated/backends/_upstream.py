"""What the fused-kernel wrappers read of an installed upstream package before trusting it: which
release is installed (without importing it: importing a package that holds a CUDA extension
loads it), with pre-releases ordered as PEP 440 orders them, and which parameters a function
takes (a plain function or a ``torch.library`` custom op), so an interface the wrapper was not
written against fails at construction, with the reason, rather than on the first call
(:func:`check_parameters`, the fused-kernel wrappers' one check).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
from collections.abc import Iterable
from typing import Any

__all__ = [
    "check_parameters",
    "distribution_version",
    "parameter_names",
    "release",
    "required_parameters",
]

_RELEASE = re.compile(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:[.-]?(a|b|rc|beta|alpha)\.?(\d*))?")
_PRE_RANK = {"alpha": 0, "a": 0, "beta": 1, "b": 1, "rc": 2}
_FINAL = 3


def release(text: str) -> tuple[int, int, int, int, int]:
    """``text`` as ``(major, minor, patch, stage, number)``, comparable across pre-releases:
    ``"4.0.0b5"`` and ``"4.0.0.beta5"`` give ``(4, 0, 0, 1, 5)``, ``"3.0.0.b1"`` gives
    ``(3, 0, 0, 1, 1)``, a final release ``"3.0.0"`` (or ``"3.0.0+cu12"``, ``"3.0.0.post1"``)
    gives ``(3, 0, 0, 3, 0)``, after every pre-release of it. Text that is no version gives
    ``(0, 0, 0, 0, 0)``."""
    match = _RELEASE.match(text)
    if match is None:
        return (0, 0, 0, 0, 0)
    major, minor, patch, stage, number = match.groups()
    rank = _FINAL if stage is None else _PRE_RANK[stage]
    return (int(major), int(minor or 0), int(patch or 0), rank, int(number or 0))


def distribution_version(*names: str) -> str | None:
    """The installed version of the first of the distributions ``names`` that is installed
    (``None``: none is), read from its metadata without importing it."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _signature(function: Any) -> inspect.Signature | None:
    """The signature of a plain function, or of the Python function a ``torch.library`` custom
    op was made from (its ``_init_fn``); ``None`` when there is none to read."""
    try:
        return inspect.signature(getattr(function, "_init_fn", function))
    except (TypeError, ValueError):
        return None


def parameter_names(function: Any) -> tuple[str, ...] | None:
    """The names of ``function``'s parameters, in order (``None``: unreadable)."""
    signature = _signature(function)
    return None if signature is None else tuple(signature.parameters)


def required_parameters(function: Any) -> tuple[str, ...] | None:
    """The names of ``function``'s parameters that have no default (``None``: unreadable)."""
    signature = _signature(function)
    if signature is None:
        return None
    empty = inspect.Parameter.empty
    return tuple(name for name, p in signature.parameters.items() if p.default is empty)


def check_parameters(
    function: Any,
    name: str,
    needed: Iterable[str],
    *,
    package: str,
    known: str = "",
    trust_unreadable: bool = False,
) -> tuple[str, ...]:
    """The names of ``function``'s parameters, once it is known to take every one of ``needed``;
    ``ImportError`` otherwise, naming what it lacks: ``"<package>: <name> takes (q, k), which
    lacks ['v']"``, then ``"; this kernel knows <known>"`` when ``known`` is given. Parameters
    that cannot be read raise ``ImportError`` saying so, unless ``trust_unreadable``: then the
    function is taken as it is and ``()`` returned."""
    names = parameter_names(function)
    if names is None and trust_unreadable:
        return ()
    knows = f"; this kernel knows {known}" if known else ""
    if names is None:
        raise ImportError(f"{package}: the parameters of {name} cannot be read{knows}")
    lacking = sorted(set(needed) - set(names))
    if lacking:
        raise ImportError(
            f"{package}: {name} takes ({', '.join(names)}), which lacks {lacking}{knows}"
        )
    return names
