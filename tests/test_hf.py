"""The Hugging Face adapter (``ringdilated.hf``) on a tiny Llama built locally, no downloads:
a dense pattern equals transformers' own sdpa attention (training step and ``generate()``); a
dilated pattern runs, and padded or packed rows give what each sequence gives alone."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
import ringdilated.hf  # noqa: E402  (registers "ringdilated")

VOCAB = 64


def _model(segments: list[int], rates: list[int], implementation: str, seed: int = 0):  # type: ignore[no-untyped-def]
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        ringdilated_segment_lengths=segments,
        ringdilated_dilation_rates=rates,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).double()
    model.set_attn_implementation(implementation)
    model.generation_config.eos_token_id = None  # greedy runs always decode every token asked
    return model


def _ids(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_a_dense_pattern_equals_sdpa_in_a_training_step_and_generate() -> None:
    """Segment >= L and rate 1 is dense causal attention: logits, gradients and greedy tokens
    equal transformers' sdpa attention on the same weights."""
    ours, theirs = _model([128], [1], "ringdilated"), _model([128], [1], "sdpa")
    ids = _ids(2, 24)
    losses = []
    for model in (ours, theirs):
        model.train()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append((out.logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (logits, grads), (ref_logits, ref_grads) = losses
    assert float((logits - ref_logits).abs().max()) < 1e-10
    assert max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads, strict=True)) < 1e-10
    prompt = _ids(1, 7, seed=2)
    tokens = [
        m.eval().generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        for m in (ours, theirs)
    ]
    assert torch.equal(tokens[0], tokens[1])


def test_padded_rows_give_the_logits_each_sequence_gives_alone() -> None:
    model = _model([4, 8], [1, 2], "ringdilated").eval()
    first, second = _ids(1, 13, seed=3), _ids(1, 9, seed=4)
    with torch.no_grad():
        alone = [model(input_ids=x).logits for x in (first, second)]
        for left in (False, True):
            ids = torch.zeros(2, 13, dtype=torch.long)
            mask = torch.zeros(2, 13, dtype=torch.long)
            ids[0], mask[0] = first[0], 1
            valid = slice(4, 13) if left else slice(0, 9)
            ids[1, valid], mask[1, valid] = second[0], 1
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            assert float((logits[0] - alone[0][0]).abs().max()) < 1e-10, left
            assert float((logits[1, valid] - alone[1][0]).abs().max()) < 1e-10, left


def test_packed_sequences_give_the_logits_each_gives_alone() -> None:
    """cu_seq_lens (as DataCollatorWithFlattening passes them) become cu_seqlens."""
    model = _model([4, 8], [1, 2], "ringdilated").eval()
    first, second = _ids(1, 11, seed=5), _ids(1, 6, seed=6)
    packed = torch.cat([first, second], 1)
    bounds = torch.tensor([0, 11, 17], dtype=torch.int32)
    positions = torch.cat([torch.arange(11), torch.arange(6)]).unsqueeze(0)
    with torch.no_grad():
        logits = model(
            input_ids=packed, position_ids=positions, use_cache=False,
            cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=11, max_length_k=11,
        ).logits  # fmt: skip
        alone = [model(input_ids=x).logits for x in (first, second)]
    assert float((logits[0, :11] - alone[0][0]).abs().max()) < 1e-10
    assert float((logits[0, 11:] - alone[1][0]).abs().max()) < 1e-10


def test_generate_with_a_dilated_pattern_decodes_padded_prompts_as_alone() -> None:
    """Left-padded batched greedy decoding (transformers' cache: a query suffix each step)
    gives each prompt the tokens it gets alone."""
    model = _model([4, 8], [1, 2], "ringdilated").eval()
    prompts = [_ids(1, 9, seed=7), _ids(1, 5, seed=8)]
    alone = [model.generate(p, max_new_tokens=10, do_sample=False, pad_token_id=0) for p in prompts]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    ids[0], mask[0] = prompts[0][0], 1
    ids[1, 4:], mask[1, 4:] = prompts[1][0], 1
    batched = model.generate(
        ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0
    )
    assert torch.equal(batched[0, 9:], alone[0][0, 9:])
    assert torch.equal(batched[1, 9:], alone[1][0, 5:])


