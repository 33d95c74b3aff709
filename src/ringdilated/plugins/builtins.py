"""The built-in backends (:mod:`ringdilated.backends`), offered through the same hooks a third
party implements: one :class:`BuiltinPlugin` per backend module, named after it, the way pytest
lists its default plugins. The plugin manager registers them before any entry-point plugin, so a
built-in keeps a contested backend name. ``local`` and ``reference`` are essential (every
single-process call needs ``local``; ``reference`` serves what no other kernel does) and cannot
be blocked.
"""

from __future__ import annotations

import attrs

from ringdilated.backends.allgather import ALLGATHER_SPEC
from ringdilated.backends.cudnn import CUDNN_SPEC
from ringdilated.backends.flash import FLASH_SPEC
from ringdilated.backends.flash3 import FLASH3_SPEC
from ringdilated.backends.flash4 import FLASH4_SPEC
from ringdilated.backends.flex import FLEX_SPEC
from ringdilated.backends.hybrid import HYBRID_SPEC
from ringdilated.backends.local import LOCAL_SPEC
from ringdilated.backends.reference import REFERENCE_SPEC
from ringdilated.backends.ringpass import RINGPASS_SPEC
from ringdilated.backends.sdpa import SDPA_SPEC
from ringdilated.backends.torch_flash import TORCH_FLASH_SPEC
from ringdilated.backends.ulysses import ULYSSES_SPEC
from ringdilated.backends.xformers import XFORMERS_SPEC
from ringdilated.core.select.capabilities import KernelSpec
from ringdilated.core.select.communicator_spec import CommunicatorSpec
from ringdilated.plugins.hookspecs import hookimpl

__all__ = ["BUILTIN_PLUGINS", "ESSENTIAL_PLUGINS", "BuiltinPlugin"]


@attrs.frozen
class BuiltinPlugin:
    """One built-in backend module's specs, offered through the plugin hooks."""

    name: str
    kernels: tuple[KernelSpec, ...] = ()
    communicators: tuple[CommunicatorSpec, ...] = ()

    @hookimpl
    def ringdilated_kernels(self) -> list[KernelSpec]:
        return list(self.kernels)

    @hookimpl
    def ringdilated_communicators(self) -> list[CommunicatorSpec]:
        return list(self.communicators)


def _plugin(module: str, *specs: KernelSpec | CommunicatorSpec) -> BuiltinPlugin:
    return BuiltinPlugin(
        f"ringdilated.backends.{module}",
        tuple(s for s in specs if isinstance(s, KernelSpec)),
        tuple(s for s in specs if isinstance(s, CommunicatorSpec)),
    )


BUILTIN_PLUGINS: tuple[BuiltinPlugin, ...] = (
    _plugin("sdpa", SDPA_SPEC),
    _plugin("torch_flash", TORCH_FLASH_SPEC),
    _plugin("cudnn", CUDNN_SPEC),
    _plugin("reference", REFERENCE_SPEC),
    _plugin("flash", FLASH_SPEC),
    _plugin("flash3", FLASH3_SPEC),
    _plugin("flash4", FLASH4_SPEC),
    _plugin("xformers", XFORMERS_SPEC),
    _plugin("flex", FLEX_SPEC),
    _plugin("local", LOCAL_SPEC),
    _plugin("ringpass", RINGPASS_SPEC),
    _plugin("allgather", ALLGATHER_SPEC),
    _plugin("ulysses", ULYSSES_SPEC),
    _plugin("hybrid", HYBRID_SPEC),
)
ESSENTIAL_PLUGINS = frozenset({"ringdilated.backends.local", "ringdilated.backends.reference"})
