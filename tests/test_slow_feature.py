"""A request's features that push the automatic choice to a kernel that materialises scores warn
once (issue 23): ``SlowFeatureWarning``, naming the features, the chosen kernel and the fused
ones that declined them; the choice carries it as data (``KernelChoice.feature_cost``) and
``explain()`` shows it. Only feature refusals count (``Capabilities.missing_features``), and a
forced kernel never warns."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import attrs
import pytest
import torch

import ringdilated
from ringdilated.backends.local import LOCAL_SPEC
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.core import (
    CAUSAL,
    FULL,
    FUSED_GRID_LIMIT,
    BatchLimit,
    Capabilities,
    Environment,
    KernelSpec,
    KeyWindow,
    Request,
    Resolver,
    Target,
)
from ringdilated.core.select import feature_cost
from ringdilated.core.select.feature_cost import FeatureCost
from ringdilated.functional import attend

CPU = frozenset({torch.float32, torch.float64})


def _fused(name: str = "fused", priority: int = 100, **capabilities: object) -> KernelSpec:
    """A fused kernel (no scratch bound) on CPU with no dropout, unless ``capabilities`` say."""
    fields: dict[str, object] = {
        "targets": (Target("cpu", CPU),),
        "dropout": False,
        "batch_limit": FUSED_GRID_LIMIT,
    }
    fields.update(capabilities)
    return KernelSpec(name, ReferenceKernel, Capabilities(**fields), priority=priority)  # type: ignore[arg-type]


#: The reference kernel's declaration with a sliding window too (resolved, never run).
WINDOWED_REFERENCE = attrs.evolve(
    REFERENCE_SPEC, capabilities=attrs.evolve(REFERENCE_SPEC.capabilities, sliding_window=True)
)


def _resolver(*specs: KernelSpec, fallback: KernelSpec = REFERENCE_SPEC) -> Resolver:
    env = Environment(packages=frozenset())
    return Resolver([*specs, fallback], env=env, communicators=(LOCAL_SPEC,))


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that has warned about nothing yet (the warning is once per process)."""
    monkeypatch.setattr(feature_cost, "_warned", set())
    monkeypatch.delenv("RINGDILATED_KERNEL", raising=False)


def _call(resolver: Resolver, dropout_p: float = 0.5, length: int = 16, **kw: object) -> None:
    q = torch.randn(1, length, 2, 8, dtype=torch.float64)
    options: dict[str, object] = {"causal": False, "kernel": "auto", **kw}
    attend(
        ringdilated.DilationPattern([8], [2]), q, q, q, scale=None, dropout_p=dropout_p,
        resolver=resolver, **options,  # type: ignore[arg-type]
    )  # fmt: skip


def test_dropout_that_turns_away_a_fused_kernel_warns_once_naming_both() -> None:
    resolver = _resolver(_fused())
    with pytest.warns(ringdilated.SlowFeatureWarning) as caught:
        _call(resolver)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "needs dropout (dropout_p > 0)" in message
    assert "the fused kernel 'fused' preferred for it does not support" in message
    assert "'reference' was chosen" in message and "kernel='reference'" in message
    assert caught[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _call(resolver)  # the same plan
        _call(resolver, length=32)  # a new plan, the same features and kernel
        _call(resolver, dropout_p=0.0)  # no dropout: the fused kernel serves it


def test_the_choice_carries_it_and_explain_shows_it() -> None:
    resolver = _resolver(_fused(), _fused("fused2", priority=50))
    choice = resolver.resolve(Request(head_dim=8, dropout=True))
    assert choice.kernel_name == "reference"
    assert choice.feature_cost == FeatureCost(("dropout",), "reference", ("fused", "fused2"))
    text = choice.explain()
    assert "  note: this call needs dropout (dropout_p > 0), which the fused kernels 'fused', " in (
        text
    )
    assert "'fused2' preferred for it do not support, so 'reference' was chosen" in text
    plain = resolver.resolve(Request(head_dim=8))
    assert plain.kernel_name == "fused" and plain.feature_cost is None
    assert "note:" not in plain.explain()


def test_a_forced_kernel_never_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    resolver = _resolver(_fused())
    request = Request(head_dim=8, dropout=True)
    assert resolver.resolve(request, "reference").feature_cost is None
    assert resolver.resolve(request, ReferenceKernel()).feature_cost is None
    monkeypatch.setenv("RINGDILATED_KERNEL", "reference")
    assert resolver.resolve(request).feature_cost is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _call(resolver)  # forced by the environment
        monkeypatch.delenv("RINGDILATED_KERNEL")
        _call(resolver, kernel="reference")
        _call(resolver, kernel=ReferenceKernel())
    assert feature_cost._warned == set()


def test_a_filter_that_makes_it_an_error_raises_once_then_calls_run() -> None:
    """The state is updated before warning, as every once-per-process warning here does."""
    resolver = _resolver(_fused())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ringdilated.SlowFeatureWarning)
        with pytest.raises(ringdilated.SlowFeatureWarning, match="needs dropout"):
            _call(resolver)
        _call(resolver)


