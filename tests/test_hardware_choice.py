"""Hardware-aware choice without hardware: fake environments, stand-in packages (issue 4's
CPU-testable part). The real flash-attn and xformers backends are not written yet; these
stand-in specs exercise the mechanism they will use: capabilities and priorities as data."""

from __future__ import annotations

import importlib
import sys
import types
import warnings

import pytest
import torch

import ringdilated
from ringdilated import Environment, KernelSpec, Request, ResolutionError, Resolver
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.backends.sdpa import SDPA_SPEC
from ringdilated.core import Capabilities, PriorityRule, Target
from ringdilated.core import dtypes as dtype_policy

HALF = frozenset({torch.float16, torch.bfloat16})


def _flash_factory() -> ReferenceKernel:
    module = importlib.import_module("flash_attn")
    module.flash_attn_func  # noqa: B018  (a broken install fails here)
    return ReferenceKernel()


FLASH = KernelSpec(
    name="standin-flash",
    factory=_flash_factory,
    capabilities=Capabilities(
        targets=(
            Target("cuda", HALF, min_capability=(8, 0), max_head_dim=256, head_dim_multiple=8),
        ),
        requires=("flash_attn",),
    ),
    priority=0,
    priority_rules=(PriorityRule(300, "cuda", min_capability=(8, 0)),),
)
XFORMERS = KernelSpec(
    name="standin-xformers",
    factory=ReferenceKernel,
    capabilities=Capabilities(
        targets=(
            Target("cuda", frozenset({torch.float16, torch.float32}), min_capability=(5, 0)),
            Target("cuda", frozenset({torch.bfloat16}), min_capability=(8, 0)),
        ),
        requires=("xformers",),
    ),
    priority=50,
    priority_rules=(PriorityRule(150, "cuda", min_capability=(7, 0), max_capability=(7, 5)),),
)
SPECS = [FLASH, XFORMERS, SDPA_SPEC, REFERENCE_SPEC]


@pytest.fixture(autouse=True)
def flash_attn_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """A working stand-in ``flash_attn`` module; tests that break it replace it."""
    stand_in = types.ModuleType("flash_attn")
    stand_in.flash_attn_func = lambda *a, **k: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", stand_in)


BOTH = frozenset({"flash_attn", "xformers"})


def cuda(cc: tuple[int, int], dtype: torch.dtype, head_dim: int = 64) -> Request:
    return Request(device_type="cuda", compute_capability=cc, dtype=dtype, head_dim=head_dim)


@pytest.mark.parametrize(
    ("cc", "dtype", "head_dim", "packages", "chosen"),
    [
        ((6, 1), torch.float32, 64, BOTH, "sdpa"),  # Pascal: sdpa in fp32, no Flash attempt
        ((6, 1), torch.float16, 64, BOTH, "sdpa"),
        ((7, 0), torch.float16, 64, BOTH, "standin-xformers"),  # Volta
        ((7, 5), torch.float16, 64, BOTH, "standin-xformers"),  # Turing
        ((7, 5), torch.float16, 64, frozenset(), "sdpa"),
        ((8, 0), torch.bfloat16, 64, BOTH, "standin-flash"),  # Ampere: flash > sdpa > xformers
        ((8, 6), torch.bfloat16, 128, BOTH, "standin-flash"),
        ((8, 6), torch.float32, 64, BOTH, "sdpa"),  # flash has no fp32
        ((9, 0), torch.float16, 64, BOTH, "standin-flash"),  # Hopper
        ((9, 0), torch.float16, 64, frozenset({"xformers"}), "sdpa"),
        ((9, 0), torch.float16, 512, BOTH, "sdpa"),  # beyond flash's head dims
        ((9, 0), torch.float16, 60, BOTH, "standin-xformers"),  # not a multiple of 8
    ],
)
def test_choice_by_hardware(cc, dtype, head_dim, packages, chosen) -> None:
    resolver = Resolver(SPECS, env=Environment(packages=packages))
    plan = resolver.resolve(cuda(cc, dtype, head_dim))
    assert plan.kernel_name == chosen, plan.explain()


def test_explain_shows_priorities_and_reasons() -> None:
    plan = Resolver(SPECS, env=Environment(packages=BOTH)).resolve(cuda((8, 0), torch.bfloat16))
    text = plan.explain()
    assert "kernel: standin-flash (priority 300, highest priority that fits)" in text
    assert "not chosen sdpa: fits, priority 100" in text
    assert "not chosen standin-xformers: fits, priority 50" in text
    volta = Resolver(SPECS, env=Environment(packages=BOTH)).resolve(cuda((7, 0), torch.float16))
    assert (
        "rejected standin-flash: needs compute capability >= 8.0, device has 7.0" in volta.explain()
    )


def test_package_broken_on_import_falls_back_and_is_explained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # no functions
    resolver = Resolver(SPECS, env=Environment(packages=BOTH))
    plan = resolver.resolve(cuda((9, 0), torch.float16))
    assert plan.kernel_name == "sdpa"
    assert "rejected standin-flash: factory failed: AttributeError" in plan.explain()
    with pytest.raises(ResolutionError, match=r"kernel 'standin-flash' .* factory failed"):
        Resolver(SPECS, env=Environment(packages=BOTH)).resolve(
            cuda((9, 0), torch.float16), "standin-flash"
        )


def test_package_missing_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "flash_attn")
    monkeypatch.setattr(sys, "path", [])  # nothing importable by name any more
    plan = Resolver(SPECS, env=Environment(packages=BOTH)).resolve(cuda((9, 0), torch.float16))
    assert plan.kernel_name == "sdpa"
    assert "factory failed: ModuleNotFoundError" in plan.explain()


@pytest.mark.parametrize(
    ("device", "cc", "expected"),
    [
        ("cpu", None, torch.float32),
        ("cuda", (6, 1), torch.float32),
        ("cuda", (7, 0), torch.float16),
        ("cuda", (7, 5), torch.float16),
        ("cuda", (8, 0), torch.bfloat16),
        ("cuda", (8, 6), torch.bfloat16),
        ("cuda", (9, 0), torch.bfloat16),
    ],
)
def test_dtype_policy(device: str, cc, expected: torch.dtype) -> None:
    assert ringdilated.recommended_dtype(device, Environment(compute_capability=cc)) == expected


def test_fp16_below_volta_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtype_policy, "_warned", set())
    with pytest.warns(
        ringdilated.SlowDtypeWarning, match=r"compute capability 6\.1 .* 10-100x slower"
    ):
        dtype_policy.warn_if_slow(cuda((6, 1), torch.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dtype_policy.warn_if_slow(cuda((6, 1), torch.float16))  # once only
        dtype_policy.warn_if_slow(cuda((6, 1), torch.float32))
        dtype_policy.warn_if_slow(cuda((7, 5), torch.float16))


def test_environment_variables_override_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGDILATED_PACKAGES", "flash_attn, xformers")
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "7.5")
    env = Environment.from_environ()
    assert env == Environment(packages=BOTH, compute_capability=(7, 5))
    assert env.capability(torch.device("cuda")) == (7, 5)
    assert env.capability(torch.device("cpu")) is None
    assert ringdilated.recommended_dtype("cuda", env) == torch.float16
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "ampere")
    with pytest.raises(
        ValueError, match=r"RINGDILATED_COMPUTE_CAPABILITY must look like '8\.0', got 'ampere'"
    ):
        Environment.from_environ()
