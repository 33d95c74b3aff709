"""ringdilated.shard_batch and the sharded loss (issue 24).

One process: the shifted labels, the positions, the padding and the documents against
expectations written here from the rules (Python loops over positions), the errors, and the loss
against ``F.cross_entropy``'s mean. On 2 and 4 gloo ranks: shard -> forward -> loss -> backward
of a tiny language model equals one process (the loss on every rank, the parameter gradients
summed over the ranks), with ignored labels, uneven lengths, packed documents and padding, in
fixed cases and a hypothesis property; the data-parallel recipes; every rank raising alike."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

import ringdilated
from tests.distributed_harness import Workers
from tests.shard_batch_tasks import VOCAB, TinyLM, batch_tensors

TASKS = "tests.shard_batch_tasks"
IGNORE = -100

# --- the rules, written out position by position ---------------------------------------------


def _document_of(case: dict[str, Any], width: int) -> list[int]:
    cu = case.get("cu_seqlens") or [0, width]
    return [sum(t >= stop for stop in cu[1:]) for t in range(width)]


def _valid(case: dict[str, Any]) -> list[list[int]]:
    ids = case["input_ids"]
    return case.get("attention_mask") or [[1] * len(row) for row in ids]


def expected_targets(case: dict[str, Any]) -> list[list[int]]:
    """The target at each position: the next position's label (or input id) when both positions
    are tokens of one document, else IGNORE."""
    ids = case["input_ids"]
    labels = case.get("labels") or ids
    valid, width = _valid(case), len(ids[0])
    document = _document_of(case, width)
    return [
        [
            labels[b][t + 1]
            if t + 1 < width and valid[b][t] and valid[b][t + 1] and document[t] == document[t + 1]
            else IGNORE
            for t in range(width)
        ]
        for b in range(len(ids))
    ]


def expected_positions(case: dict[str, Any]) -> list[list[int]]:
    """Given position ids; else each token counted from its document's (or its row's first
    token's) start, 0 at padding."""
    ids = case["input_ids"]
    rows, width = len(ids), len(ids[0])
    given = case.get("position_ids")
    if given is not None:
        return given if len(given) == rows else [given[0]] * rows
    cu = case.get("cu_seqlens") or [0, width]
    out = []
    for row in _valid(case):
        first = row.index(1) if 1 in row else 0
        if case.get("attention_mask") is not None:
            out.append([t - first if row[t] else 0 for t in range(width)])
        else:
            out.append([t - max(s for s in cu if s <= t) for t in range(width)])
    return out


def hf_positions(mask: list[list[int]]) -> list[list[int]]:
    """transformers' positions for a padded batch: ``attention_mask.cumsum(-1) - 1``, 1 at
    padding (``masked_fill_(attention_mask == 0, 1)``)."""
    out = []
    for row in mask:
        seen, positions = 0, []
        for m in row:
            seen += m
            positions.append(seen - 1 if m else 1)
        out.append(positions)
    return out


def one_process(case: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole batch on one process, no sharding, no padding: the mean cross-entropy over the
    expected targets and the parameters' gradients."""
    tensors = batch_tensors(case)
    model = TinyLM(case["causal"])
    where: dict[str, Any] = {}
    if "cu_seqlens" in tensors:
        where["cu_seqlens"] = tensors["cu_seqlens"]
    if "attention_mask" in tensors:
        where["key_padding_mask"] = tensors["attention_mask"] == 0
    logits = model(tensors["input_ids"], torch.tensor(expected_positions(case)), **where)
    targets = torch.tensor(expected_targets(case))
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


# --- one process ------------------------------------------------------------------------------


def test_labels_are_the_next_tokens_and_positions_count_from_zero() -> None:
    ids = [[3, 1, 4, 1, 5, 9, 2]]
    shard = ringdilated.shard_batch(torch.tensor(ids))
    assert shard.labels.tolist() == [[1, 4, 1, 5, 9, 2, IGNORE]]
    assert shard.labels.dtype == torch.int64
    assert shard.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6]]
    assert shard.input_ids.tolist() == ids
    assert (shard.token_count, shard.batch_token_count, shard.start, shard.length) == (6, 6, 0, 7)
    assert shard.layout.documents is None and shard.layout.padding is None
    assert shard.layout.shard_lengths == (7,)
    moved = shard.to("cpu")
    assert moved.layout is shard.layout and moved.token_count == 6
    assert moved.labels.tolist() == shard.labels.tolist()


