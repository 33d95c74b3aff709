"""``attn_implementation="ringdilated"`` sequence-parallel (``ringdilated.hf.sequence_parallel``)
on 2 and 4 gloo ranks: a tiny grouped-query Llama, sharded with ``shard_batch``, gives each rank
its slice of the one-process logits and, after backward of ``sharded_cross_entropy``, shares of
the parameter gradients that sum to the one-process gradients. The one-process reference is
transformers' own eager attention for a dense pattern (one segment covering the sequence, rate
1), and the one-process adapter for a dilated one; padding (left, right), packed documents,
ignored labels, uneven shards, every communicator, checkpointed layers, FSDP2 on a dp x cp mesh
(torch's and accelerate's), a hypothesis property; and what is refused, on every rank."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from tests.distributed_harness import Workers
from tests.hf_tasks import VOCAB, batch_tensors, tiny_llama

transformers = pytest.importorskip("transformers")
import ringdilated  # noqa: E402
import ringdilated.hf  # noqa: E402

TASKS = "tests.hf_tasks"
IGNORE = -100
DENSE, DILATED = ([64], [1]), ([4, 8], [1, 2])


def _walk(a: int, b: int, width: int) -> list[int]:
    return [(a * t + b) % VOCAB for t in range(width)]


def reference(case: dict[str, Any], implementation: str) -> dict[str, Any]:
    """One process, the whole batch: logits ``(B, L, V)`` (NaN where not compared), the mean
    cross-entropy over the shifted labels that are not ignored, and its parameter gradients.
    Positions and shifted labels are those ``shard_batch`` gives one process (its own tests
    check them). Eager attention on a padded batch makes NaN at the queries that see only
    padding (its float32 softmax of float64 minima), which reaches every position of later
    layers; so under ``"eager"`` each padded row runs alone, on its tokens only."""
    model = tiny_llama(case, implementation)
    tensors = batch_tensors(case)
    whole = ringdilated.shard_batch(**tensors)
    ids, labels, positions = tensors["input_ids"], whole.labels, whole.position_ids
    mask = tensors.get("attention_mask")
    logits = torch.full((*ids.shape, VOCAB), float("nan"), dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    if mask is not None and implementation == "eager":
        for row in range(ids.shape[0]):
            run = mask[row].nonzero().flatten()
            span = slice(int(run[0]), int(run[-1]) + 1)
            out = model(input_ids=ids[row : row + 1, span], use_cache=False).logits[0]
            logits[row, span] = out.detach()
            total = total + F.cross_entropy(out, labels[row, span], reduction="sum")
    else:
        extra = {} if mask is None else {"attention_mask": mask}
        # No cache: transformers finds packed documents in position_ids only without one.
        out = model(input_ids=ids, position_ids=positions, use_cache=False, **extra).logits
        logits = out.detach()
        total = F.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="sum")
    loss = total / labels.ne(IGNORE).sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits, "loss": loss.detach(), "grads": grads}


def tolerance(implementation: str) -> dict[str, float]:
    """``allclose`` tolerances against ``implementation``'s float64 model: transformers' eager
    attention takes its softmax in float32 (v5.23.0 models/llama/modeling_llama.py,
    ``softmax(..., dtype=torch.float32).to(query.dtype)``), so it agrees to float32 rounding of
    the probabilities (about 1e-8 on these logits); the adapter computes in float64."""
    if implementation == "eager":
        return {"rtol": 1e-5, "atol": 1e-7}
    return {"rtol": 1e-9, "atol": 1e-11}


def check(case: dict[str, Any], results: list[dict[str, Any]], implementation: str) -> None:
    """Each rank's logits are its slice of the reference's (at tokens), its loss the
    reference's, and the ranks' gradient shares sum to the reference's gradients."""
    expected = reference(case, implementation)
    close = tolerance(implementation)
    mask = batch_tensors(case).get("attention_mask")
    tokens = torch.ones(expected["logits"].shape[:2], dtype=torch.bool)
    if mask is not None:
        tokens = mask.bool()
    start = 0
    for rank, result in enumerate(results):
        n = result["logits"].shape[1]
        assert result["start"] == start, rank
        window = slice(start, start + n)
        ours, theirs = result["logits"][tokens[:, window]], expected["logits"][:, window]
        assert torch.allclose(ours, theirs[tokens[:, window]], **close), rank
        # (nan on both when no label is counted: the mean of nothing, as F.cross_entropy's)
        assert torch.allclose(result["loss"], expected["loss"], equal_nan=True, **close), rank
        start += n
    assert start == expected["logits"].shape[1]
    assert results[0]["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        summed = sum(result["grads"][name] for result in results)
        assert torch.allclose(summed, grad, **close), name


_UNEVEN = {
    "input_ids": [_walk(7, 3, 13), _walk(5, 0, 13)],
    "labels": [
        [IGNORE if t in (2, 3, 9) else x for t, x in enumerate(_walk(7, 3, 13))],
        _walk(5, 0, 13),
    ],
}
_LEFT = {
    "input_ids": [_walk(3, 2, 14), [0] * 5 + _walk(2, 7, 9)],
    "attention_mask": [[1] * 14, [0] * 5 + [1] * 9],
}
_RIGHT = {
    "input_ids": [[(t * t) % VOCAB for t in range(10)] + [0] * 4, _walk(5, 1, 14)],
    "attention_mask": [[1] * 10 + [0] * 4, [1] * 14],
}
_BOTH = {
    "input_ids": [[0] * 3 + _walk(4, 4, 8) + [0] * 2, _walk(6, 1, 13)],
    "attention_mask": [[0] * 3 + [1] * 8 + [0] * 2, [1] * 13],
}
_PACKED = {"input_ids": [_walk(3, 1, 14)], "cu_seqlens": [0, 5, 6, 11, 14]}

_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "dense, uneven, ignored labels": ({**_UNEVEN, "pattern": DENSE}, "eager"),
    "dense, left padding": ({**_LEFT, "pattern": DENSE}, "eager"),
    "dense, right padding": ({**_RIGHT, "pattern": DENSE}, "eager"),
    "dense, packed documents": ({**_PACKED, "pattern": DENSE}, "eager"),
    "dilated, uneven, ignored labels": ({**_UNEVEN, "pattern": DILATED}, "ringdilated"),
    "dilated, left padding": ({**_LEFT, "pattern": DILATED}, "ringdilated"),
    "dilated, right padding": ({**_RIGHT, "pattern": DILATED}, "ringdilated"),
    "dilated, both paddings, the shard's mask passed": (
        {**_BOTH, "pattern": DILATED, "pass_attention_mask": True},
        "ringdilated",
    ),
    "dilated longnet, packed documents": (
        {**_PACKED, "pattern": DILATED, "mode": "longnet"},
        "ringdilated",
    ),
    "dilated, checkpointed layers": (
        {**_LEFT, "pattern": DILATED, "checkpointing": True},
        "ringdilated",
    ),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_two_ranks_equal_one_process(workers2: Workers, name: str) -> None:
    case, implementation = _CASES[name]
    check(case, workers2.results(f"{TASKS}:sharded_step", case), implementation)


@pytest.mark.parametrize("name", list(_CASES))
def test_four_ranks_equal_one_process(workers4: Workers, name: str) -> None:
    case, implementation = _CASES[name]
    check(case, workers4.results(f"{TASKS}:sharded_step", case), implementation)


@pytest.mark.parametrize("communicator", ["ringpass", "allgather", "ulysses"])
@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_every_communicator_on_two_and_four_ranks(
    workers2: Workers, workers4: Workers, communicator: str, mode: str
) -> None:
    case = {**_BOTH, "pattern": DILATED, "mode": mode, "communicator": communicator}
    for workers in (workers2, workers4):
        check(case, workers.results(f"{TASKS}:sharded_step", case), "ringdilated")


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_hybrid_on_a_two_by_two_mesh(workers4: Workers, mode: str) -> None:
    case = {
        **_LEFT, "pattern": DILATED, "mode": mode, "communicator": "hybrid", "grid": True,
    }  # fmt: skip
    check(case, workers4.results(f"{TASKS}:sharded_step", case), "ringdilated")


def _fsdp_reference(case: dict[str, Any]) -> dict[str, Any]:
    return reference({k: v for k, v in case.items() if k != "cu_seqlens"}, "eager")


@pytest.mark.parametrize("mesh", ["torch", "accelerate"])
def test_fsdp2_on_a_dp_x_cp_mesh_equals_one_process(workers4: Workers, mesh: str) -> None:
    """FSDP2 over 4 ranks, a 2 x 2 dp x cp mesh, the cp dimension the process layout: every
    rank's loss is the one-process loss over both rows and FSDP2's averaged gradients are the
    one-process gradients. The mesh from accelerate's ParallelismConfig(dp_shard_size=2,
    cp_size=2) maps "cp" to the layout, "dp_shard_cp" to FSDP2 and "dp_cp" to the loss."""
    if mesh == "accelerate":
        pytest.importorskip("accelerate")
    case = {**_UNEVEN, "pattern": DENSE, "mesh": mesh, "communicator": "ringpass"}
    expected, close = _fsdp_reference(case), tolerance("eager")
    for rank, result in enumerate(workers4.results(f"{TASKS}:fsdp_step", case)):
        assert torch.allclose(result["loss"], expected["loss"], **close), rank
        assert result["grads"].keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            assert torch.allclose(result["grads"][name], grad, **close), name


@st.composite
def batches(draw: st.DrawFn, world: int) -> dict[str, Any]:
    """A small batch of random length (uneven shards or not) with ignored labels, and no
    padding, packed documents or per-row padding (left, right or both); a pattern, a mode and a
    communicator."""
    rows, width = draw(st.integers(1, 2)), draw(st.integers(world, 17))
    token = st.integers(0, VOCAB - 1)
    ids = [draw(st.lists(token, min_size=width, max_size=width)) for _ in range(rows)]
    ignored = st.lists(st.booleans(), min_size=width, max_size=width)
    labels = [[IGNORE if i else x for x, i in zip(r, draw(ignored), strict=True)] for r in ids]
    case: dict[str, Any] = {
        "input_ids": ids,
        "labels": labels,
        "pattern": draw(st.sampled_from([DENSE, DILATED, ([2, 4, 8], [1, 2, 4])])),
        "mode": draw(st.sampled_from(["head_groups", "longnet"])),
        "communicator": draw(st.sampled_from(["auto", "ringpass", "allgather", "ulysses"])),
    }
    kind = draw(st.sampled_from(["whole", "documents", "padding"]))
    if kind == "documents":
        cuts = draw(st.sets(st.integers(1, width - 1), max_size=3))
        case["cu_seqlens"] = [0, *sorted(cuts), width]
    elif kind == "padding":
        mask = []
        for _ in range(rows):
            tokens = draw(st.integers(1, width))
            left = draw(st.integers(0, width - tokens))
            mask.append([0] * left + [1] * tokens + [0] * (width - left - tokens))
        case["attention_mask"] = mask
    return case


_FEW = max(3, settings.default.max_examples // 20)  # ci: 5; thorough: 25


@settings(max_examples=_FEW)
@given(case=batches(2))
def test_property_two_ranks_equal_one_process(workers2: Workers, case: dict[str, Any]) -> None:
    check(case, workers2.results(f"{TASKS}:sharded_step", case), "ringdilated")


@settings(max_examples=_FEW)
@given(case=batches(4))
def test_property_four_ranks_equal_one_process(workers4: Workers, case: dict[str, Any]) -> None:
    check(case, workers4.results(f"{TASKS}:sharded_step", case), "ringdilated")


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        (
            "no position_ids",
            r"position_ids of row 0 on rank 1 count this shard from 0 \(0, 1, \.\.\., 6\), but "
            r"the shard begins at global position 7, 7 positions into a document that starts "
            r"at 0: pass the batch's global position_ids",
        ),
        (
            "a mask with a hole",
            r"this rank's attention_mask \(1 = token, 0 = padding\) has padding \(0\) at row 0, "
            r"column 1 \(global position 8\), where the layout has a token",
        ),
    ],
)
def test_a_mistake_on_one_rank_raises_on_every_rank(
    workers2: Workers, mistake: str, message: str
) -> None:
    """Rank 1 alone passes something that contradicts the layout: it raises a ValueError naming
    the values, rank 0 a PeerRejectedError naming rank 1's error; neither hangs."""
    case = {"input_ids": [_walk(3, 2, 14)], "pattern": DILATED, "bad_rank": 1, "mistake": mistake}
    first, second = workers2.results(f"{TASKS}:bad_shard", case)
    assert second.startswith("ValueError: attn_implementation='ringdilated' under sequence_")
    assert re.search(message, second), second
    assert first.startswith("PeerRejectedError: "), first
    assert "rank 1" in first, first


