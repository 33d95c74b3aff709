"""The process-wide registry of backends and the resolver over it.

``default_resolver()`` builds, once, a :class:`~ringdilated.core.Resolver` over every kernel and
communicator the plugins (built-in and entry-point) offer. ``default_resolver.cache_clear()`` and
``ringdilated.plugins.load_registry.cache_clear()`` rebuild it, after changing plugin environment
variables. Everything that resolves (the functional API, the compiled op, the modules, the
command line, the conformance kits) asks here; none of them owns a resolver.
"""

from __future__ import annotations

import functools
import re
import warnings

from ringdilated.core import Environment, Resolver
from ringdilated.core.select import PACKAGES_ENV_VAR
from ringdilated.core.support import unknown_names, user_stacklevel
from ringdilated.plugins.builtins import BUILTIN_PLUGINS
from ringdilated.plugins.manager import PluginRegistry, PluginWarning, load_registry

__all__ = ["default_resolver"]

_FAILED_PLUGIN = re.compile(r"""^plugin ('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""")


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
    blocked. Where a plugin failed to load (only outside strict mode: strict mode raised
    already), its kernels' packages are unknown and the name may be one of them: the same
    message, naming the failed plugins, comes as a :class:`PluginWarning` instead, so a broken
    plugin does not stop every other backend and a misspelt name is still reported."""
    if env.packages is None:
        return
    specs = [*registry.kernels.values(), *(k for p in BUILTIN_PLUGINS for k in p.kernels)]
    known = {name for spec in specs for name in spec.capabilities.requires}
    unknown = sorted(env.packages - known)
    if not unknown:
        return
    message = unknown_names(PACKAGES_ENV_VAR, unknown, known, "a package a kernel requires")
    # The failed plugins' names (quoted) from the registry's failure lines, once each, in order.
    matches = ((_FAILED_PLUGIN.match(failure), failure) for failure in registry.failures)
    failed = list(dict.fromkeys(match.group(1) if match else failure for match, failure in matches))
    if failed:
        message += (
            f"; plugins that failed to load, whose kernels' packages are unknown, may require "
            f"{'it' if len(unknown) == 1 else 'them'}: {', '.join(failed)} (fix them, or drop "
            f"the name from {PACKAGES_ENV_VAR})"
        )
        warnings.warn(message, PluginWarning, stacklevel=user_stacklevel())
        return
    raise ValueError(message)
