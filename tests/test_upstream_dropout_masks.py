"""The dropout mask a fused kernel applies is the one upstream's op draws for the ``(seed, offset)``
the kernel hands it, worked out here from the documented rule rather than read back alone.

tests/test_flash_dropout.py and tests/test_torch_cuda_ops.py read each kernel's mask back from
its output and check it is *a* valid mask (0 or ``P / (1 - p)``, the rate, one seed one mask) and
that the backward replays it. Here the mask is also predicted: from ``BlockOptions.dropout_seed``,
:func:`op_state` gives the Philox ``(seed, offset)`` each of a block's native calls receives
(the rule as the kernels document it, stated once below), and the stand-ins' Philox model
(tests/standins/philox.py: ``keep_mask``, flash-attn's 8-bit keep rule on ``uniform(seed,
offset, shape)``) gives the mask upstream's op draws for that state and the call's shape
``(batch, query heads, rows, keys)``. The mask read back must equal it entry for entry, the op
must have been handed exactly that state forward (the generator's draw) and backward (the
``rng_state`` replayed), and the gradients must be float64 autograd's under it.

Blocks with a causal offset that needs two bottom-right calls (each call its own seed), one
call, and rows that see no key, all with grouped heads (4 query heads on 2 key/value heads).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ringdilated.backends import _heads, flash, torch_flash
from ringdilated.backends.flash import FlashKernel
from ringdilated.backends.torch_flash import TorchFlashKernel
from ringdilated.core import BottomRightPiece, KeyWindow
from ringdilated.core.contract.kernel import BlockOptions
from tests.standins import flash_attention, flash_attention_backward, install_flash_attn, philox
from tests.standins.flash_attn import BACKWARD_CALLS
from tests.standins.memory import read_as

P = 0.3
N, HEADS, KV_HEADS, DIM = 2, 4, 2, 16
BLOCK_SEED = 1234


# -- the rule, stated once -------------------------------------------------------------------------


def op_state(kernel: str, block_seed: int, call: tuple[int, int, int, bool]) -> tuple[int, int]:
    """The Philox ``(seed, offset)`` that the native call ``call`` (``(row_start, row_stop, keys,
    causal)``: one bottom-right piece of ``ringdilated.core.contract.causal``) of a block seeded
    ``block_seed`` hands upstream's op, for ``kernel`` (flash or torch_flash). The documented
    rule:

    - each native call runs under ``backends/_philox.py``'s ``seeded_generator(device, seed)``:
      the default generator freshly seeded, so the op takes ``(seed, 0)`` (``manual_seed``
      resets the offset), and the backward is handed ``replay_state(seed)``, ``[seed, 0]``;
    - ``seed`` is ``core.contract.causal.piece_seed``'s: ``derive_seed`` of the block's seed and
      the piece (its rows, its keys and its mask), the path ``("bottom-right piece", row_start,
      row_stop, keys, causal)``, one rule for both kernels.

    Written out here from the documented rule, ``derive_seed`` included (:func:`_derive_seed`
    restates its docstring's hash rather than calling it), so a change to the rule shows up
    here."""
    if kernel not in ("flash", "torch_flash"):
        raise ValueError(f"no seed rule for {kernel!r}")
    first, stop, keys, causal = call
    return _derive_seed(block_seed, "bottom-right piece", first, stop, keys, int(causal)), 0


def _derive_seed(seed: int, *path: int | str) -> int:
    """``core.contract.kernel.derive_seed`` as documented: the parts joined by commas, hashed
    with BLAKE2b to 8 bytes, read little-endian, shifted right by one (a non-negative int64)."""
    text = ",".join(str(part) for part in (seed, *path)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


# -- the blocks ------------------------------------------------------------------------------------

#: ``(q_len, k_len, right, calls)``: each call ``(row_start, row_stop, keys, causal)``, worked by
#: hand from the rule of ``core/contract/causal.py`` (rows before ``-right`` see no key; rows
#: whose last visible key ``i + right`` is before the last key are one bottom-right call on keys
#: ``[0, rows + right)``; the rest see every key, unmasked).
BLOCKS = [
    # right = 6 over 16 keys: rows 0-9 see keys up to row + 6 (10 rows on 16 keys, bottom-right),
    # rows 10 and 11 every key.
    (12, 16, 6, [(0, 10, 16, True), (10, 12, 16, False)]),
    # right = 3 on a square block: rows 0-12 on all 16 keys (13 rows, bottom-right), 13-15 all.
    (16, 16, 3, [(0, 13, 16, True), (13, 16, 16, False)]),
    # right = -2: rows 0 and 1 see no key (no call), rows 2-11 see keys up to row - 2, a
    # bottom-right call of 10 rows on 10 keys.
    (12, 16, -2, [(2, 12, 10, True)]),
    # the diagonal block: one bottom-right call on everything.
    (16, 16, 0, [(0, 16, 16, True)]),
    # no mask: one unmasked call.
    (12, 16, None, [(0, 12, 16, False)]),
]


def _visible(q_len: int, k_len: int, right: int | None) -> torch.Tensor:
    rows = torch.arange(q_len).unsqueeze(1)
    return torch.arange(k_len) <= rows + (k_len if right is None else right)


def expected_keep(
    kernel: str, q_len: int, k_len: int, calls: list[tuple[int, int, int, bool]]
) -> torch.Tensor:
    """``(N, HEADS, Lq, Lk)`` bool: what upstream's op keeps, call by call, for the state
    :func:`op_state` says each call receives (entries no call covers: False)."""
    keep = torch.zeros(N, HEADS, q_len, k_len, dtype=torch.bool)
    for first, stop, keys, causal in calls:
        seed, offset = op_state(kernel, BLOCK_SEED, (first, stop, keys, causal))
        drawn = philox.keep_mask(seed, offset, (N, HEADS, stop - first, keys), P)
        keep[:, :, first:stop, :keys] = drawn
    return keep


# -- the kernels, with what their ops receive recorded --------------------------------------------


class Received:
    """The ``(seed, offset)`` each forward op took from the generator (``philox.take``, which both
    stand-ins draw through) and each backward op was handed, in call order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.forward: list[tuple[int, int]] = []
        self.backward: list[tuple[int, int]] = []
        take = philox.take

        def recording_take(generator: torch.Generator, increment: int) -> tuple[int, int]:
            state = take(generator, increment)
            self.forward.append(state)
            return state

        monkeypatch.setattr(philox, "take", recording_take)


def _flash(monkeypatch: pytest.MonkeyPatch, received: Received) -> Any:
    install_flash_attn(monkeypatch)
    kernel = FlashKernel()
    backward = kernel.backward

    def recorded_backward(*args: Any) -> Any:
        BACKWARD_CALLS.clear()
        grads = backward(*args)
        received.backward.extend(tuple(call["rng_state"]) for call in BACKWARD_CALLS)
        return grads

    kernel.backward = recorded_backward  # type: ignore[method-assign]
    return kernel


def _torch_flash(monkeypatch: pytest.MonkeyPatch, received: Received) -> Any:
    def recorded_backward(*args: Any, **kwargs: Any) -> Any:
        philox_seed = args[12]  # the schema's 13th argument: rng_state, uint64[2]
        state = read_as(philox_seed, (2,), (1,), torch.int64).tolist()
        received.backward.append((int(state[0]), int(state[1])))
        return flash_attention_backward(*args, **kwargs)

    return TorchFlashKernel(flash_attention, recorded_backward)


KERNELS: dict[str, Callable[[pytest.MonkeyPatch, Received], Any]] = {
    "flash": _flash,
    "torch_flash": _torch_flash,
}


# -- the test --------------------------------------------------------------------------------------


def _inputs(q_len: int, k_len: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(q_len * 100 + k_len)
    q = (torch.randn(N, HEADS, q_len, DIM, generator=g) * 0.5).half()
    k, v = ((torch.randn(N, KV_HEADS, k_len, DIM, generator=g) * 0.5).half() for _ in "kv")
    dout = torch.randn(N, HEADS, q_len, DIM, generator=g).half()
    return q, k, v, dout


def _probabilities(q: torch.Tensor, k: torch.Tensor, right: int | None) -> torch.Tensor:
    """float64 ``(N, HEADS, Lq, Lk)`` probabilities at scale 0.25, 0 in rows that see no key."""
    scores = q.double() @ _heads.repeat_kv(k.double(), HEADS).transpose(-1, -2) * 0.25
    hidden = _visible(q.shape[-2], k.shape[-2], right).logical_not()
    return scores.masked_fill(hidden, float("-inf")).softmax(-1).nan_to_num(0.0)


@pytest.mark.parametrize(("q_len", "k_len", "right", "calls"), BLOCKS)
@pytest.mark.parametrize("kernel_name", sorted(KERNELS))
def test_the_applied_mask_is_the_one_upstream_draws_for_the_documented_state(
    monkeypatch: pytest.MonkeyPatch,
    kernel_name: str,
    q_len: int,
    k_len: int,
    right: int | None,
    calls: list[tuple[int, int, int, bool]],
) -> None:
    check_masks(monkeypatch, kernel_name, q_len, k_len, right, calls)


def check_masks(
    monkeypatch: pytest.MonkeyPatch,
    kernel_name: str,
    q_len: int,
    k_len: int,
    right: int | None,
    calls: list[tuple[int, int, int, bool]],
) -> None:
    """The mask ``kernel_name`` applies to the block, read back, against :func:`expected_keep`;
    the states its ops received against :func:`op_state`; its gradients under that mask."""
    received = Received(monkeypatch)
    kernel = KERNELS[kernel_name](monkeypatch, received)
    q, k, v, dout = _inputs(q_len, k_len)
    options = BlockOptions(0.25, KeyWindow(None, right), dropout_p=P, dropout_seed=BLOCK_SEED)
    states = [op_state(kernel_name, BLOCK_SEED, c) for c in calls]
    assert len(set(states)) == len(states), "each call of a block its own seed"

    # The mask applied, read back as today: with v the identity, out is the dropped
    # probabilities, each 0 or P / (1 - p).
    identity = torch.eye(k_len, DIM).expand(N, KV_HEADS, k_len, DIM).half()
    weights, _ = kernel.forward(q, k, identity, options)
    probabilities = _probabilities(q, k, right)
    applied = weights[..., :k_len].double() > probabilities / (1 - P) / 2
    visible = _visible(q_len, k_len, right).expand_as(applied)
    decided = visible & (probabilities > 1e-3)  # kept or dropped beyond float16's rounding
    assert int(decided.sum()) > 0.9 * int(visible.sum())
    expected = expected_keep(kernel_name, q_len, k_len, calls)
    assert torch.equal(applied[decided], expected[decided]), "upstream's mask for that state"
    assert not bool(applied[~visible].any()), "hidden keys get nothing"
    assert received.forward == states, "the op drew from the documented (seed, offset)"

    # The backward replays that state and gives float64 autograd's gradients under the mask.
    out, lse = kernel.forward(q, k, v, options)
    grads = kernel.backward(dout, q, k, v, out, lse, options)
    assert received.backward == states, "the backward was handed the forward's (seed, offset)"
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    scores = exact[0] @ _heads.repeat_kv(exact[1], HEADS).transpose(-1, -2) * 0.25
    hidden = _visible(q_len, k_len, right).logical_not()
    attention = scores.masked_fill(hidden, float("-inf")).softmax(-1).nan_to_num(0.0)
    dropped = attention * expected.double() / (1 - P)
    oracle_out = dropped @ _heads.repeat_kv(exact[2], HEADS)
    wanted = torch.autograd.grad(oracle_out, exact, dout.double())
    assert float((out.double() - oracle_out.detach()).abs().max()) < 1e-2
    for name, got, want in zip("qkv", grads, wanted, strict=True):
        error = float((got.double() - want).abs().max() / want.abs().max().clamp(min=1))
        assert error < 1e-2, f"d{name} under upstream's mask: relative error {error:.3g}"


def _one_seed(module: Any) -> Callable[[pytest.MonkeyPatch], None]:
    """Make ``module`` seed every piece of a block alike (with its block seed's first piece)."""

    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        piece_seed = module.piece_seed
        first = BottomRightPiece(0, 1, 1, True)
        monkeypatch.setattr(module, "piece_seed", lambda seed, piece: piece_seed(seed, first))

    return patch


_one_seed_flash, _one_seed_torch_flash = _one_seed(flash), _one_seed(torch_flash)


@pytest.mark.parametrize(
    ("kernel_name", "one_seed"),
    [("flash", _one_seed_flash), ("torch_flash", _one_seed_torch_flash)],
)
def test_a_kernel_drawing_both_calls_from_one_seed_fails(
    monkeypatch: pytest.MonkeyPatch, kernel_name: str, one_seed: Callable[..., None]
) -> None:
    """The check is not vacuous: a kernel whose two calls of a block draw from the first call's
    seed applies another mask to the second call's rows than the rule predicts."""
    one_seed(monkeypatch)
    with pytest.raises(AssertionError, match="upstream's mask for that state"):
        check_masks(monkeypatch, kernel_name, *BLOCKS[0])
