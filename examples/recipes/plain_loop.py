"""Recipe: a plain training loop on a dp x cp mesh, DDP over every rank (docs/recipes.md).

    torchrun --nproc-per-node 4 examples/recipes/plain_loop.py   # gloo on CPU, NCCL on GPUs

The loss each step is the one-process mean over every counted token of the global batch:
tests/test_recipes.py checks it and the parameters against one process, in float64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from launch import init_distributed, report
from tiny_lm import TinyLM, synthetic_batches
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import ringdilated

LEARNING_RATE = 0.5


# --8<-- [start:train]
def train(
    mesh: DeviceMesh, device: torch.device, steps: int, dtype: torch.dtype = torch.float32
) -> tuple[list[float], TinyLM]:
    """Train ``TinyLM`` on ``mesh`` ("dp", "cp"): each "cp" group holds one data-parallel share
    of the global batch and splits its sequences; DDP averages the gradients over every rank.
    Returns the loss at each step and the trained model."""
    model = TinyLM(process_group=(mesh, "cp"), dtype=dtype).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE)
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh["dp"].size()
    losses = []
    for batch in synthetic_batches(steps):
        # This "dp" rank's rows, the same on every rank of its "cp" group (a data loader
        # sharded over "dp" only: DistributedSampler(num_replicas=dp_size, rank=dp_rank)).
        rows = {name: value.chunk(dp_size)[dp_rank] for name, value in batch.items()}
        # Once per step: this rank's slice of every sequence, labels shifted before sharding,
        # the batch's layout (documents, padding, shard lengths) for every layer.
        shard = ringdilated.shard_batch(
            rows["input_ids"], attention_mask=rows["attention_mask"], process_group=(mesh, "cp")
        ).to(device)
        logits = ddp(shard.input_ids, layout=shard.layout)
        # The mean over every counted token of the global batch, on every rank; each rank's
        # gradient is its tokens' share times mesh.size(), which DDP's average divides out.
        loss = ringdilated.sharded_cross_entropy(
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
        losses, _ = train(mesh, device, steps=5)
        report("plain loop, DDP on dp x cp", losses)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
