"""A planned layer call issues kernels and the data exchange only (issue 20, docs/distributed.md).

Counted by :class:`ringdilated.testing.hot_path.HotPathCounter` (a ``TorchDispatchMode`` for
device reads and tensors made from Python data, wrappers for ``tolist``/``cpu``/``numpy`` and
every ``torch.distributed`` collective): with a ``SequenceLayout``, and in every one-process call
without documents or padding, a layer call in steady state makes no host read, no copy from
Python data and no collective but the data exchange, forward and backward. The results of the
counted calls are checked against the float64 oracle.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ringdilated
from ringdilated.testing import oracle
from ringdilated.testing.hot_path import HotPathCounter
from tests.distributed_harness import Workers

TASKS = "tests.hot_path_tasks"
SEGMENTS, RATES = [8, 16, 32], [1, 2, 4]


def _zero(counts: HotPathCounter) -> None:
    assert counts.host_traffic == 0, counts


def _grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], seed: int) -> tuple[Any, ...]:
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, dout)


def _inputs(batch: int = 2, length: int = 32, dtype: torch.dtype = torch.float64) -> list[Any]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(batch, length, h, 8, generator=g, dtype=dtype).requires_grad_()
        for h in (4, 2, 2)
    ]


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_every_module_in_steady_state_makes_no_host_traffic(mode: str) -> None:
    torch.manual_seed(0)
    from ringdilated.rotary import rotary_embedding

    kw = {"segment_lengths": SEGMENTS, "dilation_rates": RATES, "mode": mode, "causal": True}
    modules = [
        (ringdilated.DilatedAttention(SEGMENTS, RATES, mode=mode, causal=True), "qkv"),
        (ringdilated.MultiheadDilatedAttention(32, 4, num_kv_heads=2, dtype=torch.float64, **kw),
         "mha"),
        (ringdilated.MultiheadDilatedAttention(32, 4, dtype=torch.float64,
                                               rotary=rotary_embedding, **kw), "mha"),
        (ringdilated.DilatedTransformerBlock(32, 4, dtype=torch.float64, **kw), "block"),
        (ringdilated.MultiheadDilatedAttention(32, 4, dtype=torch.float64, sinks=True, **kw),
         "mha"),
        (ringdilated.DilatedAttention(SEGMENTS, RATES, mode=mode, causal=True), "qkv+sinks"),
    ]  # fmt: skip
    for module, kind in modules:
        if kind.startswith("qkv"):
            args = _inputs()
            if kind == "qkv+sinks":
                args.append(torch.randn(4, dtype=torch.float64).requires_grad_())
        else:
            x = torch.randn(2, 32, 32, dtype=torch.float64, requires_grad=True)
            args = [x, x, x] if kind == "mha" else [x]

        def step(module: torch.nn.Module = module, args: list[Any] = args) -> None:
            sinks = {"sinks": args[3]} if len(args) == 4 else {}
            result = module(*args[:3], **sinks)
            out = result[0] if isinstance(result, tuple) else result
            out.sum().backward()

        step()  # the first call plans
        with HotPathCounter() as counts:
            step()
        _zero(counts)


def test_a_layout_with_documents_or_padding_makes_no_host_traffic() -> None:
    q, k, v = _inputs()
    documents = ringdilated.SequenceLayout(
        cu_seqlens=torch.tensor([0, 5, 21, 32]), agree_every_call=False
    )
    padding = ringdilated.SequenceLayout(key_padding_mask=padding_mask(), agree_every_call=False)
    for layout, extra in (
        (documents, {"cu_seqlens": torch.tensor([0, 5, 21, 32])}),
        (padding, {"key_padding_mask": padding_mask()}),
    ):
        for mode in ("head_groups", "longnet"):
            kw = {"mode": mode, "causal": True}
            ringdilated.dilated_attention(q, k, v, SEGMENTS, RATES, layout=layout, **kw)
            with HotPathCounter() as counts:
                out = ringdilated.dilated_attention(q, k, v, SEGMENTS, RATES, layout=layout, **kw)
                grads = _grads(out, (q, k, v), 1)
            _zero(counts)
            expected = oracle(q, k, v, SEGMENTS, RATES, **kw, **extra)
            assert torch.allclose(out, expected, atol=1e-12, rtol=0)
            for a, e in zip(grads, _grads(expected, (q, k, v), 1), strict=True):
                assert torch.allclose(a, e, atol=1e-12, rtol=0)


def padding_mask() -> torch.Tensor:
    return torch.tensor([[False] * 27 + [True] * 5, [True] * 3 + [False] * 29])


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_a_sliding_window_in_steady_state_makes_no_host_traffic(mode: str) -> None:
    """One process, a window with both bounds (its blocks cut into bands of rows): no host
    read, no copy from Python data, forward and backward; the results are the oracle's."""
    q, k, v = _inputs(length=1200)
    kw: dict[str, Any] = {"mode": mode, "window": (20, 3)}
    segments, rates = [1200, 400], [1, 2]
    ringdilated.dilated_attention(q, k, v, segments, rates, **kw)  # plans
    with HotPathCounter() as counts:
        out = ringdilated.dilated_attention(q, k, v, segments, rates, **kw)
        grads = _grads(out, (q, k, v), 2)
    _zero(counts)
    expected = oracle(q, k, v, segments, rates, **kw)
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)
    for a, e in zip(grads, _grads(expected, (q, k, v), 2), strict=True):
        assert torch.allclose(a, e, atol=1e-12, rtol=0)


