"""flash-attn 2's own dropout and deterministic backward behind the kernel contract, against the
stand-in ``flash_attn`` of each supported version (tests/standins/flash_attn.py), which draws its
mask from the default generator's Philox ``(seed, offset)`` and replays it in the backward from
the ``rng_state`` it is handed, as ``flash_api.cpp`` does: a wrong state gives wrong gradients.

The mask is read back through the forward itself: with ``v`` the identity (``Lk <= D``), row
``i`` of ``out`` is row ``i`` of the dropped probabilities, each ``0`` or ``P / (1 - p)`` with
``P`` from float64 math; the backward must then equal float64 autograd through that mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
import pytest
import torch

from ringdilated.backends import _philox
from ringdilated.backends.flash import FLASH_SPEC, FlashKernel
from ringdilated.core import KeyWindow
from ringdilated.core.contract.kernel import BlockOptions
from tests.standins import FLASH_VERSIONS, install_flash_attn
from tests.standins.flash_attn import BACKWARD_CALLS

P = 0.3
N, HEADS, KV_HEADS, LENGTH, DIM = 2, 4, 2, 16, 16
#: Rows 0-11 see keys up to row + 3 (a bottom-right call on 15 keys), rows 12-15 see all 16
#: keys (a second call): two native calls, each with its own seed.
WINDOW = KeyWindow(None, 3)


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` inside the block, the setting restored."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(N, HEADS, LENGTH, DIM, generator=g) * 0.5).half()
    k = (torch.randn(N, KV_HEADS, LENGTH, DIM, generator=g) * 0.5).half()
    v = torch.eye(LENGTH, DIM).expand(N, KV_HEADS, LENGTH, DIM).half()
    dout = torch.randn(N, HEADS, LENGTH, DIM, generator=g).half()
    return q, k, v, dout


def _visible(right: int) -> torch.Tensor:
    rows = torch.arange(LENGTH).unsqueeze(1)
    return torch.arange(LENGTH).unsqueeze(0) <= rows + right


def _probabilities(q: torch.Tensor, k: torch.Tensor, scale: float, right: int) -> torch.Tensor:
    keys = k.double().repeat_interleave(HEADS // KV_HEADS, 1)
    scores = (q.double() @ keys.transpose(-1, -2) * scale).masked_fill(~_visible(right), -torch.inf)
    return scores.softmax(-1)


def _revealed_drop(out: torch.Tensor, probabilities: torch.Tensor) -> torch.Tensor:
    """The dropout scale (``0`` or ``1 / (1 - p)``) each probability got, read from ``out``
    (``v`` the identity), after checking every entry is one of the two."""
    revealed = out.double()[..., :LENGTH]
    scaled = probabilities / (1 - P)
    kept = revealed > scaled / 2
    assert torch.allclose(revealed[kept], scaled[kept], rtol=2e-3, atol=1e-4), "kept: P / (1-p)"
    assert bool((revealed[~kept].abs() < 1e-4).all()), "dropped: 0"
    visible = probabilities > 0
    dropped = float((~kept & visible).sum() / visible.sum())
    assert 0.15 < dropped < 0.45, f"dropped {dropped:.2f} of the visible probabilities, p={P}"
    return kept.double() / (1 - P)


def _oracle_gradients(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, drop: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """float64 autograd through ``softmax(masked scores) * drop @ v``."""
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    group = HEADS // KV_HEADS
    keys, values = (x.repeat_interleave(group, 1) for x in (kd, vd))
    scores = (qd @ keys.transpose(-1, -2) * 0.25).masked_fill(~_visible(3), -torch.inf)
    out = (scores.softmax(-1) * drop) @ values
    return torch.autograd.grad(out, (qd, kd, vd), dout.double())


def _options(seed: int) -> BlockOptions:
    return BlockOptions(scale=0.25, window=WINDOW, dropout_p=P, dropout_seed=seed)


@pytest.mark.parametrize("version", FLASH_VERSIONS)
def test_dropout_mask_is_flash_attns_and_the_backward_replays_it(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    install_flash_attn(monkeypatch, version)
    kernel = FlashKernel()
    q, k, v, dout = _inputs()
    options = _options(seed=1234)
    out, lse = kernel.forward(q, k, v, options)
    probabilities = _probabilities(q, k, 0.25, 3)
    drop = _revealed_drop(out, probabilities)
    undropped = torch.logsumexp(
        (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.25).masked_fill(
            ~_visible(3), -torch.inf
        ),
        -1,
    )
    assert torch.allclose(lse.double(), undropped, atol=1e-5), "the lse ignores dropout"
    grads = kernel.backward(dout, q, k, v, out, lse, options)
    for name, got, want in zip("qkv", grads, _oracle_gradients(q, k, v, dout, drop), strict=True):
        tolerance = 1e-2 * max(1.0, float(want.abs().max()))
        error = float((got.double() - want).abs().max())
        assert error <= tolerance, f"d{name}: error {error:.2e} > {tolerance:.2e}"
    seeds = [call["rng_state"] for call in BACKWARD_CALLS]
    assert len(seeds) == 2 and seeds[0] != seeds[1], "two calls, two unrelated masks"
    assert all(offset == 0 for _, offset in seeds), "each call replays a freshly seeded state"


def test_a_wrong_rng_state_gives_wrong_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above is not vacuous: the backward handed another offset than the forward's
    replays another mask."""
    install_flash_attn(monkeypatch)
    kernel = FlashKernel()
    q, k, v, dout = _inputs()
    options = _options(seed=1234)
    out, lse = kernel.forward(q, k, v, options)
    drop = _revealed_drop(out, _probabilities(q, k, 0.25, 3))
    replay = _philox.replay_state
    monkeypatch.setattr(
        _philox, "replay_state", lambda seed, device, dtype: replay(seed, device, dtype) + 4
    )
    dq, _, _ = kernel.backward(dout, q, k, v, out, lse, options)
    expected = _oracle_gradients(q, k, v, dout, drop)[0]
    assert float((dq.double() - expected).abs().max()) > 0.05


