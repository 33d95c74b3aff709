"""torch's own CUDA attention ops as kernels: ``torch_flash``, ``cudnn``, and the ``sdpa`` CUDA
path's dropout, run on CPU against stand-ins of torch 2.13's ops (tests/standins/torch_flash.py,
cudnn.py, mem_efficient.py) through the conformance kit and against the float64 oracle; and what
their specs declare and how they rank.

Each stand-in gives wrong numbers (or raises) where the op would on a GPU, so each defect below
is caught here; what this cannot prove is the real kernels' arithmetic (tests/test_gpu.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch

from ringdilated.backends import _heads, cudnn, sdpa, torch_flash
from ringdilated.backends._windows import WindowPiece
from ringdilated.backends.cudnn import CudnnKernel, cudnn_spec
from ringdilated.backends.flash import FLASH_SPEC
from ringdilated.backends.flex import FLEX_SPEC
from ringdilated.backends.reference import REFERENCE_SPEC
from ringdilated.backends.sdpa import SDPA_SPEC, EfficientAttention
from ringdilated.backends.torch_flash import TORCH_FLASH_SPEC, TorchFlashKernel
from ringdilated.backends.xformers import XFORMERS_SPEC
from ringdilated.core import (
    Environment,
    KernelSpec,
    KeyWindow,
    Request,
    Resolver,
)
from ringdilated.core.contract.kernel import BlockOptions
from ringdilated.testing import ConformanceError, check_kernel
from ringdilated.testing.conformance import CHECKS
from tests.standins import (
    bshd_flash_attention,
    bshd_flash_attention_backward,
    cudnn_attention,
    cudnn_attention_backward,
    efficient_attention,
    efficient_attention_backward,
    flash_attention,
    flash_attention_backward,
    install_flash_attn,
    install_xformers,
)
from tests.test_gpu_kernel_wrappers import SHORT, on_cpu


def _with(spec: KernelSpec, factory: Callable[[], object]) -> KernelSpec:
    return attrs.evolve(on_cpu(spec), factory=factory)


def flash_kernel(kind: type = TorchFlashKernel) -> Any:
    """The kernel over the stand-ins of both op families: the SDPA-level ops, and for calls
    with a left bound ``_flash_attention_forward``/``_backward``."""
    return kind(
        flash_attention, flash_attention_backward, bshd_flash_attention,
        bshd_flash_attention_backward,
    )  # fmt: skip


def cudnn_kernel(kind: type = CudnnKernel) -> Any:
    return kind(cudnn_attention, cudnn_attention_backward)


def efficient_kernel() -> EfficientAttention:
    return EfficientAttention(efficient_attention, efficient_attention_backward)


def test_torch_flash_conforms() -> None:
    report = check_kernel(_with(TORCH_FLASH_SPEC, flash_kernel), max_examples=12)
    assert report.passed == tuple(c for c in CHECKS if "softcap" not in c)  # dropout included


def test_cudnn_conforms() -> None:
    report = check_kernel(_with(cudnn_spec(), cudnn_kernel), max_examples=12)
    assert report.passed == tuple(c for c in CHECKS if "dropout" not in c and "softcap" not in c)


@pytest.mark.parametrize("kernel", [flash_kernel, cudnn_kernel])
@pytest.mark.parametrize(("k_len", "right"), [(0, None), (16, -20), (1, None), (16, -5)])
def test_rows_that_see_no_key_give_zero_and_minus_inf_without_asking_the_op(
    kernel: Callable[[], Any], k_len: int, right: int | None
) -> None:
    """No keys at all, a window that hides every key, cuDNN's unsupported key length 1, and the
    first rows of a negative offset: 0 and ``-inf`` there, zero gradients from them."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 12, 16, generator=g).half()
    k, v = (torch.randn(2, 1, k_len, 16, generator=g).half() for _ in range(2))
    options = BlockOptions(0.25, KeyWindow(None, right))
    out, lse = kernel().forward(q, k, v, options)
    empty = options.visible_rows_start() if k_len else 12
    assert bool((out[..., :empty, :] == 0).all()) and bool(lse[..., :empty].isneginf().all())
    assert bool(torch.isfinite(lse[..., empty:]).all()), "every other row sees a key"
    dout = torch.randn(out.shape, generator=g).half()
    dq, dk, dv = kernel().backward(dout, q, k, v, out, lse, options)
    assert bool((dq[..., :empty, :] == 0).all())
    assert bool(torch.isfinite(dk).all()) and bool(torch.isfinite(dv).all())


