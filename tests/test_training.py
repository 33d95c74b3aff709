"""examples/train_tiny.py: the same tiny model trained on one process and sequence-sharded over
2 gloo ranks gives the same loss curve (float64, to rounding), each rank's own share of it is
the single process's loss at that rank's positions, and it learns. The FSDP2 recipe of
docs/recipes.md (examples/recipes/fsdp_compile.py) reproduces one process too."""

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


def test_fsdp2_on_a_dp_x_cp_mesh_with_checkpointing_and_compile_matches_one_process(
    workers4: Workers,
) -> None:
    """examples/recipes/fsdp_compile.py (docs/recipes.md): FSDP2 over 4 gloo ranks, the sequence
    sharded on the "cp" dimension of a 2 x 2 (dp, cp) mesh, padded rows, non-reentrant
    activation checkpointing and torch.compile of each block: the losses and the parameters
    after three steps are those of one process trained with torch's mean cross-entropy."""
    from tests.recipe_tasks import one_process_run

    steps = 3
    single = one_process_run(steps, learning_rate=0.5)
    for result in workers4.results("tests.recipe_tasks:fsdp_compile", {"steps": steps}):
        for a, b in zip(result["losses"], single["losses"], strict=True):
            assert abs(a - b) <= 1e-10 * abs(b), (result["losses"], single["losses"])
        assert result["graphs"] >= 1, "torch.compile compiled nothing"
        assert result["breaks"] == {}, result["breaks"]  # each block is one graph
        assert result["params"].keys() == single["params"].keys()
        for name, value in result["params"].items():
            assert torch.allclose(value, single["params"][name], atol=1e-10, rtol=0), name