def test_a_missing_pattern_and_a_custom_4d_mask_are_rejected() -> None:
    model = _model([4], [1], "ringdilated").eval()
    del model.config.ringdilated_dilation_rates
    with pytest.raises(ValueError, match=r"needs config\.ringdilated_dilation_rates"):
        model(input_ids=_ids(1, 8))
    model = _model([4], [1], "ringdilated").eval()
    with pytest.raises(ValueError, match="a custom 4-D mask is not supported"):
        model(input_ids=_ids(1, 8), attention_mask=torch.ones(1, 1, 8, 8))


def test_packing_signalled_only_by_position_ids_keeps_documents_apart() -> None:
    """position_ids that restart at 0 (DataCollatorWithFlattening without flash kwargs) are
    packed documents, as sdpa's mask makes them."""
    ours, theirs = _model([64], [1], "ringdilated").eval(), _model([64], [1], "sdpa").eval()
    ids = _ids(1, 17, seed=9)
    positions = torch.cat([torch.arange(11), torch.arange(6)]).unsqueeze(0)
    with torch.no_grad():
        a, b = (
            m(input_ids=ids, position_ids=positions, use_cache=False).logits for m in (ours, theirs)
        )
    assert float((a - b).abs().max()) < 1e-10


def test_is_causal_passed_by_transformers_wins_over_the_module_attribute() -> None:
    """A model whose attention module says is_causal=False but whose forward passes
    is_causal=True (CLIP's text encoder) gets causal attention, as with sdpa."""
    model = _model([64], [1], "ringdilated").eval()
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    ids = _ids(1, 9, seed=10)
    with torch.no_grad():
        forced = model(input_ids=ids, is_causal=True).logits
        reference = _model([64], [1], "sdpa").eval()(input_ids=ids).logits
    assert float((forced - reference).abs().max()) < 1e-10


def test_layouts_it_cannot_place_are_refused_not_miscomputed() -> None:
    """A static cache (queries not at the end of the keys) raises."""
    model = _model([8], [1], "ringdilated").eval()
    ids = _ids(1, 7, seed=11)
    with pytest.raises(ValueError, match="queries to be the last positions of the keys"):
        model.generate(
            ids, max_new_tokens=3, do_sample=False, pad_token_id=0, cache_implementation="static"
        )


def test_packing_follows_transformers_own_detection() -> None:
    """transformers packs only without a mask and a cache, splitting wherever position_ids do
    not step by 1; the adapter does exactly that (and nothing otherwise)."""
    ours, theirs = _model([64], [1], "ringdilated").eval(), _model([64], [1], "sdpa").eval()
    ids = _ids(1, 12, seed=12)
    jumps = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 5, 6, 7, 8, 9]])  # three documents for sdpa
    with torch.no_grad():
        for kwargs in (
            {"position_ids": jumps, "use_cache": False},
            {"position_ids": jumps, "use_cache": True},  # a cache: transformers does not pack
            {"position_ids": jumps, "use_cache": False, "attention_mask": torch.ones(1, 12)},
        ):
            a, b = (m(input_ids=ids, **kwargs).logits for m in (ours, theirs))
            assert float((a - b).abs().max()) < 1e-10, kwargs


def _packed(base, positions, ids, order):  # type: ignore[no-untyped-def]
    """``base`` made packed-sequence compatible as transformers 5.23 (packed-sequence mask
    first) or 5.24 (second, after any overlay) builds it."""
    from transformers.masking_utils import (
        and_masks,
        packed_sequence_mask_function,
        remap_positions_for_packed_sequence,
    )

    parts = [
        packed_sequence_mask_function(ids),
        remap_positions_for_packed_sequence(base, positions),
    ]
    return and_masks(*(parts if order == "5.23" else parts[::-1]))


