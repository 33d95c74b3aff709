"""The capability resolver: picks a kernel once per request and can say why.

Call flow::

    resolver = Resolver(specs)                       # specs from the plugin layer
    plan = resolver.resolve(Request(...), "auto")    # cached per (request, choice)
    plan.kernel.forward(...)                          # the hot path: no checks, no try/except
    print(plan.explain())

``"auto"`` picks the highest-priority backend with no reasons against it (ties: by name; for
communicators, :meth:`Resolver.choose_communicator`); under torch's deterministic switch, among
those with a deterministic mode first. A name forces that backend: it fits, or
:class:`ResolutionError` lists its reasons. It never falls back silently. ``RINGDILATED_KERNEL``
forces a backend wherever ``"auto"`` was asked.

Plugins are contained: whatever a spec's ``priority_for``/``reasons`` (or the ``extra_reasons``,
``plan_reasons`` and factory it carries) raises or returns becomes a reason against that one
backend, so it never breaks a call that another backend serves.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs

from ringdilated.core.contract.communicator import Communicator, layout_mismatch
from ringdilated.core.contract.kernel import Kernel
from ringdilated.core.contract.rules import describe, describe_exception
from ringdilated.core.plan.window import KeyWindow, as_window
from ringdilated.core.select.capabilities import (
    UNLIMITED,
    BatchLimit,
    Environment,
    KernelSpec,
    Request,
)
from ringdilated.core.select.communicator_spec import (
    CAUSAL_REFUSED,
    ROLES,
    CommunicatorChoice,
    CommunicatorSpec,
    described_by_attributes,
)
from ringdilated.core.select.cost import PieceSize, Traffic, traffic
from ringdilated.core.select.feature_cost import FeatureCost, feature_cost_of
from ringdilated.core.support.errors import ResolutionError

if TYPE_CHECKING:
    from ringdilated.core.plan.shards import ShardPlan

__all__ = ["KERNEL_ENV_VAR", "KernelChoice", "Plan", "ResolutionError", "Resolver"]

KERNEL_ENV_VAR = "RINGDILATED_KERNEL"


@attrs.frozen
class KernelChoice:
    """The resolver's decision for one request: the chosen kernel and every rejection (as
    :class:`~ringdilated.core.select.communicator_spec.CommunicatorChoice` is for communicators).

    ``batch_limit`` is the chosen kernel's declared limit on problems per call (its launch
    grid), which the driver honours when it splits the work; ``target_note`` is the note of the
    declared target that serves the request (e.g. "eager FlexAttention: forward only, unfused").
    ``deterministic``: whether the chosen kernel declares a deterministic mode
    (:attr:`Capabilities.deterministic
    <ringdilated.core.select.capabilities.Capabilities.deterministic>`); an instance passed as
    the kernel declares nothing and counts as having one. ``demoted``: the kernels ranked after
    every kernel with a deterministic mode, whatever their priority, because the request is
    deterministic and they have none. ``feature_cost``: for an automatic
    choice that the request's features made slow, which features and which faster kernels
    declined them (:class:`~ringdilated.core.select.feature_cost.FeatureCost`; ``None``
    otherwise, and always for a forced kernel).
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
    deterministic: bool = True
    demoted: tuple[str, ...] = ()
    feature_cost: FeatureCost | None = None

    def explain(self) -> str:
        """A human-readable account: the request, the choice and why each other one lost."""
        priority = dict(self.priorities)
        lines = [f"request: {self.request.describe()}"]
        passed_over = any(
            name in self.demoted
            and not reasons
            and priority.get(name, 0) > priority.get(self.kernel_name, 0)
            for name, reasons in self.rejected
        )
        fits = (
            "highest priority with a deterministic mode that fits"
            if passed_over
            else ("highest priority that fits")
        )
        how = f"forced by {self.forced_by}" if self.forced_by else fits
        note = f": {self.target_note}" if self.target_note else ""
        lines.append(
            f"kernel: {self.kernel_name} (priority {priority.get(self.kernel_name)}, {how}){note}"
        )
        if self.request.deterministic and not self.deterministic:
            lines.append(
                "  note: torch.are_deterministic_algorithms_enabled() is on, but "
                f"{self.kernel_name} declares no deterministic mode: its results may differ "
                "from run to run"
            )
        if self.feature_cost is not None:
            lines.append(f"  note: {self.feature_cost.describe()}")
        for name, reasons in self.rejected:
            if reasons:
                lines.append(f"  rejected {name}: " + "; ".join(reasons))
            else:
                demoted = ", but no deterministic mode" if name in self.demoted else ""
                lines.append(f"  not chosen {name}: fits, priority {priority.get(name)}{demoted}")
        lines.extend(f"  plugin failed: {failure}" for failure in self.plugin_failures)
        return "\n".join(lines)


