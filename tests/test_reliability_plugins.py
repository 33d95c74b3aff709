"""Reliability suite, plugins: nothing a plugin returns breaks a call that does not use it.

Each case is one kind of malformed spec or hostile plugin, installed as an entry point of the
process-wide registry (the one every ``dilated_attention`` call uses). A case either fails at
registry time (a ``PluginWarning``, or a ``PluginError`` in strict mode, naming the plugin, the
spec and the field; the plugin's other specs still register) or is contained at call time (a
reason against that backend, naming the callable and the exception). Either way, afterwards
``kernel="reference"`` and ``"auto"`` calls give the oracle's answer and leave their inputs
unchanged, and ``ringdilated doctor`` still runs.

The malformed specs are forged around the constructors' validators (``object.__setattr__`` on a
frozen instance, or a subclass), as a careless or hostile plugin could;
:func:`test_a_bad_spec_cannot_be_constructed` checks that the constructors refuse them.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch

import ringdilated
from ringdilated.backends.hybrid import HYBRID_SPEC
from ringdilated.backends.local import LOCAL_SPEC
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.cli.main import main
from ringdilated.core import Capabilities, KernelSpec, PriorityRule, Target
from ringdilated.core.plan.pattern import DilationPattern
from ringdilated.core.plan.shards import shard_plan
from ringdilated.core.select.capabilities import BatchLimit
from ringdilated.core.select.communicator_spec import CommunicatorSpec
from ringdilated.core.support.errors import SpecError
from ringdilated.functional import default_resolver
from ringdilated.plugins import PluginError, PluginWarning, hookimpl, load_registry, manager
from ringdilated.plugins.spec_validation import validate_spec
from ringdilated.testing import max_error, oracle

HOSTILE = "hostile"  # the entry point's name
SEGMENTS, RATES = [8, 16], [1, 2]


def _set(value: Any, **fields: object) -> Any:
    """``value`` with ``fields`` forced in, around the frozen class's validators."""
    for name, field_value in fields.items():
        object.__setattr__(value, name, field_value)
    return value


def _kernel(name: object = "hostile-kernel", **fields: object) -> KernelSpec:
    """A reference-like spec that would win every ``auto`` call, forged with ``fields``."""
    spec = attrs.evolve(REFERENCE_SPEC, name="placeholder", priority=10_000)
    return _set(spec, name=name, **fields)  # type: ignore[no-any-return]


def _target(**fields: object) -> KernelSpec:
    target = _set(Target("cpu", frozenset({torch.float32, torch.float64})), **fields)
    return _kernel(capabilities=attrs.evolve(REFERENCE_SPEC.capabilities, targets=(target,)))


def _capabilities(**fields: object) -> KernelSpec:
    return _kernel(capabilities=_set(attrs.evolve(REFERENCE_SPEC.capabilities), **fields))


def _communicator(name: str = "hostile-comm", **fields: object) -> CommunicatorSpec:
    spec = attrs.evolve(LOCAL_SPEC, name=name, priority=10_000, distributed=True, causal=True)
    return _set(spec, **fields)  # type: ignore[no-any-return]


class SneakyKernelSpec(KernelSpec):
    """A subclass whose ``__init__`` skips the validators."""

    def __init__(self, **fields: object) -> None:
        base = attrs.asdict(attrs.evolve(REFERENCE_SPEC, priority=10_000), recurse=False)
        _set(self, **{**base, **fields})


class RaisingReasons(KernelSpec):
    def reasons(self, request: object, env: object) -> tuple[str, ...]:
        raise RuntimeError("reasons exploded")


class StrPriority(KernelSpec):
    def priority_for(self, request: object) -> int:
        return "high"  # type: ignore[return-value]


def _boom(request: object, env: object) -> list[str]:
    raise RuntimeError("boom")


def _rules_boom(env: object) -> list[PriorityRule]:
    raise RuntimeError("rules boom")


def _plan_boom(plans: object, window: object) -> tuple[str, ...]:
    raise RuntimeError("plan boom")


def _factory_raises() -> object:
    raise ImportError("No module named 'missing_dep'")


SIBLING = attrs.evolve(REFERENCE_SPEC, name="sibling", priority=-100)


