"""``attn_implementation="ringdilated"`` sequence-parallel (``ringdilated.hf.sequence_parallel``)
on 2 and 4 gloo ranks: a tiny grouped-query Llama, sharded with ``shard_batch``, gives each rank
its slice of the one-process logits and, after backward of ``sharded_cross_entropy``, shares of
the parameter gradients that sum to the one-process gradients. The one-process reference is
transformers' own eager attention for a dense pattern (one segment covering the sequence, rate
1), and the one-process adapter for a dilated one, and the float64 oracle for one layer's call;
padding (left, right), packed documents, ignored labels, uneven shards, every communicator
(checked to be the one that ran), checkpointed layers, FSDP2 on a dp x cp mesh (torch's and
accelerate's), a hypothesis property; what a forward costs the host; and what is refused, on
every rank."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from tests.distributed_harness import Workers
from tests.hf_tasks import VOCAB, batch_tensors, first_layer_dout, sharded_step, tiny_llama

transformers = pytest.importorskip("transformers")
import ringdilated  # noqa: E402
import ringdilated.hf  # noqa: E402
import ringdilated.testing  # noqa: E402

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
    ran = {name for result in results for name in result["communicators"]}
    forced = case.get("communicator", "auto")
    if len(results) == 1:
        assert not ran, ran  # one process: nothing moves
    elif forced == "auto":
        assert ran and ran <= {"ringpass", "allgather", "ulysses"}, ran
    else:
        assert ran == {forced}, (forced, ran)
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
        assert result["communicators"] == ["ringpass"], result["communicators"]
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
        (  # two rows without padding: every row of position_ids is read, not only the first
            "row 1 counts from 0",
            r"position_ids of row 1 on rank 1 count this shard from 0 \(0, 1, \.\.\., 6\), but "
            r"the shard begins at global position 7",
        ),
    ],
)
def test_a_mistake_on_one_rank_raises_on_every_rank(
    workers2: Workers, mistake: str, message: str
) -> None:
    """Rank 1 alone passes something that contradicts the layout: it raises a ValueError naming
    the values, rank 0 a PeerRejectedError naming rank 1's error; neither hangs."""
    rows = [_walk(3, 2, 14), _walk(5, 1, 14)] if mistake == "row 1 counts from 0" else None
    ids = rows or [_walk(3, 2, 14)]
    case = {"input_ids": ids, "pattern": DILATED, "bad_rank": 1, "mistake": mistake}
    first, second = workers2.results(f"{TASKS}:bad_shard", case)
    assert second.startswith("ValueError: attn_implementation='ringdilated' under sequence_")
    assert re.search(message, second), second
    assert first.startswith("PeerRejectedError: "), first
    assert "rank 1" in first, first


def test_a_reused_layout_agrees_on_a_call_it_has_not_planned(workers2: Workers) -> None:
    """After a training step on the layout, a no_grad forward is a call it has not planned (no
    backward): rank 1's mistake there raises on both ranks, through that call's agreement.
    Once that call is planned, rank 1's mistake raises on rank 1 alone, with no collective
    (its peers would be in the planned call's data exchange)."""
    case = {
        "input_ids": [_walk(3, 2, 14)], "pattern": DILATED, "bad_rank": 1,
        "mistake": "no position_ids",
    }  # fmt: skip
    first, second = workers2.results(f"{TASKS}:reused_layout_mistake", case)
    own = r"^ValueError: .* position_ids of row 0 on rank 1 count this shard from 0"
    assert re.search(own, second["new call"]), second
    assert first["new call"].startswith("PeerRejectedError: "), first
    assert "rank 1" in first["new call"], first
    assert re.search(own, second["planned call"]), second
    assert second["control"] == "0", second


def test_labels_on_a_process_group_are_refused(workers2: Workers) -> None:
    """labels= to the model under the block on 2 ranks: transformers' loss would shift each
    shard on its own; every rank raises, naming the loss and what to use instead."""
    case = {"input_ids": [_walk(3, 2, 14)], "pattern": DILATED}
    for outcome in workers2.results(f"{TASKS}:labels_passed", case):
        assert re.search(
            r"^ValueError: .* on 2 ranks: the model was given labels= and computes its loss "
            r"\(ForCausalLM\) over this rank's shard alone .* ringdilated\.sharded_cross_entropy",
            outcome,
        ), outcome


