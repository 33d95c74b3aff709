"""Mistral (sliding windows), Gemma-2 (logit softcap, sliding and global layers) and gpt-oss
(attention sinks, sliding and global layers) under ``attn_implementation="ringdilated"`` with a
dense pattern (one segment covering the sequence, rate 1): the same logits and gradients as
transformers' own ``"eager"`` attention, the reference, on one process and sharded over gloo
ranks; and the layer's ``sliding_window`` keyword checked against its mask's window."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from tests.distributed_harness import Workers
from tests.hf_tasks import VOCAB, batch_tensors
from tests.hf_variant_tasks import WINDOW, tiny_variant

transformers = pytest.importorskip("transformers")

import ringdilated  # noqa: E402
import ringdilated.hf  # noqa: E402

TASKS = "tests.hf_variant_tasks"
MODELS = ["mistral", "gemma2", "gpt_oss"]


def _walk(a: int, b: int, width: int) -> list[int]:
    return [(a * t + b) % VOCAB for t in range(width)]


# Every sequence is longer than WINDOW, so a window left out (or off by one) changes the logits.
_LAYOUTS: dict[str, dict[str, Any]] = {
    "no padding": {"input_ids": [_walk(7, 3, 13), _walk(5, 0, 13)]},
    "left padding": {
        "input_ids": [_walk(3, 2, 14), [0] * 5 + _walk(2, 7, 9)],
        "attention_mask": [[1] * 14, [0] * 5 + [1] * 9],
    },
    "right padding": {
        "input_ids": [[(t * t) % VOCAB for t in range(10)] + [0] * 4, _walk(5, 1, 14)],
        "attention_mask": [[1] * 10 + [0] * 4, [1] * 14],
    },
    "packed documents": {"input_ids": [_walk(3, 1, 14)], "cu_seqlens": [0, 7, 8, 14]},
}


def tolerance(model: str) -> dict[str, float]:
    """``allclose`` tolerances against the float64 eager model: Mistral's and Gemma-2's eager
    attention take the softmax in float32 (transformers v5.23.0 models/mistral/
    modeling_mistral.py and models/gemma2/modeling_gemma2.py, ``softmax(..., dtype=
    torch.float32).to(query.dtype)``), so they agree to float32 rounding of the probabilities
    (about 1e-8 on these logits and gradients; Gemma-2's RMSNorm in float32 adds float32 rounding
    of its own, the same on both sides); gpt-oss's eager softmax keeps the float64 dtype
    (models/gpt_oss/modeling_gpt_oss.py, ``dtype=combined_logits.dtype``): float64 rounding."""
    if model == "gpt_oss":
        return {"rtol": 1e-9, "atol": 1e-11}
    return {"rtol": 1e-5, "atol": 1e-7}


def run(case: dict[str, Any], implementation: str) -> dict[str, Any]:
    """One process, the whole batch: logits ``(B, L, V)`` (NaN at padding), the mean
    cross-entropy over the labels ``shard_batch`` makes (shifted, not crossing documents or
    padding) and its parameter gradients. Eager attention on a padded float64 batch makes NaN at
    queries that see only padding (its float32 softmax of float64 minima), reaching every
    position of later layers; so under ``"eager"`` each padded row runs alone, on its tokens,
    and each packed document alone too (gpt-oss's eager does not find them in position_ids)."""
    model = tiny_variant(case, implementation)
    tensors = batch_tensors(case)
    whole = ringdilated.shard_batch(**tensors)
    ids, labels, positions = tensors["input_ids"], whole.labels, whole.position_ids
    mask, bounds = tensors.get("attention_mask"), tensors.get("cu_seqlens")
    logits = torch.full((*ids.shape, VOCAB), float("nan"), dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    if implementation == "eager" and (mask is not None or bounds is not None):
        for row, span in _spans(mask, bounds):
            out = model(input_ids=ids[row : row + 1, span], use_cache=False).logits[0]
            logits[row, span] = out.detach()
            total = total + F.cross_entropy(out, labels[row, span], reduction="sum")
    else:
        extra: dict[str, Any] = {} if mask is None else {"attention_mask": mask}
        if bounds is not None and case["model"] == "gpt_oss":
            # gpt-oss (v5.23.0) builds its masks without position_ids, so transformers does
            # not find the documents there: pass them as DataCollatorWithFlattening does.
            extra.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds)
        # No cache: transformers finds packed documents in position_ids only without one.
        out = model(input_ids=ids, position_ids=positions, use_cache=False, **extra).logits
        logits = out.detach()
        total = F.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="sum")
    loss = total / labels.ne(-100).sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits, "loss": loss.detach(), "grads": grads}


