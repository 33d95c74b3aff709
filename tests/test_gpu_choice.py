"""The resolver's choice, and its reasons, among every built-in kernel for Ampere (sm80), Hopper
(sm90) and Blackwell (sm100) requests, with and without each optional package (issue 23's
acceptance). Choice is data: the stand-in packages are importable, never run here; torch is
taken to be a CUDA build with flash attention and cuDNN 9.16 (torch 2.13 then tries cuDNN first
on sm90 and sm100)."""

from __future__ import annotations

import pytest
import torch

from ringdilated.backends import cudnn, torch_flash
from ringdilated.core import Environment, KernelSpec, Request, Resolver
from ringdilated.plugins.builtins import BUILTIN_PLUGINS
from tests.standins import flash_attn3, flash_attn4, install_flash_attn, install_xformers

FA2, FA3, FA4, XF = "flash_attn", "flash_attn_interface", "flash_attn.cute", "xformers"
EVERY = frozenset({FA2, FA3, FA4, XF})


@pytest.fixture(autouse=True)
def cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_flash, "_built_with_flash", lambda: True)
    monkeypatch.setattr(cudnn, "runtime_version", lambda: 91600)
    install_flash_attn(monkeypatch, "2.8.3")
    install_xformers(monkeypatch)
    flash_attn3.install_flash_attn3(monkeypatch, "3.0.0")
    flash_attn4.install_flash_attn4(monkeypatch, "4.0.0b27")


def _specs() -> list[KernelSpec]:
    specs = [spec for plugin in BUILTIN_PLUGINS for spec in plugin.kernels]
    preferred = cudnn.cudnn_spec(version=91600, cuda="12.9", deprioritized=False)
    return [preferred if spec.name == "cudnn" else spec for spec in specs]


def _choice(cc: tuple[int, int], packages: frozenset[str], **request: object):  # type: ignore[no-untyped-def]
    env = Environment(packages=packages, compute_capability=cc)
    wanted = {"dtype": torch.bfloat16, "head_dim": 128, "window": True, **request}
    return Resolver(_specs(), env=env).resolve(Request("cuda", compute_capability=cc, **wanted))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cc", "packages", "chosen"),
    [
        ((8, 0), frozenset(), "torch_flash"),  # torch's own flash op, no package needed
        ((8, 0), frozenset({FA2}), "flash"),
        ((8, 0), frozenset({FA3, FA4}), "torch_flash"),  # FA3 is sm90 only; FA4 trains on 9.0+
        ((8, 0), EVERY, "flash"),
        ((9, 0), frozenset(), "torch_flash"),  # cuDNN (240) just below it where torch prefers it
        ((9, 0), frozenset({FA2}), "flash"),
        ((9, 0), frozenset({FA4}), "flash4"),
        ((9, 0), frozenset({FA2, FA4}), "flash4"),
        ((9, 0), EVERY, "flash3"),  # Hopper: flash3 450 > flash4 400 > flash 300
        ((10, 0), frozenset(), "torch_flash"),
        ((10, 0), frozenset({FA2}), "flash"),
        ((10, 0), frozenset({FA3}), "torch_flash"),  # FA3 does not run on Blackwell
        ((10, 0), EVERY, "flash4"),  # Blackwell: flash4 500
    ],
)
def test_choice_for_each_generation_and_package_set(
    cc: tuple[int, int], packages: frozenset[str], chosen: str
) -> None:
    plan = _choice(cc, packages)
    assert plan.kernel_name == chosen, plan.explain()


def test_the_reasons_name_what_each_kernel_lacks() -> None:
    ampere = _choice((8, 0), frozenset()).explain()
    assert "kernel: torch_flash (priority 250, highest priority that fits)" in ampere
    assert "rejected flash: package 'flash_attn' is not importable" in ampere
    assert "rejected flash3: package 'flash_attn_interface' is not importable" in ampere
    assert "needs compute capability >= 9.0" in ampere.split("rejected flash3:")[1].split("\n")[0]
    assert "not chosen cudnn: fits, priority -5" in ampere  # torch tries cuDNN last there
    assert "not chosen sdpa: fits, priority 100" in ampere

    hopper = _choice((9, 0), EVERY).explain()
    assert "kernel: flash3 (priority 450, highest priority that fits)" in hopper
    for line in ("flash4: fits, priority 400", "flash: fits, priority 300",
                 "torch_flash: fits, priority 250", "cudnn: fits, priority 240"):  # fmt: skip
        assert f"not chosen {line}" in hopper, hopper

    blackwell = _choice((10, 0), frozenset({FA3})).explain()
    flash3 = blackwell.split("rejected flash3:")[1].split("\n")[0]
    assert "compute capability <= 9.0" in flash3, blackwell


def test_a_deterministic_request_ranks_kernels_with_a_deterministic_mode_first() -> None:
    """cuDNN has none (torch never picks it under the switch): it ranks after every kernel
    that has one, and explain() says why it was passed over."""
    plan = _choice((9, 0), frozenset(), deterministic=True)
    assert plan.kernel_name == "torch_flash", plan.explain()
    assert "not chosen cudnn: fits, priority 240, but no deterministic mode" in plan.explain()
    assert _choice((9, 0), EVERY, deterministic=True).kernel_name == "flash3"


def test_dropout_moves_the_choice_to_a_kernel_that_implements_it() -> None:
    """FA3/FA4 and cuDNN (as declared) have no dropout: a training call with dropout goes to
    the flash-attn 2 package, else torch's flash op, both fused, never to ``reference``."""
    assert _choice((9, 0), EVERY, dropout=True).kernel_name == "flash"
    assert _choice((10, 0), frozenset({FA3, FA4}), dropout=True).kernel_name == "torch_flash"
    explained = _choice((9, 0), EVERY, dropout=True).explain()
    assert "rejected flash3: does not support dropout_p > 0" in explained


GROUPED = [
    ((8, 0), frozenset(), "torch_flash"),
    ((9, 0), EVERY, "flash3"),
    ((10, 0), EVERY, "flash4"),
    ((9, 0), frozenset(), "torch_flash"),
]


def test_grouped_heads_and_every_fused_kernel_take_them() -> None:
    for cc, packages, chosen in GROUPED:
        plan = _choice(cc, packages, gqa=True)
        assert plan.kernel_name == chosen, plan.explain()