# One process: the layout of a batch of one process (shard_batch without a group).


def _one_process(case: dict[str, Any]) -> tuple[Any, Any]:
    return tiny_llama(case, "ringdilated").eval(), ringdilated.shard_batch(**batch_tensors(case))


def test_a_one_process_layout_gives_the_adapter_s_own_result() -> None:
    """On one process the layout's padding and documents give what transformers' own mask and
    packed positions give the adapter."""
    for case in ({**_BOTH, "pattern": DILATED}, {**_PACKED, "pattern": DILATED}):
        model, shard = _one_process(case)
        expected = reference(case, "ringdilated")["logits"]
        with torch.no_grad(), ringdilated.hf.sequence_parallel(shard.layout):
            logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
        tokens = batch_tensors(case).get("attention_mask", torch.ones(logits.shape[:2])).bool()
        assert torch.allclose(logits[tokens], expected[tokens], rtol=0, atol=1e-10)


def test_registration_and_the_one_process_path_are_unchanged() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    assert AttentionInterface._global_mapping["ringdilated"] is ringdilated.hf.attention_forward
    assert AttentionMaskInterface._global_mapping["ringdilated"] is ringdilated.hf.padding_mask
    mask = ringdilated.hf.padding_mask(batch_size=1, q_length=4, kv_length=4)
    assert mask.sharded is None and mask.layout is None
    layout = ringdilated.SequenceLayout()
    with ringdilated.hf.sequence_parallel(layout) as setting:
        inside = ringdilated.hf.padding_mask(batch_size=1, q_length=4, kv_length=4)
        assert setting.layout is layout and setting.communicator == "auto"
    assert inside.sharded is not None and inside.layout is layout
    after = ringdilated.hf.padding_mask(batch_size=1, q_length=4, kv_length=4)
    assert after.sharded is None