Plan = KernelChoice
"""0.1's name for :class:`KernelChoice` (kept for one release)."""


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

    def resolve(self, request: Request, kernel: str | Kernel = "auto") -> KernelChoice:
        """The plan for ``request``: ``kernel`` is ``"auto"``, a backend name to force, or a
        :class:`~ringdilated.core.Kernel` instance to use as it is (httpx's ``transport=``
        style: it declares nothing, so nothing is checked against the request; the driver still
        checks every call's results)."""
        if _check_choice("kernel", kernel, None):
            assert isinstance(kernel, Kernel)
            name = f"{type(kernel).__name__} instance"
            return KernelChoice(request, name, kernel, forced_by="kernel=<instance>")
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

    def _resolve_uncached(
        self, request: Request, kernel: str, forced_by: str | None
    ) -> KernelChoice:
        judged = {name: _judge(spec, request, self.env) for name, spec in self.specs.items()}
        # Under torch's deterministic switch, kernels with a deterministic mode come first.
        demote = {
            name
            for name, spec in self.specs.items()
            if request.deterministic and not _has_deterministic_mode(spec)
        }
        ranked = sorted(
            self.specs.values(), key=lambda s: (s.name in demote, -judged[s.name][0], s.name)
        )
        verdicts = {name: reasons for name, (_, reasons) in judged.items()}
        candidates = [self.specs[kernel]] if kernel != "auto" else ranked
        for place, spec in enumerate(candidates):
            if verdicts[spec.name]:
                continue
            try:
                instance = self._kernel(spec)
            except Exception as exc:  # a backend's factory (an import) may fail in any way
                verdicts[spec.name] = (f"factory failed: {type(exc).__name__}: {exc}",)
                continue
            cost = None
            if forced_by is None:
                cost = feature_cost_of(spec, candidates[:place], request, self.env)
            return KernelChoice(
                request=request,
                kernel_name=spec.name,
                kernel=instance,
                rejected=tuple((s.name, verdicts[s.name]) for s in ranked if s.name != spec.name),
                forced_by=forced_by,
                plugin_failures=self.plugin_failures,
                priorities=tuple((s.name, judged[s.name][0]) for s in ranked),
                batch_limit=spec.capabilities.batch_limit_for(request),
                target_note=getattr(spec.capabilities.target_for(request), "note", ""),
                deterministic=spec.capabilities.deterministic,
                demoted=tuple(sorted(demote - {spec.name})),
                feature_cost=cost,
            )
        if kernel != "auto":
            raise ResolutionError(
                f"kernel {kernel!r} ({forced_by}) cannot serve {request.describe()}: "
                + "; ".join(verdicts[kernel])
            )
        detail = "; ".join(f"{s.name}: {', '.join(verdicts[s.name])}" for s in ranked)
        raise ResolutionError(
            f"no kernel can serve {request.describe()} ({detail or 'no kernels loaded'})"
        )

    def explain_communicator(
        self,
        world_size: int,
        window: KeyWindow | bool,
        name: str | Communicator = "auto",
        plans: Sequence[ShardPlan] = (),
        size: PieceSize | None = None,
        grid: tuple[int, int] | None = None,
    ) -> str:
        """Which communicator serves ``world_size`` ranks, why each other one was rejected and,
        given every rank's ``plans`` and the ``size`` of a position, what each would move
        (:mod:`~ringdilated.core.select.cost`); ``grid``: a 2-D layout's ``(outer, inner)``."""
        if not isinstance(name, str):
            return f"communicator: {type(name).__name__} instance (given) for {world_size} rank(s)"
        window = as_window(window)
        chosen_name = self.choose_communicator(world_size, window, name, plans, size, grid).name
        judged = self._judge_communicators(world_size, window, plans, size, grid)
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
            if spec.name != chosen_name:
                lines.append(f"  {'rejected' if reasons else 'not chosen'} {spec.name}: {detail}")
            elif moved is not None:
                lines.append(f"  {spec.name}: {detail}")
        return "\n".join(lines)

    def _judge_communicators(
        self,
        world_size: int,
        window: KeyWindow,
        plans: Sequence[ShardPlan],
        size: PieceSize | None,
        grid: tuple[int, int] | None = None,
    ) -> list[tuple[CommunicatorSpec, tuple[str, ...], Traffic | str | None]]:
        """Every communicator in ``auto``'s order of preference, with its reasons and, where it
        fits and ``plans`` and ``size`` are given, its traffic (or why that failed). Given
        ``plans``, a spec whose ``delivery``, ``parallelism``, ``parts`` or ``dims`` breaks its
        rule (one built around the validators) is rejected with the rule, and so is a hybrid
        whose parts do not resolve. Never raises for what a plugin does."""
        judged: list[tuple[CommunicatorSpec, tuple[str, ...], Traffic | str | None]] = []
        # A 1-D call passes no dims: a spec subclass may predate them.
        args = (world_size, window, plans) if grid is None else (world_size, window, plans, 2)

        def reasons_of(spec: CommunicatorSpec) -> tuple[str, ...]:
            return _contained("reasons", lambda: spec.reasons(*args))

        for spec in self.communicator_specs.values():
            reasons = reasons_of(spec)
            moved: Traffic | str | None = None
            if not reasons and plans:
                reasons, moved = self._model(spec, plans, window, size, grid)
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
        window: KeyWindow,
        size: PieceSize | None,
        grid: tuple[int, int] | None,
    ) -> tuple[tuple[str, ...], Traffic | str | None]:
        """A fitting communicator checked (its spec's rules, its factory and a hybrid's parts:
        failures are reasons) and, given ``size``, its traffic (a failure there is said,
        not a reason). Never raises for what a plugin does."""
        try:
            attrs.validate(spec)  # a spec built around its validators (its run would misread it)
        except Exception as exc:  # a rule it breaks, or whatever a hostile field raises
            return (describe_exception(exc),), None
        try:
            chosen = self._choice(spec, window)
        except ResolutionError as exc:  # a hybrid's part that does not resolve
            return (describe_exception(exc),), None
        except Exception as exc:  # a plugin's factory may fail in any way
            return (f"factory failed: {type(exc).__name__}: {describe_exception(exc)}",), None
        if size is None:
            return (), None
        try:
            return (), traffic(chosen, plans, window, size, grid)
        except Exception as exc:  # a plugin's schedule may fail in any way
            return (), f"{type(exc).__name__}: {describe_exception(exc)}"

    def communicator_for(
        self,
        world_size: int,
        window: KeyWindow | bool,
        name: str | Communicator = "auto",
        plans: Sequence[ShardPlan] = (),
        size: PieceSize | None = None,
        grid: tuple[int, int] | None = None,
    ) -> Communicator:
        """The instance of :meth:`choose_communicator`'s choice."""
        return self.choose_communicator(world_size, window, name, plans, size, grid).instance

    def choose_communicator(
        self,
        world_size: int,
        window: KeyWindow | bool,
        name: str | Communicator = "auto",
        plans: Sequence[ShardPlan] = (),
        size: PieceSize | None = None,
        grid: tuple[int, int] | None = None,
    ) -> CommunicatorChoice:
        """The communicator for a group of ``world_size`` ranks, beside the spec describing it:
        ``name`` forced, or for ``"auto"`` the fitting one of least modelled time (given every
        rank's ``plans`` and the ``size`` of a position; :mod:`ringdilated.core.select.cost`),
        priority breaking ties and deciding alone without them; or a ``Communicator`` instance
        used as it is (:meth:`describe_communicator`). A forced one that does not fit raises
        with its reasons; a hybrid's parts are resolved by name, as forced names are. ``window``:
        the call's :class:`~ringdilated.core.plan.window.KeyWindow` (a bool: causal or not)."""
        window = as_window(window)
        if _check_choice("communicator", name, self.communicator_specs):
            assert isinstance(name, Communicator)
            chosen = self.describe_communicator(name, window)
            _check_instance_layout(chosen, world_size, grid)
            return chosen
        assert isinstance(name, str)
        # Traffic is modelled only to choose: a forced name needs none (explain shows it).
        modelled = size if name == "auto" else None
        judged = self._judge_communicators(world_size, window, plans, modelled, grid)
        verdicts = {spec.name: reasons for spec, reasons, _ in judged}
        ranked = [spec for spec, _, _ in judged]
        candidates = [self.communicator_specs[name]] if name != "auto" else ranked
        for spec in candidates:
            if verdicts[spec.name]:
                continue
            try:
                return self._choice(spec, window)
            except ResolutionError as exc:  # a hybrid's part that does not resolve
                verdicts[spec.name] = (describe_exception(exc),)
            except Exception as exc:  # a plugin's factory may fail in any way
                verdicts[spec.name] = (f"factory failed: {type(exc).__name__}: {exc}",)
        if name != "auto":
            raise ResolutionError(
                f"communicator {name!r} cannot serve {world_size} rank(s): "
                + "; ".join(verdicts[name])
            )
        detail = "; ".join(f"{s.name}: {', '.join(verdicts[s.name])}" for s, _, _ in judged)
        raise ResolutionError(f"no communicator can serve {world_size} rank(s) ({detail})")

    def describe_communicator(
        self, communicator: Communicator, window: KeyWindow | bool
    ) -> CommunicatorChoice:
        """A user's communicator instance, described by the registered spec whose factory builds
        its class (or its nearest base), else for one release by its own attributes
        (:func:`~ringdilated.core.select.communicator_spec.described_by_attributes`). Raises
        :class:`ResolutionError` naming the instance for a description it cannot use."""
        what, window = type(communicator).__name__, as_window(window)
        try:
            spec = self._spec_of_class(type(communicator))
            if spec is None:
                return described_by_attributes(
                    communicator, lambda part: self.describe_communicator(part, window)
                )
            return CommunicatorChoice(spec, communicator, self._parts(spec, window))
        except ValueError as exc:
            raise ResolutionError(f"communicator {what} instance: {exc}") from None

    def _spec_of_class(self, cls: type) -> CommunicatorSpec | None:
        """The registered spec whose factory builds ``cls`` or its nearest base (the first
        registered, where several do); ``None`` for none."""
        built: dict[type, CommunicatorSpec] = {}
        for spec in self.communicator_specs.values():
            try:
                built.setdefault(type(self._communicator(spec)), spec)
            except Exception:  # a plugin's factory may fail in any way: it builds nothing
                continue
        return next((built[base] for base in cls.__mro__ if base in built), None)

    def _choice(self, spec: CommunicatorSpec, window: KeyWindow) -> CommunicatorChoice:
        """``spec``'s instance (built once) and, for a hybrid, its parts. Raises what the
        factory raises, and :class:`ResolutionError` for a part that does not resolve."""
        return CommunicatorChoice(spec, self._communicator(spec), self._parts(spec, window))

    def _parts(self, spec: CommunicatorSpec, window: KeyWindow) -> tuple[CommunicatorChoice, ...]:
        """A hybrid spec's ``(heads, sequence)`` parts, resolved by name as forced names are:
        known, of the parallelism of their role, serving ``window``, built. Raises
        :class:`ResolutionError` naming the part and why; ``()`` for any other spec."""
        if spec.parallelism != "hybrid" or spec.parts is None:
            return ()
        parts = []
        for role, name in zip(ROLES, spec.parts, strict=True):
            part = self.communicator_specs.get(name)
            why = None
            if part is None:
                known = ", ".join(sorted(self.communicator_specs)) or "none"
                why = f"is no known communicator (known: {known})"
            elif part.parallelism != role:
                why = f"has parallelism {part.parallelism!r}, not {role!r}"
            elif window.hides_later_keys and not part.causal:
                why = CAUSAL_REFUSED
            else:
                try:
                    parts.append(CommunicatorChoice(part, self._communicator(part)))
                except Exception as exc:  # a plugin's factory may fail in any way
                    why = f"is not built: {type(exc).__name__}: {describe_exception(exc)}"
            if why is not None:
                raise ResolutionError(f"its {role} part {name!r} {why}")
        return tuple(parts)

    def kernel(self, name: str) -> Kernel:
        """The kernel instance of backend ``name``, built once; no capability check."""
        _check_choice("kernel", name, self.specs, names_only=True)
        return cast(Kernel, self._kernel(self.specs[name]))

    def _built(self, spec: KernelSpec | CommunicatorSpec) -> Any:
        """``spec``'s instance, built once by its factory. Raises what the factory raises, and
        :class:`TypeError` naming the spec for an instance of the wrong kind."""
        kind = "kernel" if isinstance(spec, KernelSpec) else "communicator"
        built: dict[str, Any] = self._kernels if kind == "kernel" else self._communicators
        if spec.name not in built:
            protocol, _, methods = _CHOICES[kind]
            instance = spec.factory()
            if not isinstance(instance, protocol):
                raise TypeError(
                    f"{kind} {spec.name!r}: factory returned {instance!r}, which lacks {methods}"
                )
            built[spec.name] = instance
        return built[spec.name]

    _kernel = _communicator = _built


