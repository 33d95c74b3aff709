"""The plugin manager: built-ins, entry-point plugins, isolation of broken ones.

Call flow::

    registry = load_registry()     # built-ins + the 'ringdilated' entry-point group, once, cached
    registry.kernels               # {name: KernelSpec} from every plugin that loaded
    registry.failures              # one line per plugin that failed to import or whose hook raised
    registry.origins               # {kernel name: where it came from}

    registry.plugins               # one PluginInfo per plugin: distribution, version, what it gave
    print(registry.describe())     # the same as a table, failures included

A plugin that fails to import, raises in a hook, returns something that is not a list of specs,
or offers a backend name another plugin already took is skipped with a :class:`PluginWarning`
naming it (and, for a duplicate name, both plugins and their distributions); the failure is
kept for ``Plan.explain()``. In strict mode the same failure raises :class:`PluginError`.
Controls, as arguments of :func:`build_registry` or as environment variables:

- ``autoload=False`` / ``RINGDILATED_DISABLE_PLUGIN_AUTOLOAD=1``: load the built-ins only.
- ``allowed=[...]`` / ``RINGDILATED_ALLOW_PLUGINS=name,other``: load only these entry points.
- ``blocked=[...]`` / ``RINGDILATED_BLOCK_PLUGINS=name,other``: skip these entry points (or
  built-ins, by module name).
- ``strict=True`` / ``RINGDILATED_STRICT_PLUGINS=1``: a failing plugin raises.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

import attrs
import pluggy

from ringdilated.core.capabilities import KernelSpec
from ringdilated.core.communicator_spec import CommunicatorSpec
from ringdilated.plugins import hookspecs
from ringdilated.plugins.builtins import BUILTIN_PLUGINS, ESSENTIAL_PLUGINS, BuiltinPlugin

__all__ = [
    "ALLOW_ENV_VAR",
    "AUTOLOAD_ENV_VAR",
    "BLOCK_ENV_VAR",
    "STRICT_ENV_VAR",
    "PluginError",
    "PluginInfo",
    "PluginRegistry",
    "PluginWarning",
    "build_registry",
    "load_registry",
]

AUTOLOAD_ENV_VAR = "RINGDILATED_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_ENV_VAR = "RINGDILATED_ALLOW_PLUGINS"
BLOCK_ENV_VAR = "RINGDILATED_BLOCK_PLUGINS"
STRICT_ENV_VAR = "RINGDILATED_STRICT_PLUGINS"


class PluginWarning(UserWarning):
    """A plugin was skipped because it failed; the message names it and says why."""


class PluginError(RuntimeError):
    """Strict mode: a plugin failed. The message names it and says why."""


@attrs.frozen
class PluginInfo:
    """One registered plugin: where it came from and which backends it offered."""

    name: str
    source: str  # "built-in" or "entry point"
    distribution: str | None
    version: str | None
    kernels: tuple[str, ...] = ()
    communicators: tuple[str, ...] = ()

    def origin(self) -> str:
        """``built-in``, or ``entry point 'name' (distribution version)``."""
        if self.source == "built-in":
            return "built-in"
        where = f"{self.distribution} {self.version}" if self.distribution else "no distribution"
        return f"{self.source} {self.name!r} ({where})"


@attrs.frozen
class PluginRegistry:
    """What the plugins offered: kernel and communicator specs by name, origins, failures."""

    kernels: dict[str, KernelSpec]
    origins: dict[str, str]
    failures: tuple[str, ...]
    manager: pluggy.PluginManager = attrs.field(eq=False, repr=False)
    communicators: dict[str, CommunicatorSpec] = attrs.field(factory=dict)
    communicator_origins: dict[str, str] = attrs.field(factory=dict)
    plugins: tuple[PluginInfo, ...] = ()

    def describe(self) -> str:
        """A table of the loaded plugins, their distributions and backends, then the failures."""
        rows = [("plugin", "source", "distribution", "kernels", "communicators")]
        for p in self.plugins:
            where = f"{p.distribution} {p.version}" if p.distribution else "-"
            rows.append(
                (
                    p.name,
                    p.source,
                    where,
                    ", ".join(p.kernels) or "-",
                    ", ".join(p.communicators) or "-",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        lines.extend(f"failed: {failure}" for failure in self.failures)
        return "\n".join(lines)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _names(env_var: str) -> frozenset[str]:
    return frozenset(n.strip() for n in os.environ.get(env_var, "").split(",") if n.strip())


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distribution_of(module_name: str) -> tuple[str | None, str | None]:
    top = module_name.split(".")[0]
    names = _packages_distributions().get(top, [])
    if not names:
        return None, None
    try:
        return names[0], importlib.metadata.version(names[0])
    except importlib.metadata.PackageNotFoundError:
        return names[0], None


def _entry_points() -> Sequence[importlib.metadata.EntryPoint]:
    return tuple(importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME))


def build_registry(
    builtins: Iterable[BuiltinPlugin] = BUILTIN_PLUGINS,
    *,
    autoload: bool | None = None,
    allowed: Iterable[str] | None = None,
    blocked: Iterable[str] | None = None,
    strict: bool | None = None,
    entry_points: Callable[[], Sequence[importlib.metadata.EntryPoint]] = _entry_points,
) -> PluginRegistry:
    """Build a registry. An argument left ``None`` comes from its environment variable.

    ``allowed``: entry-point names to load (``None`` or empty: all). ``blocked``: entry-point
    names or built-in plugin names (``ringdilated.backends.sdpa``) to skip; blocking an
    essential built-in (``local``, ``reference``) raises :class:`PluginError`. ``strict``: raise
    :class:`PluginError` on the first failing plugin instead of warning and skipping it.
    """
    if autoload is None:
        autoload = not _env_flag(AUTOLOAD_ENV_VAR)
    allow = frozenset(allowed) if allowed is not None else _names(ALLOW_ENV_VAR)
    block = frozenset(blocked) if blocked is not None else _names(BLOCK_ENV_VAR)
    essential = sorted(block & ESSENTIAL_PLUGINS)
    if essential:
        raise PluginError(
            f"plugin(s) {', '.join(map(repr, essential))} cannot be blocked: they are essential "
            f"(one-process calls and the fallback kernel need them); remove them from "
            f"{BLOCK_ENV_VAR} or blocked="
        )
    strict = _env_flag(STRICT_ENV_VAR) if strict is None else strict
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    failures: list[str] = []
    infos: dict[str, PluginInfo] = {}

    def fail(name: str, why: str) -> None:
        if strict:
            raise PluginError(f"plugin {name!r} failed (strict mode): {why}")
        message = f"plugin {name!r} skipped: {why}"
        failures.append(message)
        warnings.warn(message, PluginWarning, stacklevel=3)

    def register(plugin: ModuleType | object, info: PluginInfo) -> None:
        try:
            pm.register(plugin, name=info.name)
        except Exception as exc:  # a plugin's hooks may be malformed in any way
            fail(info.name, f"registration failed: {type(exc).__name__}: {exc}")
        else:
            infos[info.name] = info

    for builtin in builtins:
        if builtin.name in block:
            continue
        dist, version = _distribution_of(builtin.name)
        register(builtin, PluginInfo(builtin.name, "built-in", dist, version))
    if autoload:
        for ep in _entry_points_safely(entry_points, fail):
            if ep.name in block or (allow and ep.name not in allow):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # an entry point may fail to import in any way
                fail(ep.name, f"import of {ep.value!r} failed: {type(exc).__name__}: {exc}")
                continue
            dist = getattr(ep, "dist", None)
            name, version = (dist.name, dist.version) if dist is not None else (None, None)
            register(plugin, PluginInfo(ep.name, "entry point", name, version))
    kernels, kernel_origins = _collect(pm, "ringdilated_kernels", KernelSpec, infos, fail)
    communicators, comm_origins = _collect(
        pm, "ringdilated_communicators", CommunicatorSpec, infos, fail
    )
    plugins = tuple(
        attrs.evolve(
            info,
            kernels=tuple(k for k, o in kernel_origins.items() if o.startswith(f"{name} (")),
            communicators=tuple(c for c, o in comm_origins.items() if o.startswith(f"{name} (")),
        )
        for name, info in infos.items()
    )
    return PluginRegistry(
        kernels, kernel_origins, tuple(failures), pm, communicators, comm_origins, plugins
    )


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
    infos: dict[str, PluginInfo],
    fail: Callable[[str, str], None],
) -> tuple[dict[str, Any], dict[str, str]]:
    """Call ``hook_name`` of every plugin on its own, keeping what is a list of ``spec_type``."""
    specs_by_name: dict[str, Any] = {}
    spec_origins: dict[str, str] = {}
    impls = {impl.plugin_name: impl for impl in getattr(pm.hook, hook_name).get_hookimpls()}
    # Registration order (built-ins first), so an earlier plugin keeps a contested name.
    for name in infos:
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
        origin = f"{name} ({infos[name].origin()})"
        for spec in specs:
            if spec.name in specs_by_name:
                fail(
                    name,
                    f"{spec_type.__name__} name {spec.name!r} from {origin} is already "
                    f"provided by {spec_origins[spec.name]}",
                )
                continue
            specs_by_name[spec.name] = spec
            spec_origins[spec.name] = origin
    return specs_by_name, spec_origins


@functools.lru_cache(maxsize=1)
def load_registry() -> PluginRegistry:
    """The process-wide registry, built on first use. ``load_registry.cache_clear()`` rebuilds."""
    return build_registry()
