"""Recipe: ringdilated in a torchtitan-style model and training step (docs/recipes.md).

    torchrun --nproc-per-node 4 examples/recipes/torchtitan_style.py   # gloo on CPU, NCCL on GPUs

Written against torchtitan v0.2.2 (pytorch/torchtitan@v0.2.2), without importing it:

- torchtitan's attention modules take ``q, k, v`` first, ``(bs, n_heads, seqlen, head_dim)``
  (torchtitan/models/attention.py, ``ScaledDotProductAttentionWrapper.forward(q, k, v, *,
  scale, enable_gqa, is_causal)``), called as ``block.attention.inner_attention``
  (torchtitan/models/llama3/model/model.py). :class:`RingDilatedAttention` has that signature;
  :func:`apply_cp` gives it the "cp" mesh where torchtitan's ``apply_cp_to_attention_module``
  (torchtitan/distributed/context_parallel.py) would apply torch's ``_ContextParallel``, which
  is not used: ringdilated exchanges keys and values itself.
- torchtitan shards each batch once per step in ``post_dataloading_process``
  (torchtitan/train.py) with ``prepare_context_parallel_input``: torch's
  ``_context_parallel_shard``, by default with a head-tail load balancer that reorders
  positions. ringdilated needs contiguous shards in rank order: :func:`shard_step` uses
  ``ringdilated.shard_batch`` instead, whose layout travels where torchtitan's
  ``attention_masks`` do and whose global ``position_ids`` where its ``positions`` do.
- The loss is torchtitan's: this rank's summed cross-entropy over the global count of valid
  tokens (counted before sharding, summed over the data-parallel ranks), with FSDP's gradient
  division disabled (``disable_fsdp_gradient_division``,
  torchtitan/models/llama3/infra/parallelize.py), so the summed gradients are the mean's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from launch import init_distributed, report
from tiny_lm import SEQ_LEN, VOCAB, synthetic_batches
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import ringdilated
from ringdilated.rotary import rotary_embedding

DIM, N_HEADS, N_KV_HEADS, N_LAYERS = 16, 2, 1, 2
SEGMENT_LENGTHS, DILATION_RATES = [8, 32], [1, 2]
IGNORE_INDEX = -100  # torchtitan/components/loss.py
LEARNING_RATE = 0.5


# --8<-- [start:attention]
class RingDilatedAttention(nn.Module):
    """Dilated attention with torchtitan's inner-attention signature: ``q``
    ``(bs, n_heads, seqlen, head_dim)``, ``k``, ``v`` ``(bs, n_kv_heads, seqlen, head_dim)``,
    this rank's contiguous shard of the sequence, to ``(bs, n_heads, seqlen, head_dim)``.

    ``process_group``: ``None`` (one process) until :func:`apply_cp` sets the "cp" mesh.
    ``attention_masks``: the batch's :class:`ringdilated.SequenceLayout` (``BatchShard.layout``),
    or ``None``. Grouped-query heads are always grouped, not repeated (``enable_gqa`` is there
    for the signature).
    """

    def __init__(self, segment_lengths: list[int], dilation_rates: list[int]) -> None:
        super().__init__()
        self.segment_lengths, self.dilation_rates = segment_lengths, dilation_rates
        self.process_group: DeviceMesh | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attention_masks: ringdilated.SequenceLayout | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
    ) -> torch.Tensor:
        out = ringdilated.dilated_attention(
            q.transpose(1, 2),  # ringdilated takes (bs, seqlen, heads, head_dim)
            k.transpose(1, 2),
            v.transpose(1, 2),
            self.segment_lengths,
            self.dilation_rates,
            causal=is_causal,
            scale=scale,
            process_group=self.process_group,
            layout=attention_masks,
        )
        return out.transpose(1, 2)


# --8<-- [end:attention]


class Attention(nn.Module):
    """torchtitan's llama3 ``Attention``, reduced: projections, rotary embeddings at the given
    global ``positions``, the inner attention, the output projection."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = DIM // N_HEADS
        self.wq = nn.Linear(DIM, N_HEADS * self.head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias=False, dtype=dtype)
        self.wv = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias=False, dtype=dtype)
        self.wo = nn.Linear(N_HEADS * self.head_dim, DIM, bias=False, dtype=dtype)
        self.inner_attention = RingDilatedAttention(SEGMENT_LENGTHS, DILATION_RATES)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attention_masks: ringdilated.SequenceLayout | None,
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = rotary_embedding(xq, positions), rotary_embedding(xk, positions)
        output = self.inner_attention(
            xq.transpose(1, 2),  # (bs, n_heads, seqlen, head_dim)
            xk.transpose(1, 2),  # (bs, n_kv_heads, seqlen, head_dim)
            xv.transpose(1, 2),
            attention_masks=attention_masks,
            enable_gqa=True,
        ).transpose(1, 2)
        out: torch.Tensor = self.wo(output.reshape(bs, seqlen, -1))
        return out


