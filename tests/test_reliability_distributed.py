"""Distributed faults: every rank raises, within a bound, with a message naming the culprit, and
no rank's inputs change. Runs on the session's gloo pools (2 and 4 ranks) and, for faults that
break a group (a dead or too-slow peer), on fresh pools with a short timeout."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.distributed_harness import Workers

TASKS = "tests.fault_tasks"
BOUND_S = 5.0  # a rejected call raises on every rank well within this (no timeout involved)


@pytest.mark.parametrize(
    ("fault", "raised", "named"),
    [
        ("bad pattern", "ValueError", "dilation_rates[0] = 8 exceeds segment_lengths[0] = 4"),
        ("sparse q", "TypeError", "q must be a dense (strided) tensor"),
        ("dtype", "ValueError", "dtype: rank 0 torch.float64, rank 1 torch.float32"),
        # Shards of 8 and 4 are fine, but then the documents must run to 12.
        ("shard length", "ValueError", "cu_seqlens must run from 0 to the sequence length 12"),
        ("causal", "ValueError", "causal: rank 0 False, rank 1 True"),
        ("head dim", "ValueError", "k and v must have the same shape"),
        ("unknown kernel", "ValueError", "unknown kernel 'nonexistent'"),
        ("return_lse", "TypeError", "return_lse must be a bool, got 'yes'"),
        ("mode", "ValueError", "mode must be one of ('head_groups', 'longnet'), got 'dilated'"),
        ("scale", "ValueError", "scale: rank 0 None, rank 1 0.5"),
        ("unpicklable scale", "TypeError", "scale must be a float or None, got <function"),
        ("backward", "ValueError", "backward: rank 0 False, rank 1 True"),
        ("nested q", "TypeError", "q must be a dense (strided) tensor, got a nested tensor"),
        ("unreadable shape", "TypeError", "q must be a torch.Tensor, got _UnreadableShape"),
        ("surrogate", "TypeError", "segment_lengths must hold ints"),
        ("transfer_stats", "TypeError", "transfer_stats must be a ringdilated.TransferStats"),
        ("documents", "ValueError", "documents: rank 0 none, rank 1 2 documents, digest"),
        ("bad documents", "ValueError", "cu_seqlens must run from 0 to the sequence length 16"),
        ("padding", "ValueError", "documents: rank 0 none, rank 1 padding of 1 row groups"),
    ],
)
def test_a_fault_on_one_rank_raises_on_every_rank(
    workers2: Workers, fault: str, raised: str, named: str
) -> None:
    results = workers2.results(f"{TASKS}:call_with_fault", {"fault": fault, "rank": 1})
    for rank, result in enumerate(results):
        assert result["raised"] is not None, f"rank {rank} returned for fault {fault!r}"
        assert named in result["message"], (rank, result["message"])
        assert result["seconds"] < BOUND_S, (rank, result["seconds"])
        assert result["inputs_unchanged"], rank
    assert results[1]["raised"] == raised
    if raised != "ValueError":  # the faulty rank raises its own error; the others a ValueError
        assert results[0]["raised"] == "ValueError"
        assert "rank 1 rejected its input, so every rank stops" in results[0]["message"]


def test_an_empty_shard_raises_on_every_rank(workers2: Workers) -> None:
    results = workers2.results(f"{TASKS}:call_with_fault", {"fault": "empty shard", "rank": 1})
    assert all(r["raised"] == "ValueError" and r["seconds"] < BOUND_S for r in results), results
    assert "shard lengths (8, 0) (rank 1 holds 0)" in results[0]["message"]
    assert results[1]["message"] == results[0]["message"]  # one wording on every rank


def test_a_fault_on_a_middle_rank_of_four_stops_all_four(workers4: Workers) -> None:
    results = workers4.results(f"{TASKS}:call_with_fault", {"fault": "bad pattern", "rank": 2})
    assert [r["raised"] for r in results] == ["ValueError"] * 4
    assert all(r["seconds"] < BOUND_S for r in results)
    assert all("rank 2 rejected its input" in r["message"] for r in (results[0], results[3]))


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize(
    ("fault", "raised", "named"),
    [
        ("width", "ValueError", "embed_dim=16), got (1, 8, 12)"),
        ("nested", "TypeError", "must be a dense (strided) tensor"),
        ("device", None, "device"),
        ("hook", "KeyError", "a forward hook failed"),
    ],
)
def test_a_module_rejecting_its_input_on_one_rank_stops_every_rank(
    workers2: Workers, block: bool, fault: str, raised: str | None, named: str
) -> None:
    """The module's own checks, and anything failing before the attention's agreement (a layer
    given a meta input, a hook that raises), reach every rank instead of stranding the peer."""
    payload = {"rank": 1, "block": block, "fault": fault}
    results = workers2.results(f"{TASKS}:module_with_fault", payload)
    assert results[0]["raised"] == "ValueError", results
    assert results[1]["raised"] is not None, results
    if raised is not None:
        assert results[1]["raised"] == raised, results
    assert named in results[1]["message"]
    assert "rank 1 rejected its input, so every rank stops" in results[0]["message"]
    assert named in results[0]["message"]
    assert all(r["seconds"] < BOUND_S for r in results)


def test_an_agreeing_call_costs_one_small_collective_a_disagreeing_one_names_the_field(
    workers2: Workers,
) -> None:
    results = workers2.results(f"{TASKS}:collectives_of_the_agreement", {})
    for result in results:
        assert result["agreed"] == {"all_gather": 1, "all_gather_object": 0}, result
        assert result["uneven"] == {"all_gather": 2, "all_gather_object": 0}, result
        assert result["disagreed"] == {"all_gather": 1, "all_gather_object": 1}, result
        assert "causal: rank 0 False, rank 1 True" in result["message"]


def test_a_slow_peer_within_the_timeout_is_waited_for_and_exact(workers2: Workers) -> None:
    results = workers2.results(f"{TASKS}:slow_peer", {"delay": 1.5})
    assert [r["raised"] for r in results] == [None, None]
    assert results[0]["seconds"] >= 1.0, "rank 0 waited for its peer"
    assert all(r["error"] < 1e-12 for r in results)


def _outcomes(pool: Workers, task: str, payload: dict[str, object], limit: float) -> list:
    for inbox in pool._inboxes:
        inbox.put((f"{TASKS}:{task}", payload))
    outcomes = []
    deadline = time.monotonic() + limit
    while len(outcomes) < pool.world_size and time.monotonic() < deadline:
        try:
            outcomes.append(pool._outbox.get(timeout=max(0.1, deadline - time.monotonic())))
        except Exception:
            break
    return outcomes


def test_a_peer_slower_than_the_timeout_makes_every_rank_raise() -> None:
    """The group's timeout (3 s here) bounds how long any rank waits: the punctual rank raises
    after it, and the late one raises when it finds its peer gone."""
    pool = Workers(2, timeout_s=3, tasks=TASKS)
    try:
        outcomes = _outcomes(pool, "slow_peer", {"delay": 6.0}, limit=60)
        assert len(outcomes) == 2, outcomes
        for rank, ok, result in outcomes:
            assert ok and result["raised"] is not None, (rank, result)
            assert result["seconds"] < 2 * 3 + 2, (rank, result)
    finally:
        pool.close()


@pytest.mark.parametrize("tensor", ["q", "k", "v"])
@pytest.mark.parametrize(("mode", "causal"), [("head_groups", True), ("longnet", False)])
def test_nan_on_one_shard_is_never_lost_and_stays_in_its_blocks(
    workers2: Workers, tensor: str, mode: str, causal: bool
) -> None:
    """A NaN at position 10 (rank 1's shard, a segment crossing the shard boundary): every
    output the exact math makes NaN is NaN on its rank, and NaN reaches no output outside the
    blocks that hold it (docs/spec.md section 4)."""
    payload = {"tensor": tensor, "position": 10, "mode": mode, "causal": causal}
    results = workers2.results(f"{TASKS}:nan_on_a_shard", payload)
    assert all(r["out"] and r["lse"] for r in results), results
    assert sum(r["nan_rows"] for r in results) > 0


@pytest.mark.parametrize("communicator", ["allgather", "ringpass", "auto"])
def test_interleaved_subgroups_each_run_their_own_problem_without_hanging(
    workers4: Workers, communicator: str
) -> None:
    """Groups [0, 2] and [1, 3] of a 4-rank world, each its own problem: every call completes
    within the bound, equals the oracle, and creates no process group (allgather used to call
    ``dist.new_group``, a collective over the whole world, inside the call: independent groups
    of a dp x cp mesh reach it with different members at different times)."""
    from ringdilated.testing import oracle

    results = workers4.results(
        f"{TASKS}:interleaved_groups", {"communicator": communicator, "causal": False}
    )
    for rank, result in enumerate(results):
        assert result["raised"] is None, (rank, result)
        assert result["seconds"] < BOUND_S, (rank, result["seconds"])
        q, k, v = result["full"]
        expected = oracle(q, k, v, [result["segment"]], [2])
        shard = slice(16 * result["index"], 16 * (result["index"] + 1))
        assert float((result["out"] - expected[:, shard]).abs().max()) < 1e-12, rank


@pytest.mark.parametrize("form", ["tuple", "submesh"])
@pytest.mark.parametrize("communicator", ["allgather", "ringpass", "ulysses", "auto"])
def test_the_cp_dimension_of_a_2x2_mesh_is_a_process_group(
    workers4: Workers, form: str, communicator: str
) -> None:
    """process_group=(mesh, "cp") or mesh["cp"]: each context-parallel group of a dp x cp mesh
    runs its own problem, exactly, within the bound."""
    from ringdilated.testing import oracle

    for cut in (16, 11):  # equal shards, then 11 and 21 positions
        payload = {"form": form, "communicator": communicator, "cut": cut}
        for rank, result in enumerate(workers4.results(f"{TASKS}:mesh_dimension", payload)):
            assert result["seconds"] < BOUND_S, (rank, result["seconds"])
            q, k, v = result["full"]
            expected = oracle(q, k, v, [32], [2], causal=True)
            assert result["out"].shape[1] == (cut if result["cp"] == 0 else 32 - cut)
            error = (result["out"] - expected[:, result["shard"]]).abs().max()
            assert float(error) < 1e-12, (rank, cut)


@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ("ulysses on a mesh", "communicator 'ulysses' cannot serve 4 rank(s): runs on a process"),
        ("hybrid on a group", "communicator 'hybrid' cannot serve 4 rank(s): runs on a 2-D"),
        ("3-D mesh", "process_group takes a 1-D DeviceMesh; for a 3-D one"),
        ("ulysses instance on a mesh", "UlyssesCommunicator instance (parallelism 'heads') runs"),
        ("hybrid instance on a group", "HybridCommunicator instance (parallelism 'hybrid') runs"),
        ("not a grid", "process_group=(outer, inner) must form a grid: every outer group holds"),
        ("inconsistent grid", "must form a grid: every outer group holds the ranks of one"),
        ("unequal columns", "must form a grid: every outer group holds the ranks of one"),
        # A dp x cp mesh is not silently a 2-D layout: the caller names the dimensions.
        ("2-D mesh alone", "name the sequence's dimension, (mesh, 'cp'), or two for a 2-D"),
    ],
)
def test_a_layout_the_communicator_cannot_run_on_raises_on_every_rank(
    workers4: Workers, fault: str, named: str
) -> None:
    results = workers4.results(f"{TASKS}:layout_fault", {"fault": fault})
    for rank, result in enumerate(results):
        assert result["raised"] in ("ResolutionError", "ValueError"), (rank, result)
        assert named in result["message"], (rank, result["message"])
        assert result["seconds"] < BOUND_S, (rank, result["seconds"])


@pytest.mark.parametrize("lengths", [[8, 8], [8, 5]])
def test_rotary_on_one_rank_only_raises_on_every_rank(workers2: Workers, lengths: list) -> None:
    """A module placing rotary positions gathers every rank's shard length first; a peer that
    does not is already in the call's agreement: both raise, naming the rule, not a crash."""
    results = workers2.results(f"{TASKS}:rotary_on_one_rank", {"lengths": lengths})
    assert all(r["raised"] is not None and r["seconds"] < BOUND_S for r in results), results
    assert "pass the same rotary= to the module on every rank" in results[0]["message"]
    assert "rank 0 rejected its input, so every rank stops" in results[1]["message"]


def test_a_process_group_that_is_no_group_is_rejected_with_the_rule() -> None:
    import ringdilated

    class NotAMesh:
        pass

    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(TypeError, match=r"ProcessGroup, a 1-D DeviceMesh, \(mesh, dimension\)"):
        ringdilated.dilated_attention(q, q, q, [4], [1], process_group=NotAMesh())


def test_mesh_dimensions_are_checked_by_name_and_index(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On a one-process 1 x 1 mesh: the mesh alone is refused (which dimension is the
    sequence's is the caller's to say); names and indices (any integer type) select one, a pair
    of them a 2-D layout; anything else raises naming the dimensions."""
    import numpy as np
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ringdilated.core.call.grid import Grid
    from ringdilated.core.call.prepare import as_process_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp"))
        with pytest.raises(ValueError, match=r"1-D DeviceMesh; for a 2-D one \(dimensions"):
            as_process_group(mesh)
        layout = as_process_group((mesh, ("dp", "cp")))
        assert isinstance(layout, Grid) and layout.outer is mesh.get_group("dp")
        assert layout.inner is mesh.get_group("cp") and layout.shape == (1, 1)
        assert as_process_group((mesh, (1, 0))).outer is mesh.get_group("cp")
        with pytest.raises(ValueError, match=r"dimension name of \('dp', 'cp'\)"):
            as_process_group((mesh, ("dp", "nope")))
        for bad in ("nope", 2, True):
            with pytest.raises(ValueError, match=r"dimension name of \('dp', 'cp'\)"):
                as_process_group((mesh, bad))
        for good in ("cp", 1, np.int64(1)):
            assert as_process_group((mesh, good)) is mesh.get_group("cp")
        assert as_process_group(mesh["cp"]) is mesh.get_group("cp")
    finally:
        dist.destroy_process_group()


# A SequenceLayout: agreed when built and at each signature's first call ------------------------


def _layout_results(pool: Workers, **payload: Any) -> list[dict[str, Any]]:
    return pool.results(f"{TASKS}:layout_faults", payload)


@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ("different documents", "documents: rank 0 1 documents"),
        ("bad documents", "cu_seqlens must be strictly increasing"),
        ("documents past the shards", "cu_seqlens must run from 0 to the sequence length 16"),
        ("first call differs", "causal: rank 0 False, rank 1 True"),
    ],
)
def test_a_layout_fault_raises_on_every_rank(workers2: Workers, fault: str, named: str) -> None:
    for rank, result in enumerate(_layout_results(workers2, fault=fault)):
        assert result["raised"] == "ValueError", (rank, result)
        assert named in result["message"], (rank, result["message"])
        assert result["seconds"] < BOUND_S, result


def test_a_call_that_contradicts_its_layout_raises_at_once_on_its_rank(
    workers2: Workers,
) -> None:
    """The later calls on a layout make no collective; one whose shard is not the layout's
    raises on its own rank before any (here every rank's does)."""
    for result in _layout_results(workers2, fault="later call"):
        assert result["raised"] == "ValueError", result
        assert "its SequenceLayout holds 8 positions on rank" in result["message"], result
        assert result["controls"] == [1, 0], result  # the first call agreed; the second did not


def test_agree_every_call_checks_every_call_on_every_rank(workers2: Workers) -> None:
    for result in _layout_results(workers2, fault="later call differs", every_call=True):
        assert result["raised"] == "ValueError", result
        assert "causal: rank 0 False, rank 1 True" in result["message"], result
    counts = _layout_results(workers2, fault="none", every_call=True)[0]["controls"]
    assert counts == [1, 1, 1], counts
    counts = _layout_results(workers2, fault="none", every_call=False)[0]["controls"]
    assert counts == [1, 0, 0], counts


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("off", False), ("maybe", None)])
def test_the_agree_every_call_variable_is_read_strictly(
    workers2: Workers, value: str, expected: bool | None
) -> None:
    for result in _layout_results(workers2, fault="environment", value=value):
        if expected is None:
            assert result["raised"] == "ValueError", result
            assert "RINGDILATED_AGREE_EVERY_CALL must be one of" in result["message"], result
        else:
            assert result["agree_every_call"] is expected, result


def test_a_group_moves_cpu_tensors_unless_its_backend_is_nccl_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    from ringdilated.core.call import agreement

    backends = {"a": "gloo", "b": "cpu:gloo,cuda:nccl", "c": "nccl", "d": "cuda:nccl"}
    monkeypatch.setattr(dist, "get_backend", lambda group: backends[group])
    assert [agreement._has_cpu_backend(g) for g in "abcd"] == [True, True, False, False]  # type: ignore[arg-type]


@pytest.mark.parametrize("grid", [False, True])
def test_on_an_nccl_only_group_the_agreements_run_on_a_gloo_group_made_once(
    workers2: Workers, workers4: Workers, grid: bool
) -> None:
    """Item 3 of issue 20: never agree on a CUDA tensor. The layout's agreement, the first
    call's and a failing call's run on a gloo group of the same ranks, made once by those ranks
    alone (on a grid, one per dimension) with that group's timeout (issue 21); the data exchange
    stays on the caller's groups; results are exact."""
    workers = workers4 if grid else workers2
    results = workers.results(f"{TASKS}:nccl_only_group", {"grid": grid})
    for rank, result in enumerate(results):
        # each twin waits as long as its group: the pool's 60 s for WORLD; on the mesh, the
        # inner group's torch default (30 minutes), the outer's 41 s set by the task
        timeouts = [1800.0, 41.0] if grid else [60.0]
        assert result["made"] == [("gloo", True, t) for t in timeouts], result["made"]
        flags = [u for u in result["used"] if u[0] == "all_gather" and u[1] == "torch.int64"]
        reports = [u for u in result["used"] if u[0] == "all_gather_object"]
        data = [u for u in result["used"] if u[1] == "torch.float64"]
        assert flags and reports and data, result["used"]
        assert {u[2] for u in flags + reports} == {"twin"}, result["used"]
        assert {u[2] for u in data} == {"caller's"}, result["used"]
        assert result["error"] < 1e-12, result
        assert "causal" in result["message"], (rank, result)


def test_a_module_check_on_a_planned_layout_raises_at_once_joining_no_agreement(
    workers2: Workers,
) -> None:
    """A review found a failed check in a second identical layer joining an agreement while
    peers ran their data exchange (NaN on one rank, an abort on the other). On a layout that
    has planned calls the check raises at once, with no collective."""
    for result in workers2.results(f"{TASKS}:layered_module_fault", {}):
        assert result["raised"] == "ValueError", result
        assert "need_weights=True is not supported" in result["message"], result
        assert result["controls"] == 0, result
        assert result["seconds"] < BOUND_S, result


@pytest.mark.parametrize("block", [False, True])
def test_a_pre_hook_on_the_attention_module_raising_on_one_rank_strands_its_peer_until_the_timeout(
    block: bool,
) -> None:
    """docs/failures.md: a forward pre-hook on the attention module itself runs before the
    module's forward, so nothing reaches the peer: the hook's rank raises its own error at once,
    the peer waits in the call's agreement until the group's timeout (3 s here), then raises."""
    pool = Workers(2, timeout_s=3, tasks=TASKS)
    try:
        payload = {"rank": 1, "block": block}
        outcomes = dict(
            (rank, (ok, result))
            for rank, ok, result in _outcomes(pool, "hook_on_the_attention_module", payload, 60)
        )
        assert sorted(outcomes) == [0, 1], outcomes
        (ok0, peer), (ok1, hooked) = outcomes[0], outcomes[1]
        assert ok0 and ok1, outcomes
        assert hooked["raised"] == "KeyError", hooked
        assert "a forward pre-hook failed" in hooked["message"]
        assert hooked["seconds"] < BOUND_S / 2, hooked
        assert peer["raised"] is not None, peer
        assert 3 - 0.5 <= peer["seconds"] < 3 + BOUND_S, peer
    finally:
        pool.close()


def test_mesh_groups_take_torch_s_default_timeout_unless_given_one(workers4: Workers) -> None:
    """docs/distributed.md: the groups ``init_device_mesh`` makes for a dimension smaller than
    the world do not inherit ``init_process_group(timeout=...)`` (the pool's 60 s): they get
    torch's default (30 minutes), unless ``backend_override`` gives options with a timeout;
    ``new_group(timeout=...)`` takes its own."""
    for result in workers4.results(f"{TASKS}:mesh_group_timeouts", {"seconds": 7}):
        assert result["world"] == 60, result
        assert result["mesh"] == 1800, result
        assert result["mesh_override"] == 7, result
        assert result["new_group"] == 7, result