# -- the defects the stand-ins catch ---------------------------------------------------------------


class TopLeftFlash(TorchFlashKernel):
    """Takes torch's flash ``is_causal`` for SDPA's top-left mask: one call for offset 0."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        if options.window.right != 0:
            return super().forward(q, k, v, options)
        return self.forward_piece(q, k, v, _causal_call(q, k), options)

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        if options.window.right != 0:
            return super().backward(dout, q, k, v, out, lse, options)
        return self.backward_piece(dout, q, k, v, out, lse, _causal_call(q, k), options)


def _causal_call(q: torch.Tensor, k: torch.Tensor) -> WindowPiece:
    """One call on the whole block with the op's causal mask."""
    return WindowPiece(0, q.shape[-2], 0, k.shape[-2], left=None, causal=True)


def test_a_flash_wrapper_taking_is_causal_for_top_left_fails_the_kit() -> None:
    """FA2's mask is bottom-right: with ``Lq != Lk`` the one-call wrapper sees the wrong keys."""
    spec = _with(TORCH_FLASH_SPEC, lambda: flash_kernel(TopLeftFlash))
    with pytest.raises(ConformanceError, match=r"\[causal\]"):
        check_kernel(spec, max_examples=25, checks=("causal",), space=SHORT)


def test_the_cudnn_standin_reads_the_lse_as_the_backward_declares_it() -> None:
    """The backward takes ``logsumexp``'s sizes and strides as float ``Stats``: a 3-D lse is
    refused, a float64 one misread. The kernel hands over the forward's own layout."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=g).half() for _ in range(3))
    out, lse, *rest = cudnn_attention(q, k, v, None, True, scale=0.25)
    seed, offset = rest[4], rest[5]

    def grads(stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return cudnn_attention_backward(
            out, q, k, v, out, stats, seed, offset, None, None, None, 16, 16, 0.0, False,
            scale=0.25,
        )  # fmt: skip

    right = grads(lse)
    with pytest.raises(RuntimeError, match="Stats dims"):
        grads(lse.squeeze(-1))
    misread = grads(lse.double())
    assert not torch.equal(misread[0], right[0])
    kernel = CudnnKernel(cudnn_attention, cudnn_attention_backward)
    ours = kernel.backward(out, q, k, v, out, lse.squeeze(-1), BlockOptions(scale=0.25))
    assert all(torch.equal(a, b) for a, b in zip(ours, right, strict=True))


def test_the_flash_standin_reads_the_lse_by_address() -> None:
    """``mha_bwd`` reads the lse as dense float32 with no check: a strided one is misread, and
    the kernel hands over a dense copy."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 20, 16, generator=g).half() for _ in range(3))
    out, lse, *_ = flash_attention(q, k, v, scale=0.25)
    unused = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)

    def grads(stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return flash_attention_backward(
            out, q, k, v, out, stats, None, None, 20, 20, 0.0, False, *unused, scale=0.25
        )

    strided = torch.full((2, 20, 3), float("nan")).transpose(1, 2).copy_(lse)
    assert not torch.equal(grads(strided)[0], grads(lse)[0]), "a strided lse is misread"
    ours = flash_kernel().backward(out, q, k, v, out, strided, BlockOptions(scale=0.25))
    assert all(torch.equal(a, b) for a, b in zip(ours, grads(lse), strict=True))


# -- dropout against the oracle --------------------------------------------------------------------

P = 0.3


def _visible(q_len: int, k_len: int, right: int | None) -> torch.Tensor:
    rows = torch.arange(q_len).unsqueeze(1)
    bound = k_len if right is None else right
    return torch.arange(k_len).unsqueeze(0) <= rows + bound


def _probabilities(q: torch.Tensor, k: torch.Tensor, options: BlockOptions) -> torch.Tensor:
    """The float64 oracle's attention probabilities ``(N, H, Lq, Lk)`` (0 in rows that see no
    key; the inputs are finite)."""
    keys = _heads.repeat_kv(k.double(), q.shape[1])
    scores = q.double() @ keys.transpose(-1, -2) * options.scale
    visible = _visible(q.shape[-2], k.shape[-2], options.window.right)
    return scores.masked_fill(visible.logical_not(), float("-inf")).softmax(-1).nan_to_num(0.0)


def _identity(k: torch.Tensor) -> torch.Tensor:
    """``v`` whose key ``j`` is the unit vector ``j``: ``out`` is then the dropped probabilities."""
    eye = torch.eye(k.shape[-2], k.shape[-1], dtype=k.dtype)
    return eye.expand(k.shape).clone()


def read_mask(kernel: Any, q: torch.Tensor, k: torch.Tensor, options: BlockOptions) -> torch.Tensor:
    """The kernel's dropout multiplier ``(N, H, Lq, Lk)``, read off ``v = identity`` and checked
    entry by entry: each dropped probability is 0 or ``P / (1 - p)`` with ``P`` the oracle's, at
    a rate near ``p``, hidden keys 0."""
    out, _ = kernel.forward(q, k, _identity(k), options)
    seen = out[..., : k.shape[-2]].double()
    kept = _probabilities(q, k, options) / (1 - options.dropout_p)
    tol = 2e-3 * kept.clamp(min=1)  # float16 rounding of out
    zero, full = seen.abs() <= tol, (seen - kept).abs() <= tol
    assert bool((zero | full).all()), "every probability dropped or kept whole"
    decided = kept > 10 * tol
    rate = float((zero & decided).sum() / decided.sum())
    assert abs(rate - options.dropout_p) < 0.1, f"dropped {rate:.3f} of the probabilities"
    visible = _visible(q.shape[-2], k.shape[-2], options.window.right)
    assert bool((seen[..., visible.logical_not()] == 0).all()), "hidden keys stay 0"
    return full.double() / (1 - options.dropout_p)


def oracle_gradients(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: BlockOptions,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """float64 gradients of ``(P * mask) @ v`` for the oracle's ``P``."""
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    probabilities = _probabilities(qd, kd, options)
    out = (probabilities * mask) @ _heads.repeat_kv(vd, q.shape[1])
    (out * dout.double()).sum().backward()
    return tuple(x.grad for x in (qd, kd, vd))  # type: ignore[misc]


def check_dropout(kernel: Any, q_len: int, k_len: int, right: int | None, kv_heads: int) -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, q_len, 16, generator=g).half()
    k, v = (torch.randn(2, kv_heads, k_len, 16, generator=g).half() for _ in range(2))
    options = BlockOptions(0.3, KeyWindow(None, right), dropout_p=P, dropout_seed=1234)
    mask = read_mask(kernel, q, k, options)
    again = read_mask(kernel, q, k, options)
    assert torch.equal(mask, again), "the same seed draws the same mask"
    other = read_mask(kernel, q, k, attrs.evolve(options, dropout_seed=99))
    assert not torch.equal(mask, other), "another seed draws another mask"
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    kernel.forward(q, k, v, options)
    assert torch.equal(torch.rand(4), expected), "the caller's random stream did not move"
    out, lse = kernel.forward(q, k, v, options)
    dout = torch.randn(out.shape, generator=g).half()
    ours = kernel.backward(dout, q, k, v, out, lse, options)
    expected = oracle_gradients(dout, q, k, v, options, mask)
    for name, got, want in zip("qkv", ours, expected, strict=True):
        error = float((got.double() - want).abs().max() / want.abs().max().clamp(min=1))
        assert error < 2e-2, f"d{name} for the drawn mask: relative error {error:.3g}"


FLASH_WINDOWS = [(12, 16, None), (12, 16, 0), (12, 16, -2), (12, 16, 6), (16, 12, 2)]


@pytest.mark.parametrize(("q_len", "k_len", "right"), FLASH_WINDOWS)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_torch_flash_dropout_matches_the_oracle(
    q_len: int, k_len: int, right: int | None, kv_heads: int
) -> None:
    """``(12, 16, 6)`` is two calls (a causal and an unmasked piece), each with its own mask."""
    check_dropout(flash_kernel(), q_len, k_len, right, kv_heads)


@pytest.mark.parametrize(("q_len", "k_len", "right"), [(12, 16, None), (12, 12, 0), (12, 16, 3)])
def test_sdpa_cuda_path_dropout_matches_the_oracle(
    q_len: int, k_len: int, right: int | None
) -> None:
    check_dropout(efficient_kernel(), q_len, k_len, right, kv_heads=2)


@pytest.mark.parametrize(
    ("kernel", "module", "name", "wrong"),
    [
        (flash_kernel, torch_flash, "replay_state",
         lambda seed, device, dtype: torch.tensor([seed, 4], dtype=dtype)),
        (efficient_kernel, sdpa, "replay_scalars",
         lambda seed, device, offset=0: (torch.tensor(seed), torch.tensor(offset + 4))),
        (flash_kernel, torch_flash, "replay_state",
         lambda seed, device, dtype: torch.tensor([seed + 1, 0], dtype=dtype)),
    ],
)  # fmt: skip
def test_a_backward_handed_another_state_gets_wrong_gradients(
    monkeypatch: pytest.MonkeyPatch, kernel: Callable[[], Any], module: Any, name: str, wrong: Any
) -> None:
    monkeypatch.setattr(module, name, wrong)
    with pytest.raises(AssertionError, match="for the drawn mask"):
        check_dropout(kernel(), 12, 16, None, 4)


@pytest.mark.parametrize(
    ("kernel", "module"), [(flash_kernel, torch_flash), (efficient_kernel, sdpa)]
)
def test_a_forward_that_does_not_seed_the_generator_fails(
    monkeypatch: pytest.MonkeyPatch, kernel: Callable[[], Any], module: Any
) -> None:
    """Unseeded, the op draws from wherever the caller's generator stands: the mask is no
    function of the seed, and the caller's stream moves."""
    monkeypatch.setattr(module, "seeded_generator", lambda device, seed: contextlib.nullcontext())
    with pytest.raises(AssertionError, match="same seed draws the same mask"):
        check_dropout(kernel(), 12, 16, None, 4)


# -- what the specs declare, and how they rank -----------------------------------------------------

BOTH = frozenset({"flash_attn", "xformers"})


@pytest.fixture
def cuda_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch built with flash attention and running cuDNN 9.16, and the stand-in packages."""
    monkeypatch.setattr(torch_flash, "_built_with_flash", lambda: True)
    monkeypatch.setattr(cudnn, "runtime_version", lambda: 91600)
    install_flash_attn(monkeypatch)
    install_xformers(monkeypatch)


def _specs(version: int = 91600, cuda: str = "12.9") -> list[KernelSpec]:
    preferred = cudnn_spec(version=version, cuda=cuda, deprioritized=False)
    return [FLASH_SPEC, TORCH_FLASH_SPEC, preferred, XFORMERS_SPEC, SDPA_SPEC, FLEX_SPEC,
            REFERENCE_SPEC]  # fmt: skip


def cuda(cc: tuple[int, int], dtype: torch.dtype, head_dim: int = 64, **kw: Any) -> Request:
    return Request("cuda", dtype, head_dim, compute_capability=cc, **kw)


@pytest.mark.usefixtures("cuda_torch")
@pytest.mark.parametrize(
    ("cc", "dtype", "head_dim", "packages", "chosen"),
    [
        ((8, 0), torch.bfloat16, 64, BOTH, "flash"),  # the flash-attn package first (300)
        ((8, 0), torch.bfloat16, 64, frozenset(), "torch_flash"),  # then torch's flash (250)
        ((8, 6), torch.float16, 128, frozenset(), "torch_flash"),  # cuDNN last off sm90/sm100
        ((9, 0), torch.float16, 64, frozenset(), "torch_flash"),  # cuDNN next (240) there
        ((9, 0), torch.float16, 192, frozenset(), "torch_flash"),
        ((9, 0), torch.float16, 64, BOTH, "flash"),
        ((10, 0), torch.bfloat16, 128, frozenset(), "torch_flash"),
        ((10, 3), torch.bfloat16, 64, frozenset(), "torch_flash"),
        ((12, 0), torch.bfloat16, 64, frozenset(), "torch_flash"),
        ((9, 0), torch.float16, 256, frozenset(), "torch_flash"),  # cuDNN 9.16: 128 at most
        ((9, 0), torch.float16, 512, frozenset(), "sdpa"),
        ((7, 5), torch.float16, 64, frozenset(), "sdpa"),  # both need sm80
        ((8, 0), torch.float32, 64, frozenset(), "sdpa"),  # both take half types only
    ],
)
def test_choice_with_torchs_own_ops(cc, dtype, head_dim, packages, chosen) -> None:  # type: ignore[no-untyped-def]
    resolver = Resolver(_specs(), env=Environment(packages=packages))
    plan = resolver.resolve(cuda(cc, dtype, head_dim, window=True))
    assert plan.kernel_name == chosen, plan.explain()


@pytest.mark.usefixtures("cuda_torch")
def test_a_torch_whose_flash_ops_take_no_window_bounds_declines_a_left_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's wrapped flash ops took ``window_size_left``/``_right`` from 2.5 (the library
    allows 2.4): asked of the ops' schemas, a left bound goes elsewhere, with the reason, where
    they lack them; a causal window (no left bound) keeps the SDPA-level op."""
    from ringdilated.core import KeyWindow

    assert torch_flash._takes_window_bounds()  # the 2.13 wheel's schemas have them
    monkeypatch.setattr(torch_flash, "_takes_window_bounds", lambda: False)
    resolver = Resolver(_specs(), env=Environment(packages=frozenset()))
    banded = resolver.resolve(cuda((8, 0), torch.bfloat16, window=KeyWindow(64, 0)))
    assert banded.kernel_name != "torch_flash"
    assert "take no window_size_left, which a window with a left bound (64)" in banded.explain()
    causal = resolver.resolve(cuda((8, 0), torch.bfloat16, window=True))
    assert causal.kernel_name == "torch_flash", causal.explain()


@pytest.mark.usefixtures("cuda_torch")
def test_cudnn_is_not_preferred_where_torch_does_not_prefer_it() -> None:
    for version, cuda_version in ((91500, "12.9"), (91002, "13.0")):
        plan = Resolver(_specs(version, cuda_version), env=Environment(packages=frozenset()))
        chosen = plan.resolve(cuda((9, 0), torch.float16))
        assert chosen.kernel_name == "torch_flash", chosen.explain()
        assert "not chosen cudnn: fits, priority -5" in chosen.explain()


EVERY_CC = [(8, 0), (8, 6), (8, 9), (9, 0), (9, 3), (9, 5), (10, 0), (10, 1), (10, 3), (10, 7),
            (12, 0), (12, 1)]  # fmt: skip


@pytest.mark.parametrize(
    ("version", "cuda_version", "deprioritized", "preferred"),
    [
        (91600, "12.9", False, {(9, 0), (9, 3), (10, 0), (10, 3)}),
        (91600, "12.9", True, set()),
        (91500, "13.0", False, set()),
        (None, "12.9", False, set()),
        (92000, "13.0", False, {(9, 0), (9, 3), (9, 5), (10, 0), (10, 1), (10, 3), (10, 7)}),
    ],
)
def test_cudnn_priority_follows_torchs_preference(
    version: int | None, cuda_version: str, deprioritized: bool, preferred: set[tuple[int, int]]
) -> None:
    """``check_prefer_cudnn_attention``: cuDNN newer than 9.15.0, not deprioritized; sm90 and
    sm100/sm103 before CUDA 13 (``major`` 9 or 10, ``minor`` 0 or 3), any 9.x, 10.x from it;
    everywhere else after torch's math fallback (below ``reference``)."""
    spec = cudnn_spec(version=version, cuda=cuda_version, deprioritized=deprioritized)
    ranked = {cc: spec.priority_for(cuda(cc, torch.float16)) for cc in EVERY_CC}
    assert {cc for cc, priority in ranked.items() if priority == 240} == preferred
    assert {priority for cc, priority in ranked.items() if cc not in preferred} == {-5}
    assert (
        REFERENCE_SPEC.priority > -5
        and TORCH_FLASH_SPEC.priority_for(cuda((9, 0), torch.float16)) > 240 > 100
    )


@pytest.mark.usefixtures("cuda_torch")
@pytest.mark.parametrize(
    ("cc", "head_dim", "kw", "refused"),
    [
        ((8, 6), 200, {}, True),  # backward, (192, 224]
        ((8, 6), 200, {"backward": False}, False),
        ((8, 9), 240, {}, False),  # above 224 without dropout
        ((8, 9), 240, {"dropout": True}, True),
        ((12, 1), 208, {}, True),
        ((8, 0), 200, {"dropout": True}, False),
        ((9, 0), 256, {"dropout": True}, False),
    ],
)
def test_torch_flash_refuses_training_head_dims_the_consumer_gpus_lack(
    cc: tuple[int, int], head_dim: int, kw: dict[str, bool], refused: bool
) -> None:
    reasons = TORCH_FLASH_SPEC.reasons(cuda(cc, torch.bfloat16, head_dim, **kw), Environment())
    assert bool(reasons) == refused, reasons
    if refused:
        assert "check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120" in reasons[0]


@pytest.mark.usefixtures("cuda_torch")
@pytest.mark.parametrize(("impl", "cc", "dropout", "refused"), [
    ("FA3", (9, 0), False, False), ("FA3", (9, 0), True, True), ("FA3", (8, 0), False, True),
    ("FA4", (10, 0), False, False), ("FA4", (12, 0), False, True), ("Mine", (9, 0), False, True),
])  # fmt: skip
def test_torch_flash_knows_the_impls_torch_can_swap_in(
    monkeypatch: pytest.MonkeyPatch, impl: str, cc: tuple[int, int], dropout: bool, refused: bool
) -> None:
    monkeypatch.setattr(torch_flash, "_active_override", lambda: impl)
    reasons = TORCH_FLASH_SPEC.reasons(cuda(cc, torch.float16, dropout=dropout), Environment())
    assert bool(reasons) == refused, reasons
    assert all("activate_flash_attention_impl" in r for r in reasons)


@pytest.mark.parametrize(
    ("version", "cc", "head_dim", "backward", "reason"),
    [
        (92300, (9, 0), 256, True, None),
        (92300, (10, 0), 256, False, None),
        (92300, (9, 0), 192, False, None),
        (92300, (9, 0), 192, True, "takes head_dim up to 128 or exactly 256, not 192"),
        (92200, (9, 0), 256, False, "needs sm90 or sm10x with cuDNN newer than 9.22.0"),
        (92500, (10, 7), 256, False, "needs sm90 or sm10x with cuDNN newer than 9.22.0"),
        (92600, (10, 7), 256, False, None),
        (92300, (8, 0), 256, False, "exceeds 128"),
        (92300, (8, 0), 128, True, None),
        (85000, (8, 0), 64, True, "older than the 9.0.0"),
        (None, (8, 0), 64, True, "no cuDNN"),
    ],
)
def test_cudnn_head_dims_follow_the_cudnn_version(
    monkeypatch: pytest.MonkeyPatch,
    version: int | None,
    cc: tuple[int, int],
    head_dim: int,
    backward: bool,
    reason: str | None,
) -> None:
    monkeypatch.setattr(cudnn, "runtime_version", lambda: version)
    request = cuda(cc, torch.bfloat16, head_dim, backward=backward)
    reasons = cudnn_spec(version=version, cuda="12.9", deprioritized=False).reasons(
        request, Environment()
    )
    if reason is None:
        assert reasons == ()
    else:
        assert any(reason in r for r in reasons), reasons


@pytest.mark.usefixtures("cuda_torch")
def test_deterministic_requests_name_the_kernel_without_a_deterministic_mode() -> None:
    """``cudnn`` declares none (torch only warns); ``torch_flash`` and ``sdpa`` switch. Under
    the switch a kernel without a deterministic mode ranks after every kernel with one (torch
    never picks cuDNN then); named, it runs, and explain() says it has none."""
    resolver = Resolver(_specs(), env=Environment(packages=frozenset()))
    on_hopper = resolver.resolve(cuda((9, 0), torch.float16, 256, deterministic=True))
    assert on_hopper.kernel_name == "torch_flash"  # cuDNN 9.16: no 256 anyway
    preferred = Resolver(_specs(92300), env=Environment(packages=frozenset()))
    wide = cuda((9, 0), torch.float16, 64, deterministic=True)
    assert preferred.resolve(wide).kernel_name == "torch_flash"
    cudnn_only = [s for s in _specs() if s.name in ("cudnn", "reference")]
    sole = Resolver(cudnn_only, env=Environment(packages=frozenset())).resolve(wide)
    assert sole.kernel_name == "reference", sole.explain()  # deterministic outranks priority
    assert "not chosen cudnn: fits, priority 240, but no deterministic mode" in sole.explain()
    named = resolver.resolve(wide, "cudnn")
    assert "cudnn declares no deterministic mode" in named.explain()
    on_ampere = resolver.resolve(cuda((8, 0), torch.float16, deterministic=True))
    assert on_ampere.kernel_name == "torch_flash"
    assert "declares no deterministic mode" not in on_ampere.explain()
    assert SDPA_SPEC.capabilities.deterministic and TORCH_FLASH_SPEC.capabilities.deterministic


def test_sdpa_serves_dropout_on_cuda_only() -> None:
    env = Environment(packages=frozenset())
    assert SDPA_SPEC.reasons(cuda((8, 0), torch.float16, dropout=True), env) == ()
    assert SDPA_SPEC.reasons(Request("cpu", torch.float32, 64, dropout=True), env) == (
        "no dropout on cpu (flash attention for CPU)",
    )
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(NotImplementedError, match=r"sdpa has no dropout on cpu \(dropout_p=0.1\)"):
        sdpa.SdpaKernel().forward(q, q, q, BlockOptions(0.25, dropout_p=0.1))


def test_this_torch_reports_the_flash_rng_state_the_kernel_replays() -> None:
    """Asked of the wheel's own meta kernel: ``rng_state`` is ``uint64[2]`` (torch 2.13)."""
    assert torch_flash._replays_rng_state()


def test_kernels_without_dropout_refuse_it_when_called_directly() -> None:
    """Their specs refuse dropout; an instance handed it raises rather than ignoring it."""
    from ringdilated.backends._dense import GuardedBottomRightKernel

    class Native(GuardedBottomRightKernel):
        def native_forward(self, q, k, v, causal, scale):  # type: ignore[no-untyped-def]
            raise AssertionError("never reached")

    q = torch.randn(1, 2, 8, 16)
    options = BlockOptions(0.25, dropout_p=0.1)
    for kernel in (cudnn_kernel(), Native()):
        with pytest.raises(NotImplementedError, match=r"has no dropout \(dropout_p=0.1\)"):
            kernel.forward(q, q, q, options)
        with pytest.raises(NotImplementedError, match=r"has no dropout \(dropout_p=0.1\)"):
            kernel.backward(q, q, q, q, q, q[..., 0], options)
