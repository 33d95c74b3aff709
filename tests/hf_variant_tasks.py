"""Tasks for tests/test_hf_variants.py, run on every rank of a gloo pool, and the tiny Mistral,
Gemma-2 and gpt-oss models they shard (the tests build the one-process references).

A case is a dict as tests/hf_tasks.py's (``input_ids``, optional ``attention_mask``,
``cu_seqlens``) with ``model``: ``"mistral"``, ``"gemma2"`` or ``"gpt_oss"``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.hf_tasks import VOCAB, batch_tensors, communicators

WINDOW = 4
"""transformers' ``sliding_window`` of every model: smaller than every test sequence."""

_COMMON = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 256, "sliding_window": WINDOW,
    # Dense: one segment covering every test sequence at rate 1, so only the window bounds it.
    "ringdilated_segment_lengths": [64], "ringdilated_dilation_rates": [1],
}  # fmt: skip
_HYBRID = ["sliding_attention", "full_attention"]


def tiny_variant(case: dict[str, Any], implementation: str) -> Any:
    """A float64 model of ``case["model"]``'s family, seeded (the same weights in every process),
    in training mode, with ``case["pattern"]`` (segment lengths, dilation rates; default dense:
    ``[64], [1]``):

    - ``"mistral"``: ``sliding_window`` on every layer;
    - ``"gemma2"``: a sliding layer then a global one (``layer_types``),
      ``attn_logit_softcapping=2.0`` (small, so the cap bends these scores), ``kernel=
      "reference"`` (the fused sdpa kernel lacks softcap and would warn that it picks it);
      With ``case["bidirectional"]``: ``use_bidirectional_attention`` (the modules' ``is_causal``
      false) and ``is_causal=False`` (transformers' masks then bidirectional, the sliding one
      ``abs(q - kv) <= w``);
    - ``"gpt_oss"``: the same layers, attention sinks drawn away from their zero init, the
      smallest MoE (2 experts, 1 per token) with transformers' ``"eager"`` experts (its grouped
      matmul takes no float64), default rotary embeddings (not YaRN, which warns on these sizes).
    """
    import transformers

    import ringdilated.hf  # noqa: F401  (registers "ringdilated")

    family = case["model"]
    segments, rates = case.get("pattern", ([64], [1]))
    common = {
        **_COMMON, "ringdilated_segment_lengths": list(segments),
        "ringdilated_dilation_rates": list(rates),
    }  # fmt: skip
    if family == "mistral":
        config: Any = transformers.MistralConfig(**common)
        build: Any = transformers.MistralForCausalLM
    elif family == "gemma2":
        config = transformers.Gemma2Config(
            **common, layer_types=_HYBRID, attn_logit_softcapping=2.0, query_pre_attn_scalar=8,
            ringdilated_kernel="reference", **_bidirectional(case),
        )  # fmt: skip
        build = transformers.Gemma2ForCausalLM
    elif family == "gpt_oss":
        config = transformers.GptOssConfig(
            **common, layer_types=_HYBRID, num_local_experts=2, num_experts_per_tok=1,
            experts_implementation="eager",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )  # fmt: skip
        build = transformers.GptOssForCausalLM
    else:
        raise AssertionError(family)
    torch.manual_seed(0)
    model = build(config).double()
    if family == "gpt_oss":
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for layer in model.model.layers:
                sinks = layer.self_attn.sinks
                sinks.copy_(torch.randn(sinks.shape, generator=generator, dtype=sinks.dtype))
    model.set_attn_implementation(implementation)
    return model.train()


def _bidirectional(case: dict[str, Any]) -> dict[str, Any]:
    if not case.get("bidirectional"):
        return {}
    return {"use_bidirectional_attention": True, "is_causal": False}


def sharded_variant_step(case: dict[str, Any]) -> dict[str, Any]:
    """shard -> forward under sequence_parallel -> sharded loss -> backward on this rank: its
    logits, its own parameter gradients (not reduced), the loss, where its shard lies and the
    communicators its calls ran with (as tests/hf_tasks.py's ``sharded_step``)."""
    import ringdilated
    import ringdilated.hf

    model = tiny_variant(case, "ringdilated")
    shard = ringdilated.shard_batch(**batch_tensors(case), process_group=dist.group.WORLD)
    with ringdilated.hf.sequence_parallel(shard.layout):
        logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
    loss = ringdilated.sharded_cross_entropy(logits, shard.labels, dist.group.WORLD)
    loss.backward()
    return {
        "logits": logits.detach(),
        "loss": loss.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "start": shard.start,
        "communicators": communicators(shard.layout),
    }
