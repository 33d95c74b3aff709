"""Hardware-aware choice without hardware: the real flash, xformers, flex, sdpa and reference
specs under fake environments, with stand-in ``flash_attn``/``xformers`` modules (issue 4's
CPU-testable part). The stand-ins are importable but never run here: choice is data."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

import ringdilated
from ringdilated import Environment, Request, ResolutionError, Resolver
from ringdilated.backends.flash import FLASH_SPEC
from ringdilated.backends.flex import FLEX_SPEC
from ringdilated.backends.reference import REFERENCE_SPEC
from ringdilated.backends.sdpa import SDPA_SPEC
from ringdilated.backends.xformers import XFORMERS_SPEC
from ringdilated.core.select import dtypes as dtype_policy
from tests.standins import install_flash_attn, install_xformers

SPECS = [FLASH_SPEC, XFORMERS_SPEC, SDPA_SPEC, FLEX_SPEC, REFERENCE_SPEC]


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Working stand-in packages; tests that break one replace it."""
    install_flash_attn(monkeypatch)
    install_xformers(monkeypatch)


BOTH = frozenset({"flash_attn", "xformers"})


def cuda(
    cc: tuple[int, int], dtype: torch.dtype, head_dim: int = 64, causal: bool = False
) -> Request:
    return Request("cuda", dtype, head_dim, compute_capability=cc, window=causal)


@pytest.mark.parametrize(
    ("cc", "dtype", "head_dim", "packages", "chosen"),
    [
        ((6, 1), torch.float32, 64, frozenset(), "sdpa"),
        ((6, 1), torch.float32, 64, BOTH, "sdpa"),  # Pascal: sdpa in fp32, no Flash attempt
        ((6, 1), torch.float16, 64, BOTH, "sdpa"),
        ((7, 0), torch.float16, 64, BOTH, "xformers"),  # Volta
        ((7, 0), torch.float32, 64, BOTH, "xformers"),
        ((7, 5), torch.float16, 64, BOTH, "xformers"),  # Turing
        ((7, 5), torch.float16, 64, frozenset(), "sdpa"),
        ((7, 5), torch.bfloat16, 64, BOTH, "reference"),  # nothing fused takes bf16 before 8.0
        ((8, 0), torch.bfloat16, 64, BOTH, "flash"),  # Ampere: flash > sdpa > xformers
        ((8, 0), torch.bfloat16, 64, frozenset({"xformers"}), "sdpa"),
        ((8, 6), torch.bfloat16, 128, BOTH, "flash"),
        ((8, 6), torch.float32, 64, BOTH, "sdpa"),  # flash has no fp32
        ((9, 0), torch.float16, 64, BOTH, "flash"),  # Hopper
        ((9, 0), torch.float16, 256, BOTH, "flash"),
        ((9, 0), torch.float16, 512, BOTH, "sdpa"),  # beyond flash's head dims
        ((9, 0), torch.float16, 48, frozenset(), "sdpa"),
        ((9, 0), torch.float16, 60, BOTH, "reference"),  # no fused kernel takes 60
        ((10, 0), torch.bfloat16, 64, frozenset({"xformers"}), "sdpa"),  # CUTLASS stops at 9.0
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_choice_by_hardware(cc, dtype, head_dim, packages, chosen, causal) -> None:
    resolver = Resolver(SPECS, env=Environment(packages=packages))
    plan = resolver.resolve(cuda(cc, dtype, head_dim, causal))
    assert plan.kernel_name == chosen, plan.explain()


def test_choice_on_cpu() -> None:
    resolver = Resolver(SPECS, env=Environment(packages=BOTH))
    assert resolver.resolve(Request("cpu", torch.float32, 64)).kernel_name == "sdpa"
    assert resolver.resolve(Request("cpu", torch.float32, 64, dropout=True)).kernel_name == (
        "reference"
    )
    explained = resolver.resolve(Request("cpu", torch.float32, 64)).explain()
    assert "rejected flash: runs on cuda, not cpu" in explained
    assert "rejected flex: no backward (gradients) on cpu" in explained


def test_explain_shows_priorities_and_reasons() -> None:
    plan = Resolver(SPECS, env=Environment(packages=BOTH)).resolve(cuda((8, 0), torch.bfloat16))
    text = plan.explain()
    assert "kernel: flash (priority 300, highest priority that fits)" in text
    assert "not chosen sdpa: fits, priority 100" in text
    assert "not chosen xformers: fits, priority 50" in text
    assert "not chosen flex: fits, priority 20" in text
    volta = Resolver(SPECS, env=Environment(packages=BOTH)).resolve(cuda((7, 0), torch.float16))
    assert (
        "rejected flash: needs compute capability >= 8.0 (flash-attn 2 needs Ampere or newer), "
        "device has 7.0" in volta.explain()
    )


def test_package_broken_on_import_falls_back_and_is_explained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # no functions
    resolver = Resolver(SPECS, env=Environment(packages=BOTH))
    plan = resolver.resolve(cuda((9, 0), torch.float16))
    assert plan.kernel_name == "sdpa"
    assert "rejected flash: factory failed: ImportError" in plan.explain()
    with pytest.raises(ResolutionError, match=r"kernel 'flash' .* factory failed"):
        resolver.resolve(cuda((9, 0), torch.float16), "flash")


def test_forced_unfit_kernel_raises_with_its_reasons() -> None:
    resolver = Resolver(SPECS, env=Environment(packages=BOTH))
    with pytest.raises(ResolutionError) as info:
        resolver.resolve(cuda((6, 1), torch.float32), "flash")
    message = str(info.value)
    assert "needs compute capability >= 8.0" in message
    assert "dtype float32 not supported on cuda" in message


def test_package_missing_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "flash_attn")
    monkeypatch.delitem(sys.modules, "flash_attn.flash_attn_interface")
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
def test_recommended_dtype_follows_device_and_compute_capability(
    device: str, cc, expected: torch.dtype
) -> None:
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


def test_rocm_is_a_target_of_its_own_that_no_fused_kernel_claims() -> None:
    """On ROCm, torch's ``cuda`` devices are AMD GPUs: the memory-efficient backward there
    (aotriton) wants an unpadded lse, which the sdpa CUDA path does not give, and flash-attn,
    xformers and flex declare NVIDIA targets. Only the plain-math reference claims ROCm."""
    env = Environment(packages=BOTH, rocm=True)
    device = torch.device("cuda")
    assert env.device_type(device) == "rocm"
    assert env.capability(device) is None, "no NVIDIA compute capability on ROCm"
    assert Environment(rocm=False).device_type(device) == "cuda"
    plan = Resolver(SPECS, env=env).resolve(Request("rocm", torch.bfloat16, 64))
    assert plan.kernel_name == "reference"
    text = plan.explain()
    assert "rejected sdpa: runs on cpu, cuda, not rocm" in text
    assert "rejected flash: runs on cuda, not rocm" in text
    with pytest.raises(ResolutionError, match="runs on cpu, cuda, not rocm"):
        Resolver(SPECS, env=env).resolve(Request("rocm", torch.float16, 64), "sdpa")
