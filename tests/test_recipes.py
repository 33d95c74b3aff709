"""The training recipes of docs/recipes.md, each run from its file under examples/recipes/ (the
page includes those files, so the code tested is the code shown): on 4 gloo ranks, a 2 x 2
(dp, cp) mesh, float64, each recipe's losses on every rank and its parameters after three steps
equal those of one process trained with torch's mean cross-entropy (the Hugging Face recipe on a
1 x 2 mesh too; float32 as well where the recipe trains in it). The models' largest segment
spans both "cp" shards, so what crosses the ranks is compared too. The FSDP2 + checkpointing +
compile recipe is tests/test_training.py's."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed_harness import Workers
from tests.recipe_tasks import one_process_hf_run, one_process_run, one_process_torchtitan_run

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
LEARNING_RATE = 0.5  # every recipe's
# Against the one-process run in the same dtype: float64 to rounding; float32 (the dtype the
# recipes train in, whose gradient reductions FSDP2 runs differently) to float32's rounding
# compounded over three steps.
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
DTYPES = pytest.mark.parametrize("dtype", list(TOLERANCE))


def _assert_same_run(
    results: list[dict[str, Any]], single: dict[str, Any], dtype: str = "float64"
) -> None:
    tolerance = TOLERANCE[dtype]
    for rank, result in enumerate(results):
        for a, b in zip(result["losses"], single["losses"], strict=True):
            assert abs(a - b) <= tolerance * abs(b), (rank, result["losses"], single["losses"])
        if result.get("params") is None:
            continue
        assert result["params"].keys() == single["params"].keys(), rank
        for name, value in result["params"].items():
            expected = single["params"][name]
            assert torch.allclose(value, expected, atol=tolerance, rtol=0), (rank, name)


@DTYPES
def test_plain_loop_with_ddp_on_a_dp_x_cp_mesh_matches_one_process(
    workers4: Workers, dtype: str
) -> None:
    """examples/recipes/plain_loop.py: DDP over every rank, shard_batch on "cp" once per step
    (padded rows: the ranks count different tokens), sharded_cross_entropy over (dp, cp) with
    averaged_over = 4."""
    single = one_process_run(STEPS, LEARNING_RATE, dtype=dtype)
    payload = {"steps": STEPS, "dtype": dtype}
    _assert_same_run(workers4.results("tests.recipe_tasks:plain_loop", payload), single, dtype)


@DTYPES
def test_torchtitan_style_step_matches_one_process(workers4: Workers, dtype: str) -> None:
    """examples/recipes/torchtitan_style.py: an inner attention taking q, k, v first
    (bs, heads, seqlen, head_dim), given the "cp" mesh; torchtitan's shifted labels cut at the
    shard's positions; uneven shards (31 positions on 2 ranks); FSDP2 over dp x cp with its
    gradient division disabled and the loss over the global count of valid tokens."""
    single = one_process_torchtitan_run(STEPS, LEARNING_RATE, dtype)
    payload = {"steps": STEPS, "dtype": dtype}
    results = workers4.results("tests.recipe_tasks:torchtitan_style", payload)
    _assert_same_run(results, single, dtype)


@DTYPES
def test_accelerate_loop_on_its_parallelism_config_mesh_matches_one_process(
    workers4: Workers, dtype: str
) -> None:
    """examples/recipes/accelerate_cp.py's loop on the mesh of accelerate's own
    ParallelismConfig(dp_shard_size=2, cp_size=2): the attention on mesh["cp"], the loss over
    the flattened mesh["dp_cp"]. Not Accelerator itself, which refuses a ParallelismConfig on
    CPU processes."""
    accelerate = pytest.importorskip(
        "accelerate", minversion="1.10", reason="the accelerate recipe needs accelerate>=1.10"
    )
    assert hasattr(accelerate, "ParallelismConfig")
    single = one_process_run(STEPS, LEARNING_RATE, dtype=dtype)
    payload = {"steps": STEPS, "dtype": dtype}
    results = workers4.results("tests.recipe_tasks:accelerate_mesh", payload)
    assert results[0]["dims"] == ("dp_shard", "cp")
    _assert_same_run(results, single, dtype)


@DTYPES
@pytest.mark.parametrize("ranks", [2, 4])
def test_hf_plain_loop_matches_one_process(
    request: pytest.FixtureRequest, ranks: int, dtype: str
) -> None:
    """examples/recipes/hf_plain_loop.py: transformers' LlamaForCausalLM with
    attn_implementation="ringdilated" under sequence_parallel(shard.layout), the global
    position_ids passed, DDP over every rank, sharded_cross_entropy over (dp, cp) with
    averaged_over = the mesh's size; on a 1 x 2 and a 2 x 2 mesh against transformers' forward on
    one process with the batch's attention_mask (its own position ids)."""
    pytest.importorskip("transformers")
    workers: Workers = request.getfixturevalue(f"workers{ranks}")
    single = one_process_hf_run(STEPS, LEARNING_RATE, dtype=dtype)
    payload = {"steps": STEPS, "dtype": dtype}
    _assert_same_run(workers.results("tests.recipe_tasks:hf_plain_loop", payload), single, dtype)


