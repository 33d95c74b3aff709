"""What a backend can serve, declared as data, and the request it is judged against.

A backend declares :class:`Capabilities`: the :class:`Target` devices it runs on (device type,
compute-capability range, dtypes, head-dim limits), the features it has (causal masks, backward,
dropout, grouped-query heads) and the packages it imports. :meth:`Capabilities.reasons` compares
them with a frozen :class:`Request` and returns every reason the backend cannot serve it: an empty
tuple means it can. Facts about the machine that are not in the request (which packages import)
come from an :class:`Environment`, which tests replace with a fake one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

import attrs
import torch

from ringdilated.core.contract import rules
from ringdilated.core.plan.window import FULL, KeyWindow, as_window
from ringdilated.core.support.env import env_names
from ringdilated.core.support.modules import findable

__all__ = [
    "CAPABILITY_ENV_VAR",
    "DEFAULT_QUERY_ELEMENTS",
    "FEATURES",
    "FUSED_GRID_LIMIT",
    "FUSED_QUERY_ELEMENTS",
    "FUSED_WINDOWED_GRID_LIMIT",
    "GRID_LIMIT",
    "PACKAGES_ENV_VAR",
    "BatchLimit",
    "Capabilities",
    "Environment",
    "KernelSpec",
    "PriorityRule",
    "Request",
    "Target",
    "deterministic_algorithms",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.") if dtype in _FLOATS else str(dtype)


def _cc(capability: tuple[int, int] | None) -> str:
    return "none" if capability is None else f"{capability[0]}.{capability[1]}"


#: The features a :class:`Request` may need (each the name of a bool field or property of it),
#: in words; a backend declares each in :class:`Capabilities` (``backward`` per :class:`Target`
#: too).
FEATURES: Mapping[str, str] = MappingProxyType(
    {
        "causal": "causal masking",
        "sliding_window": "a sliding window (a key window bounded on the left)",
        "backward": "backward (gradients)",
        "dropout": "dropout_p > 0",
        "gqa": "grouped-query attention (fewer key/value heads)",
        "softcap": "logit softcapping (cap * tanh(score / cap))",
    }
)


def deterministic_algorithms() -> bool:
    """Whether torch's deterministic switch is on and strict: ``torch.use_deterministic_algorithms
    (True)`` without ``warn_only``. torch's own attention backwards keep their nondeterministic
    path in warn-only mode (``attention_backward.cu`` only warns), and so does every kernel here:
    this is the one reading of the switch a kernel or a request makes."""
    return (
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
    )


@attrs.frozen
class Request:
    """What an attention call needs, frozen and hashable so resolutions can be cached.

    ``device_type`` is ``"cpu"``, ``"cuda"`` (NVIDIA), ``"rocm"`` (a ``cuda`` device of a ROCm build
    of torch: its kernels differ, so targets tell them apart) or another torch device type.
    ``head_dim`` is ``None`` when not yet known. ``compute_capability`` is ``(major, minor)`` for
    CUDA devices, ``None`` otherwise. ``window``: the call's key window (a bool: causal or not),
    needing the ``causal`` feature when bounded on the right, ``sliding_window`` on the left.
    ``softcap``: the call's logit cap (``None``: none), needing the ``softcap`` feature.
    ``deterministic``: :func:`deterministic_algorithms` (torch's switch, strict) when the call was
    made. The core refuses no kernel for it (a backend's own reasons may: ``flash3`` above head dim
    192); a kernel that declares no deterministic mode ranks after every kernel that has one and is
    named as such by :meth:`KernelChoice.explain
    <ringdilated.core.select.resolver.KernelChoice.explain>`.
    """

    device_type: str = "cpu"
    dtype: torch.dtype = torch.float32
    head_dim: int | None = None
    compute_capability: tuple[int, int] | None = None
    window: KeyWindow = attrs.field(default=FULL, converter=as_window)
    backward: bool = True
    dropout: bool = False
    gqa: bool = False
    deterministic: bool = False
    softcap: float | None = attrs.field(default=None, kw_only=True)

    @property
    def causal(self) -> bool:
        return self.window.right is not None

    @property
    def sliding_window(self) -> bool:
        return self.window.left is not None

    @property
    def features(self) -> tuple[str, ...]:
        """The :data:`FEATURES` this request needs, by name, in that order."""
        return tuple(name for name in FEATURES if getattr(self, name))

    def without(self, features: Iterable[str]) -> Request:
        """This request needing none of ``features`` (names of :data:`FEATURES`): the window
        unbounded on the side ``causal`` (right) or ``sliding_window`` (left) bounds, the other
        flags off. Raises ``ValueError`` naming an unknown feature."""
        dropped = set(features)
        unknown = sorted(dropped - set(FEATURES))
        if unknown:
            raise ValueError(f"unknown features {unknown}; known: {', '.join(FEATURES)}")
        return attrs.evolve(
            self,
            window=KeyWindow(
                None if "sliding_window" in dropped else self.window.left,
                None if "causal" in dropped else self.window.right,
            ),
            backward=self.backward and "backward" not in dropped,
            dropout=self.dropout and "dropout" not in dropped,
            gqa=self.gqa and "gqa" not in dropped,
            softcap=None if "softcap" in dropped else self.softcap,
        )

    @classmethod
    def for_tensors(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        window: KeyWindow | bool,
        dropout: bool,
        backward: bool,
        env: Environment | None = None,
        softcap: float | None = None,
    ) -> Request:
        """The request for attention over ``q`` ``(B, L, H, D)`` and ``k`` ``(B, L, Hkv, D)``."""
        env = env or Environment()
        return cls(
            device_type=env.device_type(q.device),
            dtype=q.dtype,
            head_dim=q.shape[-1],
            compute_capability=env.capability(q.device),
            window=window,
            backward=backward,
            dropout=dropout,
            gqa=q.shape[2] != k.shape[2],
            deterministic=deterministic_algorithms(),
            softcap=softcap,
        )

    def describe(self) -> str:
        where = self.device_type
        if self.compute_capability is not None:
            where += f" (compute capability {_cc(self.compute_capability)})"
        features = list(self.features)
        if self.deterministic:
            features.append("deterministic")
        head_dim = "unknown" if self.head_dim is None else str(self.head_dim)
        return (
            f"{where}, {dtype_name(self.dtype)}, head_dim {head_dim}, "
            f"needs: {', '.join(features) or 'forward only'}"
        )


PACKAGES_ENV_VAR = "RINGDILATED_PACKAGES"
CAPABILITY_ENV_VAR = "RINGDILATED_COMPUTE_CAPABILITY"


def _parse_capability(text: str) -> tuple[int, int]:
    major, _, minor = text.strip().partition(".")
    if not major.isdigit() or (minor and not minor.isdigit()):
        raise ValueError(f"{CAPABILITY_ENV_VAR} must look like '8.0', got {text!r}")
    return int(major), int(minor or 0)


@attrs.frozen
class Environment:
    """Facts about the machine that requests do not carry. Replace it in tests.

    ``packages``: importable package names (dotted for a submodule); ``None`` asks the import
    system each time (:meth:`has_package`).
    ``compute_capability``: reported for every CUDA device instead of the real one (``None``:
    ask the device). ``rocm``: whether torch's ``cuda`` devices are AMD GPUs (``None``: ask
    ``torch.version.hip``). :meth:`from_environ` reads the first two from
    ``RINGDILATED_PACKAGES`` (comma-separated names) and ``RINGDILATED_COMPUTE_CAPABILITY``
    (e.g. ``8.0``).
    """

    packages: frozenset[str] | None = None
    compute_capability: tuple[int, int] | None = None
    rocm: bool | None = None

    @classmethod
    def from_environ(cls) -> Environment:
        packages = env_names(PACKAGES_ENV_VAR)
        capability = os.environ.get(CAPABILITY_ENV_VAR)
        return cls(
            packages=None if packages is None else frozenset(packages),
            compute_capability=None if not capability else _parse_capability(capability),
        )

    def has_package(self, name: str) -> bool:
        """Whether ``name`` (a module, possibly dotted) can be found, in ``packages`` when set,
        else without importing it or its parents
        (:func:`~ringdilated.core.support.modules.findable`): ``flash_attn.cute`` is looked for
        in ``flash_attn``'s directory, never by running ``flash_attn/__init__.py`` (a CUDA
        extension's import). A lookup that fails counts as missing, so a broken install is a
        reason against the kernels needing it, not an error; a parent that would fail to import
        is not imported to find out, so its kernel is rejected by its factory's import instead
        (``factory failed: ...``), again a reason."""
        if self.packages is not None:
            return name in self.packages
        return findable(name)

    def device_type(self, device: torch.device) -> str:
        """``device.type``, except ``"rocm"`` for the ``cuda`` devices of a ROCm build."""
        rocm = self.rocm if self.rocm is not None else torch.version.hip is not None
        return "rocm" if device.type == "cuda" and rocm else device.type

    def capability(self, device: torch.device) -> tuple[int, int] | None:
        """The compute capability of an NVIDIA ``device`` (``None`` for other devices)."""
        if self.device_type(device) != "cuda":
            return None
        if self.compute_capability is not None:
            return self.compute_capability
        return torch.cuda.get_device_capability(device)


#: The default :attr:`BatchLimit.query_elements`: 8M elements (32 MiB of float32 queries).
DEFAULT_QUERY_ELEMENTS = 1 << 23


@attrs.frozen
class BatchLimit:
    """How many independent problems (the ``N`` of the kernel layout) one kernel call may hold.

    Kernels that put the batch into a CUDA launch-grid dimension (``gridDim.y`` and ``gridDim.z``
    are capped at 65535) declare it. ``problems``: ``N`` at most this; ``problems_x_kv_heads``:
    ``N`` times the call's key/value heads at most this (a grid dimension holding both). The
    driver splits its calls to respect both; no request is rejected for them.

    ``query_elements``: the most query elements (problems x query heads x rows x head dim) one
    call may hold, bounding the scratch memory of a kernel that materialises scores (the
    ``reference`` kernel: ``DEFAULT_QUERY_ELEMENTS`` by default, so a kernel that declares
    nothing keeps that bound). A fused kernel, whose memory is linear in its inputs, declares
    :data:`FUSED_QUERY_ELEMENTS` (:data:`FUSED_GRID_LIMIT`), which bounds the float32
    temporaries around a call rather than the kernel's scratch; ``None`` is no bound. The
    driver holds every call to it, a sharded run's crossing pieces included: by whole segments
    (problems) where they fit, and a problem larger than the bound by its query rows (each
    chunk with every key, the window shifted, with dropout a seed of its own; one query row of
    one problem at least: :mod:`ringdilated.core.run.limited`). Whether a kernel materialises
    scores is read from this bound (:attr:`bounds_scratch`: at most the default), so a fused
    plugin kernel should declare :data:`FUSED_GRID_LIMIT` or its own larger bound. Each of
    these is ``None`` or a positive int.

    ``skips_hidden_keys``: the kernel's work follows the keys a block's window shows (it skips
    the tiles a window hides: flash-attn's local window, a FlexAttention block mask), so the
    driver hands it a window's block whole. ``False`` (the default): it computes every score it
    is handed (an additive mask, dense math), so the driver cuts a window bounded on both sides
    into bands of rows, each with only the keys its rows see
    (:func:`~ringdilated.core.run.limited.row_chunks`): a sliding window costs about ``rows x
    window`` scores either way.
    """

    problems: int | None = attrs.field(default=None, validator=rules.optional(rules.positive_int))
    problems_x_kv_heads: int | None = attrs.field(
        default=None, validator=rules.optional(rules.positive_int)
    )
    query_elements: int | None = attrs.field(
        default=DEFAULT_QUERY_ELEMENTS, validator=rules.optional(rules.positive_int), kw_only=True
    )
    skips_hidden_keys: bool = attrs.field(default=False, validator=rules.bools, kw_only=True)

    @property
    def bounds_scratch(self) -> bool:
        """Whether :attr:`query_elements` is at most the default scratch bound: the mark of a
        kernel that materialises scores (what the slow-feature rule calls unfused)."""
        bound = self.query_elements
        return isinstance(bound, int) and bound <= DEFAULT_QUERY_ELEMENTS

    def per_call(self, kv_heads: int) -> int | None:
        """The most problems a call with ``kv_heads`` key/value heads may hold (``None``: any)."""
        limits = [self.problems] if self.problems is not None else []
        if self.problems_x_kv_heads is not None:
            limits.append(max(1, self.problems_x_kv_heads // max(1, kv_heads)))
        return min(limits, default=None)


#: The CUDA limit on ``gridDim.y`` and ``gridDim.z``.
GRID_LIMIT = 65535
#: No limit on problems per call (the default scratch bound only).
UNLIMITED = BatchLimit()
#: A fused kernel's bound on query elements per call: 2^28 (1 GiB in float32). The kernel's own
#: scratch is linear in its inputs, but what scales with a call is not only its inputs: the
#: driver's float32 temporaries around it (merging partial results, lse gradients) and the
#: kernels' own float32 accumulators (flash-attn's ``dq_accum``). At this bound each stays at
#: 1 GiB, and a call still holds 32 times what the scratch bound allows.
FUSED_QUERY_ELEMENTS = 1 << 28
#: A fused CUDA kernel's limits: the launch grid's ``gridDim.y`` holds the problems, and
#: :data:`FUSED_QUERY_ELEMENTS` the query elements.
FUSED_GRID_LIMIT = BatchLimit(problems=GRID_LIMIT, query_elements=FUSED_QUERY_ELEMENTS)
#: :data:`FUSED_GRID_LIMIT` of a kernel whose local window skips the key tiles it hides
#: (flash-attn's ``window_size``: its key-block loop starts and stops at the window's edges), so
#: a sliding window's block reaches it whole, not cut into bands of rows (one launch where bands
#: would make ``L / 256``).
FUSED_WINDOWED_GRID_LIMIT = BatchLimit(
    problems=GRID_LIMIT, query_elements=FUSED_QUERY_ELEMENTS, skips_hidden_keys=True
)


@attrs.frozen
class Target:
    """One kind of device a backend runs on, with the dtypes and head dims it takes there.

    ``min_capability``/``max_capability`` bound the CUDA compute capability (inclusive);
    ``head_dim_multiple`` and ``max_head_dim`` bound the head dim (``None``: no bound).
    ``backward=False`` declares a forward-only target (a backend with gradients elsewhere);
    ``dropout=False`` a target without the dropout its backend declares elsewhere.
    ``batch_limit`` replaces the capabilities' :class:`BatchLimit` on this target (``None``: it
    applies), for a backend fused on one device and materialising scores on another.
    Every field is validated on construction (:mod:`ringdilated.core.contract.rules`): ``dtypes``
    is a non-empty frozenset of floating dtypes, the bounds are ``(int, int)`` or ``None``, the head
    dim limits positive ints.
    """

    device_type: str = attrs.field(validator=rules.non_empty_str)
    dtypes: frozenset[torch.dtype] = attrs.field(validator=rules.floating_dtypes)
    min_capability: tuple[int, int] | None = attrs.field(
        default=None, validator=rules.capability_bounds
    )
    max_capability: tuple[int, int] | None = attrs.field(
        default=None, validator=rules.capability_bounds
    )
    max_head_dim: int | None = attrs.field(
        default=None, validator=rules.optional(rules.positive_int)
    )
    head_dim_multiple: int = attrs.field(default=1, validator=rules.positive_int)
    note: str = attrs.field(default="", validator=rules.strs)
    backward: bool = attrs.field(default=True, validator=rules.bools)
    dropout: bool = attrs.field(default=True, validator=rules.bools, kw_only=True)
    batch_limit: BatchLimit | None = attrs.field(
        default=None,
        validator=rules.optional(rules.Rule("a BatchLimit", lambda v: isinstance(v, BatchLimit))),
        kw_only=True,
    )

    def reasons(self, request: Request) -> tuple[str, ...]:
        out: list[str] = []
        label = f" ({self.note})" if self.note else ""
        capability = request.compute_capability
        if self.min_capability is not None and (
            capability is None or capability < self.min_capability
        ):
            out.append(
                f"needs compute capability >= {_cc(self.min_capability)}{label}, "
                f"device has {_cc(capability)}"
            )
        if (
            self.max_capability is not None
            and capability is not None
            and capability > self.max_capability
        ):
            out.append(
                f"supports compute capability <= {_cc(self.max_capability)}{label}, "
                f"device has {_cc(capability)}"
            )
        if request.dtype not in self.dtypes:
            names = ", ".join(sorted(dtype_name(d) for d in self.dtypes))
            out.append(
                f"dtype {dtype_name(request.dtype)} not supported on {self.device_type}{label} "
                f"(supports {names})"
            )
        if request.backward and not self.backward:
            out.append(f"no backward (gradients) on {self.device_type}{label}")
        if request.dropout and not self.dropout:
            out.append(f"no dropout on {self.device_type}{label}")
        if request.head_dim is not None:
            if self.max_head_dim is not None and request.head_dim > self.max_head_dim:
                out.append(f"head_dim {request.head_dim} exceeds {self.max_head_dim}{label}")
            if request.head_dim % self.head_dim_multiple:
                out.append(
                    f"head_dim {request.head_dim} is not a multiple of "
                    f"{self.head_dim_multiple}{label}"
                )
        return tuple(out)


@attrs.frozen
class Capabilities:
    """Everything a backend supports, as data. See :meth:`reasons`.

    ``batch_limit``: how many problems one call may hold (:class:`BatchLimit`). ``deterministic``:
    the kernel gives bitwise-identical results run to run whenever :func:`deterministic_algorithms`
    (always, or by switching to a deterministic mode of its op); it is not a requirement a request
    can fail, it ranks kernels (:class:`Request`). ``targets`` is a non-empty tuple of
    :class:`Target`, ``requires`` a tuple of package names; every field is validated on
    construction.
    """

    targets: tuple[Target, ...] = attrs.field(
        validator=rules.tuple_of(Target, "Target", non_empty=True), metadata={"items": Target}
    )
    causal: bool = attrs.field(default=True, validator=rules.bools)
    sliding_window: bool = attrs.field(default=False, validator=rules.bools, kw_only=True)
    softcap: bool = attrs.field(default=False, validator=rules.bools, kw_only=True)
    deterministic: bool = attrs.field(default=False, validator=rules.bools, kw_only=True)
    backward: bool = attrs.field(default=True, validator=rules.bools)
    dropout: bool = attrs.field(default=False, validator=rules.bools)
    gqa: bool = attrs.field(default=True, validator=rules.bools)
    requires: tuple[str, ...] = attrs.field(default=(), validator=rules.requirements)
    batch_limit: BatchLimit = attrs.field(
        default=UNLIMITED,
        validator=rules.Rule("a BatchLimit", lambda v: isinstance(v, BatchLimit)),
        metadata={"spec": BatchLimit},
    )

    def batch_limit_for(self, request: Request) -> BatchLimit:
        """The limits on one call serving ``request``: its target's :attr:`Target.batch_limit`
        where that target declares one, else :attr:`batch_limit`."""
        target = self.target_for(request)
        if target is not None and target.batch_limit is not None:
            return target.batch_limit
        return self.batch_limit

    def target_for(self, request: Request) -> Target | None:
        """The first declared target that serves ``request``'s device, dtype and head dim."""
        on_device = (t for t in self.targets if t.device_type == request.device_type)
        return next((t for t in on_device if not t.reasons(request)), None)

    def reasons(self, request: Request, env: Environment) -> tuple[str, ...]:
        """Every reason this backend cannot serve ``request`` (empty: it can)."""
        out = [
            f"package {name!r} is not importable"
            for name in self.requires
            if not env.has_package(name)
        ]
        on_device = [t for t in self.targets if t.device_type == request.device_type]
        if not on_device:
            devices = ", ".join(sorted({t.device_type for t in self.targets}))
            out.append(f"runs on {devices}, not {request.device_type}")
        else:
            per_target = [t.reasons(request) for t in on_device]
            if all(per_target):
                out.extend(dict.fromkeys(r for reasons in per_target for r in reasons))
        for feature in request.features:
            if not getattr(self, feature):
                out.append(f"does not support {FEATURES[feature]}")
        return tuple(out)

    def missing_features(self, request: Request) -> tuple[str, ...]:
        """The features ``request`` needs that this backend lacks (names of :data:`FEATURES`, in
        that order): those its flags leave out, and ``backward`` or ``dropout`` where every
        declared target that would serve the request without it lacks it. Empty: none is
        missing (:meth:`reasons` may still hold others)."""
        missing = {name for name in request.features if not getattr(self, name)}
        per_target = ("backward", "dropout")  # the features a target may also lack
        without = request.without(per_target)
        on_device = [t for t in self.targets if t.device_type == request.device_type]
        serving = [t for t in on_device if not t.reasons(without)]
        for feature in per_target:
            lacking = serving and not any(getattr(t, feature) for t in serving)
            if getattr(request, feature) and lacking:
                missing.add(feature)
        return tuple(name for name in FEATURES if name in missing)


