"""Core's one pieces loop (:func:`ringdilated.core.forward_by_piece`,
:func:`ringdilated.core.backward_by_piece`), which every bottom-right kernel runs through
(``BottomRightKernel``: flash, flash3, flash4, xformers, torch_flash), and the one per-piece
dropout seed (:func:`ringdilated.core.piece_seed`).

- The loop against the float64 oracle (``ringdilated.testing.kernel_cases.dense``, autograd),
  for every offset of small blocks, with a native call written from the bottom-right rule
  (tests/standins/math.py), which is handed each piece: exact, empty rows at ``0`` / ``-inf``.
- On FakeTensor ``cuda`` tensors (a CPU-only torch has no ``copy_`` or slice indexing for them):
  the loop runs, and dispatches neither ``copy_`` nor ``index_put_``; so do flash3 and flash4,
  through their stand-ins, on a block of two pieces.
- The seeds: distinct for the pieces of a block, a pure function of the block's seed and the
  piece; flash and torch_flash draw each forward call's mask from its piece's seed and hand the
  same seed to its backward, and both kernels derive the same seeds for the same block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ringdilated.backends import _philox, torch_flash
from ringdilated.backends.flash import FlashKernel
from ringdilated.core import (
    BlockOptions,
    BottomRightPiece,
    KeyWindow,
    backward_by_piece,
    backward_in_pieces,
    forward_by_piece,
    forward_in_pieces,
    piece_seed,
)
from ringdilated.core.contract.causal import bottom_right_pieces
from ringdilated.testing.kernel_cases import dense
from tests.standins import install_flash_attn
from tests.standins.math import attend, bottom_right, grads
from tests.test_flash3_flash4 import SUPPORTED
from tests.test_torch_cuda_ops import flash_kernel

SCALE = 0.3
LENGTHS = (0, 1, 5, 7)
OFFSETS = (None, -9, -3, -1, 0, 1, 2, 4, 9)


def _to_packages(*xs: torch.Tensor) -> list[torch.Tensor]:
    """Kernel layout ``(N, H, L, D)`` to the packages' ``(N, L, H, D)`` (tests/standins/math)."""
    return [x.transpose(1, 2) for x in xs]


def _check_piece(q: torch.Tensor, k: torch.Tensor, piece: BottomRightPiece) -> None:
    assert q.shape[-2] == piece.row_stop - piece.row_start, "the piece's rows"
    assert k.shape[-2] == piece.keys, "the piece's keys"


def _native_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, piece: BottomRightPiece
) -> tuple[torch.Tensor, torch.Tensor]:
    """One bottom-right call in float64, from the rule (``j <= i + Lk - Lq`` when causal)."""
    _check_piece(q, k, piece)
    visible = bottom_right(q.shape[-2], k.shape[-2]) if piece.causal else None
    out, lse = attend(*_to_packages(q, k, v), SCALE, visible)
    return out.transpose(1, 2), lse


def _native_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    piece: BottomRightPiece,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_piece(q, k, piece)
    assert lse.shape[-1] == q.shape[-2], "the piece's rows of the lse"
    visible = bottom_right(q.shape[-2], k.shape[-2]) if piece.causal else None
    gradients = grads(*_to_packages(dout, q, k, v, out), lse, SCALE, visible)
    dq, dk, dv = (g.transpose(1, 2) for g in gradients)
    return dq, dk, dv


