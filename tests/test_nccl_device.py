"""NCCL without the rank's GPU current is refused before any exchange
(:mod:`ringdilated.core.call.nccl_device`).

Groups are stand-ins whose backend name ``torch.distributed.get_backend`` reports from a table;
the current CUDA device is ``torch.cuda.current_device`` replaced (a CPU-only torch has none).
``tests/misuse_tasks.py:nccl_without_set_device`` runs a real call on two gloo ranks that read
as NCCL for CUDA tensors.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from ringdilated.core.call import Grid, check_current_device, moves_cuda_with_nccl
from ringdilated.core.support.errors import CudaDeviceNotSetError, RingDilatedError
from tests.distributed_harness import Workers

TASKS = "tests.misuse_tasks"


class Group:
    """A process group as this check reads it: a backend name, maybe a bound device."""

    def __init__(self, backend: str, bound_device_id: torch.device | None = None) -> None:
        self.backend, self.bound_device_id = backend, bound_device_id


@pytest.fixture
def current(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Stand-in groups' backends, and cuda:0 current; the list counts the current-device
    queries."""
    asked: list[int] = []

    def current_device() -> int:
        asked.append(0)
        return 0

    monkeypatch.setattr(dist, "get_backend", lambda group=None: group.backend)
    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    return asked


CUDA1 = torch.device("cuda", 1)


@pytest.mark.parametrize("backend", ["nccl", "NCCL", "cuda:nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_with_another_gpu_current_is_refused_naming_set_device(
    current: list[int], backend: str
) -> None:
    with pytest.raises(CudaDeviceNotSetError) as raised:
        check_current_device(Group(backend), CUDA1)  # type: ignore[arg-type]
    error = raised.value
    assert isinstance(error, RuntimeError) and isinstance(error, RingDilatedError)
    assert (error.device, error.current) == ("cuda:1", 0)
    message = str(error)
    assert message.startswith(
        "this rank's tensors are on cuda:1 but the current CUDA device is cuda:0, and the "
        f"process group moves CUDA tensors with NCCL (backend {backend.lower()!r})"
    )
    assert "torch.cuda.set_device(local_rank) before init_process_group" in message
    assert "int(os.environ['LOCAL_RANK'])" in message
    assert "bound" not in message


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo", "cpu:gloo,cuda:gloo", "mpi"])
def test_other_backends_pass_without_asking_for_the_device(
    current: list[int], backend: str
) -> None:
    check_current_device(Group(backend), CUDA1)  # type: ignore[arg-type]
    assert not moves_cuda_with_nccl(Group(backend))  # type: ignore[arg-type]
    assert current == [], "no device query for a group that does not use NCCL"


@pytest.mark.parametrize("device", [torch.device("cpu"), torch.device("meta")])
def test_tensors_off_cuda_pass_without_asking_for_the_device(
    current: list[int], device: torch.device
) -> None:
    check_current_device(Group("nccl"), device)  # type: ignore[arg-type]
    assert current == []


def test_tensors_on_the_current_gpu_pass(current: list[int]) -> None:
    check_current_device(Group("nccl"), torch.device("cuda", 0))  # type: ignore[arg-type]
    assert current == [0]


def test_a_bound_device_is_named_as_not_current(current: list[int]) -> None:
    group = Group("nccl", bound_device_id=CUDA1)
    with pytest.raises(CudaDeviceNotSetError, match=r"device_id=cuda:1\) bound the group to "):
        check_current_device(group, CUDA1)  # type: ignore[arg-type]


@pytest.mark.parametrize(("outer", "inner"), [("gloo", "nccl"), ("nccl", "gloo")])
def test_a_grid_with_an_nccl_group_is_checked(current: list[int], outer: str, inner: str) -> None:
    layout = Grid(outer=Group(outer), inner=Group(inner))  # type: ignore[arg-type]
    with pytest.raises(CudaDeviceNotSetError):
        check_current_device(layout, CUDA1)
    check_current_device(Grid(Group("gloo"), Group("gloo")), CUDA1)  # type: ignore[arg-type]


def test_the_error_keeps_its_devices_across_a_pickle() -> None:
    error = CudaDeviceNotSetError("cuda:3", 0, "set the device")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is CudaDeviceNotSetError and str(again) == "set the device"
    assert (again.device, again.current) == ("cuda:3", 0)


def test_every_rank_raises_before_any_exchange(workers2: Workers) -> None:
    """Rank 1 (tensors on cuda:1, cuda:0 current) finds it; rank 0, whose tensors are on the
    current device, raises naming rank 1's error: the agreement, on gloo, reaches both before any
    data moves (the data exchange would fail on FakeTensors)."""
    results = workers2.results(f"{TASKS}:nccl_without_set_device", {})
    assert [r["raised"] for r in results] == ["ValueError", "RuntimeError"], results
    own = results[1]["message"]
    assert own.startswith("this rank's tensors are on cuda:1 but the current CUDA device is cuda:0")
    assert "torch.cuda.set_device(local_rank)" in own
    assert results[0]["message"] == (
        f"rank 1 rejected its input, so every rank stops: CudaDeviceNotSetError: {own}"
    )