def test_bad_arguments_to_sequence_parallel_raise_naming_them() -> None:
    shard = ringdilated.shard_batch(torch.tensor([_walk(1, 1, 6)]))
    with (
        pytest.raises(TypeError, match=r"got BatchShard: pass its \.layout"),
        ringdilated.hf.sequence_parallel(shard),  # type: ignore[arg-type]
    ):
        pass
    with (
        pytest.raises(TypeError, match=r"communicator must be a name .* got 3"),
        ringdilated.hf.sequence_parallel(shard.layout, communicator=3),  # type: ignore[arg-type]
    ):
        pass


def test_a_decode_step_is_refused() -> None:
    """A decode step's queries are not the whole shard: refused, naming the lengths."""
    case = {"input_ids": [_walk(2, 3, 8)], "pattern": DILATED}
    model, shard = _one_process(case)
    with (
        torch.no_grad(),
        ringdilated.hf.sequence_parallel(shard.layout),
        pytest.raises(
            ValueError, match=r"got 1 queries from position 8 of 9 keys \(a decode step over"
        ),
    ):
        model.generate(shard.input_ids, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_contradictions_with_the_layout_are_refused_naming_both() -> None:
    case = {**_PACKED, "pattern": DILATED}
    model, shard = _one_process(case)
    common = {"input_ids": shard.input_ids, "position_ids": shard.position_ids}
    cases = [
        (
            {"cu_seq_lens_q": torch.tensor([0, 14]), "cu_seq_lens_k": torch.tensor([0, 14])},
            r"reads the documents from the layout, which has documents \[0, 5, 6, 11, 14\]; got "
            r"cu_seq_lens_k \[0, 14\]",
        ),
        (
            {"attention_mask": torch.ones(1, 20, dtype=torch.long)},
            r"takes this shard's columns of the batch's attention_mask \(1 = token, 0 = "
            r"padding\), \(1, 14\), or none \(the layout holds the padding\); got shape \(1, 20\)",
        ),
        (
            {"input_ids": shard.input_ids[:, :10], "position_ids": shard.position_ids[:, :10]},
            r"this rank's input holds 10 positions but its SequenceLayout's shard on rank 0 "
            r"holds 14",
        ),
    ]
    for kwargs, message in cases:
        with (
            torch.no_grad(),
            ringdilated.hf.sequence_parallel(shard.layout),
            pytest.raises(ValueError, match=message),
        ):
            model(**{**common, **kwargs})
    # the layout's own documents as flash-attention kwargs are fine
    bounds = torch.tensor([0, 5, 6, 11, 14])
    with torch.no_grad(), ringdilated.hf.sequence_parallel(shard.layout):
        model(**common, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=5, max_length_k=5)


def test_an_attention_call_without_the_adapter_s_mask_is_refused_inside_the_block() -> None:
    model = tiny_llama({"pattern": DILATED}, "ringdilated")
    attention = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    kv = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    with (
        ringdilated.hf.sequence_parallel(ringdilated.SequenceLayout()),
        pytest.raises(ValueError, match=r"needs the mask its own mask function makes .* got None"),
    ):
        ringdilated.hf.attention_forward(attention, q, kv, kv, None)


def test_a_compiled_model_runs_sequence_parallel_eagerly_behind_graph_breaks() -> None:
    """torch.compile of the whole model: inside the block the layout's padding is read (the
    sharded path runs behind graph breaks), outside it the compiled one-process path runs (no
    padding given: other logits at the padded row's tokens)."""
    case = {**_BOTH, "pattern": DILATED}
    model, shard = _one_process(case)
    expected = reference(case, "ringdilated")["logits"]
    tokens = batch_tensors(case)["attention_mask"].bool()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    inputs = {"input_ids": shard.input_ids, "position_ids": shard.position_ids}
    with torch.no_grad():
        with ringdilated.hf.sequence_parallel(shard.layout):
            inside = compiled(**inputs).logits
        outside = compiled(**inputs).logits
    assert torch.allclose(inside[tokens], expected[tokens], rtol=0, atol=1e-10)
    assert float((outside[tokens] - expected[tokens]).abs().max()) > 1e-3
