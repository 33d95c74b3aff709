"""A deliberately wrong communicator for the communicator kit to reject: ring pass that perturbs
every buffer it receives (as a transport with a wrong offset or dtype would). Installed into and
removed from each rank's default resolver by tasks, so the session's pools stay clean."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ringdilated.backends.ringpass import RINGPASS_SPEC, RingPassCommunicator, Works
from ringdilated.functional import default_resolver

NAME = "corrupting"


@attrs.frozen
class _Corrupted:
    inner: Works
    recvs: tuple[torch.Tensor, ...]

    def wait(self) -> None:
        self.inner.wait()
        for buffer in self.recvs:
            buffer.add_(1e-3)


class CorruptingCommunicator(RingPassCommunicator):
    def exchange(
        self,
        group: object,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, torch.Tensor],
        uniform: bool = False,
    ) -> _Corrupted:
        return _Corrupted(super().exchange(group, sends, recvs), tuple(recvs.values()))


def install(payload: dict[str, Any]) -> None:
    spec = attrs.evolve(RINGPASS_SPEC, name=NAME, factory=CorruptingCommunicator, priority=-1)
    default_resolver().communicator_specs[NAME] = spec


def uninstall(payload: dict[str, Any]) -> None:
    resolver = default_resolver()
    resolver.communicator_specs.pop(NAME, None)
    resolver._communicators.pop(NAME, None)
