"""How a communicator plugin describes itself to the resolver (:class:`CommunicatorSpec`: the one
description; the instance only moves bytes), and what the resolver hands out
(:class:`CommunicatorChoice`: the chosen spec beside its instance, and a hybrid's parts)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ringdilated.core.contract import rules
from ringdilated.core.contract.communicator import (
    DELIVERIES,
    PARALLELISMS,
    Communicator,
    layout_mismatch,
    mask_argument,
)
from ringdilated.core.support.caller import user_stacklevel
from ringdilated.core.support.errors import SpecError

if TYPE_CHECKING:
    from ringdilated.core.plan.shards import ShardPlan
    from ringdilated.core.plan.window import KeyWindow

__all__ = ["SUFFIX_REFUSED", "CommunicatorChoice", "CommunicatorSpec", "described_by_attributes"]

CAUSAL_REFUSED = "cannot restrict sends to later ranks under causal=True"
"""Why a spec with ``causal=False`` cannot serve a window that hides later keys."""

SUFFIX_REFUSED = (
    "cannot serve a query suffix on a process group (q shorter than the whole sequence): it "
    "exchanges whole shards of every head; pass communicator='ringpass' or 'allgather'"
)
"""Why a head-parallel or 2-D communicator refuses a query suffix (the same on every rank)."""

ROLES = ("heads", "sequence")
"""A hybrid's parts, in the order of ``CommunicatorSpec.parts``."""


