"""Greedy decoding from a tiny dilated-attention language model with DilatedKVCache.

    python examples/decode_greedy.py

The model (random weights, seeded) is two ``DilatedTransformerBlock`` layers over a 64-token
vocabulary. It decodes 48 tokens after a 20-token prompt twice: once with one cache per layer
(prefill, then one token a step, each step attending only what the caches hold), and once by
recomputing the whole sequence at every step. The tokens must be identical; the script prints
both, the largest difference between the two runs' last logits, and the caches' size against
what full key/value caches would hold.
"""

from __future__ import annotations

import torch
from torch import nn

import ringdilated

VOCAB, EMBED, HEADS = 64, 32, 4
SEGMENTS, RATES = [8, 16], [1, 2]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED, dtype=torch.float64)
        self.blocks = nn.ModuleList(
            ringdilated.DilatedTransformerBlock(
                EMBED,
                HEADS,
                segment_lengths=SEGMENTS,
                dilation_rates=RATES,
                causal=True,
                dtype=torch.float64,
            )
            for _ in range(2)
        )
        self.head = nn.Linear(EMBED, VOCAB, dtype=torch.float64)

    def forward(
        self, tokens: torch.Tensor, caches: list[ringdilated.DilatedKVCache] | None = None
    ) -> torch.Tensor:
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, cache=None if caches is None else caches[i])
        logits: torch.Tensor = self.head(x)
        return logits


def main() -> None:
    torch.manual_seed(0)
    model = TinyLM().eval()
    prompt = torch.randint(0, VOCAB, (1, 20))
    steps = 48
    with torch.no_grad():
        caches = [block.make_cache() for block in model.blocks]
        logits = model(prompt, caches)  # prefill
        cached = [int(logits[0, -1].argmax())]
        for _ in range(steps - 1):
            logits = model(torch.tensor([[cached[-1]]]), caches)
            cached.append(int(logits[0, -1].argmax()))
        last_cached = logits[0, -1]

        sequence = prompt
        recomputed: list[int] = []
        for _ in range(steps):
            full = model(sequence)
            recomputed.append(int(full[0, -1].argmax()))
            sequence = torch.cat([sequence, torch.tensor([[recomputed[-1]]])], 1)
    difference = float((full[0, -1] - last_cached).abs().max())
    held = sum(cache.nbytes for cache in caches)
    positions = prompt.shape[1] + steps - 1
    full_kv = 2 * positions * EMBED * 8 * len(caches)
    print("cached:     ", cached)
    print("recomputed: ", recomputed)
    print(f"identical: {cached == recomputed}; last logits differ by at most {difference:.2e}")
    print(f"caches hold {held} bytes; full key/value caches would hold {full_kv} bytes")
    if cached != recomputed:
        raise SystemExit("cached decoding differs from recomputation")


if __name__ == "__main__":
    main()
