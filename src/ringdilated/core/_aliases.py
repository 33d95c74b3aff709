"""The module paths of the flat ``core/`` of ringdilated 0.1, kept for one release.

``core/`` now lives in layer folders (``ringdilated.core.contract.kernel`` was
``ringdilated.core.kernel``). A plugin written against the old paths keeps working: importing
``ringdilated.core.kernel`` gives the new module itself (what is set through one path is set for
both), after a ``DeprecationWarning`` naming the new path. Prefer the names
:mod:`ringdilated.core` exports. ``ringdilated.core.call``, a module then, is now the call
layer's package: no alias.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence

__all__ = ["MOVED", "install"]

MOVED: dict[str, str] = {
    f"ringdilated.core.{old}": new
    for old, new in {
        "env": "ringdilated.core.support.env",
        "caller": "ringdilated.core.support.caller",
        "opaque": "ringdilated.core.support.opaque",
        "pattern": "ringdilated.core.plan.pattern",
        "layout": "ringdilated.core.plan.documents",
        "shard_plan": "ringdilated.core.plan.shards",
        "heads": "ringdilated.core.plan.heads",
        "kernel": "ringdilated.core.contract.kernel",
        "communicator": "ringdilated.core.contract.communicator",
        "accumulator": "ringdilated.core.contract.accumulator",
        "causal": "ringdilated.core.contract.causal",
        "kernel_guard": "ringdilated.core.contract.guard",
        "rules": "ringdilated.core.contract.rules",
        "capabilities": "ringdilated.core.select.capabilities",
        "communicator_spec": "ringdilated.core.select.communicator_spec",
        "resolver": "ringdilated.core.select.resolver",
        "cost": "ringdilated.core.select.cost",
        "dtypes": "ringdilated.core.select.dtypes",
        "driver": "ringdilated.core.run.local",
        "sharded_run": "ringdilated.core.run.sharded",
        "head_parallel": "ringdilated.core.run.head_parallel",
        "exchange": "ringdilated.core.run.exchange",
        "payload": "ringdilated.core.run.wire",
        "agreement": "ringdilated.core.call.agreement",
        "grid": "ringdilated.core.call.grid",
        "validation": "ringdilated.core.call.validation",
        "sequence_layout": "ringdilated.core.call.sequence_layout",
        "spec_validation": "ringdilated.plugins.spec_validation",
    }.items()
}
"""Old module path -> the module that holds its contents now."""


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths in :data:`MOVED` and loads each as the module it moved to."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(MOVED[spec.name])  # a missing one fails here
        spec.loader_state = module.__spec__  # importlib sets the old path's spec on it next
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        old, new = module.__spec__.name, module.__name__  # type: ignore[union-attr]
        module.__spec__ = module.__spec__.loader_state  # type: ignore[union-attr]
        warnings.warn(
            f"{old} moved to {new} (core/ is in layer folders now); the old path is "
            "a deprecated alias, kept for one release: import the new path, or the name from "
            "ringdilated.core",
            DeprecationWarning,
            stacklevel=_importer_level(),
        )


def _importer_level() -> int:
    """The ``stacklevel`` of the first frame outside the import machinery and this module
    (``warnings.warn`` itself skips ``importlib._bootstrap`` frames, so only the others count)."""
    machinery = {__file__, importlib.__file__}
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if name in machinery:
            level += 1
        elif not ("importlib" in name and "_bootstrap" in name):  # those warnings.warn counts
            break
        frame = frame.f_back  # type: ignore[assignment]
    return level


_FINDER = _Finder()


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
