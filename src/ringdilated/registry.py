"""The process-wide registry of backends and the resolver over it.

``default_resolver()`` builds, once, a :class:`~ringdilated.core.Resolver` over every kernel and
communicator the plugins (built-in and entry-point) offer. ``default_resolver.cache_clear()`` and
``ringdilated.plugins.load_registry.cache_clear()`` rebuild it, after changing plugin environment
variables. Everything that resolves (the functional API, the compiled op, the modules, the
command line, the conformance kits) asks here; none of them owns a resolver.
"""

from __future__ import annotations

import functools

from ringdilated.core.select.capabilities import PACKAGES_ENV_VAR, Environment
from ringdilated.core.select.resolver import Resolver
from ringdilated.core.support.env import unknown_names
from ringdilated.plugins.builtins import BUILTIN_PLUGINS
from ringdilated.plugins.manager import PluginRegistry, load_registry

__all__ = ["default_resolver"]


@functools.lru_cache(maxsize=1)
def default_resolver() -> Resolver:
    """The resolver over every loaded plugin's kernels and communicators, on the machine that
    :meth:`Environment.from_environ <ringdilated.core.Environment.from_environ>` describes.

    Raises ``ValueError`` when ``RINGDILATED_PACKAGES`` names a package that no loaded kernel
    requires (a misspelt name would otherwise silently count a needed package as missing), and
    whatever building the registry raises (:func:`~ringdilated.plugins.load_registry`)."""
    registry = load_registry()
    env = Environment.from_environ()
    _check_packages(env, registry)
    return Resolver(
        registry.kernels.values(),
        env=env,
        plugin_failures=registry.failures,
        communicators=registry.communicators.values(),
    )


def _check_packages(env: Environment, registry: PluginRegistry) -> None:
    """Raise ``ValueError`` naming ``RINGDILATED_PACKAGES`` for a package in ``env.packages``
    that no kernel lists in ``Capabilities.requires``: a loaded one, or a built-in one even when
    blocked. When a plugin failed to load its kernels' packages are unknown, so nothing is
    refused then (the failure itself is reported: one plugin must not break other calls)."""
    if env.packages is None or registry.failures:
        return
    specs = [*registry.kernels.values(), *(k for p in BUILTIN_PLUGINS for k in p.kernels)]
    known = {name for spec in specs for name in spec.capabilities.requires}
    unknown = sorted(env.packages - known)
    if unknown:
        raise ValueError(
            unknown_names(PACKAGES_ENV_VAR, unknown, known, "a package a kernel requires")
        )
