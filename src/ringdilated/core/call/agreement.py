"""Every rank checks its call, then all ranks agree before any data moves (docs/spec.md, section 3).

Call flow::

    error = None
    try: validate locally                  # pattern, shapes, dtypes, layouts, kernel, communicator
    except Exception as exc: error = exc
    agree(group, error, CallSignature(...))

If any rank rejected its input, every rank raises (that rank its own error, the others a
``ValueError`` naming it); if the ranks' signatures differ, every rank raises a ``ValueError``
naming each differing field. No rank is left waiting in an exchange, and there is no way to skip
the agreement: ranks whose shapes differ would otherwise exchange buffers of different sizes.

Cost: the ranks first exchange a 64-bit digest of their signatures, an error flag, their
shard length and their query length in one ``all_gather`` of four integers each
(:func:`gather_flags`). Only when that
finds a failure or a difference do they exchange the full reports (one ``all_gather_object``) to
name it. So a call that agrees costs one small fixed-size collective and no pickling. Shards of
different lengths (docs/spec.md, section 3) cost one more: the first exchange tells every rank
the lengths, each checks its call again with them, and they agree again. That collective cannot be
skipped for a signature seen before: a rank cannot learn that a peer's input was rejected this
time without hearing from it. A query suffix (docs/spec.md, section 3: ``q`` shorter than a
rank's shard) costs the same second agreement: a rank holding no query cannot know the suffix from
its own shapes, so the first exchange tells every rank every rank's query length (a
:class:`Split`), each checks its call again with them, and they agree again.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import cast

import attrs
import torch
import torch.distributed as dist

from ringdilated.core.call import grid
from ringdilated.core.call.grid import Grid
from ringdilated.core.support.errors import (
    AgreementError,
    CallMismatchError,
    EveryRankError,
    PeerRejectedError,
    raised_on_every_rank,
)

Layout = dist.ProcessGroup | Grid
"""A process group, or a 2-D :class:`~ringdilated.core.call.grid.Grid` of two."""

__all__ = [
    "BatchSignature",
    "CallSignature",
    "LayoutSignature",
    "Split",
    "agree",
    "agreed",
    "compare_reports",
    "control_layout",
    "gather_flags",
    "safe_repr",
    "safe_str",
    "shard_lengths",
]


def safe_repr(value: object) -> str:
    """``repr(value)``, or a placeholder naming its type if that raises; always encodable as
    UTF-8 (a lone surrogate is escaped), so it can be digested and sent."""
    try:
        text = repr(value)
    except Exception:  # a caller's object may fail to print in any way
        text = f"<{type(value).__name__} whose repr raised>"
    return _encodable(text)


def safe_str(error: BaseException) -> str:
    """``f"{type}: {error}"``, or a placeholder if ``str(error)`` raises; UTF-8 encodable."""
    try:
        text = f"{type(error).__name__}: {error}"
    except Exception:
        text = f"{type(error).__name__} (whose message raised)"
    return _encodable(text)


def _encodable(text: object) -> str:
    text = str.__str__(text) if isinstance(text, str) else "<not a str>"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class _Fields:
    """Comparison of an attrs class of string fields between ranks: a digest, and the names of
    the fields that differ."""

    def digest(self) -> int:
        """A 63-bit digest of every field (ranks whose digests are equal agree)."""
        names = [f.name for f in attrs.fields(type(self))]  # type: ignore[arg-type]
        text = "\x1f".join([type(self).__name__, *(str(getattr(self, n)) for n in names)])
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest()) >> 1

    def differences(self, other: object, rank: int) -> list[str]:
        if type(other) is not type(self):
            return [f"what: rank 0 {type(self).__name__}, rank {rank} {type(other).__name__}"]
        return [
            f"{field.name}: rank 0 {getattr(self, field.name)}, rank {rank} "
            f"{getattr(other, field.name)}"
            for field in attrs.fields(type(self))  # type: ignore[arg-type]
            if getattr(self, field.name) != getattr(other, field.name)
        ]


@attrs.frozen
class CallSignature(_Fields):
    """What every rank must pass identically, as strings (built from any object a caller passed,
    so it always pickles; see :func:`safe_repr`). ``window``: the call's key window (the agreed
    :class:`~ringdilated.core.plan.window.KeyWindow`, or the raw argument where validation
    failed), so ranks with different windows, which would send each other different pieces,
    raise naming it. ``backward``: whether this rank will run a
    backward (a rank that does while its peer does not would wait in the backward exchange)."""

    pattern: str
    causal: str
    scale: str
    window: str
    dropout_p: str
    dtype: str
    documents: str
    device: str
    q_shape: str
    k_shape: str
    backward: bool
    kernel: str | None
    communicator: str | None
    lse_used: bool = True
    softcap: str = "None"
    sinks: str = "None"


@attrs.frozen
class LayoutSignature(_Fields):
    """What every rank must pass identically to a :class:`~ringdilated.SequenceLayout`: its
    documents or padding (a digest: they may be long), the sequence length and batch they say,
    whether shard lengths were given, and whether every call is checked."""

    documents: str
    shape: str
    shard_length: str
    agree_every_call: str


@attrs.frozen
class BatchSignature(_Fields):
    """What every rank of a sequence-parallel group must pass identically to
    :func:`ringdilated.shard_batch`: each tensor of the batch (shape, dtype and, where compared,
    a digest of its values; ``"none"`` when not passed) and the options."""

    input_ids: str
    labels: str
    attention_mask: str
    position_ids: str
    cu_seqlens: str
    options: str


def _has_cpu_backend(group: dist.ProcessGroup) -> bool:
    """Whether the group moves CPU tensors: any backend but NCCL alone (``"nccl"``,
    ``"cuda:nccl"``; a ``"cpu:gloo,cuda:nccl"`` group does)."""
    name = str(dist.get_backend(group)).lower()
    return not all(part.split(":")[-1] == "nccl" for part in name.split(","))


_cpu_twins: dict[dist.ProcessGroup, dist.ProcessGroup] = {}


def _group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout the group's backend waits for (``init_process_group(timeout=...)``,
    ``new_group(timeout=...)``, or torch's default for the backend), read from the backend's
    options; ``None`` where the backend does not say."""
    for device_type in getattr(group, "_device_types", ()):
        try:
            timeout = group._get_backend(torch.device(device_type)).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def _cpu_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group`` itself when it moves CPU tensors; for an NCCL-only group, a gloo group of the same
    ranks, made at the first agreement on it (the group's ranks reach that together) and kept, with
    the group's own timeout (:func:`_group_timeout`), so an agreement waits no longer than the
    group's data exchange would. ``use_local_synchronization``: only the group's own ranks make it,
    so each independent group of a mesh makes its own at its first agreement."""
    if _has_cpu_backend(group):
        return group
    twin = _cpu_twins.get(group)
    if twin is None:
        ranks = dist.get_process_group_ranks(group)
        made = dist.new_group(
            ranks, backend="gloo", timeout=_group_timeout(group), use_local_synchronization=True
        )
        assert isinstance(made, dist.ProcessGroup)
        if dist.get_process_group_ranks(made) != ranks:  # torch orders a new group's ranks
            raise ValueError(
                f"ringdilated needs a gloo group beside the NCCL-only group of ranks {ranks} "
                f"for its agreements, and torch gave ranks {dist.get_process_group_ranks(made)}"
                ": build the group with its ranks in increasing order, or with "
                "backend='cpu:gloo,cuda:nccl'"
            )
        twin = _cpu_twins[group] = made
    return twin


def control_layout(layout: Layout) -> Layout:
    """Where an agreement's collectives run: on the CPU, always. A group with a CPU backend
    (gloo, or ``"cpu:gloo,cuda:nccl"``) runs them itself; an NCCL-only group through a gloo
    group of the same ranks made once (:func:`_cpu_group`; a grid's inner group first, then its
    outer, on every rank alike). So no agreement moves a CUDA tensor or waits on the device."""
    if isinstance(layout, Grid):
        inner = _cpu_group(layout.inner)
        return Grid(outer=_cpu_group(layout.outer), inner=inner)
    return _cpu_group(layout)


def gather_flags(
    group: Layout, failed: bool, digest: int, length: int, query_length: int = -1
) -> list[tuple[int, int, int, int]]:
    """Every rank's ``(failed, digest, length, query_length)``, in rank order: one
    ``all_gather`` of four integers per rank (on a :class:`~ringdilated.core.call.grid.Grid`,
    one along each dimension, with each rank's global rank), so every rank gets the same
    answer. On the CPU, through :func:`control_layout`.

    On a grid, raises ``ValueError`` on every rank unless its two groups hold every rank once
    (``(WORLD, WORLD)``, or an inner group that is not a row of the outer ones, do not)."""
    values = [int(failed), digest, length, query_length]
    group = control_layout(group)
    if isinstance(group, Grid):
        _check_grid(group)
        values.append(dist.get_rank())
    mine = torch.tensor(values, dtype=torch.int64)
    gathered = [tuple(t.tolist()) for t in grid.gather(group, mine)]
    if isinstance(group, Grid):
        members = [g[4] for g in gathered]
        if len(set(members)) != len(members):
            raise ValueError(
                f"process_group=(outer, inner) must form a grid, every rank once in (outer, "
                f"inner) order; its {group.shape} groups hold global ranks {members}"
            )
    return [cast(tuple[int, int, int, int], g[:4]) for g in gathered]


def _check_grid(layout: Grid) -> None:
    """Raise ``ValueError`` unless ``layout`` looks like a grid: each outer group holds ranks of
    one inner index and equal inner sizes, each inner group ranks of one outer index and equal
    outer sizes. One ``all_gather`` of two integers along each dimension, then a flag
    ``all_reduce`` (max) along inner, outer and inner again, so that every rank of a
    row-and-column layout raises alike. Groups that do not partition the ranks at all can
    still leave a rank waiting here until the backend's timeout."""

    def differs(group: dist.ProcessGroup, mine: torch.Tensor) -> bool:
        column = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(column, mine, group=group)
        return any(not torch.equal(c, mine) for c in column)

    inner = torch.tensor([dist.get_rank(layout.inner), dist.get_world_size(layout.inner)])
    outer = torch.tensor([dist.get_rank(layout.outer), dist.get_world_size(layout.outer)])
    bad = torch.tensor([int(differs(layout.outer, inner) | differs(layout.inner, outer))])
    for group in (layout.inner, layout.outer, layout.inner):
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if bad.item():
        raise AgreementError(
            "process_group=(outer, inner) must form a grid: every outer group holds the "
            "ranks of one inner index, every inner group those of one outer index, and "
            "groups of one dimension are equally large"
        )


@attrs.frozen
class Split:
    """How the sequence and its queries sit on the ranks, as the first agreement of a call
    gathered them: ``lengths``, every rank's shard length (``-1`` where a rank did not say: its
    input was unreadable, or its layout holds the lengths); ``query_lengths``, every rank's
    query length where it passed a query suffix (``q`` shorter than its shard), ``-1`` where its
    ``q`` holds its whole shard (or it did not say)."""

    lengths: tuple[int, ...]
    query_lengths: tuple[int, ...]

    @property
    def uneven(self) -> tuple[int, ...] | None:
        """Every rank's shard length when every rank said it and they differ, else ``None``."""
        lengths = self.lengths
        return lengths if min(lengths) >= 0 and len(set(lengths)) > 1 else None

    @property
    def suffix(self) -> bool:
        """Whether some rank passed a query suffix."""
        return max(self.query_lengths) >= 0


def agree(
    group: Layout,
    error: Exception | None,
    signature: _Fields | None,
    length: int = -1,
    query_length: int = -1,
) -> Split | None:
    """Raise on every rank if any rank failed validation or the ranks' signatures differ, unless
    the ranks' shards are of different lengths or some rank passed a query suffix: then return
    the :class:`Split` every rank gave.

    ``length``: this rank's shard length, or ``-1`` when unknown (its input was unreadable, or
    the lengths were agreed already). ``query_length``: how many query positions this rank
    holds when fewer than its shard (a query suffix), else ``-1``. When every rank knows its
    length and they are not all equal, or some rank gave a query length, every rank gets the
    same split back and must check its call again with it (the sequence length is the lengths'
    sum, the suffix the query lengths') and agree again, passing neither; nothing else is
    decided. A rank that failed may pass ``signature=None`` and no lengths (its peers then
    raise naming its error)."""
    if error is None and signature is None:
        raise ValueError("agree() needs a signature from a rank whose checks passed")
    digest = 0 if signature is None else signature.digest()
    flags = gather_flags(group, error is not None, digest, length, query_length)
    split = Split(tuple(f[2] for f in flags), tuple(f[3] for f in flags))
    # A rank in shard_lengths() (a module placing rotary positions) while this one is in a
    # call stops here too, whatever the lengths: it goes on to compare_reports.
    placing = any(f[1] == _LENGTHS_DIGEST for f in flags)
    if (split.uneven is not None or split.suffix) and not placing:
        return split
    if any(f[0] for f in flags) or len({f[1] for f in flags}) > 1:
        compare_reports(group, error, signature)
    return None


def shard_lengths(group: Layout, length: int) -> tuple[int, ...]:
    """Every rank's shard length, before a call (a module placing rotary positions needs its
    shard's offset). The same collective as :func:`agree`'s first, so a rank that rejects its
    input meanwhile (calling :func:`agree` with its error) meets it: then every rank raises,
    naming that rank's error."""
    flags = gather_flags(group, False, _LENGTHS_DIGEST, length)
    if any(f[0] for f in flags):
        compare_reports(group, None, None)
    others = [r for r, f in enumerate(flags) if f[1] != _LENGTHS_DIGEST]
    if others:  # those ranks are in a call's agreement: this rank's difference stops them
        compare_reports(
            group,
            ValueError(
                f"this rank asked for every rank's shard length (rotary positions on a process "
                f"group) while rank(s) {others} went straight to the attention call: pass the "
                "same rotary= to the module on every rank"
            ),
            None,
        )
    return tuple(f[2] for f in flags)


_LENGTHS_DIGEST = int.from_bytes(hashlib.blake2b(b"shard_lengths", digest_size=8).digest()) >> 1
"""What :func:`shard_lengths` sends as its digest: no call signature's (those are digests of
their fields), so a rank in a call's agreement meeting it sees a difference."""


def compare_reports(group: Layout, error: Exception | None, signature: _Fields | None) -> None:
    """The full comparison (one ``all_gather_object`` of every rank's error and signature):
    raise on every rank naming the rank that failed or each field that differs. Returns only
    when every rank passed identical signatures. What it raises is :class:`EveryRankError`
    (:func:`agreed`), so nothing agrees on it again: this rank's own error (the same class and
    message), a :class:`PeerRejectedError` naming the first rank that failed, or a
    :class:`CallMismatchError`."""
    mine = (None if error is None else safe_str(error), signature)
    gathered = grid.gather_objects(control_layout(group), mine)
    reports = cast(list[tuple[str | None, _Fields]], gathered)
    failures = [(rank, message) for rank, (message, _) in enumerate(reports) if message]
    if failures:
        if error is not None:
            raise raised_on_every_rank(error)
        rank, message = failures[0]
        raise PeerRejectedError(rank, message)
    reference = reports[0][1]
    for rank, (_, other) in enumerate(reports):
        diffs = reference.differences(other, rank)
        if diffs:
            raise CallMismatchError(tuple(diffs))


def agreed(error: BaseException) -> bool:
    """Whether ``error`` came out of an agreement, and so is raised on every rank: a caller that
    would report it to its peers (a module's ``reject``) must not, as they have moved on."""
    return isinstance(error, EveryRankError)