def _gqa(**kw: object) -> Request:
    return Request(head_dim=8, gqa=True, **kw)  # type: ignore[arg-type]


def _dropout() -> Request:
    return Request(head_dim=8, dropout=True)


@pytest.mark.parametrize(
    ("preferred", "request_", "expected"),
    [
        # Each feature a fused kernel may lack, alone and together.
        (_fused(dropout=True, causal=False), Request(head_dim=8, window=CAUSAL), ("causal",)),
        (_fused(dropout=True, gqa=False), _gqa(), ("gqa",)),
        (_fused(dropout=True), Request(head_dim=8, window=KeyWindow(4, 0)), ("sliding_window",)),
        (_fused(dropout=True, backward=False), Request(head_dim=8), ("backward",)),
        (_fused(gqa=False), _gqa(dropout=True), ("dropout", "gqa")),
        # Forward-only on the request's device (a target's backward=False).
        (
            _fused(dropout=True, targets=(Target("cpu", CPU, backward=False),)),
            Request(head_dim=8),
            ("backward",),
        ),
        # Rejected for something else too: no warning.
        (_fused(), Request(head_dim=8, dropout=True, dtype=torch.float16), None),
        (_fused(requires=("nopackage",)), Request(head_dim=8, dropout=True), None),
        (_fused(targets=(Target("cpu", CPU, max_head_dim=4),)), _dropout(), None),
        (_fused(targets=(Target("cuda", CPU),)), _dropout(), None),
        # Not fused (it keeps the default scratch bound), or not preferred: no warning.
        (_fused(batch_limit=BatchLimit()), Request(head_dim=8, dropout=True), None),
        (_fused(priority=-1), Request(head_dim=8, dropout=True), None),
    ],
)  # fmt: skip
def test_only_feature_refusals_of_a_preferred_fused_kernel_count(
    preferred: KernelSpec, request_: Request, expected: tuple[str, ...] | None
) -> None:
    choice = _resolver(preferred, fallback=WINDOWED_REFERENCE).resolve(request_)
    assert choice.kernel_name == "reference"
    cost = choice.feature_cost
    assert (None if cost is None else cost.features) == expected
    if cost is not None:
        assert cost.faster == ("fused",) and cost.kernel == "reference"


def test_a_spec_whose_extra_reasons_refuse_or_raise_is_no_faster_choice() -> None:
    def refuse(request: Request, env: Environment) -> Iterable[str]:
        return ("refuses everything",)

    def broken(request: Request, env: Environment) -> Iterable[str]:
        raise RuntimeError("boom")

    for extra in (refuse, broken):
        preferred = attrs.evolve(_fused(), extra_reasons=extra)
        choice = _resolver(preferred).resolve(Request(head_dim=8, dropout=True))
        assert choice.kernel_name == "reference" and choice.feature_cost is None, extra