def _block(q_len: int, k_len: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, q_len, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, k_len, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 4, q_len, 8, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, offset: int | None
) -> tuple[torch.Tensor, ...]:
    """``(out, lse, dq, dk, dv)`` of dense float64 attention under ``window.right = offset``."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = dense(*leaves, SCALE, offset)
    if not out.numel():
        return out.detach(), lse.detach(), *(torch.zeros_like(x) for x in (q, k, v))
    gradients = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    filled = [
        torch.zeros_like(x) if g is None else g for g, x in zip(gradients, leaves, strict=True)
    ]
    return out.detach(), lse.detach(), *filled


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{what}: -inf rows"
    finite = torch.isfinite(want)
    error = float((got[finite] - want[finite]).abs().max()) if bool(finite.any()) else 0.0
    assert error < 1e-12, f"{what}: error {error:.2e}"


def _handing(handed: list[BottomRightPiece]) -> tuple[Any, Any]:
    """The float64 native calls, recording in ``handed`` the piece each is handed."""

    def forward(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        handed.append(args[-1])
        return _native_forward(*args)

    def backward(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        handed.append(args[-1])
        return _native_backward(*args)

    return forward, backward


@pytest.mark.parametrize("offset", OFFSETS)
def test_the_pieces_loop_is_exact_for_every_offset(offset: int | None) -> None:
    """Each native call is handed its piece, in :func:`bottom_right_pieces` order, forward and
    backward; the results are the oracle's (rows that see no key: ``0``, ``-inf``, zero
    gradients)."""
    for q_len in LENGTHS:
        for k_len in LENGTHS:
            q, k, v, dout = _block(q_len, k_len)
            handed: list[BottomRightPiece] = []
            forward, backward = _handing(handed)
            out, lse = forward_by_piece(forward, q, k, v, offset)
            gradients = backward_by_piece(backward, dout, q, k, v, out, lse, offset)
            pieces = list(bottom_right_pieces(q_len, k_len, offset))
            assert handed == pieces * 2
            where = f"q_len={q_len} k_len={k_len} offset={offset}"
            expected = _oracle(q, k, v, dout, offset)
            for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *gradients),
                                       expected, strict=True):  # fmt: skip
                _close(got, want, f"{name} ({where})")


def test_the_flag_only_loops_are_the_piece_loops_with_the_pieces_mask() -> None:
    """``forward_in_pieces`` / ``backward_in_pieces`` (the public API of 0.1) hand the native
    call the piece's mask flag and give the same results."""
    q, k, v, dout = _block(7, 5)
    flags: list[bool] = []

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Any:
        flags.append(causal)
        return _native_forward(q, k, v, BottomRightPiece(0, q.shape[-2], k.shape[-2], causal))

    def backward(*args: Any) -> Any:
        *tensors, causal = args
        flags.append(causal)
        q, k = tensors[1], tensors[2]
        piece = BottomRightPiece(0, q.shape[-2], k.shape[-2], causal)
        return _native_backward(*tensors, piece)

    out, lse = forward_in_pieces(forward, q, k, v, 0)
    gradients = backward_in_pieces(backward, dout, q, k, v, out, lse, 0)
    assert flags == [True, False] * 2  # rows 0-4: the diagonal; rows 5-6: every key
    expected = _oracle(q, k, v, dout, 0)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *gradients),
                               expected, strict=True):  # fmt: skip
        _close(got, want, name)


# -- on FakeTensor cuda tensors --------------------------------------------------------------------


