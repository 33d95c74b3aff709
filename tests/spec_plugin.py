"""A third-party plugin's communicators, described by their specs alone: none of the classes
below declares ``delivery``, ``parallelism`` or parts, and the hybrid's instance cannot move
anything. Installed into and removed from each rank's default resolver by tasks (as
``tests.corrupt_plugin``), so the session's pools stay clean; each ``prepare`` is recorded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringdilated.backends.ringpass import Works, point_to_point
from ringdilated.core import (
    CommunicatorSpec,
    KeyWindow,
    ShardPlan,
    every_peer_at_once,
    process_group,
)
from ringdilated.functional import default_resolver

PREPARED: list[tuple[str, int, int, bool]] = []
"""This rank's ``prepare`` calls: ``(communicator, its group's size, plans, causal)``."""


class _Recording:
    label = ""

    def prepare(self, group: object, plans: Sequence[ShardPlan], window: KeyWindow) -> None:
        PREPARED.append(
            (
                self.label,
                dist.get_world_size(process_group(group)),
                len(plans),
                window.hides_later_keys,
            )
        )


class Broadcasting(_Recording):
    """Every peer in one step, each sent the same payload, point to point."""

    label = "tp-broadcast"

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        return every_peer_at_once(rank, world_size)

    def exchange(
        self,
        group: object,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, torch.Tensor],
        uniform: bool = False,
    ) -> Works:
        return point_to_point(group, sends, recvs)


class AllToAll(Broadcasting):
    """Head parallelism's exchange: a rank's own share copied, the peers' point to point."""

    label = "tp-heads"

    def exchange(
        self,
        group: object,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, torch.Tensor],
        uniform: bool = False,
    ) -> Works:
        pg = process_group(group)
        me = dist.get_rank(pg)
        if me in sends and me in recvs:
            recvs[me].copy_(sends[me].reshape(-1))
        others = {p: t.reshape(-1) for p, t in sends.items() if p != me}
        return point_to_point(pg, others, {p: t for p, t in recvs.items() if p != me})


class Ring(Broadcasting):
    """Point to point with partners at growing distance."""

    label = "tp-ring"

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        steps = (
            tuple(p for p in (rank + t, rank - t) if 0 <= p < world_size)
            for t in range(1, world_size)
        )
        return tuple(s for s in steps if s)


class Container(_Recording):
    """What the hybrid's factory builds: never exchanged through, never needed to describe."""

    label = "tp-hybrid"

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        return ()

    def exchange(
        self,
        group: object,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, torch.Tensor],
        uniform: bool = False,
    ) -> Works:
        raise RuntimeError("a hybrid's run exchanges through its parts")


def _one_head_per_rank(plans: Sequence[ShardPlan], window: KeyWindow) -> tuple[str, ...]:
    if plans and plans[0].num_heads < len(plans):
        return ("needs one query head per rank",)
    return ()


SPECS = (
    CommunicatorSpec("tp-broadcast", Broadcasting, priority=-1, delivery="broadcast"),
    CommunicatorSpec(
        "tp-heads", AllToAll, priority=-1, parallelism="heads", plan_reasons=_one_head_per_rank
    ),
    CommunicatorSpec("tp-ring", Ring, priority=-1),
    CommunicatorSpec(
        "tp-hybrid", Container, priority=-1, parallelism="hybrid", parts=("tp-heads", "tp-ring")
    ),
)


def install(payload: dict[str, Any]) -> None:
    resolver = default_resolver()
    for spec in SPECS:
        resolver.communicator_specs[spec.name] = spec


def uninstall(payload: dict[str, Any]) -> None:
    resolver = default_resolver()
    for spec in SPECS:
        resolver.communicator_specs.pop(spec.name, None)
        resolver._communicators.pop(spec.name, None)


_MESHES: dict[int, object] = {}


def calls(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload['calls']`` calls (each ``(causal, batch)``) through communicator
    ``payload['communicator']`` on one SequenceLayout (a 2 x 2 mesh for the hybrid, else the
    world group), so a repeated signature is planned once: every rank's ``prepare`` calls, the
    largest error against the oracle, and the bytes sent per call."""
    from torch.distributed.device_mesh import init_device_mesh

    import ringdilated
    from ringdilated.testing import oracle

    rank, world = dist.get_rank(), dist.get_world_size()
    name, n = payload["communicator"], 32 // world
    group: object = dist.group.WORLD
    if default_resolver().communicator_specs[name].dims == 2:
        if world not in _MESHES:  # made once per process, in the same order on every rank
            _MESHES[world] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("o", "i"))
        group = (_MESHES[world], ("o", "i"))
    layout = ringdilated.SequenceLayout(process_group=group)
    PREPARED.clear()
    errors, sent = [], []
    for causal, batch in payload["calls"]:
        g = torch.Generator().manual_seed(batch)
        full = [torch.randn(batch, 32, 4, 8, generator=g, dtype=torch.float64) for _ in range(3)]
        mine = [x[:, n * rank : n * (rank + 1)] for x in full]
        stats = ringdilated.TransferStats()
        out = ringdilated.dilated_attention(
            *mine, [8, 32], [1, 2], causal=causal, layout=layout, communicator=name,
            transfer_stats=stats,
        )  # fmt: skip
        expected = oracle(*full, [8, 32], [1, 2], causal=causal)[:, n * rank : n * (rank + 1)]
        errors.append(float((out - expected).abs().max()))
        sent.append(stats.bytes_sent)
    return {"prepared": list(PREPARED), "errors": errors, "sent": sent}
