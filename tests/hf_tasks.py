"""Tasks for tests/test_hf_sequence_parallel.py, run on every rank of a gloo pool, and the tiny
Llama they shard (the tests build its one-process references in the test process).

A case is a dict: ``input_ids`` (rows of ints), optional ``labels``, ``attention_mask``,
``cu_seqlens``; the model's ``pattern`` (segment lengths, dilation rates) and ``mode``; the
``communicator``; ``grid`` (a 2 x 2 mesh, for ``"hybrid"``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

VOCAB = 64


def tiny_llama(case: dict[str, Any], implementation: str) -> Any:
    """A 2-layer float64 Llama with grouped-query heads (4 query, 2 key/value), seeded: the
    same weights in every process."""
    import transformers

    import ringdilated.hf  # noqa: F401  (registers "ringdilated")

    segments, rates = case.get("pattern", ([64], [1]))
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        ringdilated_segment_lengths=list(segments), ringdilated_dilation_rates=list(rates),
        ringdilated_mode=case.get("mode", "head_groups"),
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    model.set_attn_implementation(implementation)
    return model.train()


def batch_tensors(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``shard_batch``'s tensor arguments for ``case`` (the whole batch)."""
    out = {"input_ids": torch.tensor(case["input_ids"])}
    for name in ("labels", "attention_mask", "cu_seqlens"):
        if case.get(name) is not None:
            out[name] = torch.tensor(case[name])
    return out


def _process_layout(case: dict[str, Any]) -> object:
    if case.get("grid"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
        return (mesh, ("ring", "ulysses"))
    return dist.group.WORLD


def sharded_step(case: dict[str, Any]) -> dict[str, Any]:
    """shard -> forward under sequence_parallel -> sharded loss -> backward on this rank: its
    logits, its own parameter gradients (not reduced), the loss and where its shard lies."""
    import ringdilated
    import ringdilated.hf

    group = _process_layout(case)
    model = tiny_llama(case, "ringdilated")
    if case.get("checkpointing"):  # layers recomputed in backward, outside the with block
        model.gradient_checkpointing_enable({"use_reentrant": False})
    shard = ringdilated.shard_batch(**batch_tensors(case), process_group=group)
    local_mask = case.get("pass_attention_mask") and "attention_mask" in case
    kwargs: dict[str, Any] = {}
    if local_mask:  # this shard's columns of the batch's mask: read and checked, not needed
        mask = torch.tensor(case["attention_mask"])
        kwargs["attention_mask"] = mask[:, shard.start : shard.start + shard.input_ids.shape[1]]
    with ringdilated.hf.sequence_parallel(
        shard.layout, communicator=case.get("communicator", "auto")
    ):
        logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids, **kwargs).logits
    loss = ringdilated.sharded_cross_entropy(logits, shard.labels, group)
    loss.backward()
    return {
        "logits": logits.detach(),
        "loss": loss.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "start": shard.start,
        "length": shard.length,
    }


def fsdp_step(case: dict[str, Any]) -> dict[str, Any]:
    """A dp x cp mesh over 4 ranks, FSDP2 over all of them, the sequence sharded on cp:
    replica ``dp`` takes row ``dp`` of the batch, the loss is the token-weighted mean over the
    whole batch (``averaged_over`` = the 4 ranks FSDP2 averages over). ``case["mesh"]``:
    ``"torch"`` (``init_device_mesh``, dimensions ``("dp", "cp")``) or ``"accelerate"``
    (``accelerate.ParallelismConfig(dp_shard_size=2, cp_size=2).build_device_mesh("cpu")``:
    FSDP2 over its flattened ``"dp_shard_cp"``, the loss over ``"dp_cp"``). Returns the loss
    and the full (unsharded) gradients, which FSDP2 has averaged."""
    from torch.distributed.fsdp import fully_shard

    import ringdilated
    import ringdilated.hf

    if case["mesh"] == "accelerate":
        from accelerate.parallelism_config import ParallelismConfig

        mesh = ParallelismConfig(dp_shard_size=2, cp_size=2).build_device_mesh("cpu")
        dp = mesh.get_local_rank("dp_shard")
        fsdp_mesh, loss_group = mesh["dp_shard_cp"], mesh["dp_cp"]
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        dp = mesh.get_local_rank("dp")
        fsdp_mesh, loss_group = init_device_mesh("cpu", (4,)), dist.group.WORLD
    model = tiny_llama(case, "ringdilated")
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    rows = {k: v[dp : dp + 1] for k, v in batch_tensors(case).items() if k != "cu_seqlens"}
    shard = ringdilated.shard_batch(**rows, process_group=(mesh, "cp"))
    with ringdilated.hf.sequence_parallel(shard.layout, communicator=case["communicator"]):
        logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
    loss = ringdilated.sharded_cross_entropy(
        logits, shard.labels, loss_group, averaged_over=dist.get_world_size()
    )
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads}


def bad_shard(case: dict[str, Any]) -> str:
    """Rank ``case["bad_rank"]`` passes what ``case["mistake"]`` names; every rank's outcome."""
    import ringdilated
    import ringdilated.hf

    rank = dist.get_rank()
    model = tiny_llama(case, "ringdilated")
    shard = ringdilated.shard_batch(**batch_tensors(case), process_group=dist.group.WORLD)
    kwargs: dict[str, Any] = {"input_ids": shard.input_ids, "position_ids": shard.position_ids}
    if rank == case["bad_rank"]:
        if case["mistake"] == "no position_ids":
            del kwargs["position_ids"]
        elif case["mistake"] == "a mask with a hole":
            kwargs["attention_mask"] = torch.ones_like(shard.input_ids)
            kwargs["attention_mask"][0, 1] = 0
    try:
        with ringdilated.hf.sequence_parallel(shard.layout):
            model(**kwargs)
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