def test_without_a_layout_documents_are_read_every_call() -> None:
    """The per-call form keeps working as before: it reads its documents every call."""
    q, k, v = _inputs()
    with HotPathCounter() as counts:
        ringdilated.dilated_attention(q, k, v, SEGMENTS, RATES, cu_seqlens=torch.tensor([0, 32]))
    assert counts.host_reads >= 1, counts


def _case(world: int, layout: str, communicator: str, **overrides: Any) -> dict[str, Any]:
    lengths = {
        ("equal", 2): [16, 16], ("equal", 4): [8, 8, 8, 8],
        ("uneven", 2): [11, 21], ("uneven", 4): [5, 11, 9, 7],
    }[("equal" if layout != "uneven" else "uneven", world)]  # fmt: skip
    case = {
        "lengths": lengths,
        "layout": layout,
        "communicator": communicator,
        "process": "grid" if communicator == "hybrid" else "group",
        "mode": "head_groups",
        "causal": True,
        "return_lse": False,
        "segments": SEGMENTS,
        "rates": RATES,
        "cu_seqlens": [0, 3, 13, 32],
        "padding": [[False] * 29 + [True] * 3, [True] * 2 + [False] * 30, [False] * 32],
    }
    case.update(overrides)
    return case


def _check(case: dict[str, Any], results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["second"][:3] == (0, 0, 0), (rank, r["second"][:3], r["second"][3][:20])
        assert r["third"] == (0, 0, 0), (rank, r["third"], r["events"])
        assert r["exchanges"] > 0, "the calls moved data"
    full, dout, dlse = results[0]["full"], results[0]["dout"], results[0]["dlse"]
    q, k, v = (x.clone().requires_grad_() for x in full)
    extra: dict[str, Any] = {}
    if case["layout"] == "documents":
        extra["cu_seqlens"] = torch.tensor(case["cu_seqlens"])
    if case["layout"] == "padding":
        extra["key_padding_mask"] = torch.tensor(case["padding"])
    sinks = results[0]["sinks"]
    leaves: tuple[torch.Tensor, ...] = (q, k, v)
    if sinks is not None:
        sinks = sinks.clone().requires_grad_()
        leaves = (q, k, v, sinks)
    out, lse = oracle(
        q, k, v, SEGMENTS, RATES, mode=case["mode"], causal=case["causal"], return_lse=True,
        sinks=sinks, window=case.get("window"), **extra,
    )  # fmt: skip
    loss = (out * dout).sum()
    if case["return_lse"]:
        loss = loss + (lse.masked_fill(lse.isneginf(), 0) * dlse).sum()
    expected_grads = torch.autograd.grad(loss, leaves)
    # lse comes back in float32 (docs/spec.md, section 1), so its gradient arrives rounded to it.
    atol = 1e-6 if case["return_lse"] else 1e-10
    for r in results:
        shard = slice(*r["shard"])
        assert torch.allclose(r["out"], out[:, shard].detach(), atol=1e-10, rtol=0)
        for a, e in zip(r["grads"], expected_grads[:3], strict=True):
            assert torch.allclose(a, e[:, shard], atol=atol, rtol=0)
    if sinks is not None:  # each rank's share of the sinks' gradient, summed
        total = torch.stack([r["dsinks"] for r in results]).sum(0)
        assert torch.allclose(total, expected_grads[3], atol=atol, rtol=0)


@pytest.mark.parametrize("communicator", ["ringpass", "allgather", "ulysses"])
@pytest.mark.parametrize("layout", ["equal", "uneven", "documents", "padding"])
def test_two_ranks_make_no_host_traffic_in_steady_state(
    workers2: Workers, communicator: str, layout: str
) -> None:
    case = _case(2, layout, communicator, mode="longnet", return_lse=layout == "equal")
    _check(case, workers2.results(f"{TASKS}:counted_layer_calls", case))


@pytest.mark.parametrize("communicator", ["ringpass", "allgather", "ulysses", "hybrid"])
def test_sinks_add_no_host_traffic_on_two_or_four_ranks(
    workers2: Workers, workers4: Workers, communicator: str
) -> None:
    """Attention sinks, new values every call: merged on the device, no read, no collective."""
    if communicator != "hybrid":
        case = _case(2, "padding", communicator, mode="longnet", return_lse=True, sinks=True)
        _check(case, workers2.results(f"{TASKS}:counted_layer_calls", case))
    case = _case(4, "uneven", communicator, sinks=True)
    _check(case, workers4.results(f"{TASKS}:counted_layer_calls", case))


@pytest.mark.parametrize("communicator", ["ringpass", "allgather", "ulysses", "hybrid"])
@pytest.mark.parametrize("layout", ["equal", "uneven", "documents"])
def test_four_ranks_make_no_host_traffic_in_steady_state(
    workers4: Workers, communicator: str, layout: str
) -> None:
    case = _case(4, layout, communicator, return_lse=communicator == "ulysses")
    _check(case, workers4.results(f"{TASKS}:counted_layer_calls", case))


@pytest.mark.parametrize("communicator", ["ringpass", "allgather", "ulysses", "hybrid"])
@pytest.mark.parametrize("layout", ["uneven", "documents"])
def test_a_sliding_window_makes_no_host_traffic_in_steady_state(
    workers4: Workers, communicator: str, layout: str
) -> None:
    """A causal sliding window of 6 positions over shards of 5 to 11: pieces still cross
    (the window and the long segments reach past a shard), and the steady state reads nothing
    and makes no collective but the exchange, as without a window."""
    case = _case(4, layout, communicator, window=(6, 0), return_lse=communicator == "ringpass")
    _check(case, workers4.results(f"{TASKS}:counted_layer_calls", case))


COMPILE_TASKS = "tests.compile_tasks"


@pytest.mark.parametrize("communicator", ["ringpass", "allgather", "ulysses"])
def test_a_module_on_a_process_group_compiles_without_a_graph_break(
    workers2: Workers, communicator: str
) -> None:
    """fullgraph=True on 2 ranks: one call without a layout, three with a new layout each,
    every one equal to the oracle, and one graph for the layouts (the layout is an opaque
    graph input; the call without one is another signature)."""
    from ringdilated.compiled import OP_SUPPORTED

    if not OP_SUPPORTED:
        pytest.skip("this torch has no opaque types for custom ops")
    results = workers2.results(
        f"{COMPILE_TASKS}:compiled_module_on_a_group", {"communicator": communicator}
    )
    for rank, result in enumerate(results):
        assert not result["breaks"], result["breaks"]
        assert result["graphs"] <= 2, result["graphs"]
        for call in result["calls"]:
            q, k, v = (x.clone().requires_grad_() for x in call["full"])
            bounds = call["bounds"]
            extra = {} if bounds is None else {"cu_seqlens": torch.tensor(bounds)}
            expected = oracle(q, k, v, [8, 16], [1, 2], causal=True, **extra)
            grads = torch.autograd.grad(expected.sum(), (q, k, v))
            shard = slice(8 * rank, 8 * (rank + 1))
            assert torch.allclose(call["out"], expected[:, shard], atol=1e-10, rtol=0), bounds
            for a, e in zip(call["grads"], grads, strict=True):
                assert torch.allclose(a, e[:, shard], atol=1e-10, rtol=0), bounds


def test_a_selective_checkpointing_policy_saves_the_op_and_its_exchanges(
    workers2: Workers,
) -> None:
    """Checkpointed, the backward runs the forward's exchanges again; with a policy that saves
    ``ringdilated::attention`` by name, it makes only the backward's own, as without
    checkpointing. The gradients are the same all three ways."""
    from ringdilated.compiled import OP_SUPPORTED

    if not OP_SUPPORTED:
        pytest.skip("this torch has no opaque types for custom ops")
    for result in workers2.results(f"{COMPILE_TASKS}:selective_checkpointing", {}):
        plain, again, saved = (result[n] for n in ("plain", "checkpointed", "selective"))
        assert again["exchanges"] > plain["exchanges"] > 0, (again, plain)
        assert saved["exchanges"] == plain["exchanges"], (saved, plain)
        for way in (again, saved):
            for a, e in zip(way["grads"], plain["grads"], strict=True):
                assert torch.allclose(a, e, atol=1e-12, rtol=0)