@attrs.frozen
class Case:
    """One hostile plugin: what its hooks return and what must be reported.

    ``registry``: the failure is found when the registry is built (``fragments`` appear in the
    warning and in strict mode's error). Otherwise it is contained: ``forced`` raises a
    ``ResolutionError`` whose message holds ``fragments``.
    """

    kernels: Callable[[], object] | None = None
    communicators: Callable[[], object] | None = None
    fragments: tuple[str, ...] = ()
    registry: bool = True
    registered: tuple[str, ...] = ("sibling",)
    absent: tuple[str, ...] = ("hostile-kernel",)
    entry_point_name: object = HOSTILE
    forced: Callable[[], object] | None = None


def _spec_case(spec: object, *fragments: str, **kw: Any) -> Case:
    """A plugin offering a malformed kernel spec next to a good one."""
    return Case(
        kernels=lambda: [spec, SIBLING], fragments=(f"plugin {HOSTILE!r}", *fragments), **kw
    )


def _force_kernel() -> object:
    return default_resolver().resolve(ringdilated.Request(head_dim=8), "hostile-kernel")


def _force_communicator() -> object:
    pattern = DilationPattern(SEGMENTS, RATES)
    plans = [shard_plan(pattern, 32, 2, 2, rank, 2) for rank in range(2)]
    auto = default_resolver().communicator_for(2, False, "auto", plans)
    assert type(auto).__name__ == "RingPassCommunicator", "auto must skip the hostile one"
    return default_resolver().communicator_for(2, False, "hostile-comm", plans)


def _contained(spec: KernelSpec, *fragments: str) -> Case:
    return Case(
        kernels=lambda: [spec, SIBLING],
        fragments=("'hostile-kernel'", *fragments),
        registry=False,
        registered=("sibling", "hostile-kernel"),
        absent=(),
        forced=_force_kernel,
    )


