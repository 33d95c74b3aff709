"""Whether a module can be imported, found without importing it or any package above it.

``importlib.util.find_spec("flash_attn.cute")`` imports ``flash_attn`` first, running its
``__init__`` (for flash-attn 2, the import of a CUDA extension) only to learn where to look.
:func:`findable` asks the import system's finders the way an import would, one name at a time,
and looks for each submodule in its package's ``submodule_search_locations`` instead:

- a module already in ``sys.modules`` is found (``None`` there, a blocked import, is not);
- a top-level name, and a submodule of a package that is imported or whose spec names its
  search locations (a directory, a namespace package), is looked up by the finders of
  ``sys.meta_path``, as the import system looks it up, ``PathFinder``'s search made here through
  each path entry's finder (``pkgutil.get_importer``), since the namespace path it builds reads
  the parent from ``sys.modules``; nothing is imported;
- a submodule of a module without search locations, which only its parent's import could make
  (a module that puts its submodules in ``sys.modules``), is found by importing the parent, as
  an import would, and looking in ``sys.modules``;
- whatever raises on the way (a finder, that import) answers "not found": a broken install is a
  reason against the code needing it, never an error.

A package whose ``__init__`` would fail to import is still found when its files are there: the
import that needs it fails later, where it can be reported (a kernel's factory). A package whose
``__init__`` extends its own ``__path__`` (``pkgutil.extend_path``) is searched in the locations
its spec names only, until it is imported: its other directories' submodules are not found
before that (docs/plugins.md).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Iterable
from importlib.machinery import PathFinder

__all__ = ["findable"]


def findable(name: str) -> bool:
    """Whether module ``name`` (possibly dotted) can be found (module docstring); never raises."""
    try:
        return _locate(name)[0]
    except Exception:  # a finder, or a parent's import, may fail in any way
        return False


def _locate(name: str) -> tuple[bool, Iterable[str] | None]:
    """``(found, submodule search locations)`` of module ``name``."""
    if name in sys.modules:
        return _loaded(name)
    parent, _, _ = name.rpartition(".")
    locations = None
    if parent:
        found, locations = _locate(parent)
        if not found:
            return False, None
        if locations is None:  # a plain module: only its import can make a submodule
            importlib.import_module(parent)
            return _loaded(name)
    for finder in sys.meta_path:
        if finder is PathFinder:  # its namespace paths need the parent imported: searched here
            result = _on_path(name, sys.path if locations is None else locations)
        else:
            find_spec = getattr(finder, "find_spec", None)
            spec = None if find_spec is None else find_spec(name, locations)
            result = (False, None) if spec is None else (True, spec.submodule_search_locations)
        if result[0]:
            return result
    return False, None


def _loaded(name: str) -> tuple[bool, Iterable[str] | None]:
    """``(found, search locations)`` from ``sys.modules`` (absent or ``None``: not found)."""
    module = sys.modules.get(name)
    return module is not None, getattr(module, "__path__", None)


def _on_path(name: str, entries: Iterable[str]) -> tuple[bool, Iterable[str] | None]:
    """What ``PathFinder`` finds for ``name`` in ``entries``, through each entry's finder (the
    first module or regular package wins, else the namespace portions together), without the
    namespace path object it builds, which reads the parent from ``sys.modules``."""
    portions: list[str] = []
    for entry in entries:
        finder = pkgutil.get_importer(entry)
        spec = None if finder is None else finder.find_spec(name)
        if spec is None:
            continue
        if spec.loader is not None:
            return True, spec.submodule_search_locations
        portions.extend(spec.submodule_search_locations or ())
    return (True, portions) if portions else (False, None)