_CHOICES: dict[str, tuple[type, str, str]] = {
    "kernel": (Kernel, "backend", "forward(q, k, v, options) and backward(...)"),
    "communicator": (Communicator, "communicator", "schedule(), prepare() and exchange()"),
}
"""What a ``kernel=`` or ``communicator=`` argument (or a spec's factory) may be an instance of,
what its name names, and the methods that make one."""


def _check_choice(
    kind: str,
    choice: object,
    known: Collection[str] | None,
    *,
    forced_by: str | None = None,
    names_only: bool = False,
) -> bool:
    """The one rule for a ``kernel=`` or ``communicator=`` (``kind``) choice: whether it is an
    instance (used as it is); else ``TypeError`` unless a str, and ``ValueError`` naming it, and
    ``forced_by`` (what forced it), unless it is ``"auto"`` or one of ``known`` (``None``: not
    checked yet). ``names_only``: one of ``known`` and nothing else (no instance, no ``"auto"``)."""
    protocol, noun, _ = _CHOICES[kind]
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


def _has_deterministic_mode(spec: KernelSpec) -> bool:
    """``spec.capabilities.deterministic is True``; never raises (a broken spec has none)."""
    try:
        return getattr(spec.capabilities, "deterministic", False) is True
    except Exception:  # a plugin's spec may fail in any way
        return False


