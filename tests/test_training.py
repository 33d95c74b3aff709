"""examples/train_tiny.py: the same tiny model trained on one process and sequence-sharded over
2 gloo ranks gives the same loss curve (float64, to rounding), and it learns."""

from __future__ import annotations

import torch

from tests.distributed_harness import Workers, _train_tiny_module


def test_sharded_training_matches_one_process(workers2: Workers) -> None:
    steps = 12
    single = _train_tiny_module().train(steps, None, torch.float64)
    curves = workers2.results("train_tiny", {"steps": steps})
    assert curves[0] == curves[1]  # every rank saw the same all-reduced loss
    worst = max(abs(a - b) / b for a, b in zip(curves[0], single, strict=True))
    assert worst < 1e-10, (curves[0], single)
    assert single[-1] < 0.85 * single[0], single  # it learns