def test_given_labels_are_shifted_keeping_their_ignored_positions() -> None:
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    labels = [[3, IGNORE, 4, 1, 5], [9, 2, 6, IGNORE, IGNORE]]
    shard = ringdilated.shard_batch(ids, labels=torch.tensor(labels, dtype=torch.int32))
    assert shard.labels.tolist() == [[IGNORE, 4, 1, 5, IGNORE], [2, 6, IGNORE, IGNORE, IGNORE]]
    assert shard.token_count == 5
    other = ringdilated.shard_batch(ids, labels=torch.tensor(labels), ignore_index=5)
    assert other.labels.tolist() == [[IGNORE, 4, 1, 5, 5], [2, 6, IGNORE, IGNORE, 5]]
    assert other.token_count == 7  # -100 counts when it is not the ignore_index


def test_packed_documents_do_not_predict_across_their_boundaries() -> None:
    case = {"input_ids": [[1, 2, 3, 4, 5, 6, 7, 8, 9]], "cu_seqlens": [0, 3, 4, 9]}
    shard = ringdilated.shard_batch(**batch_tensors(case))
    assert shard.labels.tolist() == [[2, 3, IGNORE, IGNORE, 6, 7, 8, 9, IGNORE]]
    assert shard.labels.tolist() == expected_targets(case)
    assert shard.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4]]
    assert shard.layout.documents == ((0, 3), (3, 4), (4, 9))
    assert shard.batch_token_count == 6


@pytest.mark.parametrize(
    "mask",
    [
        [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]],  # left padding
        [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]],  # right padding
        [[0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]],  # both sides; a row of padding only
    ],
)
def test_padding_is_never_a_target_and_positions_count_from_each_rows_first_token(
    mask: list[list[int]],
) -> None:
    ids = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 1, 2]]
    case = {"input_ids": ids, "attention_mask": mask}
    shard = ringdilated.shard_batch(**batch_tensors(case))
    assert shard.labels.tolist() == expected_targets(case)
    assert shard.position_ids.tolist() == expected_positions(case)
    hf = hf_positions(mask)  # transformers' positions agree wherever there is a token
    assert all(
        shard.position_ids[b, t] == hf[b][t] for b in range(2) for t in range(6) if mask[b][t]
    )
    runs = [
        list(r.documents)
        for r in shard.layout.padding  # type: ignore[union-attr]
        for _ in range(r.start, r.stop)
    ]
    assert runs == [[(m.index(1), 6 - m[::-1].index(1))] if 1 in m else [] for m in mask]


def test_a_mask_without_padding_is_dropped() -> None:
    ids = torch.tensor([[1, 2, 3, 4]])
    shard = ringdilated.shard_batch(ids, attention_mask=torch.ones(1, 4, dtype=torch.bool))
    assert shard.layout.padding is None
    assert shard.labels.tolist() == [[2, 3, 4, IGNORE]]
    packed = ringdilated.shard_batch(
        ids, attention_mask=torch.ones(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 2, 4])
    )
    assert packed.layout.documents == ((0, 2), (2, 4))


def test_padding_to_a_multiple_appends_ignored_positions_masked_from_every_token() -> None:
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    shard = ringdilated.shard_batch(ids, pad_to_multiple_of=4, pad_token_id=7)
    assert shard.input_ids.tolist() == [[1, 2, 3, 4, 5, 7, 7, 7]]
    assert shard.labels.tolist() == [[2, 3, 4, 5, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert shard.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 0, 0]]
    assert shard.layout.documents == ((0, 5), (5, 8))  # the padding: a document of its own
    assert shard.length == 8
    packed = ringdilated.shard_batch(ids, cu_seqlens=torch.tensor([0, 2, 5]), pad_to_multiple_of=3)
    assert packed.layout.documents == ((0, 2), (2, 5), (5, 6))
    assert packed.position_ids.tolist() == [[0, 1, 0, 1, 2, 0]]
    masked = ringdilated.shard_batch(
        ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1]]), pad_to_multiple_of=4
    )
    assert [r.documents for r in masked.layout.padding] == [((1, 5),)]  # type: ignore[union-attr]
    assert masked.labels.tolist() == [[IGNORE, 3, 4, 5, IGNORE, IGNORE, IGNORE, IGNORE]]
    exact = ringdilated.shard_batch(ids, pad_to_multiple_of=5)
    assert exact.length == 5 and exact.layout.documents is None


