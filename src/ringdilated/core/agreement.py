"""Every rank checks its call, then all ranks agree before any data moves (docs/spec.md, section 3).

Call flow::

    error = None
    try: validate locally                  # pattern, shapes, dtypes, layouts, kernel, communicator
    except Exception as exc: error = exc
    agree(group, error, CallSignature(...))    # one small all_gather_object

If any rank rejected its input, every rank raises (that rank its own error, the others a
``ValueError`` naming it); if the ranks' signatures differ, every rank raises a ``ValueError``
naming each differing field. No rank is left waiting in an exchange, and there is no way to skip
the agreement: ranks whose shapes differ would otherwise exchange buffers of different sizes.
"""

from __future__ import annotations

from typing import cast

import attrs
import torch.distributed as dist

__all__ = ["CallSignature", "agree", "safe_repr"]


def safe_repr(value: object) -> str:
    """``repr(value)``, or a placeholder naming its type if that raises."""
    try:
        return repr(value)
    except Exception:  # a caller's object may fail to print in any way
        return f"<{type(value).__name__} whose repr raised>"


@attrs.frozen
class CallSignature:
    """What every rank must pass identically, as strings (built from any object a caller passed,
    so it always pickles; see :func:`safe_repr`). ``backward``: whether this rank will run a
    backward (a rank that does while its peer does not would wait in the backward exchange)."""

    pattern: str
    causal: str
    scale: str
    dropout_p: str
    dtype: str
    q_shape: str
    k_shape: str
    backward: bool
    kernel: str | None
    communicator: str | None

    def differences(self, other: CallSignature, rank: int) -> list[str]:
        return [
            f"{field.name}: rank 0 {getattr(self, field.name)}, rank {rank} "
            f"{getattr(other, field.name)}"
            for field in attrs.fields(CallSignature)
            if getattr(self, field.name) != getattr(other, field.name)
        ]


def agree(
    group: dist.ProcessGroup, error: Exception | None, signature: CallSignature | None
) -> None:
    """Raise on every rank if any rank failed validation or the ranks' signatures differ.

    A rank that failed may pass ``signature=None`` (its peers then raise naming its error)."""
    if error is None and signature is None:
        raise ValueError("agree() needs a signature from a rank whose checks passed")
    gathered: list[object] = [None] * dist.get_world_size(group)
    mine = (None if error is None else f"{type(error).__name__}: {error}", signature)
    dist.all_gather_object(gathered, mine, group=group)
    reports = cast(list[tuple[str | None, CallSignature]], gathered)  # all set: none failed
    failures = [(rank, message) for rank, (message, _) in enumerate(reports) if message]
    if failures:
        if error is not None:
            raise error
        rank, message = failures[0]
        raise ValueError(f"rank {rank} rejected its input, so every rank stops: {message}")
    reference = reports[0][1]
    for rank, (_, other) in enumerate(reports):
        diffs = reference.differences(other, rank)
        if diffs:
            raise ValueError(
                "ranks disagree on the call (every rank must pass the same): " + "; ".join(diffs)
            )
