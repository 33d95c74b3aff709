"""Sharded dilated attention, ``ringpass`` against ``allgather``: bytes against the minimum, time
against compute only, per-rank memory; and a projection of bytes per token at larger P.

One command prints every table (issue 14; 4-5 minutes on this project's 2-core machine)::

    python benchmarks/bench_distributed.py --lengths 65536 --worlds 2 4 --rounds 4

(those are the defaults). ``--backward`` adds forward+backward rows (about 4x the time);
``--no-projection`` leaves the projection out; ``--projection-only`` prints only it (seconds, no
processes); ``--json FILE`` also writes every row.

**Measured**: fp32, B=1, H=8, D=64, gloo, one thread per rank, ``head_groups``, causal and not,
forward (and with ``--backward`` forward+backward), for each pattern of ``--patterns``
(both by default):

- ``wide``: ``segment_lengths=[2048, 8192, L]``, ``dilation_rates=[1, 4, L/2048]`` (issue 3:
  the largest segment spans every rank; every block has 2048 selected positions);
- ``longnet``: LongNet's published ``[2048, 4096, 8192, 16384, 32768]``, ``[1, 2, 4, 6, 12]``.

Per rank and communicator: bytes sent (``TransferStats``) against the shard plan's minimum
(forward: the rank's pieces to the ranks whose queries see them; forward+backward: those twice,
plus the gradients of the pieces it received) and checked against
``ringdilated.core.cost.traffic``; time against the same rank running the same schedule with a
communicator that moves nothing ("compute only": the same steps, packing and kernel calls on
zeroed receive buffers; one on ``ringpass``'s P-1 steps, one on ``allgather``'s single step);
and the peak resident memory a call adds above what was resident just before it (inputs
excluded; ``MALLOC_MMAP_THRESHOLD_`` is fixed at 1 MiB so that freed buffers leave the process).
"In exchange": the time a rank spends inside ``RingPassCommunicator.exchange`` /
``AllGatherCommunicator.exchange`` and the wait on what they return (the methods are wrapped in
the rank processes started here, nowhere else): the communication the call did not hide behind
compute, including waiting for a slower peer. Ranks are processes started here, one set per world
size for every configuration; with more ranks than cores they share cores, in every column
alike. After one untimed call of each communicator, each variant's first call gives its bytes
and peak; then the variants alternate, in a rotating order, for ``--rounds`` timed rounds: best
and median are printed. A pattern that crosses no shard boundary at a world size (``longnet`` at
P=2, L=65536) moves nothing and is reported, not run.

**Projected** (no processes; every rank's shard plan through ``ringdilated.core.cost.traffic``):
bytes each rank sends per token it holds, per layer (one attention call), for ``ringpass`` and
``allgather`` at P = 8, 16, 32, 64 and L = 32768, 262144, 1048576, with LongNet's pattern and
the LongNet paper's model (MAGNETO base size: 12 heads of 64), 2-byte elements (bf16/fp16), B=1,
``head_groups`` (heads split 3, 3, 2, 2, 2 among the five patterns). Forward+backward = 2 x
forward + the gradients of the pieces received (the pairwise minimum; the measured rows with
``--backward`` check that formula).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ringdilated.cli.procstat import reset_peak, status_bytes

if TYPE_CHECKING:
    from ringdilated.core.cost import Traffic
    from ringdilated.core.pattern import DilationPattern

H, D = 8, 64
COMMUNICATORS = ("ringpass", "allgather")
LONGNET_SEGMENTS = (2048, 4096, 8192, 16384, 32768)
LONGNET_RATES = (1, 2, 4, 6, 12)
# The LongNet paper's language models: MAGNETO base size, hidden 768 = 12 heads of 64.
PROJECTION_H, PROJECTION_D, PROJECTION_BYTES = 12, 64, 2


def pattern_for(name: str, length: int) -> tuple[list[int], list[int]]:
    """Segment lengths and dilation rates of a measured pattern at sequence length ``length``."""
    if name == "wide":
        return [2048, 8192, length], [1, 4, length // 2048]
    if name == "longnet":
        return list(LONGNET_SEGMENTS), list(LONGNET_RATES)
    raise ValueError(f"unknown pattern {name!r}")


class _Done:
    def wait(self) -> None:
        return None


class ComputeOnly:
    """A communicator's schedule and delivery, moving nothing: receive buffers are zeroed."""

    def __init__(self, like: str) -> None:
        from ringdilated.backends.allgather import AllGatherCommunicator
        from ringdilated.backends.ringpass import RingPassCommunicator

        self._like = AllGatherCommunicator() if like == "allgather" else RingPassCommunicator()
        self.delivery = getattr(self._like, "delivery", "pairwise")

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        return self._like.schedule(rank, world_size)

    def prepare(self, group: object, plans: Any, causal: bool) -> None:
        return None

    def exchange(
        self,
        group: object,
        sends: Mapping[int, Any],
        recvs: Mapping[int, Any],
        uniform: bool = False,
    ) -> _Done:
        for buffer in recvs.values():
            buffer.zero_()
        return _Done()