@pytest.mark.parametrize("order", ["5.23", "5.24"])
def test_packed_mask_functions_are_recognised_in_either_order(order: str) -> None:
    """transformers 5.24 puts the packed-sequence mask second in and_masks(...) (issue 21,
    item 1): both orders, over causal or bidirectional, give the documents, no overlay."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    ids = torch.tensor([[0, 0, 0, 1, 1]])
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    common = {"batch_size": 1, "q_length": 5, "kv_length": 5}
    for base in (causal_mask_function, bidirectional_mask_function):
        mask = ringdilated.hf.padding_mask(
            mask_function=_packed(base, positions, ids, order), **common
        )
        assert mask.overlay is None, mask.overlay
        assert mask.documents is ids
        assert mask.layout is not None


@pytest.mark.parametrize("order", ["5.23", "5.24"])
def test_an_overlay_on_packed_sequences_is_refused(order: str) -> None:
    from transformers.masking_utils import (
        and_masks,
        bidirectional_mask_function,
        causal_mask_function,
        or_masks,
        packed_sequence_mask_function,
        sliding_window_overlay,
    )

    ids = torch.tensor([[0, 0, 0, 1, 1]])
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    either = or_masks(causal_mask_function, bidirectional_mask_function)
    common = {"batch_size": 1, "q_length": 5, "kv_length": 5}
    for function, found in (
        (
            _packed(either, positions, ids, order),
            "or_masks(causal_mask_function, bidirectional_mask_function)",
        ),
        (
            and_masks(
                _packed(causal_mask_function, positions, ids, order), sliding_window_overlay(2)
            ),
            "sliding_window_overlay(...)",
        ),
        (  # two packed-sequence masks and no remapped one
            and_masks(packed_sequence_mask_function(ids), packed_sequence_mask_function(ids)),
            "and_masks(packed_sequence_mask_function(...), packed_sequence_mask_function(...))",
        ),
        (
            and_masks(causal_mask_function, bidirectional_mask_function),
            "and_masks(causal_mask_function, bidirectional_mask_function)",
        ),
    ):
        overlay = ringdilated.hf.padding_mask(mask_function=function, **common).overlay
        assert overlay is not None and found in overlay, overlay


def test_a_mask_function_it_does_not_serve_is_reported_as_found() -> None:
    """The error names how transformers built the mask function it got (issue 21, item 1:
    never "an overlay" for a mask it merely failed to read)."""
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        sliding_window_bidirectional_overlay,
    )

    def custom(batch_idx, head_idx, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return kv_idx <= q_idx

    model = _model([8], [1], "ringdilated").eval()
    attention = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 8, dtype=torch.float64)
    kv = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    common = {"batch_size": 1, "q_length": 5, "kv_length": 5}
    for function, found in (
        (
            # (a causal mask under a bidirectional window: none of transformers' windows)
            and_masks(causal_mask_function, sliding_window_bidirectional_overlay(4)),
            r"transformers asked for and_masks\(causal_mask_function, "
            r"sliding_window_bidirectional_overlay\(\.\.\.\)\)",
        ),
        (custom, r"transformers asked for [\w.]*test_hf\.test_a_mask_function_it_does_not_serve"),
    ):
        mask = ringdilated.hf.padding_mask(mask_function=function, **common)
        with pytest.raises(ValueError, match=found):
            ringdilated.hf.attention_forward(attention, q, kv, kv, mask)


def _cache_kwarg(model, cache):  # type: ignore[no-untyped-def]
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns)."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("columns", [25, 15])
def test_an_attention_mask_not_one_column_per_key_is_refused(use_cache: bool, columns: int) -> None:
    """A 2-D attention_mask must have one column per key (issue 21, item 5): 25 columns on 20
    tokens were read from their last 20 (transformers reads the first), and 15 all-ones columns
    passed as no padding; both raise an error about the mask naming both lengths."""
    model = _model([4, 8], [1, 2], "ringdilated").eval()
    mask = torch.ones(1, columns, dtype=torch.long)
    with (
        torch.no_grad(),
        pytest.raises(
            ValueError,
            match=rf"one attention_mask column per key \(1 = token, 0 = padding\): 20 keys \(0 "
            rf"cached \+ 20 new positions\), got an attention_mask of {columns} columns",
        ),
    ):
        model(input_ids=_ids(1, 20), attention_mask=mask, use_cache=use_cache)


def test_a_decode_step_takes_a_mask_over_cached_and_new_positions() -> None:
    """With transformers' cache the keys are the cached positions then the new ones, and so is
    the mask: a step with such a mask (left padding in the prompt) equals sdpa's logits; a mask
    over the new positions only is refused, naming both lengths."""
    ours, theirs = _model([64], [1], "ringdilated").eval(), _model([64], [1], "sdpa").eval()
    ids = _ids(2, 20, seed=13)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :6] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    step = _ids(2, 1, seed=14)
    grown = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    logits = []
    with torch.no_grad():
        for model in (ours, theirs):
            past = model(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True
            ).past_key_values
            out = model(
                input_ids=step, attention_mask=grown, position_ids=positions[:, -1:] + 1,
                use_cache=True, **_cache_kwarg(model, past),
            )  # fmt: skip
            logits.append(out.logits)
        assert float((logits[0] - logits[1]).abs().max()) < 1e-10
        past = ours(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"21 keys \(20 cached \+ 1 new positions\), got an "
                           r"attention_mask of 1 columns"):  # fmt: skip
            ours(
                input_ids=step, attention_mask=torch.ones(2, 1), use_cache=True,
                **_cache_kwarg(ours, past),
            )  # fmt: skip


def test_an_attention_mask_row_with_holes_is_refused_in_transformers_convention() -> None:
    """The adapter takes transformers' attention_mask (1 = token, 0 = padding; issue 21, item
    8): a row whose tokens are not one run is refused in those terms, not as a
    key_padding_mask (True = padding) the user never passed."""
    model = _model([4, 8], [1, 2], "ringdilated").eval()
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 3:5] = 0
    with (
        torch.no_grad(),
        pytest.raises(
            ValueError,
            match=r"attention_mask row's tokens \(1 = token, 0 = padding\) in one contiguous run "
            r"\(left or right padding\); row 1 has 10 tokens between columns 0 and 11",
        ),
    ):
        model(input_ids=_ids(2, 12), attention_mask=mask)


def test_a_tiny_llama_compiles_without_a_graph_break() -> None:
    """fullgraph=True: unpadded rows run on the layout op; a padded batch, whose mask the op
    reads per call under compile, too; both equal eager."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _model([4, 8], [1, 2], "ringdilated").eval()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = _ids(2, 16, seed=9)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask, "position_ids": positions}):
            eager = model(input_ids=ids, **kwargs).logits
            out = compiled(input_ids=ids, **kwargs).logits
            assert float((out - eager).abs().max()) < 1e-12, kwargs
    assert not dict(torch._dynamo.utils.counters["graph_break"])