LABEL = "KernelSpec 'hostile-kernel' skipped: malformed field"
CASES = {
    "capabilities-none": _spec_case(
        _kernel(capabilities=None), LABEL, "capabilities", "KernelSpec.capabilities", "got None"
    ),
    "priority-str": _spec_case(
        _kernel(priority="high"), LABEL, "priority: KernelSpec.priority must be an int", "'high'"
    ),
    "priority-bool": _spec_case(_kernel(priority=True), LABEL, "priority", "not a bool", "True"),
    "target-dtypes-none": _spec_case(
        _target(dtypes=None), LABEL, "capabilities.targets[0].dtypes", "Target.dtypes", "None"
    ),
    "target-dtypes-ints": _spec_case(
        _target(dtypes=frozenset({1, 2})), "capabilities.targets[0].dtypes", "frozenset({1, 2})"
    ),
    "target-capability-str": _spec_case(
        _target(min_capability="8.0"), "targets[0].min_capability", "(major, minor)", "'8.0'"
    ),
    "target-head-dim-zero": _spec_case(
        _target(head_dim_multiple=0), "targets[0].head_dim_multiple", "positive int", "got 0"
    ),
    "targets-empty": _spec_case(
        _capabilities(targets=()), "capabilities.targets", "non-empty tuple of Target"
    ),
    "requires-str": _spec_case(
        _capabilities(requires="flash_attn"), "capabilities.requires", "tuple", "'flash_attn'"
    ),
    "batch-limit-zero": _spec_case(
        _capabilities(batch_limit=_set(BatchLimit(), problems=0)),
        "capabilities.batch_limit.problems",
        "BatchLimit.problems must be None or a positive int",
    ),
    "causal-str": _spec_case(_capabilities(causal="yes"), "capabilities.causal", "a bool"),
    "name-int": _spec_case(
        _kernel(name=123), "KernelSpec 123 skipped", "field name", "got 123 (an int)"
    ),
    "name-auto": _spec_case(_kernel(name="auto"), "KernelSpec 'auto'", "field name", "'auto'"),
    "name-comma": _spec_case(_kernel(name="a,b"), "KernelSpec 'a,b'", "without whitespace"),
    "name-space": _spec_case(_kernel(name="my kernel"), "KernelSpec 'my kernel'", "field name"),
    "factory-not-callable": _spec_case(
        _kernel(factory=42), LABEL, "factory: KernelSpec.factory must be callable", "42"
    ),
    "extra-reasons-not-callable": _spec_case(
        _kernel(extra_reasons="check"), LABEL, "extra_reasons", "None or callable", "'check'"
    ),
    "description-none": _spec_case(_kernel(description=None), LABEL, "description", "a str"),
    "priority-rules-for-not-callable": _spec_case(
        _kernel(priority_rules_for="rules"), LABEL, "priority_rules_for", "callable", "'rules'"
    ),
    "priority-rules-for-raises": _contained(
        _kernel(priority_rules_for=_rules_boom),
        "priority_for() failed: RuntimeError: rules boom",
    ),
    "priority-rules-for-returns-ints": _contained(
        _kernel(priority_rules_for=lambda env: [1]),
        "priority_for() failed: TypeError: priority_rules_for",
        "returned 1, not a PriorityRule",
    ),
    "priority-rules-for-returns-none": _contained(
        _kernel(priority_rules_for=lambda env: None),
        "returned None, not an iterable of PriorityRule",
    ),
    "priority-rules-list-subclass": _spec_case(
        SneakyKernelSpec(name="hostile-kernel", priority_rules=[PriorityRule(1)]),
        LABEL,
        "priority_rules: SneakyKernelSpec.priority_rules must be a tuple of PriorityRule",
        "[PriorityRule(",
    ),
    "priority-rule-str": _spec_case(
        _kernel(priority_rules=(_set(PriorityRule(1), priority="1"),)),
        "priority_rules[0].priority",
        "PriorityRule.priority must be an int",
    ),
    "communicator-distributed-str": Case(
        communicators=lambda: [_communicator(distributed="yes")],
        fragments=("CommunicatorSpec 'hostile-comm'", "field distributed", "'yes'"),
        registered=(),
        absent=("hostile-comm",),
    ),
    "communicator-delivery-unknown": Case(
        communicators=lambda: [_communicator(delivery="multicast")],
        fragments=("CommunicatorSpec 'hostile-comm'", "field delivery", "one of", "'multicast'"),
        registered=(),
        absent=("hostile-comm",),
    ),
    "communicator-parallelism-unknown": Case(
        communicators=lambda: [_communicator(parallelism="diagonal")],
        fragments=("CommunicatorSpec 'hostile-comm'", "field parallelism", "'diagonal'"),
        registered=(),
        absent=("hostile-comm",),
    ),
    "communicator-hybrid-without-parts": Case(
        communicators=lambda: [_communicator(parallelism="hybrid", dims=2)],
        fragments=("CommunicatorSpec 'hostile-comm'", "field parts", "got None"),
        registered=(),
        absent=("hostile-comm",),
    ),
    "communicator-dims-contradicts-parallelism": Case(
        communicators=lambda: [_communicator(dims=2)],
        fragments=(
            "field dims: CommunicatorSpec.dims must be 1 for parallelism 'sequence' (it follows "
            "from parallelism: 2 for 'hybrid', else 1), got 2; for 0.1's 2-D communicator write "
            "parallelism='hybrid', parts=(heads, sequence)",
        ),
        registered=(),
        absent=("hostile-comm",),
    ),
    "communicator-hybrid-part-unknown": Case(
        communicators=lambda: [
            attrs.evolve(HYBRID_SPEC, name="hostile-comm", parts=("ulysses", "missing"))
        ],
        fragments=("'hostile-comm'", "its sequence part 'missing' is no known communicator"),
        registry=False,
        registered=("hostile-comm",),
        absent=(),
        forced=lambda: default_resolver().communicator_for(4, False, "hostile-comm", grid=(2, 2)),
    ),
    "hook-returns-dict": Case(
        kernels=lambda: {"hostile-kernel": _kernel()},
        fragments=(f"plugin {HOSTILE!r}", "ringdilated_kernels() must return a list of KernelSpec"),
        registered=(),
    ),
    "hook-returns-a-non-spec": Case(
        kernels=lambda: [SIBLING, "not a spec"],
        fragments=(f"plugin {HOSTILE!r}", "must return a list of KernelSpec", "'not a spec'"),
        registered=(),
        absent=("sibling",),
    ),
    "hook-raises": Case(
        kernels=lambda: 1 / 0,
        fragments=(f"plugin {HOSTILE!r}", "ringdilated_kernels() raised ZeroDivisionError"),
        registered=(),
    ),
    "duplicate-name": _spec_case(
        attrs.evolve(REFERENCE_SPEC, name="sdpa", priority=10_000),
        "KernelSpec name 'sdpa'",
        "already provided by ringdilated.backends.sdpa (built-in)",
    ),
    "entry-point-name-int": Case(
        kernels=lambda: [SIBLING],
        entry_point_name=123,
        fragments=("plugin '123'", "entry point name must be a non-empty str, got 123"),
        registered=(),
        absent=("sibling",),
    ),
    "extra-reasons-raises": _contained(
        _kernel(extra_reasons=_boom), "extra_reasons", "_boom raised RuntimeError: boom"
    ),
    "extra-reasons-returns-ints": _contained(
        _kernel(extra_reasons=lambda request, env: [1, 2]), "extra_reasons", "returned 1, not a str"
    ),
    "extra-reasons-returns-none": _contained(
        _kernel(extra_reasons=lambda request, env: None), "returned None, not an iterable of str"
    ),
    "reasons-override-raises": _contained(
        RaisingReasons(**attrs.asdict(_kernel(), recurse=False)),
        "reasons() failed: RuntimeError: reasons exploded",
    ),
    "priority-override-str": _contained(
        StrPriority(**attrs.asdict(_kernel(), recurse=False)),
        "priority_for() failed: TypeError: returned 'high', not an int",
    ),
    "factory-returns-non-kernel": _contained(
        _kernel(factory=object), "factory failed: TypeError: kernel 'hostile-kernel'"
    ),
    "factory-raises": _contained(
        _kernel(factory=_factory_raises), "factory failed: ImportError", "missing_dep"
    ),
    "plan-reasons-raises": Case(
        communicators=lambda: [_communicator(plan_reasons=_plan_boom)],
        fragments=("'hostile-comm'", "plan_reasons", "_plan_boom raised RuntimeError: plan boom"),
        registry=False,
        registered=("hostile-comm",),
        absent=(),
        forced=_force_communicator,
    ),
}