def _spans(mask: torch.Tensor | None, bounds: torch.Tensor | None) -> list[tuple[int, slice]]:
    """``(row, columns)`` of each padded row's tokens, or of each packed document (of row 0)."""
    if bounds is not None:
        edges = bounds.tolist()
        return [(0, slice(a, b)) for a, b in itertools.pairwise(edges)]
    assert mask is not None
    spans = []
    for row in range(mask.shape[0]):
        run = mask[row].nonzero().flatten()
        spans.append((row, slice(int(run[0]), int(run[-1]) + 1)))
    return spans


def _tokens(case: dict[str, Any], shape: torch.Size) -> torch.Tensor:
    mask = batch_tensors(case).get("attention_mask")
    return torch.ones(shape, dtype=torch.bool) if mask is None else mask.bool()


@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("model", MODELS)
def test_one_process_equals_eager(model: str, layout: str) -> None:
    case = {**_LAYOUTS[layout], "model": model}
    ours, theirs = run(case, "ringdilated"), run(case, "eager")
    close = tolerance(model)
    tokens = _tokens(case, theirs["logits"].shape[:2])
    assert torch.allclose(ours["logits"][tokens], theirs["logits"][tokens], **close)
    assert torch.allclose(ours["loss"], theirs["loss"], **close)
    assert ours["grads"].keys() == theirs["grads"].keys()
    for name, grad in theirs["grads"].items():
        assert torch.allclose(ours["grads"][name], grad, **close), name


@pytest.mark.parametrize("layout", ["no padding", "right padding"])
def test_a_bidirectional_gemma2_equals_eager(layout: str) -> None:
    """Gemma-2 with ``use_bidirectional_attention`` and ``config.is_causal`` false: transformers
    masks its sliding layers with ``abs(q - kv) <= w``, served as ``window=(w, w)``."""
    case = {**_LAYOUTS[layout], "model": "gemma2", "bidirectional": True}
    ours, theirs = run(case, "ringdilated"), run(case, "eager")
    close = tolerance("gemma2")
    tokens = _tokens(case, theirs["logits"].shape[:2])
    assert torch.allclose(ours["logits"][tokens], theirs["logits"][tokens], **close)
    for name, grad in theirs["grads"].items():
        assert torch.allclose(ours["grads"][name], grad, **close), name


def test_a_bidirectional_layer_under_a_causal_mask_raises() -> None:
    """Gemma-2 with ``use_bidirectional_attention`` (its modules' ``is_causal`` false) but
    ``config.is_causal`` unset: transformers passes no ``is_causal`` and makes causal masks, so
    eager computes causal attention and sdpa (its mask skipped) bidirectional. No one answer:
    the adapter raises, naming both, before any attention runs. (With ``config.is_causal``
    set, transformers passes it to every layer and both agree: the test above.)"""
    model = tiny_variant({"model": "gemma2"}, "ringdilated")
    assert not hasattr(model.config, "is_causal")  # unset: Gemma2Config has no default
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    ids = batch_tensors(_LAYOUTS["no padding"])["input_ids"]
    with pytest.raises(ValueError, match="transformers made this layer a causal mask") as info:
        model(input_ids=ids, use_cache=False)
    assert "module's is_causal=False" in str(info.value)


