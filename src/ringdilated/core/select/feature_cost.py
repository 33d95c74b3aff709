"""What a request's features cost an automatic kernel choice, as data, and the warning about it.

A fused kernel (its ``BatchLimit`` does not bound scratch:
:attr:`~ringdilated.core.select.capabilities.BatchLimit.bounds_scratch` is false) is many times
faster than one that materialises each block's scores (the ``reference`` kernel: 8.2x at L = 16K on
CPU, issue 23). When the resolver chooses the slower kind only because the fused kernels it prefers
lack a feature the request needs (dropout, say), the choice carries a :class:`FeatureCost`;
:meth:`KernelChoice.explain <ringdilated.core.select.resolver.KernelChoice.explain>` shows it and a
call warns once per process and (features, kernel) with :class:`SlowFeatureWarning`, as a float16
call on an old GPU warns with ``SlowDtypeWarning``. A forced kernel (by name, ``RINGDILATED_KERNEL``
or an instance) carries none: that choice was made knowingly.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import attrs

from ringdilated.core.select.capabilities import FEATURES, Environment, KernelSpec, Request
from ringdilated.core.support.caller import user_stacklevel
from ringdilated.core.support.errors import SlowFeatureWarning

__all__ = ["FeatureCost", "SlowFeatureWarning", "feature_cost_of", "warn_if_slow_features"]


@attrs.frozen
class FeatureCost:
    """An automatic choice a request's ``features`` (names of
    :data:`~ringdilated.core.select.capabilities.FEATURES`) made slow: ``kernel`` materialises
    scores, while the fused kernels ``faster``, preferred for the request, would serve it but for
    those features, which they lack."""

    features: tuple[str, ...]
    kernel: str
    faster: tuple[str, ...]

    def describe(self) -> str:
        needs = " and ".join(f"{name} ({FEATURES[name]})" for name in self.features)
        one = len(self.faster) == 1
        faster = f"the fused kernel{'' if one else 's'} " + ", ".join(map(repr, self.faster))
        return (
            f"this call needs {needs}, which {faster} preferred for it "
            f"{'does' if one else 'do'} not support, so {self.kernel!r} was chosen, which "
            "materialises attention scores (much slower, and memory quadratic in a block's "
            "length)"
        )


def feature_cost_of(
    chosen: KernelSpec, preferred: Iterable[KernelSpec], request: Request, env: Environment
) -> FeatureCost | None:
    """The :class:`FeatureCost` of choosing ``chosen`` for ``request`` over ``preferred`` (the
    specs ranked above it, in order), or ``None``: when ``chosen`` is fused, or no fused one of
    ``preferred`` was turned away by features alone (:func:`_declined_features`)."""
    if not chosen.capabilities.batch_limit_for(request).bounds_scratch:
        return None
    declined = [(spec.name, _declined_features(spec, request, env)) for spec in preferred]
    faster = tuple(name for name, features in declined if features)
    if not faster:
        return None
    needed = {feature for _, features in declined for feature in features}
    return FeatureCost(tuple(name for name in FEATURES if name in needed), chosen.name, faster)


def _declined_features(spec: KernelSpec, request: Request, env: Environment) -> tuple[str, ...]:
    """The features ``request`` needs that turned fused ``spec`` away
    (:meth:`~ringdilated.core.select.capabilities.Capabilities.missing_features`), when it would
    serve the request without them; else ``()``: it is not fused, lacks nothing, or has another
    reason against the request (whatever it raises is one)."""
    try:
        missing = spec.capabilities.missing_features(request)
        if spec.capabilities.batch_limit_for(request.without(missing)).bounds_scratch:
            return ()
        serves = bool(missing) and not tuple(spec.reasons(request.without(missing), env))
    except Exception:  # a plugin's spec may fail in any way: then it serves nothing
        return ()
    return missing if serves else ()


_warned: set[tuple[tuple[str, ...], str]] = set()
"""The ``(features, kernel)`` pairs :func:`warn_if_slow_features` has warned about."""


def warn_if_slow_features(cost: FeatureCost | None) -> None:
    """Warn with :class:`SlowFeatureWarning`, once per process and ``(features, kernel)``, that
    a call's features made its automatic kernel choice slow (``cost``; ``None``: they did not)."""
    if cost is None or (cost.features, cost.kernel) in _warned:
        return
    _warned.add((cost.features, cost.kernel))  # before warning: a filter may raise it
    warnings.warn(
        f"{cost.describe()}. Pass kernel={cost.kernel!r} to choose it knowingly (no warning), "
        "or a kernel that supports what the call needs",
        SlowFeatureWarning,
        stacklevel=user_stacklevel(),
    )