class Dispatched(TorchDispatchMode):
    """Records the name of every aten op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


WRITES = {"copy_", "copy", "index_put_", "index_put", "_index_put_impl_"}


def test_the_recorder_sees_the_writes_it_looks_for() -> None:
    """Not vacuous: an index assignment, as the loop once wrote its pieces, is seen."""
    with FakeTensorMode(), Dispatched() as seen:
        out = torch.zeros(2, 4, 7, 8)
        out[..., 1:3, :] = torch.ones(2, 4, 2, 8)
    assert WRITES & set(seen.ops)


def _fake_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, piece: BottomRightPiece
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_piece(q, k, piece)
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _fake_backward(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, piece = args[1], args[2], args[3], args[-1]
    _check_piece(q, k, piece)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@pytest.mark.parametrize(
    ("q_len", "k_len", "offset", "pieces"), [(12, 16, -2, 1), (12, 16, 6, 2), (16, 8, -2, 2)]
)
def test_the_pieces_loop_runs_on_fake_cuda_without_copies(
    q_len: int, k_len: int, offset: int, pieces: int
) -> None:
    """Rows that see no key before one piece, two pieces, both: results allocated, narrowed,
    filled and added to, never copied into or index-assigned."""
    assert len(bottom_right_pieces(q_len, k_len, offset)) == pieces
    with FakeTensorMode(), Dispatched() as seen:
        base = torch.empty(2, k_len + q_len, 6, 16, dtype=torch.float16, device="cuda")
        q = base.narrow(1, 0, q_len).narrow(2, 0, 4).transpose(1, 2)  # a strided view
        k, v = (torch.empty(2, 2, k_len, 16, dtype=torch.float16, device="cuda") for _ in "kv")
        out, lse = forward_by_piece(_fake_forward, q, k, v, offset)
        assert (out.device.type, out.shape, out.dtype) == ("cuda", q.shape, torch.float16)
        assert (lse.shape, lse.dtype) == (q.shape[:-1], torch.float32)
        dq, dk, dv = backward_by_piece(_fake_backward, q.clone(), q, k, v, out, lse, offset)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert not WRITES & set(seen.ops), sorted(WRITES & set(seen.ops))
    assert {"add_", "fill_"} <= set(seen.ops)


@pytest.mark.parametrize("which", ["flash3 v2.8.3", "flash3 3.0.0", "flash4 4.0.0b27"])
def test_flash3_and_flash4_run_two_pieces_on_fake_cuda(
    monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """Through their stand-ins: a window of two pieces is two calls each way, with no copy."""
    kernel_class, install, calls = SUPPORTED[which]
    install(monkeypatch)
    kernel = kernel_class()
    options = BlockOptions(0.25, KeyWindow(None, 6), deterministic=True)
    with FakeTensorMode(), Dispatched() as seen:
        q, dout = (torch.empty(2, 4, 12, 16, dtype=torch.float16, device="cuda") for _ in "qo")
        # Four key/value heads: FlashAttention 3 before 3.0.0 deadlocks deterministic with GQA.
        k, v = (torch.empty(2, 4, 16, 16, dtype=torch.float16, device="cuda") for _ in "kv")
        out, lse = kernel.forward(q, k, v, options)
        kernel.backward(dout, q, k, v, out, lse, options)
    assert [c["op"] for c in calls] == ["forward"] * 2 + ["backward"] * 2
    assert [c["deterministic"] for c in calls if c["op"] == "backward"] == [True, True]
    assert not {"copy_", "index_put_", "_index_put_impl_"} & set(seen.ops)


# -- one dropout seed per piece --------------------------------------------------------------------


def test_piece_seeds_are_distinct_within_a_block_and_a_function_of_seed_and_piece() -> None:
    for q_len in range(1, 9):
        for k_len in range(1, 9):
            for offset in (None, *range(-8, 9)):
                pieces = bottom_right_pieces(q_len, k_len, offset)
                seeds = [piece_seed(1234, p) for p in pieces]
                assert len(set(seeds)) == len(seeds), (q_len, k_len, offset)
                again = [piece_seed(1234, BottomRightPiece(*attrs.astuple(p))) for p in pieces]
                assert again == seeds, "an equal piece, the same seed"
                assert 1234 not in seeds
                assert not set(seeds) & {piece_seed(1235, p) for p in pieces}


@contextlib.contextmanager
def _recorded_seeds(monkeypatch: pytest.MonkeyPatch, module: Any) -> Iterator[dict[str, list]]:
    """The seeds ``module``'s forward calls draw under (``seeded_generator``) and its backward
    calls replay (``replay_state``), the real functions still running."""
    seen: dict[str, list[int]] = {"forward": [], "backward": []}
    seeded, replay = module.seeded_generator, module.replay_state

    def seeded_generator(device: torch.device, seed: int) -> Any:
        seen["forward"].append(seed)
        return seeded(device, seed)

    def replay_state(seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        seen["backward"].append(seed)
        return replay(seed, device, dtype)

    with monkeypatch.context() as patch:
        patch.setattr(module, "seeded_generator", seeded_generator)
        patch.setattr(module, "replay_state", replay_state)
        yield seen


def test_flash_and_torch_flash_draw_the_same_seed_per_piece_forward_and_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A block of two pieces with dropout: two distinct seeds, the forward's replayed by the
    backward in the same order, and the same seeds in both kernels (one scheme)."""
    install_flash_attn(monkeypatch)
    g = torch.Generator().manual_seed(4)
    q, dout = (torch.randn(2, 4, 12, 16, generator=g).half() for _ in "qo")
    k, v = (torch.randn(2, 2, 16, 16, generator=g).half() for _ in "kv")
    options = BlockOptions(0.25, KeyWindow(None, 6), dropout_p=0.2, dropout_seed=77)
    drawn = {}
    for name, kernel, module in (
        ("flash", FlashKernel(), _philox),
        ("torch_flash", flash_kernel(), torch_flash),
    ):
        with _recorded_seeds(monkeypatch, module) as seen:
            out, lse = kernel.forward(q, k, v, options)
            kernel.backward(dout, q, k, v, out, lse, options)
        assert len(set(seen["forward"])) == 2, f"{name}: one seed per piece"
        assert seen["backward"] == seen["forward"], f"{name}: the backward replays them"
        drawn[name] = seen["forward"]
    assert drawn["flash"] == drawn["torch_flash"]
