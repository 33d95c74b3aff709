"""Recipe: Hugging Face accelerate's ``ParallelismConfig`` with a "cp" dimension
(accelerate >= 1.10; written against 1.15.0), the attention sharded on it (docs/recipes.md).

    accelerate launch --num-processes 4 examples/recipes/accelerate_cp.py   # GPUs
    torchrun --nproc-per-node 4 examples/recipes/accelerate_cp.py

accelerate builds the mesh ("dp_shard", "cp"), with "dp_shard_cp" and "dp_cp" flattened from it
(parallelism_config.py, ``build_device_mesh``), shards the model with FSDP2 over "dp_shard_cp",
and gives the ranks of a "cp" group the same batches (data_loader.py,
``prepare_data_loader``). Only the mesh and the data loader are used here: not
``accelerator.maybe_context_parallel`` (torch's context parallelism for SDPA, which reorders
positions), since ringdilated exchanges keys and values itself.

Not run end to end by the tests: accelerate 1.15.0 accepts a ``ParallelismConfig`` with FSDP2,
DeepSpeed or a multi-GPU-like device only, and raises on CPU processes ("ParallelismConfig is
only compatible ... but got DistributedType.MULTI_CPU"). tests/test_recipes.py runs
:func:`train_loop` on the mesh that ``ParallelismConfig.build_device_mesh("cpu")`` makes, with
the model sharded over "dp_shard_cp" as accelerate's ``fsdp2_prepare_model`` shards it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch
from accelerate import Accelerator, DataLoaderConfiguration, ParallelismConfig
from accelerate.utils import FullyShardedDataParallelPlugin
from tiny_lm import ROWS, TinyLM, synthetic_rows
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader

import ringdilated

CP_SIZE = 2
LEARNING_RATE = 0.5


# --8<-- [start:prepare]
def prepare(
    steps: int, dtype: torch.dtype = torch.float32
) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer, DataLoader[dict[str, torch.Tensor]]]:
    """The accelerator on a ("dp_shard", "cp") mesh, the model with its attention on "cp", the
    optimizer, and a data loader whose batches are split over "dp_shard" only."""
    world = int(os.environ["WORLD_SIZE"])
    accelerator = Accelerator(
        parallelism_config=ParallelismConfig(dp_shard_size=world // CP_SIZE, cp_size=CP_SIZE),
        fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["DilatedTransformerBlock"],
        ),
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )
    mesh = accelerator.torch_device_mesh
    model = TinyLM(process_group=mesh["cp"], dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = DataLoader(synthetic_rows(steps), batch_size=ROWS)  # one global batch per step
    # Left on the host: shard_batch reads it there, then moves only this rank's shard.
    loader = accelerator.prepare_data_loader(loader, device_placement=False)
    return accelerator, model, optimizer, loader


# --8<-- [end:prepare]


# --8<-- [start:loop]
def train_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Iterable[dict[str, torch.Tensor]],
    mesh: DeviceMesh,
    device: torch.device,
    backward: Callable[[torch.Tensor], None],
) -> list[float]:
    """One optimizer step per batch; the loss at each step (the global batch's mean)."""
    losses = []
    for batch in loader:
        shard = ringdilated.shard_batch(  # once per step, for every layer
            batch["input_ids"], attention_mask=batch["attention_mask"], process_group=mesh["cp"]
        ).to(device)
        logits = model(shard.input_ids, layout=shard.layout)
        # FSDP2 averages the gradients over "dp_shard_cp" ("dp_replicate" too, under HSDP):
        # over every rank of "dp_cp", the ranks whose tokens form the mean.
        loss = ringdilated.sharded_cross_entropy(
            logits, shard.labels, mesh["dp_cp"], averaged_over=mesh["dp_cp"].size()
        )
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# --8<-- [end:loop]


def main() -> None:
    accelerator, model, optimizer, loader = prepare(steps=5)
    losses = train_loop(
        model, optimizer, loader, accelerator.torch_device_mesh, accelerator.device,
        accelerator.backward,
    )  # fmt: skip
    accelerator.print(f"accelerate, dp_shard x cp: losses {losses}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
