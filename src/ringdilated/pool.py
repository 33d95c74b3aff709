"""A pool of real ``torch.distributed`` ranks on this machine (gloo, 127.0.0.1, a file store).

:class:`Workers` starts ``world_size`` processes once; each joins one gloo group and then runs
tasks sent to every rank alike, returning each rank's result. Spawning costs seconds, so a test
session keeps its pools for its whole length; the communicator conformance kit and this
project's distributed tests share this one implementation.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Workers"]

TIMEOUT_S = 120


def _worker(
    rank: int, world_size: int, store: str, inbox: Any, outbox: Any, timeout_s: float
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        for name, payload in iter(inbox.get, None):  # None: close
            try:
                module, _, function = name.partition(":")
                task_fn = getattr(importlib.import_module(module), function)
                outbox.put((rank, True, task_fn(payload)))
            except BaseException as exc:
                outbox.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        dist.destroy_process_group()


class Workers:
    """``world_size`` ranks of one gloo group, alive until :meth:`close`.

    Tasks are functions ``task(payload) -> result`` named ``"package.module:function"``, or by
    function name alone within ``tasks`` (a module name). Payloads and results are pickled.
    """

    def __init__(self, world_size: int, timeout_s: float = 60.0, tasks: str = "") -> None:
        self.world_size = world_size
        self._tasks = tasks
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory()
        store = os.path.join(self._dir.name, "store")
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store, self._inboxes[r], self._outbox, timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, name: str, payload: Any) -> list[tuple[bool, Any]]:
        """Run task ``name`` on every rank; ``[(ok, result or (type, message, traceback))]``."""
        if ":" not in name:
            name = f"{self._tasks}:{name}"
        for inbox in self._inboxes:
            inbox.put((name, payload))
        results: dict[int, tuple[bool, Any]] = {}
        while len(results) < self.world_size:
            try:
                rank, ok, value = self._outbox.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(
                    f"task {name!r}: ranks {sorted(set(range(self.world_size)) - set(results))} "
                    "did not answer"
                ) from None
            results[rank] = (ok, value)
        return [results[r] for r in range(self.world_size)]

    def results(self, name: str, payload: Any) -> list[Any]:
        """Like :meth:`run`, raising if any rank failed."""
        outcomes = self.run(name, payload)
        for rank, (ok, value) in enumerate(outcomes):
            if not ok:
                raise AssertionError(f"rank {rank} failed: {value[0]}: {value[1]}\n{value[2]}")
        return [value for _, value in outcomes]

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for p in self._procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        self._dir.cleanup()
