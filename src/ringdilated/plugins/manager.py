"""The plugin manager: built-ins, entry-point plugins, isolation of broken ones.

Call flow::

    registry = load_registry()     # built-ins + the 'ringdilated' entry-point group, once, cached
    registry.kernels               # {name: KernelSpec} from every plugin that loaded
    registry.failures              # one line per plugin that failed to import or whose hook raised
    registry.origins               # {kernel name: where it came from}

    registry.plugins               # one PluginInfo per plugin: distribution, version, what it gave
    print(registry.describe())     # the same as a table, failures included

A plugin that fails to import, raises in a hook, or returns something that is not a list of specs
is skipped with a :class:`PluginWarning` naming it. Each spec it returns is validated field by
field (:func:`~ringdilated.plugins.spec_validation.validate_spec`, nested values included): a
malformed spec, or one whose backend name another plugin already took, is skipped on its own
with a warning naming the plugin, the spec and the field (for a duplicate name, both plugins and
their distributions); the plugin's other specs still register. Every failure is kept for
``KernelChoice.explain()`` and ``describe()``. In strict mode the same failure raises
:class:`PluginError`. What loads is controlled by :func:`build_registry`'s arguments or their
environment variables (the ``*_ENV_VAR`` names below; docs/plugins.md has the table).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

import attrs
import pluggy

from ringdilated.core.contract.rules import describe, describe_exception
from ringdilated.core.select.capabilities import KernelSpec
from ringdilated.core.select.communicator_spec import CommunicatorSpec
from ringdilated.core.support.caller import user_stacklevel
from ringdilated.core.support.env import env_flag, env_names, unknown_names
from ringdilated.core.support.errors import PluginError, PluginWarning
from ringdilated.plugins import hookspecs
from ringdilated.plugins.builtins import BUILTIN_PLUGINS, ESSENTIAL_PLUGINS, BuiltinPlugin
from ringdilated.plugins.spec_validation import SpecError, spec_label, validate_spec

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
            backends = (", ".join(p.kernels) or "-", ", ".join(p.communicators) or "-")
            rows.append((p.name, p.source, where, *backends))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        lines.extend(f"failed: {failure}" for failure in self.failures)
        return "\n".join(lines)

    def failures_of(self, plugin: str) -> tuple[str, ...]:
        """The failures reported for the plugin named ``plugin`` (an entry-point or built-in
        plugin name): its import, its hooks, or one of its specs; ``()`` if none."""
        return tuple(
            f for f in self.failures if f.startswith((f"plugin {plugin!r} ", f"plugin {plugin!r}:"))
        )


class _Fail(Protocol):
    """Reports a failing plugin (or one of its specs): warns, or raises in strict mode."""

    def __call__(self, name: str, why: str, spec: str | None = None) -> None: ...


def _builtin_names(builtins: Sequence[BuiltinPlugin]) -> dict[str, frozenset[str]]:
    """Every name that designates a built-in plugin: its module name and its short name (the
    module's last part, also the backend it offers), mapped to the module names it designates."""
    names: dict[str, set[str]] = {}
    for builtin in builtins:
        for alias in (builtin.name, builtin.name.rpartition(".")[2]):
            names.setdefault(alias, set()).add(builtin.name)
    return {alias: frozenset(modules) for alias, modules in names.items()}


def _entry_point_names(entry_points: Sequence[importlib.metadata.EntryPoint]) -> frozenset[str]:
    """The readable, non-empty str names among ``entry_points`` (for checking names)."""
    names = (_attribute(ep, "name") for ep in entry_points)
    return frozenset(n for n in names if type(n) is str and n)


def _check_env_names(
    allow: tuple[str, ...] | None,
    block: tuple[str, ...] | None,
    builtin_names: Mapping[str, frozenset[str]],
    entry_point_names: frozenset[str],
) -> None:
    """Raise ``ValueError`` for a name in ``RINGDILATED_ALLOW_PLUGINS`` that is no installed
    entry point, or in ``RINGDILATED_BLOCK_PLUGINS`` that is neither that nor a built-in plugin's
    module or short name (``None``: the variable is unset or the argument was given)."""
    unknown_allowed = [n for n in allow or () if n not in entry_point_names]
    if unknown_allowed:
        message = unknown_names(
            ALLOW_ENV_VAR, unknown_allowed, entry_point_names, "an installed entry point"
        )
        if any(n in builtin_names for n in unknown_allowed):
            message += f"; built-ins always load unless {BLOCK_ENV_VAR} names them"
        raise ValueError(message)
    accepted = set(builtin_names) | entry_point_names
    unknown_blocked = [n for n in block or () if n not in accepted]
    if unknown_blocked:
        raise ValueError(
            unknown_names(
                BLOCK_ENV_VAR,
                unknown_blocked,
                accepted,
                "a built-in plugin (module or short name) or an installed entry point",
            )
        )


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
    entry_points: Callable[[], Sequence[importlib.metadata.EntryPoint]] | None = None,
) -> PluginRegistry:
    """Build a registry. An argument left ``None`` comes from its environment variable
    (``RINGDILATED_DISABLE_PLUGIN_AUTOLOAD=1``: ``autoload=False``; ``RINGDILATED_ALLOW_PLUGINS``,
    ``RINGDILATED_BLOCK_PLUGINS``: comma-separated names; ``RINGDILATED_STRICT_PLUGINS``).

    ``allowed``: entry-point names to load (``None`` or empty: all). ``blocked``: plugin names to
    skip: entry-point names, and built-ins by module name (``ringdilated.backends.sdpa``) or
    short name (``sdpa``); a name skips every plugin it names. Blocking an essential built-in
    (``local``, ``reference``) raises :class:`PluginError`. ``strict``: raise
    :class:`PluginError` on the first failing plugin instead of warning and skipping it.
    ``entry_points``: lists the ``ringdilated`` entry-point group (default: from the installed
    distributions' metadata); it is called only when plugins autoload or an environment
    variable names a plugin to check.

    The environment variables are read strictly: a switch other than ``1/true/yes/on``,
    ``0/false/no/off``, empty or unset, a name in ``RINGDILATED_ALLOW_PLUGINS`` that is no
    listed entry point, or one in ``RINGDILATED_BLOCK_PLUGINS`` that is neither that nor a
    built-in's module or short name, raises ``ValueError`` naming the variable, its value and
    what is accepted. Names given as arguments are taken as given (a program may name a plugin
    that is not installed here).
    """
    builtins = tuple(builtins)
    autoload = not env_flag(AUTOLOAD_ENV_VAR) if autoload is None else autoload
    strict = env_flag(STRICT_ENV_VAR) if strict is None else strict
    allow_env = env_names(ALLOW_ENV_VAR) if allowed is None else None
    block_env = env_names(BLOCK_ENV_VAR) if blocked is None else None
    allow = frozenset(allowed if allowed is not None else allow_env or ())
    block = frozenset(blocked if blocked is not None else block_env or ())
    builtin_names = _builtin_names(builtins)
    failures: list[str] = []

    def fail(name: str, why: str, spec: str | None = None) -> None:
        if strict:
            what = f"{spec}: {why}" if spec else why
            raise PluginError(name, f"plugin {name!r} failed (strict mode): {what}")
        message = (
            f"plugin {name!r}: {spec} skipped: {why}" if spec else f"plugin {name!r} skipped: {why}"
        )
        failures.append(message)
        warnings.warn(message, PluginWarning, stacklevel=user_stacklevel())

    to_check = (allow_env or ()) + tuple(n for n in block_env or () if n not in builtin_names)
    listed: Sequence[importlib.metadata.EntryPoint] = ()
    if autoload or to_check:
        listed = _entry_points_safely(entry_points or _entry_points, fail)
    _check_env_names(allow_env, block_env, builtin_names, _entry_point_names(listed))
    blocked_builtins = {module for name in block for module in builtin_names.get(name, ())}
    essential = sorted(blocked_builtins & ESSENTIAL_PLUGINS)
    if essential:
        named = sorted(n for n in block if builtin_names.get(n, frozenset()) & ESSENTIAL_PLUGINS)
        source = (
            f"{BLOCK_ENV_VAR}={os.environ.get(BLOCK_ENV_VAR, '')!r}"
            if blocked is None
            else "blocked="
        )
        raise PluginError(
            ", ".join(named),
            f"plugin(s) {', '.join(map(repr, named))} ({', '.join(essential)}) cannot be "
            f"blocked: they are essential (one-process calls and the fallback kernel need "
            f"them); remove them from {source}",
        )
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    infos: dict[str, PluginInfo] = {}

    def register(plugin: ModuleType | object, info: PluginInfo) -> None:
        try:
            pm.register(plugin, name=info.name)
        except Exception as exc:  # a plugin's hooks may be malformed in any way
            fail(info.name, f"registration failed: {type(exc).__name__}: {exc}")
        else:
            infos[info.name] = info

    for builtin in builtins:
        if builtin.name in blocked_builtins:
            continue
        register(builtin, PluginInfo(builtin.name, "built-in", *_distribution_of(builtin.name)))
    if autoload:
        for ep in listed:
            try:
                ep_name = ep.name
            except Exception as exc:  # an entry point object may be broken in any way
                fail("<entry point>", f"reading its name raised {type(exc).__name__}: {exc}")
                continue
            if type(ep_name) is not str or not ep_name:
                fail(
                    str(ep_name),
                    f"entry point name must be a non-empty str, got {describe(ep_name)}",
                )
                continue
            if ep_name in block or (allow and ep_name not in allow):
                continue
            try:
                plugin = ep.load()
            except (KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as exc:  # an import may fail in any way, SystemExit included
                fail(
                    ep_name,
                    f"import of {describe(_attribute(ep, 'value'))} failed: "
                    f"{type(exc).__name__}: {describe_exception(exc)}",
                )
                continue
            register(plugin, PluginInfo(ep_name, "entry point", *_distribution_of_entry_point(ep)))
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


def _distribution_of_entry_point(
    ep: importlib.metadata.EntryPoint,
) -> tuple[str | None, str | None]:
    """The entry point's distribution name and version, as str (``None`` where unknown)."""
    try:
        dist = getattr(ep, "dist", None)
        if dist is None:
            return None, None
        name, version = dist.name, dist.version
    except Exception:  # broken distribution metadata must not break the library
        return None, None
    return (None if name is None else str(name)), (None if version is None else str(version))


def _attribute(obj: object, name: str) -> object:
    """``obj.name``, or a placeholder when reading it fails in any way (for messages)."""
    try:
        return getattr(obj, name, None)
    except Exception as exc:  # a hostile object's property may raise anything
        return f"<unreadable: {type(exc).__name__}>"


def _entry_points_safely(
    entry_points: Callable[[], Sequence[importlib.metadata.EntryPoint]], fail: _Fail
) -> Sequence[importlib.metadata.EntryPoint]:
    try:
        return tuple(entry_points())
    except Exception as exc:  # broken distribution metadata must not break the library
        fail("<entry points>", f"listing the {hookspecs.PROJECT_NAME!r} group failed: {exc}")
        return ()


def _collect(
    pm: pluggy.PluginManager,
    hook_name: str,
    spec_type: type[Any],
    infos: dict[str, PluginInfo],
    fail: _Fail,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Call ``hook_name`` of every plugin on its own, keeping each valid ``spec_type`` it returned.

    A return value that is not a list of ``spec_type`` skips the plugin's hook; a malformed spec
    or a taken name skips that spec only.
    """
    specs_by_name: dict[str, Any] = {}
    spec_origins: dict[str, str] = {}
    impls = {impl.plugin_name: impl for impl in getattr(pm.hook, hook_name).get_hookimpls()}
    # Registration order (built-ins first), so an earlier plugin keeps a contested name.
    for name in infos:
        if name not in impls:
            continue
        try:
            returned: Any = impls[name].function()
            specs = tuple(returned) if isinstance(returned, (list, tuple)) else None
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as exc:  # a plugin's hook may raise anything, SystemExit included
            fail(name, f"{hook_name}() raised {type(exc).__name__}: {describe_exception(exc)}")
            continue
        if specs is None or not all(isinstance(s, spec_type) for s in specs):
            kind = spec_type.__name__
            fail(name, f"{hook_name}() must return a list of {kind}, got {describe(returned)}")
            continue
        origin = f"{name} ({infos[name].origin()})"
        for spec in specs:
            try:
                validate_spec(spec, spec_type)
            except SpecError as exc:
                fail(name, f"malformed {exc}", spec=spec_label(spec, spec_type))
                continue
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