@pytest.mark.parametrize("shape", ["flat", "one_row", "every_row"])
def test_given_positions_are_kept(shape: str) -> None:
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    row = [5, 6, 7, 8]
    given = {"flat": [row], "one_row": [row], "every_row": [row, [0, 1, 2, 3]]}[shape]
    tensor = torch.tensor(given[0] if shape == "flat" else given, dtype=torch.int32)
    shard = ringdilated.shard_batch(ids, position_ids=tensor, pad_to_multiple_of=3)
    expected = [row, row] if shape != "every_row" else given
    assert shard.position_ids.tolist() == [[*p, 0, 0] for p in expected]
    assert shard.position_ids.dtype == torch.int64


def test_left_padded_positions_from_transformers_are_taken() -> None:
    mask = [[0, 0, 1, 1], [1, 1, 1, 1]]
    shard = ringdilated.shard_batch(
        torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]),
        attention_mask=torch.tensor(mask),
        position_ids=torch.tensor(hf_positions(mask)),
    )
    assert shard.position_ids.tolist() == [[1, 1, 0, 1], [0, 1, 2, 3]]


def test_deal_gives_the_first_ranks_one_more() -> None:
    from ringdilated.batch import deal

    assert deal(14, 4) == (4, 4, 3, 3)
    assert deal(13, 2) == (7, 6)
    assert deal(8, 4) == (2, 2, 2, 2)


_BAD_BATCHES = [
    ({"input_ids": [[1.0, 2.0]]}, TypeError, "input_ids must be an integer tensor, got "
     "torch.float32"),
    ({"input_ids": [1, 2]}, ValueError, "input_ids must be (batch, seq_len) with both at least 1, "
     "got shape (2,)"),
    ({"labels": [[1, 2]]}, ValueError, "labels must have input_ids' shape (1, 3), got (1, 2)"),
    ({"attention_mask": [[1, 2, 0]]}, ValueError, "attention_mask must hold 1 (token) and 0 "
     "(padding) only, got also [2]"),
    ({"attention_mask": [[1.0, 1.0, 0.0]]}, TypeError, "attention_mask must be bool or integer"),
    ({"attention_mask": [[1, 0, 1]]}, ValueError, "attention_mask row 0 must hold its tokens (1) "
     "as one contiguous run, with padding (0) only before or after them, got 2 tokens between "
     "positions 0 and 2"),
    ({"attention_mask": [[1, 1, 0]], "cu_seqlens": [0, 1, 3]}, ValueError, "not both"),
    ({"cu_seqlens": [0, 2]}, ValueError, "cu_seqlens must run from 0 to the sequence length 3, "
     "got [0, 2]"),
    ({"position_ids": [[0, 1]]}, ValueError, "position_ids must be (1, 3), (1, 3) or (3,) like "
     "input_ids (1, 3), got (1, 2)"),
    ({"position_ids": [[0, 1, 0]]}, ValueError, "position_ids go from 1 to 0 at position 2 of row "
     "0 between two tokens, where a packed document starts"),
    ({"position_ids": [2, 3, 2], "attention_mask": [[1, 1, 1]]}, ValueError, "position_ids go from "
     "3 to 2 at position 2 of row 0"),
    ({"position_ids": [[2, 3, 5]], "input_ids": [[1, 2, 3], [4, 5, 6]]}, ValueError,
     "position_ids go from 3 to 5 at position 2 of row 0"),
    ({"ignore_index": True}, TypeError, "ignore_index must be an int, got True"),
    ({"pad_to_multiple_of": 0}, ValueError, "pad_to_multiple_of must be a positive int or None, "
     "got 0"),
    ({"check_same_batch": 1}, TypeError, "check_same_batch must be a bool, got 1"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "error", "message"), _BAD_BATCHES)
