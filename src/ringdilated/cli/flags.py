"""Flag parsing and checks shared by the commands.

Two kinds of check, two exit statuses:

- A flag whose value is wrong on its own (not a number, out of range, an unknown dtype, an
  output file in a missing directory) is rejected by argparse while it parses the command line,
  through the ``type=`` callables here: they raise :class:`argparse.ArgumentTypeError`, which
  :class:`Parser` prints as one line ``ringdilated COMMAND: error: argument --FLAG: ...`` and
  exits with status 2 before the command starts.
- Flags that conflict with each other, or a run this machine cannot do (no CUDA device, not
  enough memory), are checked by the command before any work; they raise ``ValueError`` (or
  ``MemoryError``) naming the flags, printed as one line with status 1.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import NoReturn

import torch

__all__ = [
    "DTYPES",
    "Parser",
    "at_least",
    "check_pattern",
    "cpu_or_cuda",
    "device_name",
    "device_problem",
    "dtype_name",
    "dtype_or_auto",
    "int_list",
    "output_file",
    "positive_int",
    "require_device",
    "to_dtype",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}
"""Every dtype name a flag takes (case-insensitive, ``torch.`` prefix allowed) and its dtype."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr,
    ``PROG: error: MESSAGE (see PROG --help)``, and exit status 2 (argparse's usage status)."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())  # argparse's own messages may wrap
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def at_least(minimum: int) -> Callable[[str], int]:
    """A ``type=`` callable: an integer (``_`` separators allowed) of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


positive_int = at_least(1)
"""A ``type=`` callable: an integer of at least 1."""


def int_list(minimum: int = 1) -> Callable[[str], list[int]]:
    """A ``type=`` callable: comma-separated integers, at least one, each ``>= minimum``."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(item) for item in text.split(",") if item.strip()]
        except ValueError:
            values = []
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        low = [v for v in values if v < minimum]
        if low:
            where = f" in {text!r}" if len(values) > 1 else ""
            raise argparse.ArgumentTypeError(
                f"every value must be at least {minimum}, got {low[0]}{where}"
            )
        return values

    parse.__name__ = f"list of integers >= {minimum}"
    return parse


def dtype_name(text: str) -> str:
    """A ``type=`` callable: a floating dtype name or alias (:data:`DTYPES`), as torch names it.

    ``"bf16"`` gives ``"bfloat16"``, ``"double"`` gives ``"float64"``, and so on.
    """
    key = text.strip().lower().removeprefix("torch.")
    if key not in DTYPES:
        names = ", ".join(DTYPES)
        raise argparse.ArgumentTypeError(f"expected a floating dtype ({names}), got {text!r}")
    return str(DTYPES[key]).removeprefix("torch.")


def dtype_or_auto(text: str) -> str:
    """A ``type=`` callable: ``"auto"`` or what :func:`dtype_name` takes."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return dtype_name(text)
    except argparse.ArgumentTypeError:
        names = ", ".join(DTYPES)
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or a floating dtype ({names}), got {text!r}"
        ) from None


def to_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name :func:`dtype_name` returned (or any alias it takes)."""
    return DTYPES[name.strip().lower().removeprefix("torch.")]


def device_name(text: str) -> str:
    """A ``type=`` callable: any torch device string (``cpu``, ``cuda``, ``cuda:1``, ...)."""
    try:
        return str(torch.device(text.strip()))
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"expected a torch device such as cpu, cuda or cuda:1, got {text!r}"
        ) from None


def cpu_or_cuda(text: str) -> str:
    """A ``type=`` callable: ``cpu``, ``cuda`` or ``cuda:N``."""
    name = device_name(text)
    if torch.device(name).type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return name


def device_problem(name: str) -> str | None:
    """Why ``--device name`` (already parsed) cannot be used on this machine, or ``None``."""
    device = torch.device(name)
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return f"--device {name}, but torch.cuda.is_available() is False on this machine"
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return f"--device {name}, but this machine has {count} CUDA device(s)"
    return None


def require_device(name: str) -> None:
    """Raise ``ValueError`` when :func:`device_problem` finds one."""
    problem = device_problem(name)
    if problem is not None:
        raise ValueError(problem)


def output_file(text: str) -> str:
    """A ``type=`` callable: a file path that can be written now.

    Its directory must exist and be writable, and the path must not be a directory (an existing
    file is overwritten). Checked when the command line is parsed, so a run never ends in an
    error about where to put its results.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file path")
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"directory {directory!r} of {text!r} does not exist")
    if os.path.exists(text):
        if not os.access(text, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r} exists and is not writable")
    elif not os.access(directory, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"directory {directory!r} of {text!r} is not writable")
    return text


def check_pattern(segments: list[int], rates: list[int], heads: int) -> None:
    """Raise ``ValueError`` naming the flags unless ``--segments`` and ``--rates`` make a
    :class:`~ringdilated.core.plan.pattern.DilationPattern` that ``--heads`` heads fit.

    The pattern's own message comes first, the flags that gave it after.
    """
    from ringdilated.core.plan.pattern import DilationPattern

    given = f"--segments {_joined(segments)} --rates {_joined(rates)}"
    try:
        pattern = DilationPattern(segments, rates)
    except ValueError as exc:
        raise ValueError(f"{exc} (from {given})") from None
    try:
        pattern.check_heads(heads, heads)
    except ValueError as exc:
        raise ValueError(f"--heads {heads} does not fit {given}: {exc}") from None


def _joined(values: list[int]) -> str:
    return ",".join(str(v) for v in values)
