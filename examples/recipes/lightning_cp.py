"""Recipe: Lightning's ``ModelParallelStrategy`` with a context-parallel mesh dimension
(lightning 2.6; written against 2.6.6), the attention sharded on it (docs/recipes.md).

    torchrun --nproc-per-node 4 examples/recipes/lightning_cp.py   # gloo on CPU, NCCL on GPUs

``ModelParallelStrategy`` builds a 2-D mesh ("data_parallel", "tensor_parallel") and splits the
data over "data_parallel" only (its ``distributed_sampler_kwargs``), so the ranks of a
"tensor_parallel" group see the same batches: what context parallelism needs. It has no
dimension named "cp" (lightning/fabric/strategies/model_parallel.py, ``_setup_device_mesh``):
this recipe runs no tensor parallelism and uses "tensor_parallel" as the "cp" dimension.
tests/test_recipes.py runs it on 4 gloo ranks and checks the losses and the parameters against
one process, in float64.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from tiny_lm import ROWS, TinyLM, synthetic_rows
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

import ringdilated

CP = "tensor_parallel"  # ModelParallelStrategy's second mesh dimension, used for the sequence
CP_SIZE = 2
LEARNING_RATE = 0.5


# --8<-- [start:module]
class LitTinyLM(L.LightningModule):
    def __init__(self, param_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.param_dtype = param_dtype
        self.losses: list[float] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh  # ("data_parallel", "tensor_parallel")
        self.model = TinyLM(process_group=(mesh, CP), dtype=self.param_dtype)
        # HSDP on the 2-D mesh: parameters sharded over CP, replicated over "data_parallel";
        # the gradients averaged over every rank.
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def transfer_batch_to_device(
        self, batch: dict[str, torch.Tensor], device: torch.device, dataloader_idx: int
    ) -> ringdilated.BatchShard:
        # Once per step, on the host: this rank's slice of every sequence; only it moves.
        return ringdilated.shard_batch(
            batch["input_ids"],
            attention_mask=batch["attention_mask"],
            process_group=(self.device_mesh, CP),
        ).to(device)

    def training_step(self, shard: ringdilated.BatchShard, batch_idx: int) -> torch.Tensor:
        logits = self.model(shard.input_ids, layout=shard.layout)
        mesh = self.device_mesh
        # The mean over every counted token of the global batch; HSDP averages over
        # mesh.size() ranks, which averaged_over undoes.
        loss = ringdilated.sharded_cross_entropy(
            logits, shard.labels, (mesh, ("data_parallel", CP)), averaged_over=mesh.size()
        )
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LEARNING_RATE)


def fit(module: LitTinyLM, steps: int, epochs: int = 1) -> L.Trainer:
    """Train under torchrun: ``steps`` global batches of ``ROWS`` rows per epoch (Lightning's
    sampler shuffles the rows over "data_parallel" each epoch)."""
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = L.Trainer(
        accelerator="cuda" if torch.cuda.is_available() else "cpu",
        devices=local,
        num_nodes=world // local,
        strategy=ModelParallelStrategy(
            data_parallel_size=world // CP_SIZE, tensor_parallel_size=CP_SIZE
        ),
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(synthetic_rows(steps), batch_size=ROWS // (world // CP_SIZE))
    trainer.fit(module, loader)
    return trainer


# --8<-- [end:module]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="global batches per epoch")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--float64", action="store_true", help="float64 parameters")
    parser.add_argument("--out", type=Path, help="each rank saves its losses (rank 0: parameters)")
    args = parser.parse_args()
    module = LitTinyLM(torch.float64 if args.float64 else torch.float32)
    fit(module, args.steps, args.epochs)
    params = {name: p.full_tensor().detach() for name, p in module.model.named_parameters()}
    rank = dist.get_rank()
    if args.out is not None:
        torch.save(
            {"losses": module.losses, "params": params if rank == 0 else None},
            args.out / f"rank{rank}.pt",
        )
    if rank == 0:
        print(f"lightning ModelParallelStrategy, data_parallel x cp: losses {module.losses}")
    # Tear the group down together: a rank that exits while a peer's gloo threads still run
    # aborts ("terminate called without an active exception"), failing the launch.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
