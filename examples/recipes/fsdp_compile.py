"""Recipe: FSDP2 on a dp x cp DeviceMesh, non-reentrant activation checkpointing and
torch.compile of each DilatedTransformerBlock, the attention sharded on "cp" (docs/recipes.md).

    torchrun --nproc-per-node 4 examples/recipes/fsdp_compile.py   # gloo on CPU, NCCL on GPUs

tests/test_training.py runs ``train`` on 4 gloo ranks (compiled with ``backend="aot_eager"``:
inductor needs a C++ compiler and minutes on a CPU) and checks the losses and the parameters
against one process, in float64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from launch import init_distributed, report
from tiny_lm import TinyLM, synthetic_batches
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import ringdilated

LEARNING_RATE = 0.5


# --8<-- [start:parallelize]
def parallelize(model: TinyLM, mesh: DeviceMesh, compile_backend: str = "inductor") -> TinyLM:
    """Activation checkpointing, then ``torch.compile`` of each block, then FSDP2 over every
    rank of ``mesh`` (torchtitan's order, torchtitan/models/llama3/infra/parallelize.py). The
    blocks already run their attention on ``(mesh, "cp")``: FSDP shards parameters, not the
    sequence."""
    model.activation_checkpointing = True  # torch.utils.checkpoint, use_reentrant=False
    # FSDP over every rank of the dp x cp mesh, which spans the world here: a 1-D mesh as large
    # as the world is the default group. (With more dimensions, flatten "dp" and "cp" instead.)
    fsdp_mesh = init_device_mesh(mesh.device_type, (mesh.size(),), mesh_dim_names=("fsdp",))
    for block in model.blocks:
        block.compile(backend=compile_backend)  # a call on a layout is one op: no graph break
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    return model


# --8<-- [end:parallelize]


# --8<-- [start:train]
def train(
    mesh: DeviceMesh,
    device: torch.device,
    steps: int,
    dtype: torch.dtype = torch.float32,
    compile_backend: str = "inductor",
) -> tuple[list[float], TinyLM]:
    """Train ``TinyLM`` on ``mesh`` ("dp", "cp"); FSDP2 averages the gradients over every rank.
    Returns the loss at each step and the trained (sharded) model."""
    model = TinyLM(process_group=(mesh, "cp"), dtype=dtype).to(device)
    model = parallelize(model, mesh, compile_backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh["dp"].size()
    losses = []
    for batch in synthetic_batches(steps):
        rows = {name: value.chunk(dp_size)[dp_rank] for name, value in batch.items()}
        shard = ringdilated.shard_batch(  # once per step, for every layer
            rows["input_ids"], attention_mask=rows["attention_mask"], process_group=(mesh, "cp")
        ).to(device)
        logits = model(shard.input_ids, layout=shard.layout)
        loss = ringdilated.sharded_cross_entropy(  # the global batch's mean; FSDP averages
            logits, shard.labels, (mesh, ("dp", "cp")), averaged_over=mesh.size()
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


# --8<-- [end:train]


def main() -> None:
    device = init_distributed()
    try:
        world = dist.get_world_size()
        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "cp"))
        # inductor on GPUs; aot_eager on CPU, where inductor needs a C++ compiler and minutes.
        backend = "inductor" if device.type == "cuda" else "aot_eager"
        losses, _ = train(mesh, device, steps=5, compile_backend=backend)
        report("FSDP2 + checkpointing + compile on dp x cp", losses)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