@attrs.frozen
class FakeEntryPoint:
    name: object
    plugin: object
    value: str = "hostile.module"
    dist: object = None

    def load(self) -> object:
        return self.plugin


def _install(monkeypatch: pytest.MonkeyPatch, case: Case) -> None:
    hooks = {
        hook: hookimpl(body)
        for hook, body in (
            ("ringdilated_kernels", case.kernels),
            ("ringdilated_communicators", case.communicators),
        )
        if body is not None
    }
    ep = FakeEntryPoint(case.entry_point_name, types.SimpleNamespace(**hooks))
    monkeypatch.setattr(manager, "_entry_points", lambda: (ep,))
    monkeypatch.delenv("RINGDILATED_STRICT_PLUGINS", raising=False)
    monkeypatch.delenv("RINGDILATED_KERNEL", raising=False)


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """The process-wide registry and resolver are rebuilt for the test and again after it."""
    load_registry.cache_clear()
    default_resolver.cache_clear()
    yield
    load_registry.cache_clear()
    default_resolver.cache_clear()


def _load(case: Case) -> ringdilated.plugins.PluginRegistry:
    """The process-wide registry with ``case`` installed, checking what was reported."""
    if case.registry:
        with pytest.warns(PluginWarning) as caught:
            registry = load_registry()
        messages = [str(w.message) for w in caught if issubclass(w.category, PluginWarning)]
        assert len(messages) == 1, messages
        for fragment in case.fragments:
            assert fragment in messages[0], (fragment, messages[0])
        assert registry.failures == (messages[0],)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PluginWarning)
            registry = load_registry()
    found = {**registry.kernels, **registry.communicators}
    assert set(case.registered) <= set(found), sorted(found)
    assert not set(case.absent) & set(found), sorted(found)
    return registry