def test_bad_batches_raise_naming_the_value_and_the_rule(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    args: dict[str, Any] = {"input_ids": [[1, 2, 3]], **kwargs}
    for name in ("input_ids", "labels", "attention_mask", "position_ids", "cu_seqlens"):
        if name in args:
            args[name] = torch.tensor(args[name])
    with pytest.raises(error) as caught:
        ringdilated.shard_batch(**args)
    assert message in str(caught.value)


def test_restarting_positions_are_taken_with_documents() -> None:
    shard = ringdilated.shard_batch(
        torch.tensor([[1, 2, 3]]),
        position_ids=torch.tensor([[0, 1, 0]]),
        cu_seqlens=torch.tensor([0, 3]),  # attend across them, as asked
    )
    assert shard.position_ids.tolist() == [[0, 1, 0]]
    assert shard.labels.tolist() == [[2, 3, IGNORE]]


def test_the_loss_on_one_process_is_torchs_mean_with_its_gradient() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, VOCAB, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 5), generator=g)
    labels[0, :3] = IGNORE
    loss = ringdilated.sharded_cross_entropy(logits, labels)
    (grad,) = torch.autograd.grad(loss, logits)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    (expected_grad,) = torch.autograd.grad(expected, logits)
    assert torch.allclose(loss, expected, rtol=1e-14, atol=0)
    assert torch.allclose(grad, expected_grad, rtol=1e-13, atol=1e-16)
    # averaged_over scales the gradient only; total_count divides instead of this call's count
    scaled = ringdilated.sharded_cross_entropy(logits, labels, averaged_over=3)
    (grad3,) = torch.autograd.grad(scaled, logits)
    assert torch.equal(scaled, loss) and torch.allclose(grad3, 3 * grad, rtol=1e-14)
    accumulated = ringdilated.sharded_cross_entropy(logits, labels, total_count=14)
    (grad14,) = torch.autograd.grad(accumulated, logits)
    assert torch.allclose(accumulated, loss * 7 / 14, rtol=1e-14, atol=0)
    assert torch.allclose(grad14, grad * 7 / 14, rtol=1e-13, atol=1e-16)


def test_a_batch_without_a_counted_label_has_torchs_nan_and_zero_gradients() -> None:
    logits = torch.randn(1, 4, VOCAB, dtype=torch.float64, requires_grad=True)
    labels = torch.full((1, 4), IGNORE)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    (expected_grad,) = torch.autograd.grad(expected, logits)
    loss = ringdilated.sharded_cross_entropy(logits, labels)
    (grad,) = torch.autograd.grad(loss, logits)
    assert loss.isnan() and expected.isnan()
    assert torch.equal(grad, expected_grad) and not grad.any()


def test_token_weighted_mean_of_a_custom_loss() -> None:
    x = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64, requires_grad=True)
    loss = ringdilated.token_weighted_mean((x**2).sum(), torch.tensor(3))
    loss.backward()
    assert loss.dtype == torch.float64 and loss.item() == 7.0
    assert x.grad is not None and x.grad.tolist() == [2 / 3, 4 / 3, 8 / 3]


_LOSS = ringdilated.sharded_cross_entropy
_MEAN = ringdilated.token_weighted_mean
_BAD_LOSSES = [
    (lambda: _LOSS(torch.zeros(2, 3), torch.zeros(2, 1).long()), ValueError,
     "labels must have logits' shape without its last (class) dimension, (2,), got (2, 1)"),
    (lambda: _LOSS(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32)), TypeError,
     "labels must be an int64 tensor (class indices), got torch.int32"),
    (lambda: _LOSS(torch.zeros(2, 3).long(), torch.zeros(2).long()), TypeError,
     "logits must be a floating tensor, got torch.int64"),
    (lambda: _MEAN(torch.zeros(2), 1), ValueError,
     "local_sum must be a 0-d tensor, got shape (2,)"),
    (lambda: _MEAN(torch.tensor(1.0), -1), ValueError,
     "local_count must be a non-negative int, got -1"),
    (lambda: _MEAN(torch.tensor(1.0), torch.tensor(1.5)), TypeError,
     "local_count must be an int or a 0-d integer tensor, got torch.float32"),
    (lambda: _MEAN(torch.tensor(1.0), 1, averaged_over=0), ValueError,
     "averaged_over must be a positive int (the ranks a wrapper averages gradients over), got 0"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "message"), _BAD_LOSSES)