def test_a_fused_choice_is_never_slow() -> None:
    """A fused kernel with dropout serves the call, below one without: no cost."""
    with_dropout = _fused("fusedrop", priority=50, dropout=True)
    choice = _resolver(_fused(), with_dropout).resolve(Request(head_dim=8, dropout=True))
    assert choice.kernel_name == "fusedrop" and choice.feature_cost is None


def test_missing_features_name_what_the_backend_lacks() -> None:
    lacking = Capabilities(targets=(Target("cpu", CPU),), dropout=False, gqa=False, causal=False)
    request = Request(head_dim=8, window=CAUSAL, dropout=True, gqa=True)
    assert lacking.missing_features(request) == ("causal", "dropout", "gqa")
    assert lacking.missing_features(Request(head_dim=8)) == ()
    # Only features: a dtype it lacks is a reason, not a missing feature.
    assert lacking.missing_features(Request(dtype=torch.float16)) == ()
    two_targets = Capabilities(
        targets=(Target("cpu", frozenset({torch.float32}), backward=False), Target("cpu", CPU))
    )
    assert two_targets.missing_features(Request(dtype=torch.float32)) == ()  # the second has it
    forward_only = Capabilities(targets=(Target("cpu", CPU, backward=False),))
    assert forward_only.missing_features(Request()) == ("backward",)
    assert forward_only.missing_features(Request(backward=False)) == ()
    # A target may lack dropout too (sdpa's CPU op), and both at once.
    no_dropout = Capabilities(targets=(Target("cpu", CPU, dropout=False),), dropout=True)
    assert no_dropout.missing_features(Request(dropout=True)) == ("dropout",)
    neither = Capabilities(targets=(Target("cpu", CPU, backward=False, dropout=False),))
    assert neither.missing_features(Request(dropout=True)) == ("backward", "dropout")


@pytest.mark.parametrize(
    ("features", "expected"),
    [
        (("causal",), Request(window=KeyWindow(4, None), dropout=True, gqa=True)),
        (("sliding_window",), Request(window=CAUSAL, dropout=True, gqa=True)),
        (("causal", "sliding_window", "gqa"), Request(window=FULL, dropout=True)),
        (("backward", "dropout"), Request(window=KeyWindow(4, 0), backward=False, gqa=True)),
        ((), Request(window=KeyWindow(4, 0), dropout=True, gqa=True)),
    ],
)
def test_a_request_without_features(features: tuple[str, ...], expected: Request) -> None:
    request = Request(window=KeyWindow(4, 0), dropout=True, gqa=True)
    assert request.features == ("causal", "sliding_window", "backward", "dropout", "gqa")
    assert request.without(features) == expected
    assert set(request.without(features).features) == set(request.features) - set(features)


def test_a_request_without_an_unknown_feature_raises_naming_it() -> None:
    with pytest.raises(ValueError, match=r"unknown features \['dropuot'\]; known: causal, "):
        Request().without(["dropuot"])


def test_cpu_dropout_on_the_default_resolver_names_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in case: on CPU the fused ``sdpa`` kernel has no dropout (issue 23: reference
    is 8.2x slower at L = 16K on CPU)."""
    from ringdilated.functional import default_resolver

    resolver = default_resolver()
    sdpa = resolver.specs["sdpa"].capabilities
    assert sdpa.missing_features(Request(head_dim=8, dropout=True)) == ("dropout",)
    assert not sdpa.batch_limit_for(Request(head_dim=8)).bounds_scratch
    with pytest.warns(ringdilated.SlowFeatureWarning, match=r"'sdpa'.*'reference' was chosen"):
        _call(resolver)
    choice = resolver.resolve(Request(head_dim=8, dropout=True))
    assert choice.feature_cost is not None and "sdpa" in choice.feature_cost.faster