def test_decoding_reads_the_cache_without_copying_it() -> None:
    """A decode step over transformers' cache of 300 positions: no op allocates a tensor a
    quarter as large as a layer's cached keys (the adapter reads them through strided views).
    transformers' own cache grows by ``torch.cat`` (its copy, whichever attention runs): not
    counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _model([16, 32], [1, 2], "ringdilated").eval()
    cached = 300
    prompt = _ids(1, cached, seed=10)
    with torch.no_grad():
        first = model(input_ids=prompt, use_cache=True)
        past = first.past_key_values
        keys = past.layers[0].keys
        limit = keys.numel() // 4  # a copy of a layer's keys would be 4x this

        class Largest(TorchDispatchMode):
            largest = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                inputs = {
                    x.untyped_storage().data_ptr() for x in args if isinstance(x, torch.Tensor)
                }
                for x in out if isinstance(out, (tuple, list)) else (out,):
                    fresh = isinstance(x, torch.Tensor) and (
                        x.untyped_storage().data_ptr() not in inputs  # not a view
                    )
                    if fresh and func is not torch.ops.aten.cat.default:
                        type(self).largest = max(type(self).largest, x.numel())
                return out

        step = _ids(1, 1, seed=11)
        with Largest():
            model(input_ids=step, use_cache=True, **_cache_kwarg(model, past))
    assert Largest.largest < limit, (Largest.largest, limit)


def _padded_decode_step():  # type: ignore[no-untyped-def]
    """A tiny Llama, a left-padded prompt of two rows in its cache, and the next step's inputs:
    ``(model, step kwargs)``, the step's attention_mask over the cached and new positions."""
    model = _model([8], [1], "ringdilated").eval()
    ids = _ids(2, 12, seed=15)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        past = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True
        ).past_key_values
    step = {
        "input_ids": _ids(2, 1, seed=16),
        "attention_mask": torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
        "position_ids": positions[:, -1:] + 1,
        "use_cache": True,
        **_cache_kwarg(model, past),
    }
    return model, step