@attrs.frozen
class PriorityRule:
    """A backend's priority on matching hardware: the first rule that matches a request wins.

    ``device_type`` and the inclusive compute-capability bounds are ``None`` when they do not
    matter. Hardware preferences are data here, not branches in the resolver. Every field is
    validated on construction.
    """

    priority: int = attrs.field(validator=rules.ints)
    device_type: str | None = attrs.field(
        default=None, validator=rules.optional(rules.non_empty_str)
    )
    min_capability: tuple[int, int] | None = attrs.field(
        default=None, validator=rules.capability_bounds
    )
    max_capability: tuple[int, int] | None = attrs.field(
        default=None, validator=rules.capability_bounds
    )

    def matches(self, request: Request) -> bool:
        if self.device_type is not None and request.device_type != self.device_type:
            return False
        cc = request.compute_capability
        if self.min_capability is not None and (cc is None or cc < self.min_capability):
            return False
        return self.max_capability is None or (cc is not None and cc <= self.max_capability)


@attrs.frozen
class KernelSpec:
    """A kernel backend as a plugin offers it: a name, a priority, capabilities and a factory.

    ``name`` is a non-empty str without whitespace or commas (users list names in environment
    variables) and never ``"auto"``. ``factory`` builds the kernel (it may import optional
    packages; it is called only after the capabilities accepted a request; if it raises, the
    resolver records why and moves on). ``extra_reasons`` adds checks that are not expressible
    as data and returns an iterable of str; if it raises or returns anything else,
    :meth:`reasons` turns that into a reason against this kernel. Higher priority wins among
    backends that fit (:meth:`priority_for`): the first rule that matches the request, else
    ``priority`` (an int, not a bool). The rules are ``priority_rules`` (data), after those
    ``priority_rules_for`` returns (keyword-only; ``None``: none): a callable taking the
    resolver's :class:`Environment` and returning an iterable of :class:`PriorityRule`, for a
    preference that depends on the machine (a library's runtime version, an environment
    variable), called each time the resolver ranks the kernel and never when the spec is built,
    so importing a plugin loads and reads nothing. Every field is validated on construction; the
    plugin manager validates again when the registry is built.
    """

    name: str = attrs.field(validator=rules.names)
    factory: Callable[[], object] = attrs.field(validator=rules.callables)
    capabilities: Capabilities = attrs.field(
        validator=rules.Rule("a Capabilities", lambda v: isinstance(v, Capabilities)),
        metadata={"spec": Capabilities},
    )
    priority: int = attrs.field(default=0, validator=rules.ints)
    description: str = attrs.field(default="", validator=rules.strs)
    extra_reasons: Callable[[Request, Environment], Iterable[str]] | None = attrs.field(
        default=None, validator=rules.optional(rules.callables)
    )
    priority_rules: tuple[PriorityRule, ...] = attrs.field(
        default=(),
        validator=rules.tuple_of(PriorityRule, "PriorityRule"),
        metadata={"items": PriorityRule},
    )
    priority_rules_for: Callable[[Environment], Iterable[PriorityRule]] | None = attrs.field(
        default=None, validator=rules.optional(rules.callables), kw_only=True
    )

    def priority_for(self, request: Request, env: Environment | None = None) -> int:
        """The priority of this kernel for ``request``: the first of ``priority_rules_for(env)``
        (``env``: ``Environment()`` when not given) and then of ``priority_rules`` that matches,
        else ``priority``. Raises ``TypeError`` naming what ``priority_rules_for`` returned when
        it is not an iterable of :class:`PriorityRule` (the resolver turns any failure into a
        reason against this kernel)."""
        for rule in (*self._rules_for(env), *self.priority_rules):
            if rule.matches(request):
                return rule.priority
        return self.priority

    def _rules_for(self, env: Environment | None) -> tuple[PriorityRule, ...]:
        hook = self.priority_rules_for
        if hook is None:
            return ()
        got = hook(env if env is not None else Environment())
        if isinstance(got, (str, bytes)) or not isinstance(got, Iterable):
            raise TypeError(
                f"priority_rules_for {rules.label(hook)} returned {rules.describe(got)}, not an "
                "iterable of PriorityRule"
            )
        found = tuple(got)
        bad = [rule for rule in found if not isinstance(rule, PriorityRule)]
        if bad:
            raise TypeError(
                f"priority_rules_for {rules.label(hook)} returned {rules.describe(bad[0])}, not a "
                "PriorityRule, among its rules"
            )
        return found

    def reasons(self, request: Request, env: Environment) -> tuple[str, ...]:
        """Every reason this kernel cannot serve ``request`` (empty: it can); never raises for
        what ``extra_reasons`` does."""
        reasons = list(self.capabilities.reasons(request, env))
        if self.extra_reasons is not None:
            reasons.extend(
                rules.contained_reasons("extra_reasons", self.extra_reasons, request, env)
            )
        return tuple(reasons)