_SUPPORTED_CHECKPOINTING = {**_PACKED, "pattern": DILATED, "checkpointing": True}
_REGION_WITH_MASK_CREATION = {**_PACKED, "pattern": DILATED, "checkpointing": "model"}
_RECOMPUTE_REFUSED = (
    r"^RuntimeError: attn_implementation='ringdilated': transformers' mask function ran during "
    r"a backward with no sequence_parallel block open, .* Checkpoint the decoder layers instead"
)


def test_checkpointing_a_region_that_makes_the_mask_is_refused_in_backward(
    workers2: Workers,
) -> None:
    """torch.utils.checkpoint around the whole model (mask creation included): its recompute
    in the backward runs outside the block; it raises there, on one process (which would
    otherwise give gradients of the unsharded, documentless model) and on 2 ranks."""
    assert re.search(_RECOMPUTE_REFUSED, sharded_step(_REGION_WITH_MASK_CREATION)["error"])
    for result in workers2.results(f"{TASKS}:sharded_step", _REGION_WITH_MASK_CREATION):
        assert re.search(_RECOMPUTE_REFUSED, result["error"]), result["error"]


def test_checkpointed_layers_with_documents_on_one_process_equal_the_reference() -> None:
    """The supported form, the layers checkpointed, on one process with packed documents: the
    recompute runs on the layout the mask carries (the 2- and 4-rank cases are above)."""
    check(_SUPPORTED_CHECKPOINTING, [sharded_step(_SUPPORTED_CHECKPOINTING)], "ringdilated")


