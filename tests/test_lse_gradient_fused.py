"""The lse's gradient in the kernel's own backward where it takes it (FlashAttention 4's
``dlse=``, the contract's optional ``LseGradientKernel.backward_with_lse``), else in a second
backward call, as before (``ringdilated.core.contract.lse``).

FlashAttention 4 runs on CPU through its stand-in (tests/standins/flash_attn4.py: ``dlse`` as
``_flash_attn_bwd`` takes it at 4.0.0b5 and 4.0.0b27); every gradient is compared with float64
autograd of ``sum(dout * out) + sum(dlse * lse)`` (the kit's ``dense`` for a block, the oracle
for a call) under the tolerance rule, a kernel without the method is held to the same
gradients, and the stand-in's call record counts the op's calls: one per bottom-right piece
with ``dlse``, where the second-call path makes two. What this cannot prove: the real CUDA
kernels' arithmetic (tests/test_gpu.py).
"""

from __future__ import annotations

import queue
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ringdilated.backends.flash4 import Flash4Kernel
from ringdilated.backends.reference import ReferenceKernel
from ringdilated.core import BatchLimit, BlockOptions, KernelContractError, KeyWindow
from ringdilated.core import LseGradientKernel as LseGradientKernelExport
from ringdilated.core.contract.communicator import every_peer_at_once
from ringdilated.core.contract.guard import CheckedKernel
from ringdilated.core.contract.kernel import LseGradientKernel
from ringdilated.core.contract.lse import backward_plus_lse_gradient, backward_with_lse
from ringdilated.core.plan.documents import DocumentLayout
from ringdilated.core.plan.pattern import DilationPattern
from ringdilated.core.plan.shards import ShardPlan, shard_plan
from ringdilated.core.plan.window import as_window
from ringdilated.core.run.local import (
    BackwardInputs,
    BatchLimitedKernel,
    CallState,
    DilatedAttentionFunction,
    as_lse_layout,
    pattern_run,
)
from ringdilated.core.run.sharded import ShardedRun
from ringdilated.testing import allowed_error, dense_attention, max_error, oracle
from ringdilated.testing.kernel_cases import dense
from tests.standins import flash_attn4 as fa4
from tests.test_fake_cuda import Layout, Recorder

