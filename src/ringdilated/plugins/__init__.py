"""The pluggy layer: hook specifications, the plugin manager and the registry of backends."""

from ringdilated.plugins import manager
from ringdilated.plugins.hookspecs import hookimpl, hookspec
from ringdilated.plugins.manager import *  # noqa: F403  (the names of its __all__)
from ringdilated.plugins.manager import load_registry

__all__ = ["describe", "hookimpl", "hookspec"]
__all__ += manager.__all__


def describe() -> str:
    """What is loaded, from which distribution and version, and what failed and why."""
    return load_registry().describe()
