"""Tasks for tests/test_shard_batch.py, run on every rank of a gloo pool, and the tiny language
model they train (the tests run its one-process reference in the test process)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB, WIDTH, MAX_POSITION = 11, 8, 64


class TinyLM(nn.Module):
    """Token and learned position embeddings, one causal or bidirectional
    :class:`ringdilated.DilatedTransformerBlock` with rotary embeddings, a head: wrong positions
    (either source) or wrong documents change its logits. Seeded: equal on every rank."""

    def __init__(self, causal: bool, process_group: object = None) -> None:
        import ringdilated
        from ringdilated.rotary import rotary_embedding

        super().__init__()
        torch.manual_seed(0)
        f64 = torch.float64
        self.embed = nn.Embedding(VOCAB, WIDTH, dtype=f64)
        self.position = nn.Embedding(MAX_POSITION, WIDTH, dtype=f64)
        self.block = ringdilated.DilatedTransformerBlock(
            WIDTH, 2, segment_lengths=[4, 8], dilation_rates=[1, 2], causal=causal,
            process_group=process_group, dtype=f64, rotary=rotary_embedding,
        )  # fmt: skip
        self.head = nn.Linear(WIDTH, VOCAB, dtype=f64)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **where: Any) -> Any:
        """Logits ``(B, n, VOCAB)``; ``where``: the block's ``layout=``, or ``cu_seqlens=`` /
        ``key_padding_mask=`` on one process."""
        x = self.embed(input_ids) + self.position(position_ids)
        return self.head(self.block(x, **where))


def batch_tensors(case: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``shard_batch`` that ``case`` describes (the whole batch)."""
    out: dict[str, Any] = {"input_ids": torch.tensor(case["input_ids"])}
    for name in ("labels", "attention_mask", "position_ids", "cu_seqlens"):
        if case.get(name) is not None:
            out[name] = torch.tensor(case[name])
    return out


def train_step(case: dict[str, Any]) -> dict[str, Any]:
    """shard -> forward -> loss -> backward on this rank: the loss, this rank's own parameter
    gradients (not reduced) and its shard."""
    import ringdilated

    group = dist.group.WORLD
    model = TinyLM(case["causal"], group)
    shard = ringdilated.shard_batch(
        **batch_tensors(case), process_group=group,
        pad_to_multiple_of=case.get("pad_to_multiple_of"), pad_token_id=case.get("pad_id", 0),
    )  # fmt: skip
    logits = model(shard.input_ids, shard.position_ids, layout=shard.layout)
    loss = ringdilated.sharded_cross_entropy(logits, shard.labels, group)
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "start": shard.start,
        "length": shard.length,
        "input_ids": shard.input_ids,
        "labels": shard.labels,
        "position_ids": shard.position_ids,
        "token_count": shard.token_count,
        "batch_token_count": shard.batch_token_count,
        "shard_lengths": shard.layout.shard_lengths,
    }


def dp_cp_step(case: dict[str, Any]) -> dict[str, Any]:
    """A 2 x 2 (dp, cp) mesh: data-parallel replica ``dp`` takes row ``dp`` of the batch, its cp
    ranks shard it; the loss over ``case['loss_group']`` with ``averaged_over``; then the
    gradients averaged over all 4 ranks, as FSDP2 or DDP over the mesh does."""
    from torch.distributed.device_mesh import init_device_mesh

    import ringdilated

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp = mesh.get_local_rank("dp")
    model = TinyLM(True, (mesh, "cp"))
    tensors = {k: v[dp : dp + 1] for k, v in batch_tensors(case).items()}
    shard = ringdilated.shard_batch(**tensors, process_group=(mesh, "cp"))
    logits = model(shard.input_ids, shard.position_ids, layout=shard.layout)
    loss_group = {
        "world": dist.group.WORLD,
        "grid": (mesh, ("dp", "cp")),
        "cp": (mesh, "cp"),
    }[case["loss_group"]]
    loss = ringdilated.sharded_cross_entropy(
        logits, shard.labels, loss_group, averaged_over=case["averaged_over"]
    )
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        grads[name] = p.grad / dist.get_world_size()
    return {"loss": loss.detach(), "grads": grads}


def autograd_all_reduce_gradient(payload: dict[str, Any]) -> dict[str, float]:
    """The reason ringdilated.loss does not all-reduce its loss through
    ``torch.distributed.nn.functional.all_reduce``: this rank's gradient of ``x`` when every rank
    calls ``backward()`` on ``all_reduce(x * rank_weight) / P``, beside the share it should get."""
    from torch.distributed.nn.functional import all_reduce

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    weight = float(rank + 1)
    (all_reduce(x * weight) / world).backward()
    assert x.grad is not None
    return {"gradient": float(x.grad), "share": weight / world}


def mismatched_batches(payload: dict[str, Any]) -> str:
    """Rank 1's batch differs from the others' in ``payload['field']``: what each rank raises."""
    import ringdilated

    rank = dist.get_rank()
    ids = torch.arange(16).view(2, 8) % VOCAB
    kwargs: dict[str, Any] = {"labels": ids.clone()}
    if rank == 1:
        if payload["field"] == "input_ids":
            ids = ids.clone()
            ids[1, 5] += 1
        else:
            kwargs["labels"][0, 0] = -100
    try:
        ringdilated.shard_batch(ids, process_group=dist.group.WORLD, **kwargs)
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bad_batch_on_one_rank(payload: dict[str, Any]) -> str:
    """Rank ``payload['bad_rank']`` passes float input ids, or (``'short'``) every rank passes a
    sequence shorter than the ranks: what each rank raises."""
    import ringdilated

    rank = dist.get_rank()
    ids = torch.arange(16).view(2, 8)
    if payload.get("short"):
        ids = ids[:, : dist.get_world_size() - 1]
    elif rank == payload["bad_rank"]:
        ids = ids.double()
    try:
        ringdilated.shard_batch(ids, process_group=dist.group.WORLD)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
