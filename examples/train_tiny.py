"""Train a tiny LongNet-style language model on synthetic data, on one process or sharded.

    python examples/train_tiny.py                        # one process
    torchrun --nproc-per-node 2 examples/train_tiny.py   # sequence-sharded over 2 gloo ranks

The task: sequences walk a fixed permutation of the vocabulary from a random start, with one
token in eight replaced at random, so the next token is mostly a function of the current one.
(The model is small and trains for seconds; the point is the equality of the two curves.)
Sharded, ``ringdilated.shard_batch`` gives every rank a contiguous slice of every sequence
(labels shifted before sharding, global positions, the batch's layout); only attention
communicates, ``ringdilated.sharded_cross_entropy`` gives every rank the whole batch's mean loss,
the parameter gradients are summed over the ranks, and every rank takes the same optimizer step.
Under torchrun, rank 0 also trains the same model on one process and prints both loss curves and
their largest relative difference: they must agree to rounding.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ringdilated import (
    DilatedTransformerBlock,
    SequenceLayout,
    shard_batch,
    sharded_cross_entropy,
)

VOCAB, EMBED, HEADS, SEQ_LEN, BATCH = 16, 32, 4, 64, 4


class TinyLongNet(nn.Module):
    def __init__(self, process_group: object = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED, dtype=dtype)
        self.position = nn.Embedding(SEQ_LEN, EMBED, dtype=dtype)
        self.blocks = nn.ModuleList(
            DilatedTransformerBlock(
                EMBED,
                HEADS,
                segment_lengths=[16, 32],
                dilation_rates=[1, 2],
                causal=True,
                process_group=process_group,
                dtype=dtype,
            )
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(EMBED, dtype=dtype)
        self.head = nn.Linear(EMBED, VOCAB, dtype=dtype)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, layout: SequenceLayout
    ) -> torch.Tensor:
        """Logits for ``tokens``, a slice of each sequence at global ``positions``."""
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x, layout=layout)
        return self.head(self.norm(x))


def synthetic_batch(generator: torch.Generator) -> torch.Tensor:
    """``(BATCH, SEQ_LEN)`` tokens: the target at each position is the next token."""
    noise = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=generator)
    replace = torch.rand(BATCH, SEQ_LEN, generator=generator) < 1 / 8
    tokens = noise.clone()
    for t in range(1, SEQ_LEN):
        walk = (5 * tokens[:, t - 1] + 3) % VOCAB
        tokens[:, t] = torch.where(replace[:, t], noise[:, t], walk)
    return tokens


def train(
    steps: int = 30,
    process_group: object = None,
    dtype: torch.dtype = torch.float32,
    position_losses: list[torch.Tensor] | None = None,
) -> list[float]:
    """The loss (mean over every predicted token of every sequence) at each step.

    ``position_losses``, when given, receives at each step this process's own loss per sequence
    position (summed over the batch, 0 at the last position, which predicts nothing):
    ``(SEQ_LEN,)`` on one process, the rank's slice of positions when sharded.
    """
    sharded = process_group is not None
    torch.manual_seed(0)  # the same initial parameters on every rank and on one process
    model = TinyLongNet(process_group, dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1)  # the same batches on every rank
    losses = []
    for _ in range(steps):
        shard = shard_batch(synthetic_batch(data), process_group=process_group)
        logits = model(shard.input_ids, shard.position_ids, shard.layout)
        # The batch's mean on every rank; backward gives each rank its tokens' share.
        loss = sharded_cross_entropy(logits, shard.labels, process_group)
        if position_losses is not None:
            token_losses = F.cross_entropy(
                logits.detach().reshape(-1, VOCAB), shard.labels.reshape(-1), reduction="none"
            )
            position_losses.append(token_losses.view(BATCH, -1).sum(0))
        optimizer.zero_grad()
        loss.backward()
        if sharded:  # the shares' sum is the one-process gradient
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad, group=process_group)
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:
        for step, loss in enumerate(train(args.steps)):
            print(f"step {step:3d}  loss {loss:.4f}")
        return
    dist.init_process_group("gloo")
    try:
        sharded = train(args.steps, dist.group.WORLD)
        if dist.get_rank() == 0:
            single = train(args.steps)
            worst = max(abs(a - b) / abs(b) for a, b in zip(sharded, single, strict=True))
            print(f"{'step':>4}  {'sharded':>10}  {'one process':>11}")
            for step, (a, b) in enumerate(zip(sharded, single, strict=True)):
                print(f"{step:4d}  {a:10.6f}  {b:11.6f}")
            verdict = "PASS" if worst < 1e-4 else "FAIL"
            print(f"{verdict}: largest relative difference {worst:.2e} over {args.steps} steps")
            if verdict == "FAIL":
                raise SystemExit(1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