def test_a_padded_decode_step_reads_the_mask_once() -> None:
    """A review found the adapter read a padded batch's attention_mask on the host twice per
    forward, every decode step included (a check of its runs, then the layout's read, which
    checks them again). Now ringdilated's own reads in a step are the layout's one read of the
    mask (for every layer) and the all-ones test that skips it."""
    from ringdilated.testing.hot_path import HotPathCounter

    model, step = _padded_decode_step()
    with torch.no_grad(), HotPathCounter() as counts:
        model(**step)
    ours = [what for kind, what in counts.events if kind == "read" and "/transformers/" not in what]
    assert len(ours) == 2, counts.events
    assert sum("tolist" in what for what in ours) == 1, ours


def test_a_decode_step_mask_with_holes_is_refused_in_transformers_convention() -> None:
    """The check of the runs is the layout's now; its error is still given in the adapter's
    terms (attention_mask, 1 = token), on a decode step as on a prompt."""
    model, step = _padded_decode_step()
    step["attention_mask"][0, 5] = 0  # row 0: tokens at 0-4 and 6-12
    with (
        torch.no_grad(),
        pytest.raises(
            ValueError,
            match=r"attention_mask row's tokens \(1 = token, 0 = padding\) in one contiguous run "
            r"\(left or right padding\); row 0 has 12 tokens between columns 0 and 12",
        ),
    ):
        model(**step)


def test_a_warning_through_the_adapter_names_the_user_s_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A review found ringdilated's warnings through a Hugging Face model named transformers'
    modeling_llama.py (the frame that called the adapter); they name the user's line."""
    import torch.distributed as dist

    from ringdilated import DistributedNotInitializedWarning
    from ringdilated.core.call import grid

    assert not dist.is_initialized()
    model = _model([8], [1], "ringdilated").eval()
    monkeypatch.setenv("WORLD_SIZE", "2")  # a launched rank without init_process_group
    monkeypatch.setattr(grid, "_warned_alone", False)
    with torch.no_grad(), pytest.warns(DistributedNotInitializedWarning) as caught:
        model(input_ids=_ids(1, 8))
    assert [w.filename for w in caught] == [__file__]


def test_softcap_and_sinks_pass_through_as_gemma2_and_gpt_oss_pass_them() -> None:
    """``softcap=`` (Gemma 2) and ``s_aux=`` (gpt-oss's sinks, in the model's dtype) reach the
    call: the result is the oracle's with both."""
    import types

    from ringdilated.testing import max_error, oracle

    config = types.SimpleNamespace(
        ringdilated_segment_lengths=[4, 8], ringdilated_dilation_rates=[1, 2],
        ringdilated_kernel="reference",
    )  # fmt: skip
    module = types.SimpleNamespace(config=config, is_causal=True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    out, _ = ringdilated.hf.attention_forward(
        module,
        3 * q,
        k,
        v,
        None,
        scaling=0.5,
        softcap=1.5,
        s_aux=sinks,  # type: ignore[arg-type]
    )
    expected = oracle(
        (3 * q).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), [4, 8], [1, 2],
        causal=True, scale=0.5, softcap=1.5, sinks=sinks,
    )  # fmt: skip
    assert max_error(out, expected) < 1e-12