def test_same_seed_same_mask_another_seed_another(monkeypatch: pytest.MonkeyPatch) -> None:
    install_flash_attn(monkeypatch)
    kernel = FlashKernel()
    q, k, v, _ = _inputs()
    first, _ = kernel.forward(q, k, v, _options(seed=5))
    again, _ = kernel.forward(q, k, v, _options(seed=5))
    other, _ = kernel.forward(q, k, v, _options(seed=6))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_dropout_leaves_the_callers_random_stream_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    install_flash_attn(monkeypatch)
    kernel = FlashKernel()
    q, k, v, dout = _inputs()
    torch.manual_seed(77)
    torch.rand(3)
    before = torch.default_generator.get_state()
    out, lse = kernel.forward(q, k, v, _options(seed=9))
    kernel.backward(dout, q, k, v, out, lse, _options(seed=9))
    assert torch.equal(torch.default_generator.get_state(), before)


def test_without_seeding_the_backward_cannot_replay_the_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stand-in is strict where flash-attn is: a forward that draws from the generator as
    the caller left it (not freshly seeded) uses an offset the seed alone cannot replay."""
    install_flash_attn(monkeypatch)
    kernel = FlashKernel()
    q, k, v, dout = _inputs()
    monkeypatch.setattr(_philox, "seeded_generator", lambda device, seed: contextlib.nullcontext())
    torch.manual_seed(3)
    torch.rand(1)
    out, lse = kernel.forward(q, k, v, _options(seed=1234))
    drop = _revealed_drop(out, _probabilities(q, k, 0.25, 3))
    dq, _, _ = kernel.backward(dout, q, k, v, out, lse, _options(seed=1234))
    assert float((dq.double() - _oracle_gradients(q, k, v, dout, drop)[0]).abs().max()) > 0.05


@pytest.mark.parametrize("version", FLASH_VERSIONS)
def test_the_backward_is_deterministic_when_the_options_ask(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """``BlockOptions.deterministic`` (the driver sets it from the plan's reading of torch's
    switch, tests/test_deterministic.py) reaches every call's backward, with dropout too (two
    calls); the kernel does not read torch's switch itself."""
    install_flash_attn(monkeypatch, version)
    kernel = FlashKernel()
    q, k, _, dout = _inputs()
    v = k.clone()
    options = BlockOptions(scale=0.25)
    out, lse = kernel.forward(q, k, v, options)
    kernel.backward(dout, q, k, v, out, lse, options)
    kernel.backward(dout, q, k, v, out, lse, attrs.evolve(options, deterministic=True))
    with deterministic_algorithms():
        kernel.backward(dout, q, k, v, out, lse, options)
    assert [call["deterministic"] for call in BACKWARD_CALLS] == [False, True, False]
    assert not torch.are_deterministic_algorithms_enabled()
    BACKWARD_CALLS.clear()
    dropping = attrs.evolve(_options(seed=3), deterministic=True)
    out, lse = kernel.forward(q, k, v, dropping)
    kernel.backward(dout, q, k, v, out, lse, dropping)
    assert [call["deterministic"] for call in BACKWARD_CALLS] == [True, True]


def test_flash_declares_dropout_and_a_deterministic_backward() -> None:
    assert FLASH_SPEC.capabilities.dropout
    assert FLASH_SPEC.capabilities.deterministic