# Variant name -> what is passed as ``communicator=``; "compute/X" moves nothing on X's schedule.
VARIANTS = ("ringpass", "allgather", "compute/ringpass", "compute/allgather")


class _Clock:
    """Seconds spent inside communicators' ``exchange`` and their pending ``wait``."""

    def __init__(self) -> None:
        self.seconds = 0.0


class _TimedPending:
    def __init__(self, pending: Any, clock: _Clock) -> None:
        self._pending, self._clock = pending, clock

    def wait(self) -> None:
        start = time.perf_counter()
        self._pending.wait()
        self._clock.seconds += time.perf_counter() - start


def _time_exchanges(cls: Any, clock: _Clock) -> None:
    """Make ``cls.exchange`` (in this rank's process only) add the time it and the wait on
    what it returns take to ``clock``: the communication the call did not hide behind compute
    (including waiting for a slower peer)."""
    original = cls.exchange

    def exchange(
        self: Any, group: object, sends: Any, recvs: Any, uniform: bool = False
    ) -> _TimedPending:
        start = time.perf_counter()
        pending = original(self, group, sends, recvs, uniform)
        clock.seconds += time.perf_counter() - start
        return _TimedPending(pending, clock)

    cls.exchange = exchange


def _rank(
    rank: int,
    world: int,
    store: str,
    length: int,
    configs: Sequence[tuple[str, bool, bool]],
    rounds: int,
    out: Any,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    import ringdilated
    from ringdilated.backends.allgather import AllGatherCommunicator
    from ringdilated.backends.ringpass import RingPassCommunicator

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    clock = _Clock()
    for cls in (RingPassCommunicator, AllGatherCommunicator):
        _time_exchanges(cls, clock)
    group = dist.group.WORLD
    shard = length // world
    torch.manual_seed(rank)
    base = [torch.randn(1, shard, H, D) for _ in range(3)]
    dout = torch.randn(1, shard, H, D)
    chosen: dict[str, Any] = {
        name: ComputeOnly(name.split("/")[1]) if name.startswith("compute/") else name
        for name in VARIANTS
    }
    results: dict[str, Any] = {}
    for number, (pattern, causal, backward) in enumerate(configs):
        segments, rates = pattern_for(pattern, length)
        if backward:
            q, k, v = (t.detach().requires_grad_() for t in base)
        else:
            q, k, v = base

        def call(
            variant: str,
            stats: Any,
            inputs: tuple[Any, Any, Any] = (q, k, v),
            pattern_args: tuple[list[int], list[int]] = (segments, rates),
            causal: bool = causal,
            backward: bool = backward,
        ) -> None:
            o = ringdilated.dilated_attention(
                *inputs, *pattern_args, causal=causal, process_group=group,
                communicator=chosen[variant], transfer_stats=stats,
            )  # fmt: skip
            if backward:
                o.backward(dout)
                for t in inputs:
                    t.grad = None
            del o

        if number == 0:
            # Untimed calls first, so that one-time costs (thread pools, gloo's first
            # collectives and transfers) land in no variant's memory or time.
            for variant in COMMUNICATORS:
                call(variant, None)
        key = f"{pattern}|{int(causal)}|{int(backward)}"
        entry: dict[str, Any] = {}
        for variant in VARIANTS:  # the first call of each: its peak and its bytes
            stats = ringdilated.TransferStats()
            dist.barrier()
            before = status_bytes("VmRSS")
            reset_peak()
            call(variant, stats)
            entry[variant] = {
                "peak_bytes": status_bytes("VmHWM") - before,
                "bytes_sent": stats.bytes_sent,
                "bytes_received": stats.bytes_received,
                "exchanges": stats.exchanges,
                "seconds": [],
                "exchange_seconds": [],
            }
        for i in range(rounds):
            shift = i % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                dist.barrier()
                clock.seconds = 0.0
                start = time.perf_counter()
                call(variant, None)
                entry[variant]["seconds"].append(time.perf_counter() - start)
                entry[variant]["exchange_seconds"].append(clock.seconds)
        results[key] = entry
    out.put((rank, results))
    dist.destroy_process_group()


def run_world(
    world: int, length: int, configs: Sequence[tuple[str, bool, bool]], rounds: int
) -> list[dict[str, Any]]:
    """Every configuration on ``world`` ranks (one process each); each rank's results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank, args=(r, world, store, length, configs, rounds, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=3600) for _ in range(world))
        for p in procs:
            p.join()
    return [results[r] for r in range(world)]


def modelled(
    pattern: DilationPattern,
    length: int,
    world: int,
    heads: int,
    head_dim: int,
    element_size: int,
    causal: bool,
) -> dict[str, Traffic]:
    """``cost.traffic`` for both communicators over every rank's shard plan (forward pass)."""
    from ringdilated.backends.allgather import AllGatherCommunicator
    from ringdilated.backends.ringpass import RingPassCommunicator
    from ringdilated.core.cost import NCCL, PieceSize, traffic
    from ringdilated.core.shard_plan import shard_plan

    plans = [shard_plan(pattern, length, heads, heads, r, world) for r in range(world)]
    size = PieceSize(1, head_dim, element_size, NCCL)
    return {
        "ringpass": traffic("ringpass", RingPassCommunicator(), plans, causal, size),
        "allgather": traffic("allgather", AllGatherCommunicator(), plans, causal, size),
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def measure(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    from ringdilated.core.pattern import DilationPattern

    all_configs = [
        (pattern, causal, backward)
        for pattern in args.patterns
        for causal in (False, True)
        for backward in ((False, True) if args.backward else (False,))
    ]
    mismatches = []
    for length in args.lengths:
        print(
            f"\n### Measured: L = {length}, fp32, B=1, H={H}, D={D}, gloo, one thread per rank, "
            f"{args.rounds} rounds\n"
        )
        print(
            "| pattern | causal | pass | P | rank | communicator | bytes sent | minimum "
            "| sent / min | exchanges | time best / median (s) | compute only best / median (s) "
            "| ratio best / median | in exchange best / median (ms) | peak MiB "
            "| compute only peak MiB |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        notes = []
        for world in args.worlds:
            models = {}
            for pattern_name, causal, _ in all_configs:
                segments, rates = pattern_for(pattern_name, length)
                models[pattern_name, causal] = modelled(
                    DilationPattern(segments, rates), length, world, H, D, 4, causal
                )
            # A pattern that crosses no shard boundary moves nothing: not worth timing.
            configs = [
                c for c in all_configs if any(sum(t.sent) for t in models[c[0], c[1]].values())
            ]
            for c in all_configs:
                if c not in configs:
                    notes.append(
                        f"{c[0]}, causal={c[1]}, P={world}: no segment crosses a shard "
                        "boundary; both communicators send 0 bytes (modelled); not run"
                    )
            if not configs:
                continue
            started = time.perf_counter()
            per_rank = run_world(world, length, configs, args.rounds)
            elapsed = time.perf_counter() - started
            for pattern_name, causal, backward in configs:
                model = models[pattern_name, causal]
                key = f"{pattern_name}|{int(causal)}|{int(backward)}"
                for rank, results in enumerate(per_rank):
                    entry = results[key]
                    fwd_min = model["ringpass"].minimum[rank]
                    received_min = model["ringpass"].received[rank]
                    minimum = 2 * fwd_min + received_min if backward else fwd_min
                    for name in COMMUNICATORS:
                        got, base = entry[name], entry[f"compute/{name}"]
                        expected = model[name].sent[rank]
                        if backward:
                            expected = 2 * expected + received_min
                        if got["bytes_sent"] != expected:
                            mismatches.append(
                                f"{pattern_name} causal={causal} backward={backward} P={world} "
                                f"rank {rank} {name}: sent {got['bytes_sent']}, model {expected}"
                            )
                        best, median = min(got["seconds"]), statistics.median(got["seconds"])
                        cbest = min(base["seconds"])
                        cmedian = statistics.median(base["seconds"])
                        wait = [1e3 * x for x in got["exchange_seconds"]]
                        over = f"{got['bytes_sent'] / minimum:.2f}" if minimum else "-"
                        row = {
                            "L": length,
                            "pattern": pattern_name,
                            "causal": causal,
                            "pass": "fwd+bwd" if backward else "fwd",
                            "P": world,
                            "rank": rank,
                            "communicator": name,
                            "minimum": minimum,
                            "modelled_sent": expected,
                            **got,
                            "compute_only_seconds": base["seconds"],
                            "compute_only_peak_bytes": base["peak_bytes"],
                        }
                        rows.append(row)
                        print(
                            f"| {pattern_name} | {'yes' if causal else 'no'} | {row['pass']} "
                            f"| {world} | {rank} | {name} | {got['bytes_sent']} | {minimum} "
                            f"| {over} | {got['exchanges']} | {best:.3f} / {median:.3f} "
                            f"| {cbest:.3f} / {cmedian:.3f} "
                            f"| {best / cbest:.2f} / {median / cmedian:.2f} "
                            f"| {min(wait):.1f} / {statistics.median(wait):.1f} "
                            f"| {_mib(got['peak_bytes'])} | {_mib(base['peak_bytes'])} |",
                            flush=True,
                        )
            print(f"<!-- P={world}: {elapsed:.0f} s -->", flush=True)
        for line in notes:
            print(f"\n- {line}", end="")
        print()
    if mismatches:
        print("\nBytes differing from ringdilated.core.cost.traffic:")
        for line in mismatches:
            print(f"- {line}")
    else:
        print("\nBytes sent equal ringdilated.core.cost.traffic's model on every row.")


def project(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    from ringdilated.core.pattern import DilationPattern

    pattern = DilationPattern(LONGNET_SEGMENTS, LONGNET_RATES, "head_groups")
    own = 2 * PROJECTION_H * PROJECTION_D * PROJECTION_BYTES
    print(
        f"\n### Projected: LongNet's pattern, H={PROJECTION_H}, D={PROJECTION_D}, "
        f"{PROJECTION_BYTES}-byte elements, B=1, head_groups (a token's own K and V: {own} B)\n"
    )
    print(
        "| L | P | tokens / rank | causal | ringpass fwd B/token: busiest / mean "
        "| allgather fwd B/token: busiest / mean | allgather / ringpass (busiest) "
        "| ringpass fwd+bwd B/token (busiest) | allgather fwd+bwd B/token (busiest) "
        "| steps ringpass / allgather | modelled NCCL ms ringpass / allgather |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for length in args.projection_lengths:
        for world in args.projection_worlds:
            tokens = length // world
            for causal in (False, True):
                model = modelled(
                    pattern, length, world, PROJECTION_H, PROJECTION_D, PROJECTION_BYTES, causal
                )
                received = model["ringpass"].received
                cells: dict[str, Any] = {}
                for name in COMMUNICATORS:
                    t = model[name]
                    both = [2 * s + r for s, r in zip(t.sent, received, strict=True)]
                    cells[name] = {
                        "busiest": max(t.sent) / tokens,
                        "mean": sum(t.sent) / world / tokens,
                        "fwd_bwd_busiest": max(both) / tokens,
                        "steps": t.steps,
                        "modelled_ms": t.seconds * 1e3,
                    }
                rp, ag = cells["ringpass"], cells["allgather"]
                ratio = f"{ag['busiest'] / rp['busiest']:.1f}" if rp["busiest"] else "-"
                rows.append(
                    {"projection": True, "L": length, "P": world, "causal": causal, **cells}
                )
                print(
                    f"| {length} | {world} | {tokens} | {'yes' if causal else 'no'} "
                    f"| {rp['busiest']:.1f} / {rp['mean']:.1f} "
                    f"| {ag['busiest']:.1f} / {ag['mean']:.1f} | {ratio} "
                    f"| {rp['fwd_bwd_busiest']:.1f} | {ag['fwd_bwd_busiest']:.1f} "
                    f"| {rp['steps']} / {ag['steps']} "
                    f"| {rp['modelled_ms']:.3f} / {ag['modelled_ms']:.3f} |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[65536])
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument(
        "--patterns", nargs="*", default=["wide", "longnet"], choices=["wide", "longnet"]
    )
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per variant")
    parser.add_argument(
        "--backward", action="store_true", help="also forward+backward (about 4x the time)"
    )
    parser.add_argument(
        "--projection-lengths", type=int, nargs="*", default=[32768, 262144, 1048576]
    )
    parser.add_argument("--projection-worlds", type=int, nargs="*", default=[8, 16, 32, 64])
    parser.add_argument("--no-projection", action="store_true")
    parser.add_argument("--projection-only", action="store_true")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # A fixed threshold (not glibc's adaptive one): large buffers are returned to the system when
    # freed, so each call's peak is measured from what is really resident before it.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    if not args.projection_only:
        measure(args, rows)
    if not args.no_projection:
        project(args, rows)
    print(f"\n<!-- total {time.perf_counter() - started:.0f} s -->")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
