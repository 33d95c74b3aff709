"""The recipes of examples/recipes/ (docs/recipes.md) as tasks for a gloo pool (``Workers``),
and the one-process training run that each must reproduce, written with plain torch only."""

from __future__ import annotations

import pathlib
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

RECIPES = pathlib.Path(__file__).resolve().parents[1] / "examples" / "recipes"
if str(RECIPES) not in sys.path:  # the recipes import their neighbours, as under torchrun
    sys.path.insert(0, str(RECIPES))

IGNORE = -100


def next_token_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The target at each position, written out: the next token where both it and the position
    are tokens, else ``IGNORE`` (the last position, padding, the last token before padding)."""
    valid = attention_mask.bool()
    labels = torch.full_like(input_ids, IGNORE)
    both = valid[:, :-1] & valid[:, 1:]
    labels[:, :-1] = torch.where(both, input_ids[:, 1:], IGNORE)
    return labels


def one_process_run(
    steps: int, learning_rate: float, one_batch: bool = False, dtype: str = "float64"
) -> dict[str, Any]:
    """``TinyLM`` trained on one process on each whole global batch with torch's mean
    cross-entropy and SGD: the loss at each step and the final parameters. ``one_batch``: the
    first global batch at every step."""
    from tiny_lm import TinyLM, synthetic_batches

    model = TinyLM(dtype=getattr(torch, dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    batches = [next(synthetic_batches(1))] * steps if one_batch else synthetic_batches(steps)
    losses = []
    for batch in batches:
        padding = batch["attention_mask"] == 0
        logits = model(batch["input_ids"], key_padding_mask=padding)
        labels = next_token_labels(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": _params(model)}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name, whole (an FSDP2 parameter gathered from its shards)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def _dtype(payload: dict[str, Any]) -> torch.dtype:
    """The parameters' dtype a task is asked for: ``payload["dtype"]``, float64 by default."""
    dtype: torch.dtype = getattr(torch, payload.get("dtype", "float64"))
    return dtype


def _dp_cp_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "cp"))


def plain_loop(payload: dict[str, Any]) -> dict[str, Any]:
    """examples/recipes/plain_loop.py's ``train`` on a (dp, cp) mesh of this pool's ranks."""
    import plain_loop

    losses, model = plain_loop.train(
        _dp_cp_mesh(), torch.device("cpu"), payload["steps"], _dtype(payload)
    )
    return {"losses": losses, "params": _params(model)}


def fsdp_compile(payload: dict[str, Any]) -> dict[str, Any]:
    """examples/recipes/fsdp_compile.py's ``train`` on a (dp, cp) mesh of this pool's ranks,
    compiled with ``aot_eager``; also how many graphs dynamo compiled."""
    import fsdp_compile

    # torch 2.13 warns when an FSDP2 root returns a view (a linear layer's output on 3-D input
    # is one) that an in-place op could detach from its hooks; the loss does no in-place op.
    warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    losses, model = fsdp_compile.train(
        _dp_cp_mesh(), torch.device("cpu"), payload["steps"], torch.float64, "aot_eager"
    )
    counters = torch._dynamo.utils.counters
    return {
        "losses": losses,
        "params": _params(model),
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": dict(counters["graph_break"]),
    }


def one_process_torchtitan_run(
    steps: int, learning_rate: float, dtype: str = "float64"
) -> dict[str, Any]:
    """examples/recipes/torchtitan_style.py's ``Transformer`` trained on one process: inputs
    ``x[:, :-1]``, labels ``x[:, 1:]`` of each whole global batch, torch's mean cross-entropy."""
    from tiny_lm import synthetic_batches
    from torchtitan_style import Transformer

    model = Transformer(getattr(torch, dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    losses = []
    for batch in synthetic_batches(steps):
        x = batch["input_ids"]
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": _params(model)}


def torchtitan_style(payload: dict[str, Any]) -> dict[str, Any]:
    """examples/recipes/torchtitan_style.py's ``train`` on a (dp, cp) mesh of this pool's ranks."""
    import torchtitan_style

    warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
    losses, model = torchtitan_style.train(
        _dp_cp_mesh(), torch.device("cpu"), payload["steps"], _dtype(payload)
    )
    return {"losses": losses, "params": _params(model)}


def accelerate_mesh(payload: dict[str, Any]) -> dict[str, Any]:
    """examples/recipes/accelerate_cp.py's ``train_loop`` on the mesh of accelerate's own
    ``ParallelismConfig(dp_shard_size=2, cp_size=2)``, the model sharded as accelerate's
    ``fsdp2_prepare_model`` shards it (each block, then the root, on "dp_shard_cp"), each
    "dp_shard" rank given its rows as accelerate's data loader gives them (the same on the ranks
    of a "cp" group). ``Accelerator`` itself refuses this on CPU processes (MULTI_CPU)."""
    from accelerate import ParallelismConfig
    from accelerate_cp import LEARNING_RATE, train_loop
    from tiny_lm import TinyLM, synthetic_batches
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
    warnings.filterwarnings("ignore", "Slicing a flattened dim from root mesh")
    mesh = ParallelismConfig(dp_shard_size=2, cp_size=2).build_device_mesh("cpu")
    model = TinyLM(process_group=mesh["cp"], dtype=_dtype(payload))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp_shard_cp"])
    fully_shard(model, mesh=mesh["dp_shard_cp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    dp_rank = mesh.get_local_rank("dp_shard")
    loader = [
        {name: value.chunk(2)[dp_rank] for name, value in batch.items()}
        for batch in synthetic_batches(payload["steps"])
    ]
    losses = train_loop(model, optimizer, loader, mesh, torch.device("cpu"), torch.Tensor.backward)
    return {"losses": losses, "params": _params(model), "dims": mesh.mesh_dim_names}


def one_process_hf_run(steps: int, learning_rate: float, dtype: str = "float64") -> dict[str, Any]:
    """examples/recipes/hf_plain_loop.py's ``tiny_llama`` trained on one process on each whole
    global batch: transformers' forward with the batch's ``attention_mask`` (its own position
    ids), torch's mean cross-entropy over :func:`next_token_labels`, SGD."""
    from hf_plain_loop import tiny_llama
    from tiny_lm import synthetic_batches

    model = tiny_llama(getattr(torch, dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    losses = []
    for batch in synthetic_batches(steps):
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits
        labels = next_token_labels(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": _params(model)}


def hf_plain_loop(payload: dict[str, Any]) -> dict[str, Any]:
    """examples/recipes/hf_plain_loop.py's ``train`` on a (dp, cp) mesh of this pool's ranks."""
    import hf_plain_loop

    losses, model = hf_plain_loop.train(
        _dp_cp_mesh(), torch.device("cpu"), payload["steps"], _dtype(payload)
    )
    return {"losses": losses, "params": _params(model)}
