"""Recipe: a Hugging Face causal LM (``attn_implementation="ringdilated"``) sharded over "cp" in a
plain training loop, DDP over every rank of a dp x cp mesh (docs/recipes.md).

    torchrun --nproc-per-node 4 examples/recipes/hf_plain_loop.py   # gloo on CPU, NCCL on GPUs

Needs ``transformers`` (``pip install -e '.[hf]'``). The model is transformers' own
``LlamaForCausalLM``, only its attention is ringdilated's; under
``ringdilated.hf.sequence_parallel(shard.layout)`` each rank runs it on its shard of every
sequence. tests/test_recipes.py checks every rank's losses and the parameters against one
process trained on the whole global batches with torch's mean cross-entropy, on 2 and 4 gloo
ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers
from launch import init_distributed, report
from tiny_lm import SEQ_LEN, VOCAB, synthetic_batches
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import ringdilated
import ringdilated.hf  # registers attn_implementation="ringdilated"

LEARNING_RATE = 0.5


def tiny_llama(dtype: torch.dtype = torch.float32) -> transformers.LlamaForCausalLM:
    """A seeded two-layer Llama with grouped-query heads (4 query, 2 key/value) and a dilated
    pattern over ``SEQ_LEN`` positions: the same parameters on every rank."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ_LEN,
        ringdilated_segment_lengths=[8, 32], ringdilated_dilation_rates=[1, 2],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.set_attn_implementation("ringdilated")
    return model.train()


# --8<-- [start:train]
def train(
    mesh: DeviceMesh, device: torch.device, steps: int, dtype: torch.dtype = torch.float32
) -> tuple[list[float], transformers.LlamaForCausalLM]:
    """Train ``tiny_llama`` on ``mesh`` ("dp", "cp"): each "cp" group holds one data-parallel
    share of the global batch and splits its sequences; DDP averages the gradients over every
    rank. Returns the loss at each step and the trained model."""
    model = tiny_llama(dtype).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE)
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh["dp"].size()
    losses = []
    for batch in synthetic_batches(steps):
        # This "dp" rank's rows, the same on every rank of its "cp" group.
        rows = {name: value.chunk(dp_size)[dp_rank] for name, value in batch.items()}
        # Once per step: this rank's slice of every sequence, labels shifted before sharding,
        # global position_ids, the batch's layout (documents, padding, shard lengths).
        shard = ringdilated.shard_batch(
            rows["input_ids"], attention_mask=rows["attention_mask"], process_group=(mesh, "cp")
        ).to(device)
        # Every attention layer of this forward runs on the layout. Pass the global
        # position_ids (left out, transformers would count each shard from 0) and no labels=
        # (transformers' loss would shift each shard on its own and average per rank).
        with ringdilated.hf.sequence_parallel(shard.layout):
            logits = ddp(
                input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False
            ).logits
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
        report("Hugging Face Llama, plain loop, DDP on dp x cp", losses)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