_COUNTED = {
    "padding, the shard's mask passed": {**_BOTH, "pattern": DILATED, "pass_attention_mask": True},
    "packed documents, cu_seq_lens_k passed": {
        **_PACKED, "pattern": DILATED, "pass_cu_seq_lens": True,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(_COUNTED))
def test_a_forward_s_host_cost_does_not_grow_with_layers(workers2: Workers, name: str) -> None:
    """Host reads, copies and control collectives of a step (forward under the block, backward)
    are the same for 2 and 4 layers, on a new layout and on it again. On a new layout the
    only control collective is one agreement (every layer's calls share a plan); on it again
    there is none, and no copy; the reads are the adapter's checks, one bool each (the mask or
    cu_seq_lens_k on every rank, and the positions on rank 1, whose shard begins inside a
    document), and transformers' own packed-sequence test without an attention_mask."""
    for rank, result in enumerate(workers2.results(f"{TASKS}:counted_steps", _COUNTED[name])):
        for two, four in zip(result[2], result[4], strict=True):
            for count in ("reads", "copies", "control"):
                assert two[count] == four[count], (rank, count, two["events"], four["events"])
            assert two["exchanges"] > 0 and four["exchanges"] == 2 * two["exchanges"]
        first, again = result[2]
        assert first["control"] == 1, (rank, first["events"])
        assert again["control"] == again["copies"] == 0, (rank, again["events"])
        ours = [what for _, what in again["events"] if "_hf_shard_checks.py" in what]
        assert len(ours) == 1 + rank, (rank, again["events"])
        others = [what for _, what in again["events"] if "_hf_shard_checks.py" not in what]
        assert all("transformers/masking_utils.py" in what for what in others), others


def test_one_layer_s_call_equals_the_float64_oracle(workers2: Workers) -> None:
    """The first layer's call on 2 ranks, grouped-query heads (4 query, 2 key/value), a
    dilated pattern, left and right padding: each rank's output, and the gradients of its
    shard's query, key and value, are those of the oracle over the whole batch's query, key
    and value (as transformers passed them to the adapter, the ranks' shards joined)."""
    case = {**_BOTH, "pattern": DILATED}
    results = workers2.results(f"{TASKS}:first_layer_call", case)
    q, k, v = (
        torch.cat([r["inputs"][i] for r in results], dim=2).transpose(1, 2).requires_grad_()
        for i in range(3)
    )
    assert (q.shape[2], k.shape[2], v.shape[2]) == (4, 2, 2)
    padding = batch_tensors(case)["attention_mask"] == 0
    segments, rates = DILATED
    expected = ringdilated.testing.oracle(
        q, k, v, segments, rates, causal=True, scale=results[0]["scaling"],
        key_padding_mask=padding,
    )  # fmt: skip
    grads = torch.autograd.grad(expected, (q, k, v), first_layer_dout(case))
    for result in results:
        shard = slice(result["start"], result["start"] + result["out"].shape[1])
        assert torch.allclose(result["out"], expected[:, shard], rtol=0, atol=1e-10)
        for mine, theirs in zip(result["grads"], grads, strict=True):
            assert torch.allclose(mine.transpose(1, 2), theirs[:, shard], rtol=0, atol=1e-10)


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
    with (
        pytest.raises(
            ValueError,
            match=r"unknown communicator 'ringpas'; known communicators: .*\bringpass\b",
        ),
        ringdilated.hf.sequence_parallel(shard.layout, communicator="ringpas"),
    ):
        pass
    assert ringdilated.hf.active() is None  # nothing was left open


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


def test_contradictions_name_what_the_layout_holds() -> None:
    """A layout without documents whose length no call has said yet has one document of the
    shard's length; a padded layout has no shared documents; its padding mask's rows."""
    model = tiny_llama({"pattern": DILATED}, "ringdilated").eval()
    ids = torch.tensor([_walk(2, 3, 8)])
    cases = [
        (
            ringdilated.SequenceLayout(),
            {"input_ids": ids, "cu_seq_lens_k": torch.tensor([0, 4, 8])},
            r"which has documents \[0, 8\]; got cu_seq_lens_k \[0, 4, 8\]",
        ),
        (
            ringdilated.shard_batch(**batch_tensors(_BOTH)).layout,
            {"input_ids": torch.tensor(_BOTH["input_ids"]), "cu_seq_lens_k": [0, 13]},
            r"which has padding \(each row's tokens its one document: no cu_seqlens\); got "
            r"cu_seq_lens_k \[0, 13\]",
        ),
        (
            ringdilated.shard_batch(**batch_tensors(_BOTH)).layout,
            {
                "input_ids": torch.tensor(_BOTH["input_ids"][:1]),
                "attention_mask": torch.ones(1, 13),
            },
            r"the model's batch has 1 rows but the layout's padding mask has 2 rows",
        ),
    ]
    for layout, kwargs, message in cases:
        with (
            torch.no_grad(),
            ringdilated.hf.sequence_parallel(layout),
            pytest.raises(ValueError, match=message),
        ):
            model(**kwargs)


def test_mask_overlays_are_refused_under_the_block() -> None:
    """A mask function that intersects or unites plain causal with another (a bidirectional
    window here, which no transformers mask puts over causal) is refused at the first attention
    call, naming how transformers built it."""
    from transformers.masking_utils import (
        create_causal_mask,
        sliding_window_bidirectional_overlay,
    )

    model = tiny_llama({"pattern": DILATED}, "ringdilated")
    attention = model.model.layers[0].self_attn
    embeds = torch.zeros(1, 6, 32, dtype=torch.float64)
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    kv = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    for argument, built in (
        (
            "and_mask_function",
            r"and_masks\(causal_mask_function, sliding_window_bidirectional_overlay\(\.\.\.\)\)",
        ),
        (
            "or_mask_function",
            r"or_masks\(causal_mask_function, sliding_window_bidirectional_overlay\(\.\.\.\)\)",
        ),
    ):
        with ringdilated.hf.sequence_parallel(ringdilated.SequenceLayout()):
            mask = create_causal_mask(
                config=model.config, inputs_embeds=embeds, attention_mask=None,
                past_key_values=None, **{argument: sliding_window_bidirectional_overlay(3)},
            )  # fmt: skip
            assert isinstance(mask, ringdilated.hf.KeyMask) and mask.sharded is not None
            with pytest.raises(ValueError, match=f"transformers asked for {built}$"):
                ringdilated.hf.attention_forward(attention, q, kv, kv, mask)


def test_a_static_cache_is_refused_when_the_mask_is_made() -> None:
    """generate(cache_implementation="static") under the block: transformers makes the mask
    itself (and would call .contiguous() on it); the mask function refuses the cache layout."""
    model, shard = _one_process({"input_ids": [_walk(2, 3, 8)], "pattern": DILATED})
    with (
        torch.no_grad(),
        ringdilated.hf.sequence_parallel(shard.layout),
        pytest.raises(
            ValueError,
            match=r"transformers sized this forward's keys by its cache, 9 for 8 queries: a "
            r"static or sliding-window cache layout \(generate\(cache_implementation='static'\)",
        ),
    ):
        model.generate(
            shard.input_ids, max_new_tokens=2, do_sample=False, pad_token_id=0,
            cache_implementation="static",
        )  # fmt: skip


def test_cross_attention_is_refused_with_its_own_message() -> None:
    """An encoder-decoder model (tiny Bart) under the block, and a bidirectional mask over other
    keys than the queries (what transformers asks for cross attention, in any model)."""
    from transformers import BartConfig, BartForConditionalGeneration
    from transformers.masking_utils import bidirectional_mask_function

    config = BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64,
        ringdilated_segment_lengths=[4, 8], ringdilated_dilation_rates=[1, 2],
    )  # fmt: skip
    bart = BartForConditionalGeneration(config).eval()
    bart.set_attn_implementation("ringdilated")
    ids = torch.tensor([_walk(2, 3, 8)])
    layout = ringdilated.shard_batch(ids).layout
    with (
        torch.no_grad(),
        ringdilated.hf.sequence_parallel(layout),
        pytest.raises(
            ValueError,
            match=r"shards self-attention only: BartConfig has is_encoder_decoder=True, and "
            r"cross attention reads the encoder's whole output",
        ),
    ):
        bart(input_ids=ids, decoder_input_ids=ids)
    with (
        ringdilated.hf.sequence_parallel(layout),
        pytest.raises(
            ValueError,
            match=r"a bidirectional mask over 6 keys for this shard's 4 queries, without a cache: "
            r"cross attention over an encoder's states",
        ),
    ):
        ringdilated.hf.padding_mask(
            batch_size=1, q_length=4, kv_length=6, mask_function=bidirectional_mask_function
        )


