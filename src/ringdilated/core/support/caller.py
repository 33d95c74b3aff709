"""Where a warning points: the user's line that called into ringdilated.

``warnings.warn(..., stacklevel=n)`` counts frames, and the number of frames between the user's
call and the line that warns differs per entry point (a module's ``forward`` under
``nn.Module.__call__``, a functional call, a planned layout, a compiled region). So every
warning of the package takes :func:`user_stacklevel` instead of a fixed number.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["user_stacklevel"]

_PACKAGE = os.sep.join(os.path.abspath(__file__).split(os.sep)[: -__name__.count(".")]) + os.sep
"""The ``ringdilated`` package's folder (this module is ``ringdilated.core.support.caller``)."""
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _inside(filename: str) -> bool:
    """Whether a frame of this file is the library's: ringdilated's, or torch's, which stands
    between a user's line and ringdilated (``nn.Module.__call__``, ``torch._dynamo``'s
    wrappers, ``torch.utils.checkpoint``)."""
    return filename.startswith((_PACKAGE, _TORCH))


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by the caller of this function name the
    first frame outside ringdilated and torch: 2 would name the
    function that calls ``warnings.warn``; each library frame above it adds one."""
    frame = sys._getframe(1)  # the function that warns
    level = 1
    while frame is not None and _inside(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
