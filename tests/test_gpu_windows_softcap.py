"""Key windows bounded on the left and softcapping through the fused GPU kernels (``flash``,
``flash3``, ``flash4``, ``torch_flash``), run on CPU against stand-ins that apply each upstream
release's own rewriting of its window arguments (tests/standins/flash_windows.py) and its
softcap, forward and backward, through the oracle checks of tests/window_checks.py; what each
kernel declares, and the reasons, naming the release, where it cannot serve a request. The
arguments each op receives on FakeTensor ``cuda`` tensors are checked in
tests/test_fake_cuda_windows.py. What this cannot prove: the real CUDA kernels' arithmetic.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ringdilated.backends._windows import WindowPiece, seen_rows, window_pieces
from ringdilated.backends.cudnn import CUDNN_SPEC, CudnnKernel
from ringdilated.backends.flash import FLASH_SPEC, FlashKernel
from ringdilated.backends.flash3 import FLASH3_SPEC, Flash3Kernel
from ringdilated.backends.flash4 import FLASH4_SPEC, Flash4Kernel
from ringdilated.backends.sdpa import SDPA_SPEC
from ringdilated.backends.torch_flash import TORCH_FLASH_SPEC, TorchFlashKernel
from ringdilated.backends.xformers import XFORMERS_SPEC
from ringdilated.core import (
    BlockOptions,
    Environment,
    KernelSpec,
    KeyWindow,
    Request,
    ResolutionError,
    Resolver,
)
from ringdilated.core.contract.causal import bottom_right_pieces
from tests.standins import (
    FLASH_VERSIONS,
    bshd_flash_attention,
    bshd_flash_attention_backward,
    flash_attention,
    flash_attention_backward,
    install_flash_attn,
    install_xformers,
)
from tests.standins import flash_attn3 as fa3
from tests.standins import flash_attn4 as fa4
from tests.standins.distributions import fake_distributions
from tests.standins.flash_windows import fa2_visible, fa3_visible, fa4_visible
from tests.standins.math import bottom_right_window
from tests.window_checks import WINDOW_CASES, check_window_case, top_left_window

_aten = torch.ops.aten

# -- the pieces ------------------------------------------------------------------------------------

#: Each op's mask for a piece, as the op rewrites the arguments the kernels pass it: ``causal``,
#: the piece's left bound (``-1``/``None``: none) and no right bound.
OP_MASKS: dict[str, Callable[[WindowPiece], torch.Tensor | None]] = {
    "flash-attn 2 forward": lambda p: fa2_visible(
        p.rows, p.keys, p.causal, -1 if p.left is None else p.left, -1, forward=True
    ),
    "flash-attn 2 backward": lambda p: fa2_visible(
        p.rows, p.keys, p.causal, -1 if p.left is None else p.left, -1, forward=False
    ),
    "FlashAttention 3": lambda p: fa3_visible(
        p.rows, p.keys, p.causal, -1 if p.left is None else p.left, -1
    ),
    "FlashAttention 4": lambda p: fa4_visible(p.rows, p.keys, p.causal, p.left, None),
}
BOUNDS = [None, *range(-8, 9)]


@pytest.mark.parametrize("op", sorted(OP_MASKS))
def test_the_pieces_reproduce_every_window_under_each_ops_own_rules(op: str) -> None:
    """Every window on every block up to 6 x 6, far from the diagonal included: the union of the
    pieces' masks, each as the op computes it from the arguments the kernels pass, is exactly
    the top-left window; pieces never overlap, every row of a piece sees a key and every key of
    a piece is seen (the op's convention for empty rows never matters), and a left bound is
    within ``[0, keys - 1)`` (no op rewrites it)."""
    mask_of = OP_MASKS[op]
    for q_len in range(7):
        for k_len in range(7):
            for left in BOUNDS:
                for right in BOUNDS:
                    window = KeyWindow(left, right)
                    expected = top_left_window(q_len, k_len, window)
                    covered = torch.zeros(q_len, k_len, dtype=torch.int64)
                    for p in window_pieces(q_len, k_len, window):
                        mask = mask_of(p)
                        mask = (
                            torch.ones(p.rows, p.keys, dtype=torch.bool) if mask is None else mask
                        )
                        assert bool(mask.any(-1).all()) and bool(mask.any(0).all()), (window, p)
                        assert p.left is None or 0 <= p.left < p.keys - 1, (window, p)
                        block = covered[p.row_start : p.row_stop, p.key_start : p.key_stop]
                        block += mask.long()
                    assert torch.equal(covered, expected.long()), (op, q_len, k_len, window)
                    first, last = seen_rows(q_len, k_len, window)
                    rows = torch.arange(q_len)
                    assert torch.equal((rows >= first) & (rows < last), expected.any(-1))


def test_without_a_left_bound_the_pieces_are_cores_bottom_right_pieces() -> None:
    """So a block without a left bound makes the calls (and draws the dropout seeds) it did."""
    for q_len in range(7):
        for k_len in range(7):
            for right in BOUNDS:
                pieces = window_pieces(q_len, k_len, KeyWindow(None, right))
                assert all(p.key_start == 0 and p.left is None for p in pieces)
                core = bottom_right_pieces(q_len, k_len, right)
                assert tuple(p.bottom_right for p in pieces) == core, (q_len, k_len, right)


def test_the_window_passed_to_the_op_as_it_is_would_be_wrong() -> None:
    """Why the pieces exist: the block's top-left window handed to a bottom-right op (one call,
    ``causal`` for ``right = 0``, its left bound as is) sees other keys whenever ``Lq != Lk``
    (and flash-attn 2 makes an unbounded right ``seqlen_k`` beside a left bound)."""
    window = KeyWindow(2, 0)
    assert not torch.equal(
        fa2_visible(3, 8, True, 2, -1, forward=True), top_left_window(3, 8, window)
    )
    # set_params_fprop: right -1 beside left 0 becomes seqlen_k, a finite bound: with 6 rows on
    # 3 keys the first two rows (those before rows - keys - 1) lose keys an unbounded right
    # would show them.
    quirk = fa2_visible(6, 3, False, 0, -1, forward=True)
    unbounded = bottom_right_window(6, 3, 0, None)
    assert quirk is not None and torch.equal(quirk, bottom_right_window(6, 3, 0, 3))
    assert torch.equal(quirk[2:], unbounded[2:]) and not bool((quirk[:2] == unbounded[:2]).all())


# -- the kernels through the oracle ----------------------------------------------------------------

Install = Callable[[pytest.MonkeyPatch], Any]


def _flash(version: str) -> Install:
    def install(monkeypatch: pytest.MonkeyPatch) -> FlashKernel:
        install_flash_attn(monkeypatch, version)
        return FlashKernel()

    return install


def _flash3(interface: str) -> Install:
    def install(monkeypatch: pytest.MonkeyPatch) -> Flash3Kernel:
        fa3.install_flash_attn3(monkeypatch, interface)
        return Flash3Kernel()

    return install


def _flash4(version: str) -> Install:
    def install(monkeypatch: pytest.MonkeyPatch) -> Flash4Kernel:
        fa4.install_flash_attn4(monkeypatch, version)
        return Flash4Kernel()

    return install


def _torch_flash(monkeypatch: pytest.MonkeyPatch) -> TorchFlashKernel:
    return TorchFlashKernel(
        flash_attention, flash_attention_backward, bshd_flash_attention,
        bshd_flash_attention_backward,
    )  # fmt: skip


#: Every supported release's stand-in, and whether its kernel takes softcapped gradients.
KERNELS: dict[str, tuple[Install, bool]] = {
    **{f"flash {v}": (_flash(v), True) for v in FLASH_VERSIONS},
    **{f"flash3 {i}": (_flash3(i), True) for i in fa3.INTERFACES},
    "flash4 4.0.0b5": (_flash4("4.0.0b5"), False),
    "flash4 4.0.0b27": (_flash4("4.0.0b27"), True),
    "torch_flash": (_torch_flash, False),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_windows_and_softcap_meet_the_oracle(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Forward, rows without keys and gradients of every case the kernel serves (a release whose
    gradients take no softcap gets the cases without one, and raises for the others: below)."""
    install, softcapped_backward = KERNELS[name]
    kernel = install(monkeypatch)
    served = [c for c in WINDOW_CASES if softcapped_backward or c[2] is None]
    assert len(served) >= 12
    for case, window, softcap in served:
        check_window_case(kernel, case, window, softcap)


