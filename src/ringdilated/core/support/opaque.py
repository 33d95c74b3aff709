"""Python objects that ``torch.library`` custom ops may take as arguments (torch's *opaque
reference types*), so that ``torch.compile`` passes them into a graph as inputs, without
guarding on them or tracing into them.

A :class:`~ringdilated.core.call.sequence_layout.SequenceLayout` made once per batch reaches the
registered attention op this way: a new layout per batch reuses the compiled graph. Opaque
types arrived in torch 2.9 (``torch._library.opaque_object``, still private there); with an
older torch, :data:`SUPPORTED` is ``False``, the classes are plain classes, and calls that would
take an op with them run eagerly behind a graph break instead.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["SUPPORTED", "OpaqueBase", "register"]

T = TypeVar("T", bound=type)

try:
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase

    SUPPORTED = True
except ImportError:  # torch < 2.9

    class OpaqueBase:  # type: ignore[no-redef]
        """A plain base class where torch has no opaque types."""

    SUPPORTED = False


def register(cls: T) -> T:
    """Register ``cls`` (a subclass of :class:`OpaqueBase`) as an opaque reference type, where
    torch supports them; returns it."""
    if SUPPORTED:
        register_opaque_type(cls, typ="reference")
    return cls