def _dims(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    """``dims`` follows from ``parallelism``: 2 for ``"hybrid"``, else 1; a contradiction is a
    :class:`SpecError`, which for 0.1's ``dims=2`` alone says what to write instead."""
    rules.ints(instance, attribute, value)
    wanted = 2 if instance.parallelism == "hybrid" else 1
    if value != wanted:
        rule = f"must be {wanted} for parallelism {rules.describe(instance.parallelism)} (it"
        rule += f" follows from parallelism: 2 for 'hybrid', else 1), got {value}"
        hint = "; for 0.1's 2-D communicator write parallelism='hybrid', parts=(heads, sequence)"
        raise SpecError("dims", f"{type(instance).__name__}.dims {rule}{hint * (value == 2)}")


def _parts(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    """A ``(heads, sequence)`` pair of communicator names for a hybrid, ``None`` otherwise."""
    parallelism = instance.parallelism
    if parallelism == "hybrid":
        rule = rules.Rule(
            "a (heads, sequence) pair of communicator names for parallelism 'hybrid'",
            lambda v: isinstance(v, tuple) and len(v) == 2 and all(map(rules.names.check, v)),
            lambda v: isinstance(v, tuple),
        )
    else:
        rule = rules.Rule(
            f"None for parallelism {rules.describe(parallelism)} (only a 'hybrid' communicator "
            "has parts)",
            lambda v: v is None,
            lambda v: True,
        )
    rule(instance, attribute, value)


@attrs.frozen
class CommunicatorSpec:
    """A communicator as a plugin offers it: its one description (the instance moves bytes).

    ``distributed``: serves process groups of more than one rank (``False``: one process only).
    ``causal``: honours the send rule of a key window that hides later keys (sending only toward
    later ranks; :class:`~ringdilated.core.plan.window.KeyWindow`). ``delivery``:
    ``"pairwise"`` or ``"broadcast"``; ``parallelism``: ``"sequence"``, ``"heads"`` or
    ``"hybrid"`` (see :mod:`ringdilated.core.contract.communicator`); ``parts``: a hybrid's
    ``(heads, sequence)`` communicator names, resolved as forced names are (required for, and
    only for, ``"hybrid"``). ``dims``: its process layout, which follows from ``parallelism`` (2,
    a 2-D :class:`~ringdilated.core.call.grid.Grid`, for ``"hybrid"``; else 1, a process group):
    accepted for compatibility, a contradiction rejected.
    A query suffix (the plans' ``query_start > 0``) is served by sequence parallelism only.
    ``plan_reasons``: given every rank's shard plan and the call's key window, the reasons this
    communicator cannot move that plan's data exactly (empty: it can); if it raises or returns
    anything but str, :meth:`reasons` turns that into a reason against this communicator.
    ``name`` follows the kernel name rule (non-empty, no whitespace or commas, not ``"auto"``),
    ``priority`` is an int (not a bool); every field is validated on construction, and again
    by the plugin manager. ``delivery``, ``parallelism`` and ``parts`` are keyword-only.
    """

    name: str = attrs.field(validator=rules.names)
    factory: Callable[[], object] = attrs.field(validator=rules.callables)
    priority: int = attrs.field(default=0, validator=rules.ints)
    distributed: bool = attrs.field(default=True, validator=rules.bools)
    causal: bool = attrs.field(default=True, validator=rules.bools)
    # Before dims (which follows from parallelism), keyword-only (positions stay those of 0.1).
    delivery: str = attrs.field(
        default="pairwise", validator=rules.one_of(DELIVERIES), kw_only=True
    )
    parallelism: str = attrs.field(
        default="sequence", validator=rules.one_of(PARALLELISMS), kw_only=True
    )
    parts: tuple[str, str] | None = attrs.field(default=None, validator=_parts, kw_only=True)
    dims: int = attrs.field(
        default=attrs.Factory(lambda s: 2 if s.parallelism == "hybrid" else 1, takes_self=True),
        validator=_dims,
    )
    description: str = attrs.field(default="", validator=rules.strs)
    plan_reasons: Callable[[Sequence[ShardPlan], KeyWindow], tuple[str, ...]] | None = attrs.field(
        default=None, validator=rules.optional(rules.callables)
    )

    def reasons(
        self, world_size: int, window: KeyWindow, plans: Sequence[ShardPlan] = (), dims: int = 1
    ) -> tuple[str, ...]:
        """Every reason this communicator cannot serve the group (empty: it can); never raises for
        what ``plan_reasons`` does. ``dims``: the call's layout (1: a group; 2: a 2-D grid)."""
        out: list[str] = []
        mismatch = layout_mismatch(self.dims, dims)
        if world_size > 1 and mismatch is not None:
            out.append(mismatch)
        if world_size > 1 and not self.distributed:
            out.append(f"serves one process only, the group has {world_size} ranks")
        if world_size == 1 and self.distributed:
            out.append("a group of one rank needs no communication (local serves it)")
        if window.hides_later_keys and not self.causal:
            out.append(CAUSAL_REFUSED)
        if plans and plans[0].query_start > 0 and self.parallelism != "sequence":
            out.append(SUFFIX_REFUSED)
        if plans and self.plan_reasons is not None and not out:
            mask = mask_argument(self.plan_reasons, window)
            out.extend(rules.contained_reasons("plan_reasons", self.plan_reasons, plans, mask))
        return tuple(out)


@attrs.frozen(eq=False)
class CommunicatorChoice:
    """A communicator as the resolver hands it out: ``spec`` describes it, ``instance`` moves
    the bytes; for a hybrid, ``parts`` are its ``(heads, sequence)`` communicators (each a
    choice, resolved by the names ``spec.parts`` gives)."""

    spec: CommunicatorSpec
    instance: Communicator
    parts: tuple[CommunicatorChoice, ...] = ()

    def __attrs_post_init__(self) -> None:
        """What the instance declares or holds against its spec (0.1 read its ``delivery`` and
        ``parallelism``, and a hybrid's ``heads`` and ``sequence``) is refused, not ignored."""
        read: dict[str, object] = {r: p.instance for r, p in zip(ROLES, self.parts, strict=False)}
        read |= {"delivery": self.spec.delivery, "parallelism": self.spec.parallelism}
        for name, value in read.items():
            if (held := getattr(self.instance, name, value)) != value:
                field = "parts" if name in ROLES else name
                what = f"{type(self.instance).__name__}.{name} is {held!r}, which is not read"
                raise SpecError(field, f"{what}: say it as {field}= of its spec {self.name!r}")

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def parallelism(self) -> str:
        return self.spec.parallelism

    @property
    def broadcast(self) -> bool:
        """Whether the sharded run sends it broadcast payloads (``delivery="broadcast"``)."""
        return self.spec.delivery == "broadcast"


_warned: set[type] = set()
"""The classes :func:`described_by_attributes` has warned about."""


def described_by_attributes(
    communicator: Communicator, describe: Callable[[Communicator], CommunicatorChoice]
) -> CommunicatorChoice:
    """Compatibility, for one release: a communicator instance passed by a user whose class no
    registered spec's factory builds, described as 0.1 described it: by its ``delivery``
    (default ``"pairwise"``) and ``parallelism`` (default ``"sequence"``) attributes and, for
    ``"hybrid"``, by the communicators it holds as ``heads`` and ``sequence`` (each described by
    ``describe``). The only place the engine reads a communicator's attributes. Warns
    ``DeprecationWarning`` once per class that declares either attribute; raises ``ValueError``
    naming an unknown value or a missing part."""
    cls = type(communicator)
    declared: dict[str, str] = {}
    for field, allowed in (("delivery", DELIVERIES), ("parallelism", PARALLELISMS)):
        value = getattr(communicator, field, None)
        if value is None:
            continue
        if cls not in _warned:
            _warned.add(cls)  # before warning: a filter may turn the warning into an error
            warnings.warn(
                f"{cls.__name__} declares its delivery or parallelism as an attribute: declare "
                "them in a CommunicatorSpec (delivery=, parallelism=, parts=) and register it "
                "(docs/plugins.md); attributes are read for one more release",
                DeprecationWarning,
                stacklevel=user_stacklevel(),
            )
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"{cls.__name__}.{field} must be one of {allowed}, got {value!r}")
        declared[field] = value
    parts = []
    if declared.get("parallelism") == "hybrid":
        for role in ROLES:
            inner = getattr(communicator, role, None)
            part = describe(inner) if isinstance(inner, Communicator) else None
            if part is None or part.parallelism != role:
                raise ValueError(
                    f"its {role!r} must be a Communicator of parallelism {role!r}, got {inner!r}"
                )
            parts.append(part)
    name = cls.__name__ if rules.names.check(cls.__name__) else "instance"
    spec = CommunicatorSpec(
        name=name,
        factory=lambda: communicator,
        parts=(parts[0].name, parts[1].name) if parts else None,
        **declared,  # type: ignore[arg-type]
    )
    return CommunicatorChoice(spec, communicator, tuple(parts))