HALF = torch.float16
SCALE = 0.25
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@pytest.fixture(params=fa4.VERSIONS)
def flash4(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Flash4Kernel:
    """FlashAttention 4 over the stand-in of each supported release (sm90)."""
    fa4.install_flash_attn4(monkeypatch, request.param)
    return Flash4Kernel()


class PlainFlash4:
    """FlashAttention 4 behind the base contract only (no ``backward_with_lse``): what any
    kernel without the method gets."""

    def __init__(self, kernel: Flash4Kernel) -> None:
        self.kernel = kernel

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        return self.kernel.forward(q, k, v, options)

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        return self.kernel.backward(dout, q, k, v, out, lse, options)


def _op_backwards() -> list[dict[str, Any]]:
    return [c for c in fa4.CALLS if c["op"] == "backward"]


def _block(
    q_len: int, k_len: int, n: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, dout, dlse)``: kernel layout, float16, ``dlse`` float32."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, q_len, 16, generator=g).to(HALF)
    k, v = (torch.randn(n, kv_heads, k_len, 16, generator=g).to(HALF) for _ in range(2))
    dout = torch.randn(n, heads, q_len, 16, generator=g).to(HALF)
    dlse = torch.randn(n, heads, q_len, generator=g)
    return q, k, v, dout, dlse


def _loss(
    out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None
) -> torch.Tensor:
    """``sum(dout * out) + sum(dlse * lse)`` in float64, the lse of rows that see no key (a
    constant ``-inf``) left out."""
    loss = (out.double() * dout.double()).sum()
    if dlse is None:
        return loss
    return loss + (lse.masked_fill(torch.isneginf(lse), 0).double() * dlse.double()).sum()


def _dense_gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    offset: int | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """Autograd of :func:`_loss` through dense attention of one block computed in ``dtype``
    (float64: the exact gradients; the inputs' dtype: the tolerance rule's baseline)."""
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = dense(leaves[0], leaves[1], leaves[2], SCALE, offset, dtype)
    return torch.autograd.grad(_loss(out, lse, dout.to(dtype), dlse), leaves)


def _assert_exact(
    grads: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    baseline: Sequence[torch.Tensor],
) -> None:
    for name, actual, exact, base in zip(
        ("dq", "dk", "dv"), grads, expected, baseline, strict=True
    ):
        error, allowed = max_error(actual, exact), allowed_error(exact, base, HALF)
        assert error <= allowed, f"{name}: error {error:.3e} vs float64 exceeds {allowed:.3e}"


#: ``(q_len, k_len, window.right)``, the bottom-right calls it takes (worked out by hand: a
#: piece of rows seeing a prefix of the keys, one of rows seeing them all) and the rows that
#: see a key.
BLOCKS = [
    ((20, 24, None), 1, 20),
    ((20, 24, 10), 2, 20),  # rows 0..13 causal on all 24 keys, rows 14..19 unmasked
    ((24, 20, 0), 2, 24),  # rows 0..19 causal on 20 keys, rows 20..23 unmasked
    ((24, 20, -3), 2, 21),  # rows 0..2 see no key; 3..22 causal on 20 keys; 23 unmasked
]


@pytest.mark.parametrize(("shape", "pieces", "seen_rows"), BLOCKS)
def test_flash4_folds_dlse_into_one_op_call_per_piece(
    flash4: Flash4Kernel, shape: tuple[int, int, int | None], pieces: int, seen_rows: int
) -> None:
    """Grouped heads (4 query, 2 key/value), causal offsets that make one piece or two, rows
    that see no key: the gradients of ``out`` and ``lse`` together, exact, from one op call
    per piece, each handed its rows of ``dlse`` as a dense float32 ``(batch, heads, rows)``."""
    q_len, k_len, offset = shape
    q, k, v, dout, dlse = _block(q_len, k_len)
    options = BlockOptions(SCALE, KeyWindow(None, offset))
    out, lse = flash4.forward(q, k, v, options)
    fa4.CALLS.clear()
    grads = flash4.backward_with_lse(dout, dlse, q, k, v, out, lse, options)
    calls = _op_backwards()
    assert len(calls) == pieces, "one op call per piece, the lse's gradient folded in"
    rows = 0
    for call in calls:
        (n, piece_rows, heads, _), *_ = call["tensors"]["q"]
        shape_, stride, _, dtype = call["tensors"]["dlse"]
        assert shape_ == (n, heads, piece_rows) and dtype == torch.float32
        assert stride == (heads * piece_rows, piece_rows, 1), "handed over dense"
        rows += piece_rows
    assert rows == seen_rows
    expected = _dense_gradients(q, k, v, dout, dlse, offset, torch.float64)
    baseline = _dense_gradients(q, k, v, dout, dlse, offset, HALF)
    _assert_exact(grads, expected, baseline)
    # The check could fail: the gradients without the lse's share are far outside it.
    without = _dense_gradients(q, k, v, dout, None, offset, torch.float64)
    for name, i in (("dq", 0), ("dk", 1)):
        allowed = allowed_error(expected[i], baseline[i], HALF)
        assert max_error(without[i], expected[i]) > 10 * allowed, name


@pytest.mark.parametrize(("shape", "pieces", "seen_rows"), BLOCKS)
def test_a_kernel_without_the_method_gets_two_calls_and_the_same_gradients(
    flash4: Flash4Kernel, shape: tuple[int, int, int | None], pieces: int, seen_rows: int
) -> None:
    q_len, k_len, offset = shape
    plain = PlainFlash4(flash4)
    assert isinstance(flash4, LseGradientKernel) and not isinstance(plain, LseGradientKernel)
    assert LseGradientKernelExport is LseGradientKernel
    q, k, v, dout, dlse = _block(q_len, k_len, seed=1)
    options = BlockOptions(SCALE, KeyWindow(None, offset))
    out, lse = flash4.forward(q, k, v, options)
    expected = _dense_gradients(q, k, v, dout, dlse, offset, torch.float64)
    baseline = _dense_gradients(q, k, v, dout, dlse, offset, HALF)
    for kernel, calls in ((flash4, pieces), (plain, 2 * pieces)):
        fa4.CALLS.clear()
        grads = backward_with_lse(kernel, dout, dlse, q, k, v, out, lse, options)  # type: ignore[arg-type]
        assert len(_op_backwards()) == calls, type(kernel).__name__
        _assert_exact(grads, expected, baseline)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_dlse_poisons_its_problem_as_the_second_call_does(
    flash4: Flash4Kernel, bad: float
) -> None:
    """``dlse`` of problem (0, key/value head 0) holds NaN or infinity: its ``dq`` and ``dk``
    are NaN, as the second-call path makes them, its ``dv`` (which does not depend on the lse)
    and every other problem exact."""
    q, k, v, dout, dlse = _block(24, 20, seed=2)
    options = BlockOptions(SCALE, KeyWindow(None, -3))
    out, lse = flash4.forward(q, k, v, options)
    poisoned = dlse.clone()
    poisoned[0, 1, 7] = bad
    fused = flash4.backward_with_lse(dout, poisoned, q, k, v, out, lse, options)
    two_calls = backward_with_lse(PlainFlash4(flash4), dout, poisoned, q, k, v, out, lse, options)  # type: ignore[arg-type]
    for a, b in zip(fused, two_calls, strict=True):
        assert torch.equal(a.isnan(), b.isnan())
    dq, dk, _ = fused
    assert dq[0, :2].isnan().all() and dk[0, 0].isnan().all()
    # Untouched: problem 1, problem 0's other key/value head (query heads 2, 3), every dv.
    expected = _dense_gradients(q, k, v, dout, dlse, -3, torch.float64)
    baseline = _dense_gradients(q, k, v, dout, dlse, -3, HALF)
    clean = [(0, (1,)), (0, (0, slice(2, 4))), (1, (1,)), (1, (0, slice(1, 2))), (2, (...,))]
    for i, where in clean:
        exact, actual = expected[i][where], fused[i][where]
        assert max_error(actual, exact) <= allowed_error(exact, baseline[i][where], HALF), where


def test_the_stand_in_refuses_a_dlse_the_compiled_preprocess_would(
    flash4: Flash4Kernel,
) -> None:
    """Float32 of the lse's shape, as ``fake_tensor(Float32, mLSE.shape)`` compiles it (the
    wrapper always hands it that: these call the op directly)."""
    q, k, v, dout, dlse = _block(20, 24)
    out, lse = flash4.native_forward(q, k, v, False, SCALE)
    qt, kt, vt, out_t, dout_t = (x.transpose(1, 2) for x in (q, k, v, out, dout))
    buffers = {name: torch.empty_like(x) for name, x in (("dq", qt), ("dk", kt), ("dv", vt))}
    for wrong in (dlse.double(), dlse[..., :-1].contiguous()):
        with pytest.raises(RuntimeError, match="preprocess takes Float32 of the lse's shape"):
            flash4._backward(
                qt, kt, vt, out_t, dout_t, lse, softmax_scale=SCALE, dlse=wrong, **buffers
            )


# the driver: one process, and a sharded run -------------------------------------------------------


def _call_inputs(
    length: int, q_len: int, seed: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v, dout, dlse)`` of a call: ``(B, L, H, D)`` float16, 4 query and 2 key/value
    heads, the queries the last ``q_len`` positions."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, q_len, 4, 16, generator=g).to(HALF)
    k, v = (torch.randn(2, length, 2, 16, generator=g).to(HALF) for _ in range(2))
    dout = torch.randn(2, q_len, 4, 16, generator=g).to(HALF)
    dlse = torch.randn(2, 4, q_len, generator=g)
    return q, k, v, dout, dlse


def _call_reference(
    inputs: Sequence[torch.Tensor], keywords: Mapping[str, Any], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Autograd of :func:`_loss` through the whole call, densely in ``dtype`` (float64: the
    oracle)."""
    q, k, v, dout, dlse = inputs
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    if dtype == torch.float64:
        out, lse = oracle(*leaves, return_lse=True, **keywords)
    else:
        out, lse = dense_attention(*leaves, dtype=dtype, **keywords)
    return torch.autograd.grad(_loss(out, lse, dout, dlse), leaves)


@pytest.mark.parametrize(
    ("mode", "causal", "q_len"),
    [
        ("head_groups", True, 32),
        ("longnet", False, 32),
        ("longnet", True, 32),
        ("longnet", True, 20),
    ],
)
def test_the_driver_calls_the_op_once_per_piece_with_dlse(
    flash4: Flash4Kernel, mode: str, causal: bool, q_len: int
) -> None:
    """Through ``LocalRun`` (the kernel checked by ``CheckedKernel``): with the lse's gradient,
    FlashAttention 4 gets exactly the op calls it gets without it, a kernel without the method
    twice as many, and both give the oracle's gradients (a query suffix, the last 20 of 32
    positions, included; the driver's causal blocks are each one bottom-right call, so the
    two-piece offsets are the block tests' above)."""
    inputs = _call_inputs(32, q_len)
    q, k, v, dout, dlse = inputs
    pattern = DilationPattern([8, 16], [1, 2], mode)  # type: ignore[arg-type]
    keywords = {"segment_lengths": [8, 16], "dilation_rates": [1, 2], "mode": mode}
    keywords["causal"] = causal
    expected = _call_reference(inputs, keywords, torch.float64)
    baseline = _call_reference(inputs, keywords, HALF)

    def run(kernel: Any, lse_term: bool) -> tuple[Grads, int]:
        layout = DocumentLayout.whole(2, 32, q_len)
        executor = pattern_run(
            kernel, pattern, q, k, window=as_window(causal), scale=None, dropout_p=0.0,
            layout=layout,
        )  # fmt: skip
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = DilatedAttentionFunction.apply(*leaves, executor, CallState())
        fa4.CALLS.clear()
        loss = _loss(out, lse, dout, dlse if lse_term else None)
        grads = torch.autograd.grad(loss, leaves)
        return grads, len(_op_backwards())  # type: ignore[return-value]

    _, plain_calls = run(flash4, lse_term=False)
    assert plain_calls > 0
    for kernel, factor in ((flash4, 1), (PlainFlash4(flash4), 2)):
        grads, calls = run(kernel, lse_term=True)
        assert calls == factor * plain_calls, type(kernel).__name__
        _assert_exact(grads, expected, baseline)


class _Mailbox:
    """In-process transport for a sharded run on threads: one FIFO per (sender, receiver); both
    ends of a pair exchange in the same order, by the shard plans."""

    def __init__(self, world: int) -> None:
        self.queues: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {
            (a, b): queue.Queue() for a in range(world) for b in range(world)
        }


class _Pending:
    def __init__(self, mailbox: _Mailbox, rank: int, recvs: Mapping[int, torch.Tensor]) -> None:
        self.mailbox, self.rank, self.recvs = mailbox, rank, recvs

    def wait(self) -> None:
        for src, buffer in self.recvs.items():
            buffer.copy_(self.mailbox.queues[src, self.rank].get(timeout=60))


class ThreadCommunicator:
    """A communicator for rank ``rank`` of ranks running on threads of this process."""

    def __init__(self, mailbox: _Mailbox, rank: int) -> None:
        self.mailbox, self.rank = mailbox, rank

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        return every_peer_at_once(rank, world_size)

    def prepare(self, group: object, plans: Sequence[ShardPlan], window: KeyWindow) -> None:
        return None

    def exchange(
        self,
        group: object,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, torch.Tensor],
        uniform: bool = False,
    ) -> _Pending:
        for dst, tensor in sends.items():
            self.mailbox.queues[self.rank, dst].put(tensor.clone())
        return _Pending(self.mailbox, self.rank, recvs)


@pytest.mark.parametrize("causal", [False, True])
def test_a_sharded_runs_crossing_pieces_take_dlse_in_one_call(
    flash4: Flash4Kernel, causal: bool
) -> None:
    """Two ranks (threads, an in-process transport) of 16 positions each; the 32-position
    segments cross the shards. Each rank's gradients are the oracle's, and the op calls with
    the lse's gradient are those without it (the crossing pieces' included)."""
    world, length = 2, 32
    inputs = _call_inputs(length, length, seed=4)
    q, k, v, dout, dlse = inputs
    pattern = DilationPattern([8, 32], [1, 2], "longnet")
    keywords = {"segment_lengths": [8, 32], "dilation_rates": [1, 2], "mode": "longnet"}
    keywords["causal"] = causal
    expected = _call_reference(inputs, keywords, torch.float64)
    baseline = _call_reference(inputs, keywords, HALF)
    plans = tuple(shard_plan(pattern, length, 4, 2, r, world) for r in range(world))
    assert all(p.crossings for p in plans), "the pieces cross ranks"
    window = as_window(causal)

    def rank_run(rank: int, mailbox: _Mailbox, lse_term: bool) -> Grads:
        shard = slice(rank * 16, rank * 16 + 16)
        qr, kr, vr, dout_r = (x[:, shard].contiguous() for x in (q, k, v, dout))
        inner = pattern_run(
            flash4, pattern, qr, kr, window=window, scale=None, dropout_p=0.0, complete=False,
            blocks=plans[rank].inner,
        )  # fmt: skip
        run = ShardedRun(
            inner, plans, rank, ThreadCommunicator(mailbox, rank), None, broadcast=False
        )
        out, lse = run.forward(qr, kr, vr, CallState())
        dlse_r = as_lse_layout(dlse[:, :, shard].contiguous()) if lse_term else None
        return run.backward(BackwardInputs(dout_r, dlse_r, qr, kr, vr, out, lse), CallState())

    def sharded(lse_term: bool) -> tuple[list[Grads], int]:
        mailbox = _Mailbox(world)
        fa4.CALLS.clear()
        with ThreadPoolExecutor(world) as pool:
            futures = [pool.submit(rank_run, r, mailbox, lse_term) for r in range(world)]
            results = [f.result(timeout=120) for f in futures]
        return results, len(_op_backwards())

    _, without = sharded(lse_term=False)
    results, with_lse = sharded(lse_term=True)
    assert with_lse == without > 0
    for rank, grads in enumerate(results):
        shard = slice(rank * 16, rank * 16 + 16)
        _assert_exact(grads, [e[:, shard] for e in expected], [b[:, shard] for b in baseline])


# the wrappers: CheckedKernel and BatchLimitedKernel -----------------------------------------------


class ExactWithLse(ReferenceKernel):
    """The reference kernel (float64) with a native ``backward_with_lse`` (its two backward
    calls, summed in float64): for the checks of what wraps it. Records what it is handed."""

    def __init__(self) -> None:
        self.handed: list[torch.Tensor] = []

    def backward_with_lse(self, dout, dlse, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        self.handed.append(dlse)
        return backward_plus_lse_gradient(ReferenceKernel(), dout, dlse, q, k, v, out, lse, options)


class WrongShape(ExactWithLse):
    def backward_with_lse(self, dout, dlse, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        dq, dk, dv = super().backward_with_lse(dout, dlse, q, k, v, out, lse, options)
        return dq[..., :1], dk, dv


class WrongDtype(ExactWithLse):
    def backward_with_lse(self, dout, dlse, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        dq, dk, dv = super().backward_with_lse(dout, dlse, q, k, v, out, lse, options)
        return dq, dk.float(), dv


class WritesDlse(ExactWithLse):
    def backward_with_lse(self, dout, dlse, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        dlse.mul_(2)
        return super().backward_with_lse(dout, dlse, q, k, v, out, lse, options)


class NarrowBackward(ReferenceKernel):
    """No ``backward_with_lse``; its ``backward`` returns a ``dv`` one row short."""

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        dq, dk, dv = super().backward(dout, q, k, v, out, lse, options)
        return dq, dk, dv[..., :-1, :]


def _exact_block(n: int = 2, seed: int = 5) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 4, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(n, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(n, 4, 6, 8, generator=g, dtype=torch.float64)
    dlse = torch.randn(n, 6, 4, generator=g, dtype=torch.float64).transpose(1, 2)  # strided
    return q, k, v, dout, dlse


def _float64_gradients(inputs: Sequence[torch.Tensor], offset: int | None) -> Grads:
    q, k, v, dout, dlse = inputs
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = dense(leaves[0], leaves[1], leaves[2], SCALE, offset)
    return torch.autograd.grad(_loss(out, lse, dout, dlse), leaves)  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("kernel", "message"),
    [
        (
            WrongShape(),
            r"backward_with_lse's dq is \(2, 4, 6, 1\) float64, expected \(2, 4, 6, 8\)",
        ),
        (WrongDtype(), r"backward_with_lse's dk is \(2, 2, 7, 8\) float32, expected .* float64"),
        (WritesDlse(), r"it modified its input\(s\) dlse in place"),
        (NarrowBackward(), r"backward's dv is \(2, 2, 6, 8\) float64, expected \(2, 2, 7, 8\)"),
    ],
    ids=["shape", "dtype", "writes-dlse", "fallback-checked"],
)
def test_checked_kernel_holds_backward_with_lse_to_the_contract(
    kernel: ReferenceKernel, message: str
) -> None:
    q, k, v, dout, dlse = _exact_block()
    options = BlockOptions(SCALE, KeyWindow(None, 1))
    out, lse = ReferenceKernel().forward(q, k, v, options)
    checked = CheckedKernel(kernel, "bad")
    with pytest.raises(KernelContractError, match=message):
        checked.backward_with_lse(dout, dlse, q, k, v, out, lse, options)


@pytest.mark.parametrize("native", [True, False])
def test_checked_kernel_passes_backward_with_lse_through(native: bool) -> None:
    """With the method: the kernel's own, handed the very ``dlse`` given; without it: two
    checked backward calls. Both give float64 autograd's gradients."""
    inputs = _exact_block()
    q, k, v, dout, dlse = inputs
    options = BlockOptions(SCALE, KeyWindow(None, 1))
    out, lse = ReferenceKernel().forward(q, k, v, options)
    inner = ExactWithLse() if native else ReferenceKernel()
    grads = CheckedKernel(inner, "k").backward_with_lse(dout, dlse, q, k, v, out, lse, options)
    if native:
        assert len(inner.handed) == 1 and inner.handed[0] is dlse  # type: ignore[attr-defined]
    for actual, exact in zip(grads, _float64_gradients(inputs, 1), strict=True):
        assert max_error(actual, exact) < 1e-12


@pytest.mark.parametrize("native", [True, False])
def test_batch_limited_kernel_splits_dlse_with_n(flash4: Flash4Kernel, native: bool) -> None:
    """Five problems, at most two per call: each op call gets the same problems of ``q`` and
    of ``dlse`` (one call per part with the method, two without), and the gradients are
    float64 autograd's."""
    q, k, v, dout, dlse = _block(20, 24, n=5, seed=6)
    options = BlockOptions(SCALE, KeyWindow(None, 10))  # two pieces per call
    out, lse = flash4.forward(q, k, v, options)
    inner = flash4 if native else PlainFlash4(flash4)
    limited = BatchLimitedKernel(inner, BatchLimit(problems=2))  # type: ignore[arg-type]
    fa4.CALLS.clear()
    grads = limited.backward_with_lse(dout, dlse, q, k, v, out, lse, options)
    batches = [c["tensors"]["q"][0][0] for c in _op_backwards()]
    if native:
        assert batches == [2, 2, 2, 2, 1, 1]  # (2 pieces) x parts of 2, 2, 1
        assert [c["tensors"]["dlse"][0][0] for c in _op_backwards()] == batches
    else:
        assert batches == [2] * 8 + [1] * 4 and all("dlse" not in c["tensors"] for c in fa4.CALLS)
    expected = _dense_gradients(q, k, v, dout, dlse, 10, torch.float64)
    _assert_exact(grads, expected, _dense_gradients(q, k, v, dout, dlse, 10, HALF))


# FakeTensor cuda: the driver's real calls, replayed -----------------------------------------------


class LseRecorder(Recorder):
    """:class:`Recorder` with ``backward_with_lse``: records its argument layouts (computing
    with the reference kernel's two calls, in the inputs' dtypes)."""

    def backward_with_lse(self, dout, dlse, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        args = (dout, dlse, q, k, v, out, lse)
        self.calls.append(("backward_with_lse", tuple(map(Layout.of, args)), options))
        grads = backward_plus_lse_gradient(ReferenceKernel(), *args, options)
        return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v), strict=True))


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_on_fake_cuda_flash4_gets_the_drivers_dlse_dense(flash4: Flash4Kernel, mode: str) -> None:
    """The driver hands ``backward_with_lse`` strided views of its lse-layout ``dlse``; on fake
    ``cuda`` tensors of exactly those layouts (non-causal: a CPU-only torch cannot slice the
    pieces of fake tensors), every op call gets a dense float32 ``dlse`` of the lse's shape, one
    call per ``backward_with_lse``."""
    recorder = LseRecorder()
    pattern = DilationPattern([8, 16], [1, 2], mode)  # type: ignore[arg-type]
    q, k, v, dout, dlse = _call_inputs(40, 40)
    run = pattern_run(recorder, pattern, q, k, window=as_window(False), scale=None, dropout_p=0.0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = DilatedAttentionFunction.apply(*leaves, run, CallState())
    torch.autograd.grad(_loss(out, lse, dout, dlse), leaves)
    replayed = [(layouts, options) for kind, layouts, options in recorder.calls if "lse" in kind]
    assert replayed and all(kind != "backward" for kind, _, _ in recorder.calls)
    assert any(layouts[1].stride[-1] != 1 for layouts, _ in replayed), "strided dlse views"
    fa4.CALLS.clear()
    with FakeTensorMode():
        for layouts, options in replayed:
            tensors = [layout.fake() for layout in layouts]
            grads = flash4.backward_with_lse(*tensors, options)
            assert [g.shape for g in grads] == [t.shape for t in tensors[2:5]]
    calls = _op_backwards()
    assert len(calls) == len(replayed)
    for call in calls:
        batch, rows, heads, _ = call["tensors"]["q"][0]
        assert call["tensors"]["dlse"] == (
            (batch, heads, rows),
            (heads * rows, rows, 1),
            0,
            torch.float32,
        )


def test_a_large_dlse_in_float16_stays_finite_and_exact() -> None:
    """A loss scaler's 65536 times an lse term of order 1 overflows float16 (65504) if ``dlse``
    enters the second backward call as it is; scaled by a power of two on the device, the
    gradient (about 1e4 here, which float16 holds) is the float64 oracle's."""
    g = torch.Generator().manual_seed(4)
    q64, k64, v64 = (
        torch.randn(1, 2, 8, 16, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    dlse = torch.full((1, 2, 8), 65536.0)
    options = BlockOptions(0.25, KeyWindow(None, 0))
    q, k, v = (x.detach().half() for x in (q64, k64, v64))
    kernel = ReferenceKernel()
    out, lse = kernel.forward(q, k, v, options)
    dout = torch.zeros_like(out)
    dq, dk, dv = backward_with_lse(kernel, dout, dlse, q, k, v, out, lse, options)
    assert (dq.dtype, dk.dtype, dv.dtype) == (torch.float16,) * 3
    _, want_lse = dense(q64, k64, v64, 0.25, 0)
    wanted = torch.autograd.grad((want_lse * dlse.double()).sum(), (q64, k64))
    for name, got, want in zip("qk", (dq, dk), wanted, strict=True):
        assert bool(torch.isfinite(got).all()), f"d{name} overflowed"
        error = float((got.double() - want).abs().max() / want.abs().max())
        assert error < 4e-3, f"d{name}: relative error {error:.3g}"


def test_wrappers_return_the_inputs_dtypes_on_both_paths() -> None:
    """``backward_with_lse`` of a wrapped kernel without the method (two backward calls) gives
    ``dq``, ``dk`` in the inputs' dtype, like the method itself, so wrappers nest: a checked
    kernel over a batch-limited one over a checked one, split or not."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 2, 8, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    options = BlockOptions(0.25, KeyWindow(None, 0))
    out, lse = ReferenceKernel().forward(q, k, v, options)
    dlse = torch.randn(lse.shape, generator=g)
    for limit in (BatchLimit(), BatchLimit(problems=1), BatchLimit(query_elements=64)):
        inner = CheckedKernel(ReferenceKernel(), "reference")
        kernel = CheckedKernel(BatchLimitedKernel(inner, limit), "limited")
        grads = kernel.backward_with_lse(out, dlse, q, k, v, out, lse, options)
        assert [x.dtype for x in grads] == [torch.bfloat16] * 3, limit