def _judge(spec: KernelSpec, request: Request, env: Environment) -> tuple[int, tuple[str, ...]]:
    """``spec``'s priority for ``request`` and every reason against it; never raises.

    A spec's methods may be overridden by a subclass, and a spec may reach a resolver without
    the plugin manager's checks: what they raise or return wrongly becomes a reason.
    """
    try:
        # Only a spec that asks for the machine gets ``env``: a subclass may override 0.1's
        # ``priority_for(request)``.
        machine = getattr(spec, "priority_rules_for", None) is not None
        priority = spec.priority_for(request, env) if machine else spec.priority_for(request)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"returned {describe(priority)}, not an int")
    except Exception as exc:  # a plugin's spec may fail in any way
        return _UNRANKED, (_failed("priority_for", exc),)
    return priority, _contained("reasons", lambda: spec.reasons(request, env))


def _check_instance_layout(
    chosen: CommunicatorChoice, world_size: int, grid: tuple[int, int] | None
) -> None:
    """Raise :class:`ResolutionError` when a communicator passed as an instance cannot run on
    the call's layout (a hybrid one needs a 2-D layout, every other kind a process group): a
    named one is rejected with the same reason (:func:`layout_mismatch`)."""
    parallelism = chosen.parallelism
    mismatch = layout_mismatch(2 if parallelism == "hybrid" else 1, 1 if grid is None else 2)
    if world_size > 1 and mismatch is not None:
        what = f"communicator {type(chosen.instance).__name__} instance"
        raise ResolutionError(f"{what} (parallelism {parallelism!r}) {mismatch}")


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
