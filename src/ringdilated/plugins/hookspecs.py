"""The hooks a ringdilated plugin implements.

A plugin is a module or object with functions named after these specs and marked with
:data:`hookimpl`. Built-in backends register through exactly these hooks; third-party ones arrive
through the ``ringdilated`` entry-point group (see ``docs/plugins.md``)::

    # mypackage/ringdilated_plugin.py
    from ringdilated.plugins import hookimpl

    @hookimpl
    def ringdilated_kernels():
        return [KernelSpec(name="mykernel", factory=MyKernel, capabilities=..., priority=50)]

    # pyproject.toml
    [project.entry-points.ringdilated]
    mykernel = "mypackage.ringdilated_plugin"
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ringdilated.core.select.capabilities import KernelSpec
    from ringdilated.core.select.communicator_spec import CommunicatorSpec

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]

PROJECT_NAME = "ringdilated"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def ringdilated_kernels() -> list[KernelSpec]:  # type: ignore[empty-body]
    """Return the kernel backends this plugin offers, as :class:`~ringdilated.core.KernelSpec`.

    Called once when the plugin registry is built. Must not import heavy optional packages:
    a spec declares the packages it needs in ``Capabilities.requires`` and its factory imports
    them only once the resolver has chosen it.
    """


@hookspec
def ringdilated_communicators() -> list[CommunicatorSpec]:  # type: ignore[empty-body]
    """Return the communicators this plugin offers, as
    :class:`~ringdilated.core.select.communicator_spec.CommunicatorSpec`.

    Called once when the plugin registry is built, like :func:`ringdilated_kernels`.
    """