def _assert_calls_still_work() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 32, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    before = [t.clone() for t in (q, k, v)]
    expected = oracle(q, k, v, SEGMENTS, RATES)
    for kernel in ("reference", "auto"):
        out = ringdilated.dilated_attention(q, k, v, SEGMENTS, RATES, kernel=kernel)
        assert max_error(out, expected) < 1e-10, kernel
    plan = default_resolver().resolve(ringdilated.Request(head_dim=8))
    assert plan.kernel_name == "sdpa", plan.explain()
    for tensor, copy in zip((q, k, v), before, strict=True):
        assert torch.equal(tensor, copy)


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_hostile_plugin_is_contained(
    case: Case, monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    _install(monkeypatch, case)
    _load(case)
    if case.forced is not None:
        with pytest.raises(ringdilated.ResolutionError) as info:
            case.forced()
        for fragment in case.fragments:
            assert fragment in str(info.value), (fragment, str(info.value))
    _assert_calls_still_work()


@pytest.mark.parametrize(
    "case",
    [c for c in CASES.values() if c.registry],
    ids=[n for n, c in CASES.items() if c.registry],
)
def test_strict_mode_raises_a_plugin_error(
    case: Case, monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    _install(monkeypatch, case)
    monkeypatch.setenv("RINGDILATED_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError) as info:
        load_registry()
    message = str(info.value)
    assert "failed (strict mode)" in message
    for fragment in case.fragments:
        fragment = fragment.replace(" skipped", "")  # strict mode refuses rather than skips
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize(
    "name", ["entry-point-name-int", "name-int", "capabilities-none", "extra-reasons-raises"]
)
def test_doctor_survives_a_hostile_plugin(
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    fresh_registry: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    case = CASES[name]
    _install(monkeypatch, case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)
        assert main(["doctor", "--device", "cpu", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    if case.registry:
        assert f"failed: {case.fragments[0]}" in out and case.fragments[-1] in out
    else:
        assert "rejected hostile-kernel: extra_reasons" in out and "RuntimeError: boom" in out


def test_doctor_in_strict_mode_reports_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, fresh_registry: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _install(monkeypatch, CASES["name-int"])
    monkeypatch.setenv("RINGDILATED_STRICT_PLUGINS", "1")
    assert main(["doctor", "--device", "cpu", "--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    assert "could not be built" in out and "KernelSpec 123" in out and "field name" in out


def _valid_target(**kw: object) -> Target:
    return Target("cpu", frozenset({torch.float32}), **kw)  # type: ignore[arg-type]


def test_a_0_1_dims_2_spec_is_a_spec_error_saying_what_to_write() -> None:
    """0.1's 2-D communicator (``dims=2`` alone) is a ``SpecError`` (a ``ValueError``) saying
    what declares one now, naming its field once when the plugin manager checks it again."""
    with pytest.raises(
        SpecError, match=r"write parallelism='hybrid', parts=\(heads, sequence\)"
    ) as info:
        validate_spec(_communicator(dims=2), CommunicatorSpec)
    assert info.value.field == "dims" and str(info.value).count("field dims") == 1


@pytest.mark.parametrize(
    ("build", "error", "fragments"),
    [
        (lambda: _kernel_kw(capabilities=None), TypeError, "KernelSpec.capabilities"),
        (lambda: _kernel_kw(priority="high"), TypeError, "KernelSpec.priority"),
        (lambda: _kernel_kw(priority=True), TypeError, "KernelSpec.priority"),
        (lambda: _kernel_kw(name=123), TypeError, "KernelSpec.name"),
        (lambda: _kernel_kw(name="auto"), ValueError, "KernelSpec.name"),
        (lambda: _kernel_kw(name="a,b"), ValueError, "KernelSpec.name"),
        (lambda: _kernel_kw(factory=42), TypeError, "KernelSpec.factory"),
        (lambda: _kernel_kw(priority_rules=[PriorityRule(1)]), TypeError, "priority_rules"),
        (lambda: Target("cpu", None), TypeError, "Target.dtypes"),  # type: ignore[arg-type]
        (lambda: Target("cpu", frozenset({torch.int32})), ValueError, "Target.dtypes"),
        (lambda: Target("", frozenset({torch.float32})), ValueError, "Target.device_type"),
        (lambda: _valid_target(min_capability=(8,)), ValueError, "Target.min_capability"),
        (lambda: _valid_target(max_head_dim=-8), ValueError, "Target.max_head_dim"),
        (lambda: Capabilities(targets=()), ValueError, "Capabilities.targets"),
        (lambda: Capabilities((_valid_target(),), requires="x"), TypeError, "requires"),
        (lambda: BatchLimit(0), ValueError, "BatchLimit.problems"),
        (lambda: PriorityRule(1, device_type=""), ValueError, "PriorityRule.device_type"),
        (lambda: CommunicatorSpec("c", object, priority=1.5), TypeError, "priority"),
        (lambda: CommunicatorSpec("c", object, plan_reasons=3), TypeError, "plan_reasons"),
        (
            lambda: CommunicatorSpec("c", object, delivery="multicast"),
            ValueError,
            "CommunicatorSpec.delivery must be one of ('pairwise', 'broadcast'), got 'multicast'",
        ),
        (lambda: CommunicatorSpec("c", object, delivery=None), TypeError, "delivery"),
        (
            lambda: CommunicatorSpec("c", object, parallelism="diagonal"),
            ValueError,
            "CommunicatorSpec.parallelism must be one of ('sequence', 'heads', 'hybrid')",
        ),
        (
            lambda: CommunicatorSpec("c", object, parallelism="hybrid"),
            TypeError,
            "CommunicatorSpec.parts must be a (heads, sequence) pair of communicator names",
        ),
        (
            lambda: CommunicatorSpec("c", object, parallelism="hybrid", parts=("a", "auto")),
            ValueError,
            "for parallelism 'hybrid', got ('a', 'auto')",
        ),
        (
            lambda: CommunicatorSpec("c", object, parallelism="hybrid", parts=["a", "b"]),
            TypeError,
            "got ['a', 'b'] (a list)",
        ),
        (
            lambda: CommunicatorSpec("c", object, parts=("a", "b")),
            ValueError,
            "CommunicatorSpec.parts must be None for parallelism 'sequence' (only a 'hybrid'",
        ),
        (
            lambda: CommunicatorSpec("c", object, dims=2),
            SpecError,  # a ValueError
            "field dims: CommunicatorSpec.dims must be 1 for parallelism 'sequence' (it follows "
            "from parallelism: 2 for 'hybrid', else 1), got 2; for 0.1's 2-D communicator write "
            "parallelism='hybrid', parts=(heads, sequence)",
        ),
        (
            lambda: CommunicatorSpec("c", object, parallelism="heads", dims=2),
            SpecError,
            "dims must be 1 for parallelism 'heads' (it follows from parallelism: 2 for 'hybrid', "
            "else 1), got 2; for 0.1's 2-D communicator write",
        ),
        (
            lambda: CommunicatorSpec("c", object, parallelism="hybrid", parts=("a", "b"), dims=1),
            ValueError,
            "dims must be 2 for parallelism 'hybrid' (it follows from parallelism: 2 for 'hybrid'"
            ", else 1), got 1",
        ),
        (lambda: CommunicatorSpec("c", object, dims="2"), TypeError, "CommunicatorSpec.dims"),
    ],
)
def test_a_bad_spec_cannot_be_constructed(
    build: Callable[[], object], error: type[Exception], fragments: str
) -> None:
    with pytest.raises(error, match="must be") as info:
        build()
    assert fragments in str(info.value) and ", got " in str(info.value)


def _kernel_kw(**fields: object) -> KernelSpec:
    base: dict[str, Any] = {
        "name": "k",
        "factory": ReferenceKernel,
        "capabilities": REFERENCE_SPEC.capabilities,
    }
    return KernelSpec(**{**base, **fields})


class _RaisingName:
    """An entry point whose ``name`` (and ``value``) raise something other than AttributeError."""

    @property
    def name(self) -> str:
        raise RuntimeError("name boom")

    @property
    def value(self) -> str:
        raise RuntimeError("value boom")


class _ExitingImport:
    name = "exits"

    @property
    def value(self) -> str:
        raise RuntimeError("value boom")

    def load(self) -> object:
        raise SystemExit(3)


class _NastyInt(int):
    def __neg__(self) -> int:
        raise RuntimeError("neg boom")


class _NastyStr(str):
    __slots__ = ()

    def __lt__(self, other: object) -> bool:
        raise RuntimeError("lt boom")

    __hash__ = str.__hash__


@pytest.mark.parametrize(
    ("entry_point", "named"),
    [
        (_RaisingName(), "reading its name raised RuntimeError: name boom"),
        (_ExitingImport(), "plugin 'exits' skipped: import of"),
    ],
    ids=["name raises", "import exits"],
)
def test_a_broken_entry_point_object_is_skipped(
    entry_point: object, named: str, monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    monkeypatch.setattr(manager, "_entry_points", lambda: (entry_point,))
    with pytest.warns(PluginWarning, match=named):
        load_registry()
    _assert_calls_still_work()


@pytest.mark.parametrize(
    "spec",
    [
        _kernel(priority=_NastyInt(5)),
        _kernel(name=_NastyStr("nasty-name")),
    ],
    ids=["int subclass priority", "str subclass name"],
)
def test_subclassed_int_and_str_fields_are_refused(
    spec: KernelSpec, monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    """The resolver negates priorities and sorts names: exact int and str only."""
    ep = FakeEntryPoint(
        HOSTILE, types.SimpleNamespace(ringdilated_kernels=hookimpl(lambda: [spec]))
    )
    monkeypatch.setattr(manager, "_entry_points", lambda: (ep,))
    with pytest.warns(PluginWarning, match="malformed field"):
        load_registry()
    _assert_calls_still_work()
