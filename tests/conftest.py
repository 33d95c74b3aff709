"""Shared test configuration: hypothesis profiles and the kernels under test.

Profiles: ``ci`` (default; fast) and ``thorough`` (``HYPOTHESIS_PROFILE=thorough``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.distributed_harness import TASKS, Workers

settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def workers2() -> Iterator[Workers]:
    """Two gloo ranks for the whole session (spawning costs seconds)."""
    pool = Workers(2, tasks=TASKS)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def workers4() -> Iterator[Workers]:
    """Four gloo ranks for the whole session."""
    pool = Workers(4, tasks=TASKS)
    yield pool
    pool.close()
