"""The process-wide registry of backends and the resolver over it.

``default_resolver()`` builds, once, a :class:`~ringdilated.core.Resolver` over every kernel and
communicator the plugins (built-in and entry-point) offer. ``default_resolver.cache_clear()`` and
``ringdilated.plugins.load_registry.cache_clear()`` rebuild it, after changing plugin environment
variables. Everything that resolves (the functional API, the compiled op, the modules, the
command line, the conformance kits) asks here; none of them owns a resolver.
"""

from __future__ import annotations

import functools

from ringdilated.core.capabilities import Environment
from ringdilated.core.resolver import Resolver
from ringdilated.plugins.manager import load_registry

__all__ = ["default_resolver"]


@functools.lru_cache(maxsize=1)
def default_resolver() -> Resolver:
    """The resolver over every loaded plugin's kernels and communicators."""
    registry = load_registry()
    return Resolver(
        registry.kernels.values(),
        env=Environment.from_environ(),
        plugin_failures=registry.failures,
        communicators=registry.communicators.values(),
    )
