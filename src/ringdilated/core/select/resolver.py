"""The capability resolver: picks a kernel once per request and can say why.

Call flow::

    resolver = Resolver(specs)                       # specs from the plugin layer
    plan = resolver.resolve(Request(...), "auto")    # cached per (request, choice)
    plan.kernel.forward(...)                          # the hot path: no checks, no try/except
    print(plan.explain())

``"auto"`` picks the highest-priority backend with no reasons against it (ties: by name); for
communicators, given every rank's shard plan, the one of least modelled exchange time
(:mod:`ringdilated.core.select.cost`), priority breaking ties.
A name forces that backend: it fits, or :class:`ResolutionError` lists its reasons. It never
falls back silently. ``RINGDILATED_KERNEL`` forces a backend wherever ``"auto"`` was asked.

Plugins are contained: whatever a spec's ``priority_for``/``reasons`` (or the ``extra_reasons``,
``plan_reasons`` and factory it carries) raises or returns becomes a reason against that one
backend, so it never breaks a call that another backend serves.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING

import attrs

from ringdilated.core.contract.communicator import (
    Communicator,
    delivery_of,
    hybrid_parts,
    layout_mismatch,
    parallelism_of,
)
from ringdilated.core.contract.kernel import Kernel
from ringdilated.core.contract.rules import describe, describe_exception
from ringdilated.core.select.capabilities import (
    UNLIMITED,
    BatchLimit,
    Environment,
    KernelSpec,
    Request,
)
from ringdilated.core.select.communicator_spec import CommunicatorSpec
from ringdilated.core.select.cost import PieceSize, Traffic, traffic
from ringdilated.core.support.errors import ResolutionError

if TYPE_CHECKING:
    from ringdilated.core.plan.shards import ShardPlan

__all__ = ["KERNEL_ENV_VAR", "Plan", "ResolutionError", "Resolver"]

KERNEL_ENV_VAR = "RINGDILATED_KERNEL"


@attrs.frozen
class Plan:
    """The resolver's decision for one request: the chosen kernel and every rejection.

    ``batch_limit`` is the chosen kernel's declared limit on problems per call (its launch
    grid), which the driver honours when it splits the work; ``target_note`` is the note of the
    declared target that serves the request (e.g. "eager FlexAttention: forward only, unfused").
    """

    request: Request
    kernel_name: str
    kernel: Kernel = attrs.field(eq=False, repr=False)
    rejected: tuple[tuple[str, tuple[str, ...]], ...] = ()
    forced_by: str | None = None
    plugin_failures: tuple[str, ...] = ()
    priorities: tuple[tuple[str, int], ...] = ()
    batch_limit: BatchLimit = UNLIMITED
    target_note: str = ""

    def explain(self) -> str:
        """A human-readable account: the request, the choice and why each other one lost."""
        priority = dict(self.priorities)
        lines = [f"request: {self.request.describe()}"]
        how = f"forced by {self.forced_by}" if self.forced_by else "highest priority that fits"
        note = f": {self.target_note}" if self.target_note else ""
        lines.append(
            f"kernel: {self.kernel_name} (priority {priority.get(self.kernel_name)}, {how}){note}"
        )
        for name, reasons in self.rejected:
            if reasons:
                lines.append(f"  rejected {name}: " + "; ".join(reasons))
            else:
                lines.append(f"  not chosen {name}: fits, priority {priority.get(name)}")
        lines.extend(f"  plugin failed: {failure}" for failure in self.plugin_failures)
        return "\n".join(lines)


class Resolver:
    """Chooses among kernel specs for requests; each decision is made once and cached."""

    def __init__(
        self,
        specs: Iterable[KernelSpec],
        env: Environment | None = None,
        plugin_failures: Iterable[str] = (),
        communicators: Iterable[CommunicatorSpec] = (),
    ) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.communicator_specs = {spec.name: spec for spec in communicators}
        self._communicators: dict[str, Communicator] = {}
        self.env = env if env is not None else Environment()
        self.plugin_failures = tuple(plugin_failures)
        self._kernels: dict[str, Kernel] = {}
        self._resolve = functools.lru_cache(maxsize=512)(self._resolve_uncached)

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.specs))

    def check_kernel_name(self, kernel: object) -> None:
        """Raise unless ``kernel`` is ``"auto"``, a known kernel's name or a Kernel instance
        (no request yet): :func:`_check_choice`."""
        _check_choice("kernel", kernel, self.specs)

    def check_communicator_name(self, communicator: object) -> None:
        """Raise unless ``communicator`` is ``"auto"``, a known communicator's name or a
        Communicator instance (no group yet): :func:`_check_choice`."""
        _check_choice("communicator", communicator, self.communicator_specs)

    def resolve(self, request: Request, kernel: str | Kernel = "auto") -> Plan:
        """The plan for ``request``: ``kernel`` is ``"auto"``, a backend name to force, or a
        :class:`~ringdilated.core.Kernel` instance to use as it is (httpx's ``transport=``
        style: it declares nothing, so nothing is checked against the request; the driver still
        checks every call's results)."""
        if _check_choice("kernel", kernel, None):
            assert isinstance(kernel, Kernel)
            name = f"{type(kernel).__name__} instance"
            return Plan(request, name, kernel, forced_by="kernel=<instance>")
        assert isinstance(kernel, str)
        forced_by = None
        forced = os.environ.get(KERNEL_ENV_VAR, "").strip()  # spaces stripped, as everywhere
        if kernel == "auto" and forced:
            kernel = forced
            forced_by = f"{KERNEL_ENV_VAR}={kernel}"
        elif kernel != "auto":
            forced_by = f"kernel={kernel!r}"
        _check_choice("kernel", kernel, self.specs, forced_by=forced_by)
        return self._resolve(request, kernel, forced_by)

    def _resolve_uncached(self, request: Request, kernel: str, forced_by: str | None) -> Plan:
        judged = {name: _judge(spec, request, self.env) for name, spec in self.specs.items()}
        ranked = sorted(self.specs.values(), key=lambda s: (-judged[s.name][0], s.name))
        verdicts = {name: reasons for name, (_, reasons) in judged.items()}
        candidates = [self.specs[kernel]] if kernel != "auto" else ranked
        chosen: tuple[KernelSpec, Kernel] | None = None
        for spec in candidates:
            if verdicts[spec.name]:
                continue
            try:
                chosen = (spec, self._kernel(spec))
                break
            except Exception as exc:  # a backend's factory (an import) may fail in any way
                verdicts[spec.name] = (f"factory failed: {type(exc).__name__}: {exc}",)
        if chosen is None:
            if kernel != "auto":
                raise ResolutionError(
                    f"kernel {kernel!r} ({forced_by}) cannot serve {request.describe()}: "
                    + "; ".join(verdicts[kernel])
                )
            detail = "; ".join(f"{s.name}: {', '.join(verdicts[s.name])}" for s in ranked)
            raise ResolutionError(
                f"no kernel can serve {request.describe()} ({detail or 'no kernels loaded'})"
            )
        spec, instance = chosen
        return Plan(
            request=request,
            kernel_name=spec.name,
            kernel=instance,
            rejected=tuple((s.name, verdicts[s.name]) for s in ranked if s.name != spec.name),
            forced_by=forced_by,
            plugin_failures=self.plugin_failures,
            priorities=tuple((s.name, judged[s.name][0]) for s in ranked),
            batch_limit=spec.capabilities.batch_limit,
            target_note=getattr(spec.capabilities.target_for(request), "note", ""),
        )

    def explain_communicator(
        self,
        world_size: int,
        causal: bool,
        name: str | Communicator = "auto",
        plans: Sequence[ShardPlan] = (),
        size: PieceSize | None = None,
        grid: tuple[int, int] | None = None,
    ) -> str:
        """Which communicator serves ``world_size`` ranks, why each other one was rejected and,
        given every rank's ``plans`` and the ``size`` of a position, what each would move
        (:mod:`ringdilated.core.select.cost`). ``grid``: ``(outer, inner)`` of a 2-D layout
        (``None``: a process group)."""
        if not isinstance(name, str):
            return f"communicator: {type(name).__name__} instance (given) for {world_size} rank(s)"
        chosen = self.communicator_for(world_size, causal, name, plans, size, grid)
        chosen_name = next(n for n, c in self._communicators.items() if c is chosen)
        judged = self._judge_communicators(world_size, causal, plans, size, grid)
        if name != "auto":
            how = f"forced by communicator={name!r}"
        elif any(t is not None for _, _, t in judged):
            how = "least modelled time that fits"
        else:
            how = "highest priority that fits"
        lines = [f"communicator: {chosen_name} ({how}) for {world_size} rank(s)"]
        for spec, reasons, moved in judged:
            if isinstance(moved, Traffic):
                detail = moved.describe()
            elif isinstance(moved, str):
                detail = f"fits; traffic not modelled ({moved})"
            else:
                detail = "; ".join(reasons) if reasons else "fits, lower priority"
            if spec.name == chosen_name:
                if moved is not None:
                    lines.append(f"  {spec.name}: {detail}")
            else:
                lines.append(f"  {'rejected' if reasons else 'not chosen'} {spec.name}: {detail}")
        return "\n".join(lines)

    def _judge_communicators(
        self,
        world_size: int,
        causal: bool,
        plans: Sequence[ShardPlan],
        size: PieceSize | None,
        grid: tuple[int, int] | None = None,
    ) -> list[tuple[CommunicatorSpec, tuple[str, ...], Traffic | str | None]]:
        """Every communicator in ``auto``'s order of preference, with its reasons and, where it
        fits and ``plans`` and ``size`` are given, its traffic (or why that failed). Given
        ``plans``, an instance declaring an unknown ``delivery`` or ``parallelism`` is rejected
        with the reason (its run would raise). Never raises for what a plugin does."""
        judged: list[tuple[CommunicatorSpec, tuple[str, ...], Traffic | str | None]] = []
        for spec in self.communicator_specs.values():
            dims = 1 if grid is None else 2
            reasons = _communicator_reasons(spec, world_size, causal, plans, dims)
            moved: Traffic | str | None = None
            if not reasons and plans:
                reasons, moved = self._model(spec, plans, causal, size, grid)
            judged.append((spec, reasons, moved))

        def preference(
            item: tuple[CommunicatorSpec, tuple[str, ...], object],
        ) -> tuple[float, int, str]:
            spec, _, moved = item
            seconds = moved.seconds if isinstance(moved, Traffic) else float("inf")
            return (seconds, -spec.priority, spec.name)

        return sorted(judged, key=preference)

    def _model(
        self,
        spec: CommunicatorSpec,
        plans: Sequence[ShardPlan],
        causal: bool,
        size: PieceSize | None,
        grid: tuple[int, int] | None,
    ) -> tuple[tuple[str, ...], Traffic | str | None]:
        """A fitting communicator's instance checked (its factory, its declared ``delivery`` and
        ``parallelism``: failures are reasons) and, given ``size``, its traffic (a failure there
        is said, not a reason). Never raises for what a plugin does."""
        try:
            communicator = self._communicator(spec)
        except Exception as exc:  # a plugin's factory may fail in any way
            return (f"factory failed: {type(exc).__name__}: {describe_exception(exc)}",), None
        try:
            delivery_of(communicator)
            parallelism_of(communicator)
        except ValueError as exc:
            return (describe_exception(exc),), None
        if size is None:
            return (), None
        try:
            return (), traffic(spec.name, communicator, plans, causal, size, grid)
        except Exception as exc:  # a plugin's schedule may fail in any way
            return (), f"{type(exc).__name__}: {describe_exception(exc)}"

    def communicator_for(
        self,
        world_size: int,
        causal: bool,
        name: str | Communicator = "auto",
        plans: Sequence[ShardPlan] = (),
        size: PieceSize | None = None,
        grid: tuple[int, int] | None = None,
    ) -> Communicator:
        """The communicator for a group of ``world_size`` ranks: ``name`` forced, or for
        ``"auto"`` the fitting one of least modelled time (given every rank's ``plans`` and the
        ``size`` of a position; :mod:`ringdilated.core.select.cost`), priority breaking ties and
        deciding alone without them; or a
        :class:`~ringdilated.core.contract.communicator.Communicator` instance used as it is. A
        forced one that does not fit raises with its reasons. ``plans`` also let a communicator
        check that
        it can move them."""
        if _check_choice("communicator", name, self.communicator_specs):
            assert isinstance(name, Communicator)
            _check_instance_layout(name, world_size, grid)
            return name
        assert isinstance(name, str)
        # Traffic is modelled only to choose: a forced name needs none (explain shows it).
        modelled = size if name == "auto" else None
        judged = self._judge_communicators(world_size, causal, plans, modelled, grid)
        verdicts = {spec.name: reasons for spec, reasons, _ in judged}
        ranked = [spec for spec, _, _ in judged]
        candidates = [self.communicator_specs[name]] if name != "auto" else ranked
        for spec in candidates:
            if verdicts[spec.name]:
                continue
            try:
                return self._communicator(spec)
            except Exception as exc:  # a plugin's factory may fail in any way
                verdicts[spec.name] = (f"factory failed: {type(exc).__name__}: {exc}",)
        if name != "auto":
            raise ResolutionError(
                f"communicator {name!r} cannot serve {world_size} rank(s): "
                + "; ".join(verdicts[name])
            )
        detail = "; ".join(f"{s.name}: {', '.join(verdicts[s.name])}" for s, _, _ in judged)
        raise ResolutionError(f"no communicator can serve {world_size} rank(s) ({detail})")

    def _communicator(self, spec: CommunicatorSpec) -> Communicator:
        if spec.name not in self._communicators:
            instance = spec.factory()
            if not isinstance(instance, Communicator):
                raise TypeError(
                    f"communicator {spec.name!r}: factory returned {instance!r}, which lacks "
                    "schedule(), prepare() and exchange()"
                )
            self._communicators[spec.name] = instance
        return self._communicators[spec.name]

    def kernel(self, name: str) -> Kernel:
        """The kernel instance of backend ``name``, built once; no capability check."""
        _check_choice("kernel", name, self.specs, names_only=True)
        return self._kernel(self.specs[name])

    def _kernel(self, spec: KernelSpec) -> Kernel:
        if spec.name not in self._kernels:
            kernel = spec.factory()
            if not isinstance(kernel, Kernel):
                raise TypeError(
                    f"kernel {spec.name!r}: factory returned {kernel!r}, which lacks "
                    "forward(q, k, v, options) and backward(...)"
                )
            self._kernels[spec.name] = kernel
        return self._kernels[spec.name]


_CHOICES: dict[str, tuple[type, str]] = {
    "kernel": (Kernel, "backend"),
    "communicator": (Communicator, "communicator"),
}
"""What a ``kernel=`` or ``communicator=`` argument may be an instance of, and what its name
names."""


def _check_choice(
    kind: str,
    choice: object,
    known: Collection[str] | None,
    *,
    forced_by: str | None = None,
    names_only: bool = False,
) -> bool:
    """The one rule for a ``kernel=`` or ``communicator=`` (``kind``) choice: whether it is an
    instance (used as it is); else ``TypeError`` unless a str, and ``ValueError`` naming it,
    and ``forced_by`` (what forced it), unless it is ``"auto"`` or one of ``known`` (``None``:
    not checked yet). ``names_only``: one of ``known`` and nothing else (no instance, no
    ``"auto"``)."""
    protocol, noun = _CHOICES[kind]
    if not names_only:
        if isinstance(choice, protocol) and not isinstance(choice, str):
            return True
        if not isinstance(choice, str):
            raise TypeError(
                f"{kind} must be 'auto', a {noun} name (str) or a {protocol.__name__} "
                f"instance, got {choice!r}"
            )
    if known is not None and choice not in known and (names_only or choice != "auto"):
        via = "" if forced_by is None else f" ({forced_by})"
        names = ", ".join(sorted(known)) or "none"
        auto = "" if names_only else ", or 'auto'"
        raise ValueError(f"unknown {kind} {choice!r}{via}; known {kind}s: {names}{auto}")
    return False


#: The rank of a backend whose priority could not be read: below every real one.
_UNRANKED = -(2**63)


def _judge(spec: KernelSpec, request: Request, env: Environment) -> tuple[int, tuple[str, ...]]:
    """``spec``'s priority for ``request`` and every reason against it; never raises.

    A spec's methods may be overridden by a subclass, and a spec may reach a resolver without
    the plugin manager's checks: what they raise or return wrongly becomes a reason.
    """
    try:
        priority = spec.priority_for(request)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"returned {describe(priority)}, not an int")
    except Exception as exc:  # a plugin's spec may fail in any way
        return _UNRANKED, (_failed("priority_for", exc),)
    return priority, _contained("reasons", lambda: spec.reasons(request, env))


