"""The tiny causal language model that the recipes of docs/recipes.md train, and its data.

Nothing here is parallel: each recipe gives :class:`TinyLM` the process group its attention
runs on and shards the batch. The model and the batches are seeded, so every rank, and the
one-process run the tests compare with, start from the same parameters and see the same data.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ringdilated
from ringdilated.rotary import rotary_embedding

VOCAB, WIDTH, HEADS, LAYERS = 32, 16, 2, 2
SEGMENT_LENGTHS, DILATION_RATES = [8, 32], [1, 2]
ROWS, SEQ_LEN = 4, 32  # one global batch: ROWS sequences of SEQ_LEN tokens


# --8<-- [start:model]
class TinyLM(nn.Module):
    """Token embeddings, ``LAYERS`` causal dilated transformer blocks with rotary positions, a
    head: tokens ``(B, n)`` to logits ``(B, n, VOCAB)``.

    ``process_group``: where the attention runs, e.g. ``(mesh, "cp")``; ``None`` on one process.
    Every layer but the attention works per token, so a rank runs the model on its shard of
    each sequence and only the attention communicates.
    """

    def __init__(self, process_group: object = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial parameters on every rank
        self.embed = nn.Embedding(VOCAB, WIDTH, dtype=dtype)
        self.blocks = nn.ModuleList(
            ringdilated.DilatedTransformerBlock(
                WIDTH,
                HEADS,
                segment_lengths=SEGMENT_LENGTHS,
                dilation_rates=DILATION_RATES,
                causal=True,
                rotary=rotary_embedding,  # positions come from the layout: global on every rank
                process_group=process_group,
                dtype=dtype,
            )
            for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(WIDTH, dtype=dtype)
        self.head = nn.Linear(WIDTH, VOCAB, dtype=dtype)
        self.activation_checkpointing = False

    def forward(
        self,
        input_ids: torch.Tensor,
        layout: ringdilated.SequenceLayout | None = None,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for ``input_ids``: a rank's shard with the batch's ``layout``
        (``BatchShard.layout``), or a whole batch on one process with its ``key_padding_mask``
        (``True`` = padding)."""
        x = self.embed(input_ids)
        for block in self.blocks:
            if self.activation_checkpointing:  # non-reentrant: keyword arguments pass through
                x = checkpoint(
                    block, x, layout=layout, key_padding_mask=key_padding_mask, use_reentrant=False
                )
            else:
                x = block(x, layout=layout, key_padding_mask=key_padding_mask)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


# --8<-- [end:model]


def synthetic_batches(steps: int, seed: int = 1) -> Iterator[dict[str, torch.Tensor]]:
    """``steps`` global batches, the same on every rank that draws them: ``input_ids``
    ``(ROWS, SEQ_LEN)`` int64 and ``attention_mask`` ``(ROWS, SEQ_LEN)``, 1 = token, 0 = right
    padding (each row keeps between half and all of its tokens)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        input_ids = torch.randint(0, VOCAB, (ROWS, SEQ_LEN), generator=generator)
        lengths = torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (ROWS, 1), generator=generator)
        attention_mask = (torch.arange(SEQ_LEN) < lengths).long()
        yield {"input_ids": input_ids, "attention_mask": attention_mask}


def synthetic_rows(steps: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """The rows of ``synthetic_batches(steps, seed)`` in order, as a map-style dataset for a
    ``DataLoader``: batches of ``ROWS`` rows without shuffling are those global batches."""
    return [
        {name: value[row] for name, value in batch.items()}
        for batch in synthetic_batches(steps, seed)
        for row in range(ROWS)
    ]
