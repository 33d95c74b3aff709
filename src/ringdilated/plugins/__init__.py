"""The pluggy layer: hook specifications, the plugin manager and the registry of backends."""

from ringdilated.plugins.hookspecs import hookimpl, hookspec
from ringdilated.plugins.manager import (
    ALLOW_ENV_VAR,
    AUTOLOAD_ENV_VAR,
    BLOCK_ENV_VAR,
    STRICT_ENV_VAR,
    PluginError,
    PluginInfo,
    PluginRegistry,
    PluginWarning,
    build_registry,
    load_registry,
)

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
    "describe",
    "hookimpl",
    "hookspec",
    "load_registry",
]


def describe() -> str:
    """What is loaded, from which distribution and version, and what failed and why."""
    return load_registry().describe()
