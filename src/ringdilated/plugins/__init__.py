"""The pluggy layer: hook specifications, the plugin manager and the registry of backends."""

from ringdilated.plugins.hookspecs import hookimpl, hookspec
from ringdilated.plugins.manager import (
    AUTOLOAD_ENV_VAR,
    BLOCK_ENV_VAR,
    PluginRegistry,
    PluginWarning,
    build_registry,
    load_registry,
)

__all__ = [
    "AUTOLOAD_ENV_VAR",
    "BLOCK_ENV_VAR",
    "PluginRegistry",
    "PluginWarning",
    "build_registry",
    "hookimpl",
    "hookspec",
    "load_registry",
]