class Straight(FlashKernel):
    """Hands the op the block's window as it is: one call, ``causal`` for ``right = 0``."""

    def unguarded_forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        w = options.window
        return self.native_forward(
            q, k, v, w.right == 0, options.scale, window_left=w.left, softcap=options.softcap
        )

    def unguarded_backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        w = options.window
        return self.native_backward(
            dout, q, k, v, out, lse, w.right == 0, options.scale, window_left=w.left,
            softcap=options.softcap,
        )  # fmt: skip


class Uncapped(FlashKernel):
    """Forgets to pass the softcap to the op."""

    def forward_piece(self, q, k, v, piece, options):  # type: ignore[no-untyped-def]
        return self.native_forward(q, k, v, piece.causal, options.scale, window_left=piece.left)


@pytest.mark.parametrize("kind", [Straight, Uncapped])
def test_a_wrong_translation_fails_the_oracle(monkeypatch: pytest.MonkeyPatch, kind: type) -> None:
    """The checks are not vacuous: the stand-in computes upstream's bottom-right semantics."""
    install_flash_attn(monkeypatch, "2.8.3")
    failures = 0
    for case, window, softcap in WINDOW_CASES:
        try:
            check_window_case(kind(), case, window, softcap)
        except AssertionError:
            failures += 1
    assert failures >= 5