def test_labels_on_one_process_are_transformers_own_and_the_losses_are_put_back() -> None:
    """On one process labels= is the unsharded loss, as without the block; transformers'
    registered losses are guarded only while a block is open."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    before = dict(LOSS_MAPPING)
    model, shard = _one_process({"input_ids": [_walk(3, 2, 14)], "pattern": DILATED})
    inputs = {"input_ids": shard.input_ids, "labels": shard.input_ids}
    with torch.no_grad():
        expected = model(**inputs).loss
        with ringdilated.hf.sequence_parallel(shard.layout):
            assert LOSS_MAPPING["ForCausalLM"] is not before["ForCausalLM"]
            loss = model(**inputs, position_ids=shard.position_ids).loss
    assert all(LOSS_MAPPING[name] is loss for name, loss in before.items())
    assert torch.allclose(loss, expected, rtol=0, atol=1e-12)


def _sharded_layout() -> ringdilated.SequenceLayout | None:
    mask = ringdilated.hf.padding_mask(batch_size=1, q_length=4, kv_length=4)
    return None if mask.sharded is None else mask.layout


def test_blocks_nest_the_innermost_winning_and_threads_keep_their_own() -> None:
    """Nested blocks: the innermost one's layout and communicator, then the outer's again. Two
    threads in their own blocks at once each see their own; a thread without one sees none,
    and so does a thread started inside a block, unless it runs in a copy of the context."""
    import contextvars
    import threading

    outer, inner = ringdilated.SequenceLayout(), ringdilated.SequenceLayout()
    with ringdilated.hf.sequence_parallel(outer):
        with ringdilated.hf.sequence_parallel(inner, communicator="ringpass") as setting:
            assert _sharded_layout() is inner
            assert ringdilated.hf.active() is setting and setting.communicator == "ringpass"
        assert _sharded_layout() is outer
    assert _sharded_layout() is None

    both_open = threading.Barrier(3)
    seen: dict[str, object] = {}

    def in_block(name: str, layout: ringdilated.SequenceLayout) -> None:
        with ringdilated.hf.sequence_parallel(layout):
            both_open.wait()
            seen[name] = _sharded_layout()
            both_open.wait()

    def outside() -> None:
        both_open.wait()
        seen["outside"] = _sharded_layout()
        both_open.wait()

    threads = [
        threading.Thread(target=in_block, args=("first", outer)),
        threading.Thread(target=in_block, args=("second", inner)),
        threading.Thread(target=outside),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"first": outer, "second": inner, "outside": None}

    def started_inside(name: str) -> None:
        seen[name] = _sharded_layout()

    with ringdilated.hf.sequence_parallel(outer):
        plain = threading.Thread(target=started_inside, args=("plain",))
        copied = threading.Thread(
            target=contextvars.copy_context().run, args=(started_inside, "copied")
        )
        for thread in (plain, copied):
            thread.start()
            thread.join()
    assert seen["plain"] is None and seen["copied"] is outer


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