class TransformerBlock(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM, dtype=dtype)
        self.attention = Attention(dtype)
        self.ffn_norm = nn.RMSNorm(DIM, dtype=dtype)
        self.feed_forward = nn.Sequential(
            nn.Linear(DIM, 4 * DIM, dtype=dtype), nn.SiLU(), nn.Linear(4 * DIM, DIM, dtype=dtype)
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attention_masks: ringdilated.SequenceLayout | None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), positions, attention_masks)
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class Transformer(nn.Module):
    """torchtitan's decoder shape: ``forward(tokens, positions=..., attention_masks=...)``."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial parameters on every rank
        self.tok_embeddings = nn.Embedding(VOCAB, DIM, dtype=dtype)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dtype) for i in range(N_LAYERS)})
        self.norm = nn.RMSNorm(DIM, dtype=dtype)
        self.output = nn.Linear(DIM, VOCAB, bias=False, dtype=dtype)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks: ringdilated.SequenceLayout | None = None,
    ) -> torch.Tensor:
        if positions is None:  # one process, whole sequences
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, positions, attention_masks)
        logits: torch.Tensor = self.output(self.norm(h))
        return logits


# --8<-- [start:parallelize]
def apply_cp(model: Transformer, cp_mesh: DeviceMesh) -> None:
    """Where torchtitan calls ``apply_cp_to_attention_module([block.attention.inner_attention
    for block in model.layers.values()], cp_mesh, attn_type)``."""
    for block in model.layers.values():
        block.attention.inner_attention.process_group = cp_mesh


def parallelize(model: Transformer, mesh: DeviceMesh) -> Transformer:
    """Context parallelism on "cp", then FSDP2 over dp x cp (torchtitan's "fsdp" mesh is
    dp_shard x cp), the gradients summed, not averaged: the loss divides by the global count."""
    apply_cp(model, mesh["cp"])
    # The dp x cp mesh spans the world here: a 1-D mesh as large as the world is the default group.
    fsdp_mesh = init_device_mesh(mesh.device_type, (mesh.size(),), mesh_dim_names=("fsdp",))
    for block in model.layers.values():
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    for module in model.modules():  # torchtitan's disable_fsdp_gradient_division
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM: for float32 and bfloat16 gradients FSDP2 would otherwise reduce with
            # PREMUL_SUM(1 / factor), which NCCL has and gloo does not.
            module.set_force_sum_reduction_for_comms(True)
    return model


# --8<-- [end:parallelize]


# --8<-- [start:step]
def shard_step(
    inputs: torch.Tensor, labels: torch.Tensor, cp_mesh: DeviceMesh, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, dict[str, object]]:
    """In place of torchtitan's ``prepare_context_parallel_input``: this rank's inputs and
    labels and the model's keyword arguments (global ``positions``, the layout as
    ``attention_masks``). torchtitan's labels come shifted (``input = x[:-1]``,
    ``label = x[1:]``): they are cut at the same positions, not passed to ``shard_batch``,
    which would shift them again."""
    shard = ringdilated.shard_batch(inputs, process_group=cp_mesh).to(device)
    mine = slice(shard.start, shard.start + shard.input_ids.shape[1])
    extra_kwargs = {"positions": shard.position_ids, "attention_masks": shard.layout}
    return shard.input_ids, labels[:, mine].to(device), extra_kwargs


def train(
    mesh: DeviceMesh, device: torch.device, steps: int, dtype: torch.dtype = torch.float32
) -> tuple[list[float], Transformer]:
    """torchtitan's training step on ``mesh`` ("dp", "cp"), one micro-batch per step: the
    global average loss at each step (what torchtitan logs) and the trained (sharded) model."""
    model = parallelize(Transformer(dtype).to(device), mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh["dp"].size()
    losses = []
    for batch in synthetic_batches(steps):
        x = batch["input_ids"].chunk(dp_size)[dp_rank]  # this "dp" rank's rows
        inputs, labels = x[:, :-1], x[:, 1:]  # torchtitan's text datasets
        # torchtitan's train_step: valid tokens counted before sharding, summed over "dp".
        global_valid_tokens = (labels != IGNORE_INDEX).sum().to(device)
        dist.all_reduce(global_valid_tokens, group=mesh.get_group("dp"))
        inputs, labels, extra_kwargs = shard_step(inputs, labels, mesh["cp"], device)
        pred = model(inputs, **extra_kwargs)
        # torchtitan's loss_sum / global_valid_tokens; its value is the global mean (the sum
        # over dp x cp that torchtitan logs), its gradient this rank's share.
        loss = ringdilated.sharded_cross_entropy(
            pred, labels, (mesh, ("dp", "cp")), total_count=global_valid_tokens
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


# --8<-- [end:step]


def main() -> None:
    device = init_distributed()
    try:
        world = dist.get_world_size()
        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "cp"))
        losses, _ = train(mesh, device, steps=5)
        report(f"torchtitan-style, sequences of {SEQ_LEN - 1} tokens on dp x cp", losses)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
