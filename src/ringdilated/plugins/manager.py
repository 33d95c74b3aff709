"""The plugin manager: built-ins, entry-point plugins, isolation of broken ones.

Call flow::

    registry = load_registry()     # built-ins + the 'ringdilated' entry-point group, once, cached
    registry.kernels               # {name: KernelSpec} from every plugin that loaded
    registry.failures              # one line per plugin that failed to import or whose hook raised
    registry.origins               # {kernel name: where it came from}

A plugin that fails to import, raises in a hook or returns something that is not a list of
:class:`~ringdilated.core.KernelSpec` is skipped with a :class:`PluginWarning` naming it, and the
failure is kept for ``Plan.explain()``. Environment controls:

- ``RINGDILATED_DISABLE_PLUGIN_AUTOLOAD=1``: load the built-ins only.
- ``RINGDILATED_BLOCK_PLUGINS=name,other``: skip entry points (or built-ins) by name.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

import attrs
import pluggy

from ringdilated.core.capabilities import KernelSpec
from ringdilated.core.communicator_spec import CommunicatorSpec
from ringdilated.plugins import hookspecs

__all__ = [
    "AUTOLOAD_ENV_VAR",
    "BLOCK_ENV_VAR",
    "BUILTIN_PLUGINS",
    "PluginRegistry",
    "PluginWarning",
    "load_registry",
]

AUTOLOAD_ENV_VAR = "RINGDILATED_DISABLE_PLUGIN_AUTOLOAD"
BLOCK_ENV_VAR = "RINGDILATED_BLOCK_PLUGINS"
BUILTIN_PLUGINS = (
    "ringdilated.backends.sdpa",
    "ringdilated.backends.reference",
    "ringdilated.backends.flash",
    "ringdilated.backends.xformers",
    "ringdilated.backends.flex",
    "ringdilated.backends.local",
    "ringdilated.backends.ringpass",
    "ringdilated.backends.allgather",
)


class PluginWarning(UserWarning):
    """A plugin was skipped because it failed; the message names it and says why."""


@attrs.frozen
class PluginRegistry:
    """What the plugins offered: kernel and communicator specs by name, origins, failures."""

    kernels: dict[str, KernelSpec]
    origins: dict[str, str]
    failures: tuple[str, ...]
    manager: pluggy.PluginManager = attrs.field(eq=False, repr=False)
    communicators: dict[str, CommunicatorSpec] = attrs.field(factory=dict)
    communicator_origins: dict[str, str] = attrs.field(factory=dict)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _blocked() -> frozenset[str]:
    return frozenset(n.strip() for n in os.environ.get(BLOCK_ENV_VAR, "").split(",") if n.strip())


def _entry_points() -> Sequence[importlib.metadata.EntryPoint]:
    return tuple(importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME))


def build_registry(
    builtins: Iterable[str] = BUILTIN_PLUGINS,
    *,
    autoload: bool | None = None,
    blocked: Iterable[str] | None = None,
    entry_points: Callable[[], Sequence[importlib.metadata.EntryPoint]] = _entry_points,
) -> PluginRegistry:
    """Build a registry. Defaults come from the environment variables above."""
    if autoload is None:
        autoload = not _env_flag(AUTOLOAD_ENV_VAR)
    block = frozenset(blocked) if blocked is not None else _blocked()
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    failures: list[str] = []
    origins: dict[str, str] = {}

    def fail(name: str, why: str) -> None:
        message = f"plugin {name!r} skipped: {why}"
        failures.append(message)
        warnings.warn(message, PluginWarning, stacklevel=3)

    def register(plugin: ModuleType | object, name: str, origin: str) -> None:
        try:
            pm.register(plugin, name=name)
        except Exception as exc:  # a plugin's hooks may be malformed in any way
            fail(name, f"registration failed: {type(exc).__name__}: {exc}")
        else:
            origins[name] = origin

    for module_name in builtins:
        if module_name in block:
            continue
        register(importlib.import_module(module_name), module_name, "built-in")
    if autoload:
        for ep in _entry_points_safely(entry_points, fail):
            if ep.name in block:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # an entry point may fail to import in any way
                fail(ep.name, f"import of {ep.value!r} failed: {type(exc).__name__}: {exc}")
                continue
            dist = getattr(ep, "dist", None)
            where = f"{dist.name} {dist.version}" if dist is not None else ep.value
            register(plugin, ep.name, f"entry point {ep.name!r} ({where})")
    kernels, kernel_origins = _collect(pm, "ringdilated_kernels", KernelSpec, origins, fail)
    communicators, comm_origins = _collect(
        pm, "ringdilated_communicators", CommunicatorSpec, origins, fail
    )
    return PluginRegistry(kernels, kernel_origins, tuple(failures), pm, communicators, comm_origins)


def _entry_points_safely(
    entry_points: Callable[[], Sequence[importlib.metadata.EntryPoint]],
    fail: Callable[[str, str], None],
) -> Sequence[importlib.metadata.EntryPoint]:
    try:
        return entry_points()
    except Exception as exc:  # broken distribution metadata must not break the library
        fail("<entry points>", f"listing the {hookspecs.PROJECT_NAME!r} group failed: {exc}")
        return ()


def _collect(
    pm: pluggy.PluginManager,
    hook_name: str,
    spec_type: type[Any],
    origins: dict[str, str],
    fail: Callable[[str, str], None],
) -> tuple[dict[str, Any], dict[str, str]]:
    """Call ``hook_name`` of every plugin on its own, keeping what is a list of ``spec_type``."""
    specs_by_name: dict[str, Any] = {}
    spec_origins: dict[str, str] = {}
    impls = {impl.plugin_name: impl for impl in getattr(pm.hook, hook_name).get_hookimpls()}
    # Registration order (built-ins first), so an earlier plugin keeps a contested name.
    for name in origins:
        if name not in impls:
            continue
        try:
            specs: Any = impls[name].function()
        except Exception as exc:  # a plugin's hook may raise anything
            fail(name, f"{hook_name}() raised {type(exc).__name__}: {exc}")
            continue
        if not isinstance(specs, (list, tuple)) or not all(isinstance(s, spec_type) for s in specs):
            fail(name, f"{hook_name}() must return a list of {spec_type.__name__}, got {specs!r}")
            continue
        for spec in specs:
            if spec.name in specs_by_name:
                fail(
                    name,
                    f"{spec_type.__name__} name {spec.name!r} is already provided by "
                    f"{spec_origins[spec.name]}",
                )
                continue
            specs_by_name[spec.name] = spec
            spec_origins[spec.name] = f"{name} ({origins.get(name, 'registered')})"
    return specs_by_name, spec_origins


@functools.lru_cache(maxsize=1)
def load_registry() -> PluginRegistry:
    """The process-wide registry, built on first use. ``load_registry.cache_clear()`` rebuilds."""
    return build_registry()