def _check_instance_layout(
    communicator: Communicator, world_size: int, grid: tuple[int, int] | None
) -> None:
    """Raise :class:`ResolutionError` when a communicator passed as an instance declares an
    unknown ``delivery`` or ``parallelism``, lacks a hybrid's parts (:func:`hybrid_parts`) or
    cannot run on the call's layout (:func:`layout_mismatch`): a named one is rejected with the
    same reasons."""
    what = type(communicator).__name__
    try:
        parallelism = parallelism_of(communicator)
        delivery_of(communicator)
        if parallelism == "hybrid":
            hybrid_parts(communicator)
    except (TypeError, ValueError) as exc:
        raise ResolutionError(f"communicator {what} instance: {exc}") from None
    mismatch = layout_mismatch(2 if parallelism == "hybrid" else 1, 1 if grid is None else 2)
    if world_size > 1 and mismatch is not None:
        raise ResolutionError(
            f"communicator {what} instance (parallelism {parallelism!r}) {mismatch}"
        )


def _communicator_reasons(
    spec: CommunicatorSpec,
    world_size: int,
    causal: bool,
    plans: Sequence[ShardPlan],
    dims: int = 1,
) -> tuple[str, ...]:
    """``spec.reasons(...)``; what it raises or returns wrongly becomes a reason. Never raises."""
    if dims == 1:  # a spec subclass may predate ``dims``
        return _contained("reasons", lambda: spec.reasons(world_size, causal, plans))
    return _contained("reasons", lambda: spec.reasons(world_size, causal, plans, dims))


def _contained(method: str, call: Callable[[], Iterable[object]]) -> tuple[str, ...]:
    """``call()``'s reasons, or one reason saying how ``method`` failed."""
    try:
        reasons = tuple(call())
        bad = next((r for r in reasons if not isinstance(r, str)), None)
        if bad is not None:
            raise TypeError(f"returned {describe(bad)}, not a str, among its reasons")
    except Exception as exc:  # a plugin's spec may fail in any way
        return (_failed(method, exc),)
    return tuple(str(r) for r in reasons)


def _failed(method: str, exc: Exception) -> str:
    return f"{method}() failed: {type(exc).__name__}: {describe_exception(exc)}"