def test_flash4_before_beta9_refuses_softcapped_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """4.0.0b5's backward drops the cap (its stand-in too); the kernel raises instead of
    returning those gradients, and a kernel that skipped the check would be wrong."""
    fa4.install_flash_attn4(monkeypatch, "4.0.0b5")
    case, window, _ = WINDOW_CASES[0]
    q, k, v = case.tensors()
    options = BlockOptions(case.scale, window, softcap=2.0)
    out, lse = Flash4Kernel().forward(q, k, v, options)  # the forward caps
    with pytest.raises(NotImplementedError, match=r"no softcap in backward before 4\.0\.0b9"):
        Flash4Kernel().backward(out, q, k, v, out, lse, options)
    monkeypatch.setattr("ringdilated.backends.flash4._softcap_backward", lambda version: True)
    capped = [c for c in WINDOW_CASES if c[2] is not None]
    failures = 0
    for case, window, softcap in capped:
        try:
            check_window_case(Flash4Kernel(), case, window, softcap)
        except AssertionError:
            failures += 1
    assert failures >= len(capped) // 2, "gradients without the cap are wrong"


def test_flash4_dlse_path_takes_the_window_and_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """``backward_with_lse`` (one call per piece with ``dlse``) equals ``backward`` plus the lse
    term of a second backward (core's ``lse_gradient`` rule: ``dout = dlse e_0``), for a window
    with a left bound and a cap."""
    fa4.install_flash_attn4(monkeypatch, "4.0.0b27")
    kernel = Flash4Kernel()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g).half() for _ in range(3))
    options = BlockOptions(0.3, KeyWindow(3, -4), softcap=1.5)
    out, lse = kernel.forward(q, k, v, options)
    dout = torch.randn(q.shape, generator=g).half()
    dlse = torch.randn(lse.shape, generator=g)
    fused = kernel.backward_with_lse(dout, dlse, q, k, v, out, lse, options)
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    seen = top_left_window(20, 20, options.window)
    from ringdilated.testing import masked_attention

    o, s = masked_attention(*exact, seen, 0.3, torch.float64, softcap=1.5)
    loss = (o * dout.double()).sum() + (s.masked_fill(~seen.any(-1), 0.0) * dlse.double()).sum()
    for got, want in zip(fused, torch.autograd.grad(loss, exact), strict=True):
        assert float((got.double() - want).abs().max()) < 2e-2 * max(1.0, float(want.abs().max()))


def test_softcap_with_dropout_is_refused_by_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    install_flash_attn(monkeypatch, "2.8.3")
    q = torch.randn(1, 1, 8, 16).half()
    options = BlockOptions(0.25, KeyWindow(2, 0), dropout_p=0.1, softcap=3.0)
    with pytest.raises(NotImplementedError, match="Softcapping does not support dropout"):
        FlashKernel().forward(q, q, q, options)


