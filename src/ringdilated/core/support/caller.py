"""Where a warning points: the user's line that called into ringdilated.

``warnings.warn(..., stacklevel=n)`` counts frames, and the number of frames between the user's
call and the line that warns differs per entry point (a module's ``forward`` under
``nn.Module.__call__``, a functional call, a planned layout, a compiled region, a Hugging Face
model's layers). So every warning of the package takes :func:`user_stacklevel` instead of a
fixed number.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["user_stacklevel"]

_PACKAGE = os.sep.join(os.path.abspath(__file__).split(os.sep)[: -__name__.count(".")]) + os.sep
"""The ``ringdilated`` package's folder (this module is ``ringdilated.core.support.caller``)."""
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _folder(module: object) -> str | None:
    """The folder of an imported package (``None`` for one without a file, e.g. a stub)."""
    filename = getattr(module, "__file__", None)
    if not isinstance(filename, str):
        return None
    return os.path.dirname(os.path.abspath(filename)) + os.sep


_WRAPPERS = ("transformers", "accelerate", "peft")
"""Packages whose frames stand between a user's line and ringdilated once imported: a Hugging
Face model's layers call the adapter (its warnings would name ``modeling_llama.py``),
accelerate's hooks and peft's wrappers call a model's ``forward``."""


def _libraries() -> tuple[str, ...]:
    """The folders whose frames stand between a user's line and ringdilated: ringdilated's,
    torch's (``nn.Module.__call__``, ``torch._dynamo``'s wrappers, ``torch.utils.checkpoint``)
    and those of :data:`_WRAPPERS` that are imported. They are looked up in ``sys.modules``,
    never imported: the frames can only be theirs when they are."""
    found = (_folder(sys.modules.get(name)) for name in _WRAPPERS)
    return (_PACKAGE, _TORCH, *(f for f in found if f is not None))


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by the caller of this function name the
    first frame outside ringdilated, torch and the wrappers (see :func:`_libraries`): 2 would
    name the function that calls ``warnings.warn``; each library frame above it adds one."""
    inside = _libraries()
    frame, level = sys._getframe(1), 1  # the function that warns
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