def test_bad_loss_arguments_raise(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as caught:
        call()
    assert message in str(caught.value)


# --- sequence-sharded over gloo ranks ---------------------------------------------------------


def _padded_length(case: dict[str, Any]) -> int:
    width, multiple = len(case["input_ids"][0]), case.get("pad_to_multiple_of") or 1
    return math.ceil(width / multiple) * multiple


def check_against_one_process(case: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """Every rank's loss is the one-process loss; the gradients summed over the ranks are its
    gradients; each rank holds its dealt slice of the expected inputs, targets and positions."""
    loss, grads = one_process(case)
    world, width, length = len(results), len(case["input_ids"][0]), _padded_length(case)
    lengths = [length // world + (r < length % world) for r in range(world)]
    targets, positions = expected_targets(case), expected_positions(case)
    pad = case.get("pad_id", 0)
    whole_ids = [row + [pad] * (length - width) for row in case["input_ids"]]
    whole_targets = [row + [IGNORE] * (length - width) for row in targets]
    whole_positions = [row + [0] * (length - width) for row in positions]
    for rank, result in enumerate(results):
        assert torch.allclose(result["loss"], loss, rtol=1e-12, atol=0, equal_nan=True), rank
        start = sum(lengths[:rank])
        window = slice(start, start + lengths[rank])
        assert (result["start"], result["length"]) == (start, length)
        assert result["shard_lengths"] == tuple(lengths)
        assert result["input_ids"].tolist() == [r[window] for r in whole_ids]
        assert result["labels"].tolist() == [r[window] for r in whole_targets]
        assert result["position_ids"].tolist() == [r[window] for r in whole_positions]
        counted = sum(t != IGNORE for r in whole_targets for t in r[window])
        assert result["token_count"] == counted
        assert result["batch_token_count"] == sum(t != IGNORE for r in targets for t in r)
    for name, expected in grads.items():
        summed = sum(result["grads"][name] for result in results)
        assert torch.allclose(summed, expected, rtol=1e-9, atol=1e-12), name


def _walk(a: int, b: int, width: int) -> list[int]:
    return [(a * t + b) % VOCAB for t in range(width)]


_FIXED = {
    "uneven, ignored labels": {
        "input_ids": [_walk(7, 3, 13), _walk(5, 0, 13)],
        "labels": [[IGNORE if t in (2, 3, 9) else x for t, x in enumerate(_walk(7, 3, 13))],
                   _walk(5, 0, 13)],
        "causal": True,
    },
    "packed documents crossing shards": {
        "input_ids": [_walk(3, 1, 14)],
        "cu_seqlens": [0, 5, 6, 11, 14],
        "causal": False,
    },
    "left and right padding, padded to the ranks": {
        "input_ids": [[(t * t) % VOCAB for t in range(11)], _walk(2, 5, 11)],
        "attention_mask": [[0] * 3 + [1] * 8, [1] * 7 + [0] * 4],
        "causal": False,
        "pad_to_multiple_of": 4,
        "pad_id": 3,
    },
    "bidirectional, padded to 8, no documents": {
        "input_ids": [_walk(4, 1, 10)],
        "causal": False,
        "pad_to_multiple_of": 8,
    },
    "packed, padded to 8, given positions": {
        "input_ids": [_walk(5, 2, 10)],
        "cu_seqlens": [0, 4, 10],
        "position_ids": [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]],
        "causal": True,
        "pad_to_multiple_of": 8,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(_FIXED))
def test_two_ranks_equal_one_process(workers2: Workers, name: str) -> None:
    case = _FIXED[name]
    check_against_one_process(case, workers2.results(f"{TASKS}:train_step", case))


@pytest.mark.parametrize("name", list(_FIXED))
def test_four_ranks_equal_one_process(workers4: Workers, name: str) -> None:
    case = _FIXED[name]
    check_against_one_process(case, workers4.results(f"{TASKS}:train_step", case))


@st.composite
def batches(draw: st.DrawFn, world: int) -> dict[str, Any]:
    """A small batch: random length (uneven or not), tokens, ignored labels, and none, packed
    documents or per-row padding, given positions or not, padding to a multiple or not."""
    rows, width = draw(st.integers(1, 2)), draw(st.integers(world, 18))
    token = st.integers(0, VOCAB - 1)
    ids = [draw(st.lists(token, min_size=width, max_size=width)) for _ in range(rows)]
    case: dict[str, Any] = {"input_ids": ids, "causal": draw(st.booleans())}
    if draw(st.booleans()):
        ignored = st.lists(st.booleans(), min_size=width, max_size=width)
        case["labels"] = [
            [IGNORE if i else x for x, i in zip(row, draw(ignored), strict=True)] for row in ids
        ]
    kind = draw(st.sampled_from(["whole", "documents", "padding"]))
    if kind == "documents":
        cuts = draw(st.sets(st.integers(1, width - 1), max_size=3)) if width > 1 else set()
        case["cu_seqlens"] = [0, *sorted(cuts), width]
    elif kind == "padding":
        mask = []
        for _ in range(rows):
            tokens = draw(st.integers(1, width))
            left = draw(st.integers(0, width - tokens))
            mask.append([0] * left + [1] * tokens + [0] * (width - left - tokens))
        case["attention_mask"] = mask
    if draw(st.booleans()):  # the positions a transformers pipeline would pass
        if kind == "padding":
            case["position_ids"] = hf_positions(case["attention_mask"])
        else:
            case["position_ids"] = expected_positions(case)
    case["pad_to_multiple_of"] = draw(st.sampled_from([None, world, 8]))
    return case


_FEW = max(4, settings.default.max_examples // 5)  # ci: 20; thorough: 100


@settings(max_examples=_FEW)
@given(case=batches(2))
def test_property_two_ranks_equal_one_process(workers2: Workers, case: dict[str, Any]) -> None:
    check_against_one_process(case, workers2.results(f"{TASKS}:train_step", case))


@settings(max_examples=_FEW)
@given(case=batches(4))
def test_property_four_ranks_equal_one_process(workers4: Workers, case: dict[str, Any]) -> None:
    check_against_one_process(case, workers4.results(f"{TASKS}:train_step", case))


_TWO_ROWS = {
    "input_ids": [_walk(3, 2, 11), _walk(7, 1, 11)],
    # row 0 counts 3 labels, row 1 counts 9: a mean of the rows' means is not the batch's mean
    "labels": [[IGNORE if t % 4 else x for t, x in enumerate(_walk(3, 2, 11))],
               [IGNORE if t == 4 else x for t, x in enumerate(_walk(7, 1, 11))]],
    "causal": True,
}  # fmt: skip


@pytest.mark.parametrize("loss_group", ["world", "grid"])
def test_dp_x_cp_token_weighted_over_the_global_batch(workers4: Workers, loss_group: str) -> None:
    """Replica dp takes row dp, its 2 cp ranks shard it; the loss over all 4 ranks with
    averaged_over=4, gradients averaged over the 4 ranks (as FSDP2 does) give the one-process
    mean over both rows and its gradients."""
    loss, grads = one_process(_TWO_ROWS)
    case = {**_TWO_ROWS, "loss_group": loss_group, "averaged_over": 4}
    for result in workers4.results(f"{TASKS}:dp_cp_step", case):
        assert torch.allclose(result["loss"], loss, rtol=1e-12, atol=0)
        for name, expected in grads.items():
            assert torch.allclose(result["grads"][name], expected, rtol=1e-9, atol=1e-12), name


def test_dp_x_cp_each_replicas_mean_averaged(workers4: Workers) -> None:
    """The loss over each cp group with averaged_over=2: each replica reports its own row's
    mean, and the averaged gradients are those of the mean of the two rows' means."""
    rows = [
        {**_TWO_ROWS, **{k: [_TWO_ROWS[k][i]] for k in ("input_ids", "labels")}} for i in (0, 1)
    ]
    per_row = [one_process(row) for row in rows]
    case = {**_TWO_ROWS, "loss_group": "cp", "averaged_over": 2}
    for rank, result in enumerate(workers4.results(f"{TASKS}:dp_cp_step", case)):
        assert torch.allclose(result["loss"], per_row[rank // 2][0], rtol=1e-12, atol=0), rank
        for name in per_row[0][1]:
            expected = (per_row[0][1][name] + per_row[1][1][name]) / 2
            assert torch.allclose(result["grads"][name], expected, rtol=1e-9, atol=1e-12), name


def test_an_autograd_all_reduce_of_the_loss_would_count_each_share_world_times(
    workers2: Workers,
) -> None:
    """Why the loss is not all-reduced through torch.distributed.nn.functional.all_reduce."""
    for result in workers2.results(f"{TASKS}:autograd_all_reduce_gradient", {}):
        assert result["gradient"] == 2 * result["share"]


@pytest.mark.parametrize("field", ["input_ids", "labels"])
def test_ranks_holding_different_batches_raise_on_every_rank(workers2: Workers, field: str) -> None:
    for message in workers2.results(f"{TASKS}:mismatched_batches", {"field": field}):
        assert message.startswith("CallMismatchError: ranks disagree on the call"), message
        assert f"{field}: rank 0 (2, 8) torch.int64, digest " in message, message
        other = "labels" if field == "input_ids" else "input_ids"
        assert f"{other}:" not in message


def test_bad_input_on_one_rank_raises_on_every_rank(workers4: Workers) -> None:
    messages = workers4.results(f"{TASKS}:bad_batch_on_one_rank", {"bad_rank": 2})
    assert messages[2] == "TypeError: input_ids must be an integer tensor, got torch.float64"
    for rank in (0, 1, 3):
        assert messages[rank] == (
            "PeerRejectedError: rank 2 rejected its input, so every rank stops: TypeError: "
            "input_ids must be an integer tensor, got torch.float64"
        )


def test_a_sequence_shorter_than_the_ranks_raises_on_every_rank(workers4: Workers) -> None:
    for message in workers4.results(f"{TASKS}:bad_batch_on_one_rank", {"short": True}):
        assert message == (
            "ValueError: the sequence length 3 must be at least the 4 ranks (every shard holds a "
            "position): pad it with pad_to_multiple_of"
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_logits_give_the_float64_loss_and_gradient(dtype: torch.dtype) -> None:
    """Half logits are upcast: 8192 tokens of losses near 11 sum past float16's 65504 (the sum
    in float16 was ``inf``; in bfloat16, 0.5% off); value and gradient against float64."""
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(8192, 1000, generator=g) * 3).to(dtype)
    labels = torch.randint(0, 1000, (8192,), generator=g)
    exact = logits.double().requires_grad_()
    want = torch.nn.functional.cross_entropy(exact, labels)
    (want_grad,) = torch.autograd.grad(want, exact)
    low = logits.clone().requires_grad_()
    got = ringdilated.sharded_cross_entropy(low, labels)
    assert got.dtype == torch.float32
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-5 * float(want.detach())
    (grad,) = torch.autograd.grad(got, low)
    assert grad.dtype == dtype
    error = float((grad.double() - want_grad).abs().max() / want_grad.abs().max())
    assert error < (1e-3 if dtype == torch.float16 else 8e-3)


def test_a_large_token_count_keeps_its_gradient_scale_in_half_precision() -> None:
    """``averaged_over / count`` for 2e7 tokens is below float16's smallest normal: kept in
    float64, the gradient of a float16 ``local_sum`` is that scale rounded once."""
    local = torch.tensor(3.0, dtype=torch.float16, requires_grad=True)
    value = ringdilated.token_weighted_mean(local, 1, total_count=20_000_000)
    (grad,) = torch.autograd.grad(value, local)
    assert float(grad) == float(torch.tensor(1 / 20_000_000, dtype=torch.float16))
    assert float(grad) > 0
