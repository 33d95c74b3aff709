"""examples/train_tiny.py: the same tiny model trained on one process and sequence-sharded over
2 gloo ranks gives the same loss curve (float64, to rounding), each rank's own share of it is
the single process's loss at that rank's positions, and it learns."""

from __future__ import annotations

import torch

from tests.distributed_harness import Workers, _train_tiny_module


def test_sharded_training_matches_one_process(workers2: Workers) -> None:
    steps = 12
    positions: list[torch.Tensor] = []
    single = _train_tiny_module().train(steps, None, torch.float64, position_losses=positions)
    ranks = workers2.results("train_tiny", {"steps": steps})
    worst = max(abs(a - b) / b for a, b in zip(ranks[0]["curve"], single, strict=True))
    assert worst < 1e-10, (ranks[0]["curve"], single)
    assert single[-1] < 0.85 * single[0], single  # it learns
    # The curve is all-reduced, so it cannot tell the ranks apart: each rank's own per-position
    # losses (before the all-reduce) must equal the single process's at those positions.
    whole = torch.stack(positions)  # (steps, SEQ_LEN)
    shard = whole.shape[1] // len(ranks)
    for rank, result in enumerate(ranks):
        expected = whole[:, rank * shard : (rank + 1) * shard]
        assert result["positions"].shape == expected.shape, rank
        assert torch.allclose(result["positions"], expected, rtol=1e-10, atol=0), rank
