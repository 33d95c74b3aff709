"""Key windows and softcapping on FakeTensor ``cuda`` tensors: every window and softcap argument
each flash op receives, checked against the block's window by the op's own rules.

A block of the driver's strided views (rate 2, query heads 2-3 of 6, one key/value head, as a
sharded run or a row chunk hands a kernel) goes through ``flash`` (flash-attn 2.6.3 and 2.8.3),
``flash3`` (each interface), ``flash4`` (4.0.0b5 and b27) and ``torch_flash`` under windows far
from the diagonal. Each op call is recorded as the op received it (the stand-ins' records for the
flash-attn packages; a dispatch mode over the aten ops, whose meta kernels run, for torch's), and
its rows and keys are read back from its tensors' storage offsets in the block's own memory (no
copy). The mask each call's ``causal`` and window arguments make under that op's rewriting
(tests/standins/flash_windows.py), placed at its rows and keys, must tile the block's top-left
window exactly, with no overlap; every forward call's rows and keys have a backward call; and the
softcap each op receives is the block's (or the op's "none").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ringdilated.backends.flash import FlashKernel
from ringdilated.backends.flash3 import Flash3Kernel
from ringdilated.backends.flash4 import Flash4Kernel
from ringdilated.backends.torch_flash import TorchFlashKernel
from ringdilated.core import BlockOptions, KeyWindow
from tests.standins import flash_attn as fa2
from tests.standins import flash_attn3 as fa3
from tests.standins import flash_attn4 as fa4
from tests.standins.flash_windows import fa2_visible, fa3_visible, fa4_visible
from tests.test_fake_cuda_torch_ops import bound
from tests.window_checks import top_left_window

_aten = torch.ops.aten
ROWS, KEYS = 20, 45
#: Element strides of the block's views along their rows (q: rate 2 of 6 heads; k, v: 6 heads).
Q_ROW, K_ROW = 192, 96
#: A causal block, sliding windows on and off the diagonal (a key block 25 positions before the
#: query block: ``(3, 25)``), keys only ahead or only behind, a left bound alone, and a window
#: no row sees a key of.
WINDOWS = [
    KeyWindow(None, 0),
    KeyWindow(5, 0),
    KeyWindow(6, -4),
    KeyWindow(3, 25),
    KeyWindow(10, 30),
    KeyWindow(0, 0),
    KeyWindow(-2, 6),
    KeyWindow(-30, 40),
    KeyWindow(7, None),
    KeyWindow(1, -25),
]


@attrs.frozen
class Call:
    """One op call as its op received it: the offsets of its query and key tensors, their row
    counts, and its mask and cap arguments (the op's own convention)."""

    op: str
    family: str
    q_offset: int
    k_offset: int
    rows: int
    keys: int
    causal: bool
    left: Any
    right: Any
    softcap: Any


Visible = Callable[[Call], "torch.Tensor | None"]


def _flash_calls() -> list[Call]:
    """flash-attn 2's record (``q``, ``k``: ``(shape, stride, offset)`` of ``(B, L, H, D)``)."""
    return [
        Call(
            c["op"],
            "flash_attn",
            c["q"][2],
            c["k"][2],
            c["rows"],
            c["keys"],
            c["causal"],
            *c["window"],
            c["softcap"],
        )
        for c in fa2.CALLS
    ]


def _recorded(record: list[dict[str, Any]]) -> list[Call]:
    """FlashAttention 3's or 4's record (``tensors``: ``(shape, stride, offset, dtype)``)."""
    return [
        Call(
            c["op"],
            "flash",
            c["tensors"]["q"][2],
            c["tensors"]["k"][2],
            c["tensors"]["q"][0][1],
            c["tensors"]["k"][0][1],
            c["causal"],
            *c["window"],
            c["softcap"],
        )
        for c in record
    ]


class OpRecorder(TorchDispatchMode):
    """Records torch's flash ops as they receive them (after the ops' own defaults)."""

    OPS: ClassVar[dict[Any, tuple[str, str, int]]] = {
        _aten._scaled_dot_product_flash_attention.default: ("forward", "sdpa", 2),
        _aten._scaled_dot_product_flash_attention_backward.default: ("backward", "sdpa", 2),
        _aten._flash_attention_forward.default: ("forward", "bshd", 1),
        _aten._flash_attention_backward.default: ("backward", "bshd", 1),
    }

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in self.OPS:
            op, family, rows_dim = self.OPS[func]
            a = bound(func, args, kwargs or {})
            q, k = a["query"], a["key"]
            windows = (a.get("window_size_left"), a.get("window_size_right"))
            rows, keys = q.shape[rows_dim], k.shape[rows_dim]
            offsets = (q.storage_offset(), k.storage_offset())
            self.calls.append(
                Call(op, family, *offsets, rows, keys, a["is_causal"], *windows, None)
            )
        return func(*args, **(kwargs or {}))


def _fa2(c: Call) -> torch.Tensor | None:
    return fa2_visible(c.rows, c.keys, c.causal, c.left, c.right, forward=c.op == "forward")


def _torch(c: Call) -> torch.Tensor | None:
    """``window_size_left.value_or(-1)``, then flash-attn 2's rules (torch's vendored copy)."""
    left, right = (-1 if x is None else x for x in (c.left, c.right))
    return fa2_visible(c.rows, c.keys, c.causal, left, right, forward=c.op == "forward")


def _fa3(c: Call) -> torch.Tensor | None:
    return fa3_visible(c.rows, c.keys, c.causal, c.left, c.right)


def _fa4(c: Call) -> torch.Tensor | None:
    return fa4_visible(c.rows, c.keys, c.causal, c.left, c.right)


def _kernel_flash(monkeypatch: pytest.MonkeyPatch, version: str) -> Any:
    fa2.install_flash_attn(monkeypatch, version)
    return FlashKernel()


#: name: (make the kernel, read its calls, the op's mask rule, the softcap the op gets for none)
KERNELS: dict[str, tuple[Callable[..., Any], Callable[[], list[Call]], Visible, Any]] = {
    **{
        f"flash {v}": (lambda mp, v=v: _kernel_flash(mp, v), _flash_calls, _fa2, 0.0)
        for v in ("2.6.3", "2.8.3")
    },
    **{
        f"flash3 {i}": (
            lambda mp, i=i: (fa3.install_flash_attn3(mp, i), Flash3Kernel())[1],
            lambda: _recorded(fa3.CALLS),
            _fa3,
            0.0,
        )
        for i in fa3.INTERFACES
    },
    **{
        f"flash4 {v}": (
            lambda mp, v=v: (fa4.install_flash_attn4(mp, v), Flash4Kernel())[1],
            lambda: _recorded(fa4.CALLS),
            _fa4,
            None,
        )
        for v in fa4.VERSIONS
    },
}


def _block() -> tuple[torch.Tensor, ...]:
    """Fake ``cuda`` views of one ``(2, 45, 6, 16)`` buffer: q every second position of heads
    2-3, k and v one head each."""
    base = torch.empty(2, KEYS, 6, 16, dtype=torch.float16, device="cuda")
    q = base.as_strided((2, 2, ROWS, 16), (KEYS * 96, 16, Q_ROW, 1), 32)
    k = base.as_strided((2, 1, KEYS, 16), (KEYS * 96, 16, K_ROW, 1), 64)
    v = base.as_strided((2, 1, KEYS, 16), (KEYS * 96, 16, K_ROW, 1), 80)
    dout = torch.empty(2, 2, ROWS, 16, dtype=torch.float16, device="cuda")
    return q, k, v, dout


def _run(
    kernel: Any,
    options: BlockOptions,
    recorder: TorchDispatchMode | None = None,
    backward: bool = True,
) -> int:
    """Forward (and backward) of the block on fake ``cuda`` tensors; the query's storage offset."""
    with FakeTensorMode(), recorder or contextlib.nullcontext():
        q, k, v, dout = _block()
        out, lse = kernel.forward(q, k, v, options)
        assert out.shape == q.shape and lse.shape == q.shape[:-1] and out.device.type == "cuda"
        if backward:
            grads = kernel.backward(dout, q, k, v, out, lse, options)
            assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
        return q.storage_offset()


def _check_tiling(
    calls: list[Call],
    visible: Visible,
    window: KeyWindow,
    q_base: int,
    directions: tuple[str, ...] = ("forward", "backward"),
) -> None:
    """The calls of each direction tile the block's window exactly, with the same pieces."""
    expected = top_left_window(ROWS, KEYS, window)
    pieces = {}
    for op in directions:
        covered = torch.zeros(ROWS, KEYS, dtype=torch.int64)
        mine = []
        for c in (c for c in calls if c.op == op):
            row, rem_q = divmod(c.q_offset - q_base, Q_ROW)
            key, rem_k = divmod(c.k_offset - 64, K_ROW)
            assert rem_q == 0 and rem_k == 0, f"{c}: not a view of the block's own memory"
            mask = visible(c)
            mask = torch.ones(c.rows, c.keys, dtype=torch.bool) if mask is None else mask
            assert bool(mask.any(-1).all()), f"{c}: a row that sees no key reached the op"
            covered[row : row + c.rows, key : key + c.keys] += mask.long()
            mine.append((row, key, c.rows, c.keys, c.causal, c.left, c.right))
        assert torch.equal(covered, expected.long()), f"{op} calls {mine} for {window}"
        pieces[op] = mine
    assert all(mine == pieces[directions[0]] for mine in pieces.values())


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_each_op_gets_the_window_and_the_cap_its_rules_need(
    monkeypatch: pytest.MonkeyPatch, name: str, window: KeyWindow
) -> None:
    """With a softcap (4.0.0b5: forward only, its backward refuses one) and without: the calls
    tile the window, and each gets the block's cap, or the op's "none" (FlashAttention 4: ``None``
    forward, ``0.0`` backward, as its defaults)."""
    make, read, visible, no_cap = KERNELS[name]
    capped_backward = name != "flash4 4.0.0b5"
    directions = ("forward", "backward") if capped_backward else ("forward",)
    q_base = _run(make(monkeypatch), BlockOptions(0.25, window, softcap=2.5), None, capped_backward)
    _check_tiling(read(), visible, window, q_base, directions)
    assert {c.softcap for c in read()} <= {2.5}
    _run(make(monkeypatch), BlockOptions(0.25, window))  # installing clears the record
    _check_tiling(read(), visible, window, q_base)
    expected_none = {no_cap, 0.0} if name.startswith("flash4") else {no_cap}
    assert {c.softcap for c in read()} <= expected_none


@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_torch_flash_sends_left_bounds_to_the_ops_that_take_them(window: KeyWindow) -> None:
    """Calls without a left bound keep the SDPA-level op (no window arguments); calls with one
    go to ``_flash_attention_forward``/``_backward`` with ``window_size_left`` set and
    ``window_size_right`` left to the op's ``None`` (``-1``)."""
    kernel = TorchFlashKernel()  # outside fake mode: construction asks a meta kernel
    recorder = OpRecorder()
    q_base = _run(kernel, BlockOptions(0.25, window), recorder)
    _check_tiling(recorder.calls, _torch, window, q_base)
    for call in recorder.calls:
        assert call.right is None and (call.left is not None) == (call.family == "bshd"), call


def test_a_sliding_window_reaches_torchs_window_ops() -> None:
    """``(5, 0)``: the rows see keys ``[i - 5, i]``, so keys ``[0, 20)`` suffice: one causal
    call on that square, ``_flash_attention_forward`` and its backward, ``window_size_left = 5``
    (on a square the bottom-right corner is the diagonal)."""
    recorder = OpRecorder()
    _run(TorchFlashKernel(), BlockOptions(0.25, KeyWindow(5, 0)), recorder)
    assert [(c.op, c.family, c.causal, c.left) for c in recorder.calls] == [
        ("forward", "bshd", True, 5),
        ("backward", "bshd", True, 5),
    ]


def test_the_tiling_check_catches_the_window_passed_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check is not vacuous: the block's top-left window handed to the op in one call
    (``causal`` for ``right = 0``, its left bound as is) does not tile it."""

    class Straight(FlashKernel):
        def unguarded_forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
            w = options.window
            return self.native_forward(q, k, v, w.right == 0, 0.25, window_left=w.left)

        def unguarded_backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
            w = options.window
            return self.native_backward(
                dout, q, k, v, out, lse, w.right == 0, 0.25, window_left=w.left
            )

    fa2.install_flash_attn(monkeypatch, "2.8.3")
    q_base = _run(Straight(), BlockOptions(0.25, KeyWindow(5, 0)))
    with pytest.raises(AssertionError, match="forward calls"):
        _check_tiling(_flash_calls(), _fa2, KeyWindow(5, 0), q_base)
