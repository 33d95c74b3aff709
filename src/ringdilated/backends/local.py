"""The ``local`` communicator: one process, nothing moves."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ringdilated.backends.ringpass import NothingToPrepare, Works
from ringdilated.core import CommunicatorSpec

__all__ = ["LOCAL_SPEC", "LocalCommunicator"]


class LocalCommunicator(NothingToPrepare):
    """The communicator of a single process: no steps, no peers."""

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        return ()

    def exchange(
        self,
        group: object,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, torch.Tensor],
        uniform: bool = False,
    ) -> Works:
        if sends or recvs:
            raise RuntimeError(
                f"local communicator asked to move data to/from ranks {sorted({*sends, *recvs})}"
            )
        return Works(())


LOCAL_SPEC = CommunicatorSpec(
    name="local",
    factory=LocalCommunicator,
    priority=0,
    distributed=False,
    delivery="pairwise",
    parallelism="sequence",
    description="one process; no communication",
)