def test_kernels_without_softcap_or_windows_refuse_them_when_called_directly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_xformers(monkeypatch)
    from ringdilated.backends.xformers import XformersKernel

    q = torch.randn(1, 2, 8, 16).half()
    capped = BlockOptions(0.25, softcap=3.0)
    for kernel in (XformersKernel(), CudnnKernel(), _torch_flash(monkeypatch)):
        with pytest.raises(NotImplementedError, match="softcap"):
            kernel.forward(q, q, q, capped)
    with pytest.raises(NotImplementedError, match="left bound"):
        XformersKernel().forward(q, q, q, BlockOptions(0.25, KeyWindow(2, 0)))
    with pytest.raises(NotImplementedError, match="left bound"):
        CudnnKernel().forward(q, q, q, BlockOptions(0.25, KeyWindow(2, 0)))


# -- dropout under a window ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["flash 2.6.3", "flash 2.8.3", "torch_flash"])
def test_dropout_under_a_left_bound_masks_the_visible_keys_and_replays(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A block of three calls (``window (16, 6)`` on ``Lq = 24``, ``Lk = 20``: a causal call, an
    unmasked one and one bounded on the left only): the weight each value gets, read back with
    one-hot values, is 0 on every hidden key and 0 or ``P / (1 - p)`` on every visible one (each
    call its own seed: the kept fraction is about ``1 - p``), the same for a second forward, and
    the backward replays it: float64 autograd under that mask."""
    kernel = KERNELS[name][0](monkeypatch)
    window, p = KeyWindow(16, 6), 0.3
    pieces = window_pieces(24, 20, window)
    assert [(x.causal, x.left is None) for x in pieces] == [
        (True, True),
        (False, True),
        (False, False),
    ]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 24, 16, generator=g).half()
    k = torch.randn(1, 1, 20, 16, generator=g).half()
    options = BlockOptions(0.3, window, dropout_p=p, dropout_seed=77)
    seen = top_left_window(24, 20, window)
    weights = torch.cat([
        kernel.forward(q, k, _one_hot(k, start), options)[0][..., : min(16, 20 - start)].double()
        for start in range(0, 20, 16)
    ], -1)  # fmt: skip
    scores = (q.double() @ k.double().transpose(-1, -2) * 0.3).masked_fill(~seen, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    assert bool((weights[..., ~seen] == 0).all()), "hidden keys get no weight"
    kept = weights * (1 - p) > probs / 2
    assert float((weights - probs * kept / (1 - p)).abs().max()) < 1e-2
    fraction = float(kept[..., seen].double().mean())
    assert abs(fraction - (1 - p)) < 0.12, fraction
    v = torch.randn(k.shape, generator=g).half()
    out, lse = kernel.forward(q, k, v, options)
    again = kernel.forward(q, k, v, options)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
    dout = torch.randn(q.shape, generator=g).half()
    grads = kernel.backward(dout, q, k, v, out, lse, options)
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    s = (exact[0] @ exact[1].transpose(-1, -2) * 0.3).masked_fill(~seen, float("-inf"))
    attention = torch.softmax(s, -1).nan_to_num(0.0) * kept.double() / (1 - p)
    want = torch.autograd.grad(attention @ exact[2], exact, dout.double())
    for got, expected in zip(grads, want, strict=True):
        error = float((got.double() - expected).abs().max() / expected.abs().max().clamp(min=1))
        assert error < 1e-2


def _one_hot(k: torch.Tensor, start: int) -> torch.Tensor:
    """Values whose column ``j - start`` is 1 at key ``j`` (``start <= j < start + D``)."""
    basis = torch.zeros(k.shape, dtype=k.dtype)
    keys = torch.arange(min(k.shape[-1], k.shape[-2] - start))
    basis[..., start + keys, keys] = 1
    return basis


# -- what each kernel declares ---------------------------------------------------------------------

WINDOWED = Request("cuda", torch.float16, 64, (9, 0), window=KeyWindow(128, 0))
CAPPED = Request("cuda", torch.float16, 64, (9, 0), softcap=30.0)


@pytest.mark.parametrize(
    ("spec", "window", "softcap"),
    [
        (FLASH_SPEC, True, True),
        (FLASH3_SPEC, True, True),
        (FLASH4_SPEC, True, True),
        (TORCH_FLASH_SPEC, True, False),
        (XFORMERS_SPEC, False, False),
        (CUDNN_SPEC, False, False),
        (SDPA_SPEC, True, False),  # sdpa: windows by an additive bias
    ],
)
def test_what_each_kernel_declares(spec: KernelSpec, window: bool, softcap: bool) -> None:
    assert spec.capabilities.sliding_window is window
    assert spec.capabilities.softcap is softcap


def _reasons(spec: KernelSpec, request: Request) -> str:
    return " | ".join(spec.reasons(request, Environment(frozenset({"flash_attn", "xformers"}))))


def test_the_reasons_name_the_upstream_release(monkeypatch: pytest.MonkeyPatch) -> None:
    install_flash_attn(monkeypatch, "2.7.4.post1")
    dropping = Request("cuda", torch.float16, 64, (9, 0), dropout=True, softcap=30.0)
    assert "flash-attn 2.7 takes no softcap with dropout (mha_fwd: 'Softcapping does not " in (
        _reasons(FLASH_SPEC, dropping)
    )
    assert not _reasons(FLASH_SPEC, CAPPED) and not _reasons(FLASH_SPEC, WINDOWED)
    assert "torch 2.13" in _reasons(TORCH_FLASH_SPEC, CAPPED)
    assert "pass softcap = 0.0 to mha_fwd/mha_bwd" in _reasons(TORCH_FLASH_SPEC, CAPPED)
    assert "xformers 0.0.35's cutlass operators mask a left window only" in (
        _reasons(XFORMERS_SPEC, WINDOWED)
    )
    assert "xformers 0.0.35's cutlass operators have no softcap" in _reasons(XFORMERS_SPEC, CAPPED)
    assert "_scaled_dot_product_cudnn_attention takes no key window" in (
        _reasons(CUDNN_SPEC, WINDOWED)
    )
    assert "_scaled_dot_product_cudnn_attention takes no softcap" in _reasons(CUDNN_SPEC, CAPPED)


@pytest.mark.parametrize(
    ("version", "refused"),
    [("4.0.0b5", True), ("4.0.0b8", True), ("4.0.0b9", False), ("4.0.0b27", False), (None, True)],
)
def test_flash4_declines_softcapped_gradients_before_beta9(
    monkeypatch: pytest.MonkeyPatch, version: str | None, refused: bool
) -> None:
    fake_distributions(monkeypatch, {"flash-attn-4": version, "flash-attn4": None})
    reasons = " ".join(FLASH4_SPEC.reasons(CAPPED, Environment(frozenset({"flash_attn.cute"}))))
    assert ("its backward applies softcap from 4.0.0b9 on" in reasons) is refused
    forward_only = Request("cuda", torch.float16, 64, (9, 0), backward=False, softcap=30.0)
    assert not FLASH4_SPEC.reasons(forward_only, Environment(frozenset({"flash_attn.cute"})))


def test_a_sliding_window_goes_to_a_kernel_that_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """On sm80 with flash-attn and xformers installed, a window bounded on the left resolves to
    ``flash``; without flash-attn, ``xformers`` is rejected with its reason."""
    install_flash_attn(monkeypatch, "2.8.3")
    request = Request("cuda", torch.float16, 64, (8, 0), window=KeyWindow(64, 0))
    env = Environment(frozenset({"flash_attn", "xformers"}), compute_capability=(8, 0))
    plan = Resolver([FLASH_SPEC, XFORMERS_SPEC, SDPA_SPEC], env=env).resolve(request)
    assert plan.kernel_name == "flash"
    with pytest.raises(ResolutionError, match="mask a left window only with the bottom-right"):
        Resolver([XFORMERS_SPEC], env=env).resolve(request)


# -- the stand-ins keep the schemas ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "standin"),
    [
        (_aten._flash_attention_forward.default, bshd_flash_attention),
        (_aten._flash_attention_backward.default, bshd_flash_attention_backward),
    ],
)
def test_standins_take_the_window_ops_schema_arguments(op: Any, standin: Any) -> None:
    """Names, order, keyword-only markers and defaults of torch 2.13's schemas (the window
    arguments ``window_size_left``/``window_size_right`` among them)."""
    schema = [(a.name, a.kwarg_only, a.default_value) for a in op._schema.arguments]
    params = inspect.signature(standin).parameters.values()
    ours = [
        (p.name, p.kind is p.KEYWORD_ONLY, None if p.default is p.empty else p.default)
        for p in params
    ]
    assert ours == schema
    assert {"window_size_left", "window_size_right"} <= {name for name, _, _ in schema}