def test_lightning_model_parallel_strategy_matches_one_process(tmp_path: Path) -> None:
    """examples/recipes/lightning_cp.py under torchrun, 4 gloo ranks: ModelParallelStrategy's
    "tensor_parallel" dimension as "cp", HSDP on its 2-D mesh, the batch sharded in
    transfer_batch_to_device. One global batch for three epochs (Lightning's sampler shuffles
    the rows each epoch; the global batch stays the same)."""
    pytest.importorskip(
        "lightning", minversion="2.4", reason="the Lightning recipe needs lightning>=2.4"
    )
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        str(ROOT / "examples" / "recipes" / "lightning_cp.py"),
        "--steps", "1", "--epochs", str(STEPS), "--float64", "--out", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(4)]
    _assert_same_run(results, one_process_run(STEPS, LEARNING_RATE, one_batch=True))


def test_every_recipe_model_attends_across_its_cp_shards() -> None:
    """Each recipe model's largest segment is longer than a shard (a sequence of SEQ_LEN on a
    "cp" group of 2), so some queries attend keys of the other rank. With every segment inside
    one shard each rank attends its shard alone and the comparison with one process cannot see
    what crosses the ranks: a torchtitan step passing local positions, each shard counted from
    0, passed the test with the earlier [8, 16] pattern."""
    import tiny_lm  # examples/recipes/, on sys.path since tests.recipe_tasks is imported
    import torchtitan_style

    shard = tiny_lm.SEQ_LEN // 2
    patterns = {
        "tiny_lm": tiny_lm.SEGMENT_LENGTHS,
        "torchtitan_style": torchtitan_style.SEGMENT_LENGTHS,
    }
    if importlib.util.find_spec("transformers") is not None:
        import hf_plain_loop

        patterns["hf_plain_loop"] = hf_plain_loop.tiny_llama().config.ringdilated_segment_lengths
    for name, segments in patterns.items():
        assert max(segments) > shard, (name, segments, shard)


SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::([\w-]+))?"$', re.MULTILINE)


def test_the_page_includes_every_recipe_from_its_file() -> None:
    """docs/recipes.md shows no recipe code of its own: every block includes a file (or a
    marked section of one) under examples/recipes/, and every recipe file is included."""
    page = (ROOT / "docs" / "recipes.md").read_text()
    assert "```python\n--8<--" in page
    included = SNIPPET.findall(page)
    assert included
    for path, section in included:
        text = (ROOT / path).read_text()
        if section:
            assert f"# --8<-- [start:{section}]" in text, (path, section)
            assert f"# --8<-- [end:{section}]" in text, (path, section)
    files = {path for path, _ in included}
    recipes = {f"examples/recipes/{p.name}" for p in (ROOT / "examples" / "recipes").glob("*.py")}
    assert recipes <= files, recipes - files
    for block in re.findall(r"^```python\n(.*?)^```", page, re.DOTALL | re.MULTILINE):
        assert SNIPPET.fullmatch(block.strip()), block