def test_the_window_is_what_separates_the_models_from_the_global_ones() -> None:
    """The comparison above can fail: with every layer global (no sliding window) Mistral's
    logits move well beyond the tolerance, so the window reached every layer."""
    case = {**_LAYOUTS["no padding"], "model": "mistral"}
    windowed = run(case, "eager")["logits"]
    model = tiny_variant(case, "ringdilated")
    model.config.sliding_window = None  # the layers' keyword and mask read it per forward
    ids = batch_tensors(case)["input_ids"]
    with torch.no_grad():
        unbounded = model(input_ids=ids, use_cache=False).logits
    assert float((unbounded - windowed).abs().max()) > 1e-3


def check(case: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """Each rank's logits are its slice of eager's (at tokens), its loss eager's, and the ranks'
    gradient shares sum to eager's gradients."""
    expected = run(case, "eager")
    close = tolerance(case["model"])
    tokens = _tokens(case, expected["logits"].shape[:2])
    start = 0
    for rank, result in enumerate(results):
        n = result["logits"].shape[1]
        assert result["start"] == start, rank
        columns = tokens[:, start : start + n]
        theirs = expected["logits"][:, start : start + n]
        assert torch.allclose(result["logits"][columns], theirs[columns], **close), rank
        assert torch.allclose(result["loss"], expected["loss"], **close), rank
        start += n
    assert start == expected["logits"].shape[1]
    assert {name for result in results for name in result["communicators"]}
    for name, grad in expected["grads"].items():
        summed = sum(result["grads"][name] for result in results)
        assert torch.allclose(summed, grad, **close), name


_SHARDED = ["left padding", "right padding", "packed documents"]


@pytest.mark.parametrize("layout", _SHARDED)
@pytest.mark.parametrize("model", MODELS)
def test_two_ranks_equal_eager(workers2: Workers, model: str, layout: str) -> None:
    case = {**_LAYOUTS[layout], "model": model}
    check(case, workers2.results(f"{TASKS}:sharded_variant_step", case))


@pytest.mark.parametrize("model", MODELS)
def test_four_ranks_equal_eager(workers4: Workers, model: str) -> None:
    case = {**_LAYOUTS["left padding"], "model": model}
    check(case, workers4.results(f"{TASKS}:sharded_variant_step", case))


@pytest.mark.parametrize("model", MODELS)
def test_a_dilated_pattern_with_windows_on_two_ranks_equals_one_process(
    workers2: Workers, model: str
) -> None:
    """A dilated pattern under the windows (no eager counterpart): the ranks' logits and summed
    gradients are the one-process adapter's, in float64 rounding; Gemma-2's to float32
    rounding, as its RMSNorm computes in float32 (v5.23.0 models/gemma2/modeling_gemma2.py,
    ``Gemma2RMSNorm.forward``: ``x.float()``, ``self.weight.float()``), so its weights' gradients,
    summed over each rank's tokens then over ranks, round differently (about 1e-7 relative)."""
    case = {**_LAYOUTS["left padding"], "model": model, "pattern": ([4, 8], [1, 2])}
    results = workers2.results(f"{TASKS}:sharded_variant_step", case)
    expected = run(case, "ringdilated")
    tokens = _tokens(case, expected["logits"].shape[:2])
    close = tolerance("gemma2") if model == "gemma2" else {"rtol": 1e-9, "atol": 1e-11}
    start = 0
    for result in results:
        n = result["logits"].shape[1]
        columns = tokens[:, start : start + n]
        theirs = expected["logits"][:, start : start + n]
        assert torch.allclose(result["logits"][columns], theirs[columns], **close)
        start += n
    for name, grad in expected["grads"].items():
        assert torch.allclose(sum(r["grads"][name] for r in results), grad, **close), name


def _layer_call(window: int | None) -> tuple[Any, Any, Any]:
    """A Mistral layer's attention and a query/key pair, and the mask transformers makes with
    ``sliding_window=window`` (``create_sliding_window_causal_mask``, or ``create_causal_mask``
    for ``None``)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    model = tiny_variant({"model": "mistral"}, "ringdilated")
    model.config.sliding_window = window
    make = create_causal_mask if window is None else create_sliding_window_causal_mask
    embeds = torch.zeros(1, 6, 32, dtype=torch.float64)
    mask = make(
        config=model.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None
    )
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    return model.model.layers[0].self_attn, q, mask


@pytest.mark.parametrize(("made", "passed"), [(3, 5), (None, 5), (3, None)])
def test_a_keyword_other_than_the_mask_s_window_is_refused_naming_both(
    made: int | None, passed: int | None
) -> None:
    attention, q, mask = _layer_call(made)
    kv = q[:, :2]
    message = (
        rf"passes sliding_window={passed} but transformers made its mask with "
        rf"sliding_window={made}"
    )
    with pytest.raises(ValueError, match=message):
        ringdilated.hf.attention_forward(attention, q, kv, kv, mask, sliding_window=passed)


def test_the_masks_window_is_transformers_own() -> None:
    """``kv > q - w`` and ``kv <= q`` is ``(w - 1, 0)``; ``abs(q - kv) <= w`` is ``(w, w)``:
    read from transformers' mask functions, checked against the boolean mask they compute."""
    from transformers.masking_utils import (
        sliding_window_bidirectional_mask_function,
        sliding_window_causal_mask_function,
    )

    q, kv = torch.arange(9)[:, None], torch.arange(9)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    for function in (
        sliding_window_causal_mask_function(WINDOW),
        sliding_window_bidirectional_mask_function(WINDOW),
    ):
        mask = ringdilated.hf.padding_mask(batch_size=1, q_length=9, kv_length=9,
                                           mask_function=function)  # fmt: skip
        assert mask.overlay is None and mask.sliding_window == WINDOW
        assert mask.window is not None
        left, right = mask.window
        expected = function(zero, zero, q, kv)  # broadcast over every (q, kv) pair
        assert torch.equal((kv >= q - left) & (kv <= q + right), expected), mask.window


@pytest.mark.parametrize("model", MODELS)
def test_generation_with_a_full_dynamic_cache_equals_eager(model: str) -> None:
    """transformers' default cache for these models keeps only the window on sliding layers
    (``DynamicCache(config=...)``: v5.23.0 cache_utils.py), whose decode steps the adapter
    refuses (the queries are not the last of all positions); ``past_key_values=DynamicCache()``
    keeps every position, and greedy decoding then gives eager's tokens and step logits."""
    from transformers import DynamicCache

    ids = torch.tensor([_walk(3, 1, 8)])  # longer than WINDOW: the sliding cache drops keys
    options = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    ours = tiny_variant({"model": model}, "ringdilated").eval()
    with pytest.raises(ValueError, match=r"pass past_key_values=transformers\.DynamicCache\(\)"):
        ours.generate(ids, **options)
    full = {"output_logits": True, "return_dict_in_generate": True, **options}
    runs = [
        tiny_variant({"model": model}, implementation)
        .eval()
        .generate(ids, past_key_values=DynamicCache(), **full)
        for implementation in ("ringdilated", "eager")
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    close = tolerance(model)
    for a, b in zip(runs[0].logits, runs[1].logits, strict=True):
        assert torch.allclose(a, b, **close)


@pytest.mark.parametrize("order", ["5.23", "5.24"])
def test_a_packed_sliding_window_mask_gives_documents_and_window(order: str) -> None:
    """transformers makes the sliding-window mask packed-sequence compatible around it (the
    packed-sequence mask first in 5.23, second in 5.24): the documents and the window both."""
    from transformers.masking_utils import (
        and_masks,
        packed_sequence_mask_function,
        remap_positions_for_packed_sequence,
        sliding_window_causal_mask_function,
    )

    ids, positions = torch.tensor([[0, 0, 0, 1, 1]]), torch.tensor([[0, 1, 2, 0, 1]])
    parts = [
        packed_sequence_mask_function(ids),
        remap_positions_for_packed_sequence(sliding_window_causal_mask_function(3), positions),
    ]
    function = and_masks(*(parts if order == "5.23" else parts[::-1]))
    mask = ringdilated.hf.padding_mask(
        batch_size=1, q_length=5, kv_length=5, mask_function=function
    )
    assert (mask.overlay, mask.sliding_window, mask.window) == (None, 3, (2, 0))
    assert mask.documents is ids
