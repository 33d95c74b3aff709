"""Sharded dilated attention, four communicators: ``ringpass`` and ``allgather`` (sequence
parallelism), ``ulysses`` (head parallelism) and ``hybrid`` (2-D): bytes, time against compute
only, time in exchange, per-rank compute balance and memory; and a projection of bytes per token
at larger P.

One command prints every table (issues 14 and 15; 312-582 s on this project's 2-core machine,
depending on what else runs on it)::

    python benchmarks/bench_distributed.py --lengths 65536 --worlds 2 4 --rounds 2

(those are the defaults; issue 14's runs used 4 rounds: with twice the variants, 2 keep the run
within about 5 minutes on a quiet machine). ``--backward`` adds forward+backward rows (about 4x
the time; the bytes of ``ulysses`` and ``hybrid`` are then not checked against a model);
``--no-projection`` leaves the projection out; ``--projection-only`` prints only it (seconds, no
processes); ``--json FILE`` also writes ``{"environment", "rows"}``: every row, and the
versions and machine they were measured with (``ringdilated.cli.bench.environment``).

**Measured**: fp32, B=1, D=64, gloo, one thread per rank, ``head_groups``, forward (and with
``--backward`` forward+backward), for each pattern of ``--patterns`` (all three by default):

- ``wide`` (H=8, causal and not): ``segment_lengths=[2048, 8192, L]``,
  ``dilation_rates=[1, 4, L/2048]`` (issue 3: the largest segment spans every rank; every block
  has 2048 selected positions; a head's work is 2048 : 512 : 64 x L selected pairs);
- ``longnet`` (H=8, causal and not): LongNet's published ``[2048, 4096, 8192, 16384, 32768]``,
  ``[1, 2, 4, 6, 12]``;
- ``unequal`` (H=6, not causal; issue 15's balance case): ``[2048, 4096, 8192]``, ``[1, 2, 4]``:
  heads whose work is 4 : 4 : 2 : 2 : 1 : 1.

Communicators: ``ringpass``, ``allgather``, ``ulysses`` (``process_group`` the world group) and
``hybrid`` (``process_group``: the (outer, inner) groups of a 2-D ``DeviceMesh``
``(ring, ulysses)``, made once per rank process, outside the timed calls: (2, 2) at P=4; at
P=2 ``--p2-grid``, default 1x2: all-to-all over both ranks and a ring of one, ``ulysses``
through the hybrid path; other P: (P/2, 2)).

Per rank and communicator: bytes sent and received (``TransferStats``), checked against
``ringdilated.core.select.cost.traffic`` (forward: both; with ``--backward`` the sequence
communicators'
sent bytes against 2 x forward + the gradients of the pieces received); for the sequence
communicators against the shard plan's minimum (the rank's pieces to the ranks whose queries see
them), for every communicator against what ``ringpass`` sends. Time against the same rank
running the same schedule with a communicator that moves nothing ("compute only"):
``ringpass``'s P-1 steps and ``allgather``'s one step on zeroed receive buffers; for
``ulysses`` a ``UlyssesCommunicator`` subclass whose ``exchange`` zeroes the receive buffers and
returns (the sharding into head shares and back, and the kernel calls, are the same; the
all-to-all's own concatenation and copy-out are skipped with it); for ``hybrid`` the hybrid
spec with those two as its parts (each ``compute/<name>``, registered in the rank processes).
Zeroed, not left unfilled: garbage holding a NaN would make the kernels' non-finite repair mark
rows NaN, and their results would no longer be comparable.
"In exchange": the time a rank spends inside ``RingPassCommunicator``,
``AllGatherCommunicator`` and ``UlyssesCommunicator``'s ``exchange`` and the wait on what they
return (the methods are wrapped in the rank processes started here, nowhere else; ``hybrid``
uses the last two, its all-to-all part given apart): the communication the call did not hide
behind compute, including waiting for a slower peer (``ulysses`` waits on each of its two
all-to-alls at once: it hides nothing, and the second waits for the slowest rank's attention).
"Kernel CPU": the CPU time of the rank's thread inside the CPU flash kernel's calls
(``CpuFlashAttention.forward``/``backward``, wrapped likewise): with one thread per rank, the
rank's own attention work, whether or not it shares a core. Peak: the resident memory a call
adds above what was resident just before it (inputs excluded; ``MALLOC_MMAP_THRESHOLD_`` is
fixed at 1 MiB so that freed buffers leave the process).

**Balance**: max over mean of the ranks' work. Analytic: selected query-key pairs (causal: the
visible ones) of the queries a rank attends: its sequence shard of every head (``ringpass``,
``allgather``), its heads of ``deal_heads`` over the whole sequence (``ulysses``), its inner
rank's heads over its outer index's chunk (``hybrid``); against contiguous equal-count dealing
(heads in order, ``H // P`` each, one more to the first ``H % P``) for the head-parallel ones.
Not causal, the heads' figures equal ``ringdilated.core.plan.heads``' ``HeadShare.cost`` (checked).
Measured: kernel CPU, and the thread's CPU time over the compute-only call (over the call
itself where no compute-only variant is run); per rank the median of the rounds.

Ranks are processes started here, one set per world size for every configuration; with more
ranks than cores they share cores, in every column alike. After one untimed call of each
communicator, each variant's first call gives its bytes and peak; then the variants alternate,
in a rotating order reversed every other round, for ``--rounds`` timed rounds: best and median
are printed. (Which variant runs just before another matters here: in a check at P=2, a
``ulysses`` or ``hybrid`` call right after an ``allgather`` call took 1.1-1.7x as long as right
after the other of the two; with a plain rotation ``hybrid`` always followed ``ulysses``.) Where the
sequence communicators move nothing (no segment crosses a shard boundary), a configuration is
reported, not run (``longnet`` at P=2), except the balance case (``unequal`` at P=2 and 4), run
with ``ringpass`` (moving nothing: the sequence-parallel reference), ``ulysses`` and ``hybrid``.

**Projected** (no processes; every rank's shard plan through
``ringdilated.core.select.cost.traffic``):
bytes each rank sends per token it holds, per layer (one attention call), at P = 8, 16, 32, 64
and L = 32768, 262144, 1048576, with LongNet's pattern and the LongNet paper's model (MAGNETO
base size: 12 heads of 64), 2-byte elements (bf16/fp16), B=1, ``head_groups`` (heads split 3, 3,
2, 2, 2 among the five patterns). Issue 14's table: ``ringpass`` and ``allgather``;
forward+backward = 2 x forward + the gradients of the pieces received (the measured rows with
``--backward`` check that formula). Issue 15's: ``ulysses`` (needs a query head per rank: P <= 12
here) and ``hybrid`` on a grid of (P/8, 8) (all-to-all within 8 ranks, a node;
``--projection-inner``), its bytes split into the ring part across chunks and the all-to-all
within a node, the modelled time, and the analytic work balance; forward only.
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
    from ringdilated.core.plan.pattern import DilationPattern
    from ringdilated.core.select.cost import Traffic

H, D = 8, 64
SEQUENCE = ("ringpass", "allgather")
COMMUNICATORS = (*SEQUENCE, "ulysses", "hybrid")
LONGNET_SEGMENTS = (2048, 4096, 8192, 16384, 32768)
LONGNET_RATES = (1, 2, 4, 6, 12)
# The LongNet paper's language models: MAGNETO base size, hidden 768 = 12 heads of 64.
PROJECTION_H, PROJECTION_D, PROJECTION_BYTES = 12, 64, 2
PATTERNS = ("wide", "longnet", "unequal")
# Query heads per pattern; the causal settings measured (head balance does not depend on it).
HEADS = {"wide": H, "longnet": H, "unequal": 6}
CAUSAL = {"wide": (False, True), "longnet": (False, True), "unequal": (False,)}


def pattern_for(name: str, length: int) -> tuple[list[int], list[int]]:
    """Segment lengths and dilation rates of a measured pattern at sequence length ``length``."""
    if name == "wide":
        return [2048, 8192, length], [1, 4, length // 2048]
    if name == "longnet":
        return list(LONGNET_SEGMENTS), list(LONGNET_RATES)
    if name == "unequal":
        return [2048, 4096, 8192], [1, 2, 4]
    raise ValueError(f"unknown pattern {name!r}")


def grid_for(world: int, p2_grid: tuple[int, int]) -> tuple[int, int]:
    """``(outer, inner)`` of ``hybrid``'s mesh at ``world`` ranks."""
    if world == 2:
        return p2_grid
    return world // 2, 2


class _Done:
    def wait(self) -> None:
        return None


def compute_only(cls: type) -> type:
    """Communicator class ``cls`` with an ``exchange`` that moves nothing: receive buffers are
    zeroed (left unfilled, one holding a NaN would send the kernel to its dense path). Its
    schedule, and its spec's delivery and parallelism, are ``cls``'s."""

    class ComputeOnly(cls):  # type: ignore[valid-type,misc]
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

    ComputeOnly.__name__ = ComputeOnly.__qualname__ = f"ComputeOnly{cls.__name__}"
    return ComputeOnly


def register_compute_only() -> None:
    """Register in this process's resolver ``compute/<name>`` for every communicator: its spec,
    with a factory whose exchanges move nothing (for ``hybrid``: its parts' twins as parts)."""
    import attrs

    from ringdilated.registry import default_resolver

    specs = default_resolver().communicator_specs
    for name in COMMUNICATORS:
        spec = specs[name]
        parts = None if spec.parts is None else tuple(f"compute/{p}" for p in spec.parts)
        factory = spec.factory if parts else compute_only(spec.factory)  # type: ignore[arg-type]
        twin = attrs.evolve(spec, name=f"compute/{name}", factory=factory, parts=parts)
        specs[twin.name] = attrs.evolve(twin, priority=-1000)  # never "auto"'s choice


# Variant name, passed as ``communicator=``; "compute/X" moves nothing on X's schedule.
VARIANTS = (*COMMUNICATORS, *(f"compute/{name}" for name in COMMUNICATORS))
# Where the sequence communicators move nothing, only the balance case is run, without allgather
# and compute-only variants: ringpass (moving nothing) as the sequence-parallel reference.
IDLE_VARIANTS = ("ringpass", "ulysses", "hybrid")
BALANCE_PATTERNS = ("unequal",)


class _Clock:
    """Seconds spent inside communicators' ``exchange`` and their pending ``wait``, or CPU
    seconds inside kernel calls."""

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
    what it returns take to ``clock``: the communication the call did not hide behind
    compute (including waiting for a slower peer)."""
    original = cls.exchange

    def exchange(
        self: Any, group: object, sends: Any, recvs: Any, uniform: bool = False
    ) -> _TimedPending:
        start = time.perf_counter()
        pending = original(self, group, sends, recvs, uniform)
        clock.seconds += time.perf_counter() - start
        return _TimedPending(pending, clock)

    cls.exchange = exchange


def _time_kernel(cls: Any, clock: _Clock) -> None:
    """Make ``cls.forward`` and ``cls.backward`` (in this rank's process only) add the CPU time
    of the calling thread inside them to ``clock``."""
    for method in ("forward", "backward"):
        original = getattr(cls, method)

        def timed(self: Any, *args: Any, _original: Any = original) -> Any:
            start = time.thread_time()
            try:
                return _original(self, *args)
            finally:
                clock.seconds += time.thread_time() - start

        setattr(cls, method, timed)


Plan = Sequence[tuple[tuple[str, bool, bool], Sequence[str]]]
"""Each configuration ``(pattern, causal, backward)`` with the variants run for it."""


def _rank(
    rank: int,
    world: int,
    grid: tuple[int, int],
    store: str,
    length: int,
    plan: Plan,
    rounds: int,
    out: Any,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ringdilated
    from ringdilated.backends.allgather import AllGatherCommunicator
    from ringdilated.backends.ringpass import RingPassCommunicator
    from ringdilated.backends.sdpa import CpuFlashAttention
    from ringdilated.backends.ulysses import UlyssesCommunicator

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    # hybrid's 2-D layout, made once here: creating its groups is a collective of every rank.
    # Passed as its (outer, inner) pair of groups: the same Grid as (mesh, ("ring", "ulysses")),
    # and a form every version of the call's process_group argument has taken.
    mesh = init_device_mesh("cpu", grid, mesh_dim_names=("ring", "ulysses"))
    layout = (mesh.get_group("ring"), mesh.get_group("ulysses"))
    clocks = {"ringpass": _Clock(), "allgather": _Clock(), "ulysses": _Clock()}
    _time_exchanges(RingPassCommunicator, clocks["ringpass"])
    _time_exchanges(AllGatherCommunicator, clocks["allgather"])
    _time_exchanges(UlyssesCommunicator, clocks["ulysses"])
    kernel_clock = _Clock()
    _time_kernel(CpuFlashAttention, kernel_clock)
    group = dist.group.WORLD
    shard = length // world
    inputs: dict[int, tuple[list[Any], Any]] = {}
    for heads in sorted({HEADS[pattern] for (pattern, _, _), _ in plan}):
        torch.manual_seed(1000 * heads + rank)
        inputs[heads] = (
            [torch.randn(1, shard, heads, D) for _ in range(3)],
            torch.randn(1, shard, heads, D),
        )
    register_compute_only()
    groups = {name: layout if name.endswith("hybrid") else group for name in VARIANTS}
    results: dict[str, Any] = {}
    for number, ((pattern, causal, backward), variants) in enumerate(plan):
        segments, rates = pattern_for(pattern, length)
        base, dout = inputs[HEADS[pattern]]
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
            dout: Any = dout,
        ) -> None:
            o = ringdilated.dilated_attention(
                *inputs, *pattern_args, causal=causal, process_group=groups[variant],
                communicator=variant, transfer_stats=stats,
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
        for variant in variants:  # the first call of each: its peak and its bytes
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
                "exchange_parts": [],
                "kernel_cpu_seconds": [],
                "cpu_seconds": [],
            }
        for i in range(rounds):
            # Rotated, and reversed every other round: what ran just before a call changes its
            # time here (a ulysses or hybrid call right after a light one is the slower), so no
            # variant always follows the same one.
            shift = i % len(variants)
            order = [*variants[shift:], *variants[:shift]]
            for variant in reversed(order) if i % 2 else order:
                dist.barrier()
                for clock in (*clocks.values(), kernel_clock):
                    clock.seconds = 0.0
                cpu = time.thread_time()
                start = time.perf_counter()
                call(variant, None)
                got = entry[variant]
                got["seconds"].append(time.perf_counter() - start)
                got["cpu_seconds"].append(time.thread_time() - cpu)
                got["kernel_cpu_seconds"].append(kernel_clock.seconds)
                got["exchange_seconds"].append(sum(c.seconds for c in clocks.values()))
                got["exchange_parts"].append({n: c.seconds for n, c in clocks.items()})
        results[key] = entry
    out.put((rank, results))
    dist.destroy_process_group()


def run_world(
    world: int, grid: tuple[int, int], length: int, plan: Plan, rounds: int
) -> list[dict[str, Any]]:
    """Every configuration on ``world`` ranks (one process each); each rank's results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank, args=(r, world, grid, store, length, plan, rounds, queue))
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
    grid: tuple[int, int] | None = None,
) -> dict[str, Traffic | None]:
    """``cost.traffic`` for every communicator over every rank's shard plan (forward pass);
    ``hybrid`` only with a ``grid``; ``None`` for a communicator that cannot serve (``ulysses``
    with fewer query heads than ranks)."""
    from ringdilated.core.plan.shards import shard_plan
    from ringdilated.core.select.cost import NCCL, PieceSize, traffic
    from ringdilated.registry import default_resolver

    plans = [shard_plan(pattern, length, heads, heads, r, world) for r in range(world)]
    size = PieceSize(1, head_dim, element_size, NCCL)
    resolver = default_resolver()

    def model(name: str, layout: tuple[int, int] | None = None) -> Traffic:
        chosen = resolver.choose_communicator(world, causal, name, grid=layout)
        return traffic(chosen, plans, causal, size, layout)

    models: dict[str, Traffic | None] = {
        "ringpass": model("ringpass"),
        "allgather": model("allgather"),
        "ulysses": None,
        "hybrid": None,
    }
    if heads >= world:
        models["ulysses"] = model("ulysses")
    if grid is not None and heads >= grid[1]:
        models["hybrid"] = model("hybrid", grid)
    return models


def hybrid_across(
    pattern: DilationPattern,
    length: int,
    heads: int,
    head_dim: int,
    element_size: int,
    causal: bool,
    grid: tuple[int, int],
) -> list[int]:
    """Bytes each rank of a ``hybrid`` forward sends across its outer group (between chunks: the
    ring part, ``ringpass`` on its share of the heads), in flat rank order; the rest of what it
    sends is its inner group's all-to-all."""
    from ringdilated.backends.ringpass import RINGPASS_SPEC, RingPassCommunicator
    from ringdilated.core.plan.heads import deal_heads, share_plan
    from ringdilated.core.plan.shards import shard_plan
    from ringdilated.core.select.communicator_spec import CommunicatorChoice
    from ringdilated.core.select.cost import NCCL, PieceSize, traffic

    outer, inner = grid
    size = PieceSize(1, head_dim, element_size, NCCL)
    chunks = tuple([length // outer] * outer)
    sent = [0] * (outer * inner)
    ring = CommunicatorChoice(RINGPASS_SPEC, RingPassCommunicator())
    for i, share in enumerate(deal_heads(pattern, length, heads, heads, inner)):
        across = [
            share_plan(shard_plan(pattern, length, heads, heads, o, outer, None, chunks), share)
            for o in range(outer)
        ]
        moved = traffic(ring, across, causal, size)
        for o in range(outer):
            sent[o * inner + i] = moved.sent[o]
    return sent


def pairs(
    pattern: DilationPattern,
    length: int,
    heads: int,
    subset: Sequence[int],
    lo: int,
    hi: int,
    causal: bool,
) -> int:
    """Selected query-key pairs of query heads ``subset`` for queries in ``[lo, hi)`` (causal:
    a query sees the selected keys of its segment up to itself)."""
    chosen = set(subset)
    total = 0
    for block in pattern.blocks(length, heads, heads):
        run, sel = block.heads, block.selection
        count = sum(1 for h in range(run.q_start, run.q_stop) if h in chosen)
        n = sel.count
        if not count or not n or hi <= sel.start or lo >= sel.stop:
            continue
        first = max(0, (lo - sel.start) // sel.segment_length)
        last = min(sel.num_segments, -(-(hi - sel.start) // sel.segment_length))
        for s in range(first, last):
            base = sel.start + s * sel.segment_length + sel.offset
            j0 = max(0, -(-(lo - base) // sel.rate))
            j1 = min(n, -(-(hi - base) // sel.rate))
            if j1 <= j0:
                continue
            if causal:
                total += count * (j1 * (j1 + 1) - j0 * (j0 + 1)) // 2
            else:
                total += count * (j1 - j0) * n
    return total


def contiguous_shares(heads: int, world: int) -> list[tuple[int, ...]]:
    """Heads dealt in order, ``heads // world`` each, one more to the first ``heads % world``."""
    base, extra = divmod(heads, world)
    counts = [base + (r < extra) for r in range(world)]
    starts = [sum(counts[:r]) for r in range(world)]
    return [tuple(range(starts[r], starts[r] + counts[r])) for r in range(world)]


def rank_work(
    pattern: DilationPattern,
    length: int,
    heads: int,
    world: int,
    communicator: str,
    causal: bool,
    grid: tuple[int, int] | None = None,
    contiguous: bool = False,
) -> tuple[list[int], list[tuple[int, ...]] | None]:
    """Each rank's selected pairs under ``communicator`` (analytic), and its query heads for the
    head-parallel ones (``contiguous``: dealt by :func:`contiguous_shares`, not ``deal_heads``)."""
    from ringdilated.core.plan.heads import deal_heads, head_costs

    every = tuple(range(heads))
    if communicator in SEQUENCE:
        n = length // world
        work = [
            pairs(pattern, length, heads, every, r * n, (r + 1) * n, causal) for r in range(world)
        ]
        return work, None
    if communicator == "ulysses":
        outer, inner = 1, world
    else:
        assert grid is not None
        outer, inner = grid
    if contiguous:
        shares = contiguous_shares(heads, inner)
    else:
        dealt = deal_heads(pattern, length, heads, heads, inner)
        shares = [s.q_heads for s in dealt]
        if not causal and outer == 1:  # the library's own figure
            costs = head_costs(pattern, length, heads, heads)
            assert [s.cost for s in dealt] == [sum(costs[h] for h in s) for s in shares]
            assert [s.cost for s in dealt] == [
                pairs(pattern, length, heads, s, 0, length, False) for s in shares
            ]
    chunk = length // outer
    work = [
        pairs(pattern, length, heads, shares[i], o * chunk, (o + 1) * chunk, causal)
        for o in range(outer)
        for i in range(inner)
    ]
    return work, [shares[i] for _ in range(outer) for i in range(inner)]


def balance(values: Sequence[float]) -> float:
    """Max over mean (1.0: every rank the same)."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean else float("nan")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _range(values: Sequence[float], fmt: str = ".3f") -> str:
    return f"{min(values):{fmt}} / {statistics.median(values):{fmt}}"


def measure(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    from ringdilated.core.plan.pattern import DilationPattern

    all_configs = [
        (pattern, causal, backward)
        for pattern in args.patterns
        for causal in CAUSAL[pattern]
        for backward in ((False, True) if args.backward else (False,))
    ]
    mismatches: list[str] = []
    checked = 0
    for length in args.lengths:
        print(
            f"\n### Measured: L = {length}, fp32, B=1, H={H} (unequal: "
            f"{HEADS['unequal']}), D={D}, gloo, one thread per rank, {args.rounds} rounds\n"
        )
        print(
            "| pattern | causal | pass | P | rank | communicator | bytes sent | bytes received "
            "| minimum | sent / min | sent / ringpass's | exchanges | time best / median (s) "
            "| compute only best / median (s) | ratio best / median "
            "| in exchange best / median (ms) | kernel CPU median (s) | peak MiB "
            "| compute only peak MiB |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        notes: list[str] = []
        balance_lines: list[str] = []
        for world in args.worlds:
            grid = grid_for(world, args.p2_grid)
            models = {}
            for pattern_name, causal, _ in all_configs:
                segments, rates = pattern_for(pattern_name, length)
                models[pattern_name, causal] = modelled(
                    DilationPattern(segments, rates),
                    length,
                    world,
                    HEADS[pattern_name],
                    D,
                    4,
                    causal,
                    grid,
                )
            plan: list[tuple[tuple[str, bool, bool], tuple[str, ...]]] = []
            for config in all_configs:
                model = models[config[0], config[1]]
                variants = VARIANTS
                if not any(sum(model[n].sent) for n in SEQUENCE):  # type: ignore[union-attr]
                    heads_sent = ", ".join(
                        f"{n} up to {max(t.sent)} B a rank"
                        for n in ("ulysses", "hybrid")
                        if (t := model[n]) is not None
                    )
                    idle = (
                        f"{config[0]}, causal={config[1]}, P={world}: no segment crosses a shard "
                        f"boundary; the sequence communicators send 0 bytes (modelled; "
                        f"{heads_sent})"
                    )
                    if config[0] not in BALANCE_PATTERNS:
                        notes.append(f"{idle}: not run")
                        continue
                    variants = IDLE_VARIANTS
                    notes.append(f"{idle}: run with {', '.join(variants)} only")
                unserved = [n for n in ("ulysses", "hybrid") if model[n] is None]
                variants = tuple(v for v in variants if v.split("/")[-1] not in unserved)
                plan.append((config, variants))
            if not plan:
                continue
            started = time.perf_counter()
            per_rank = run_world(world, grid, length, plan, args.rounds)
            elapsed = time.perf_counter() - started
            for (pattern_name, causal, backward), variants in plan:
                model = models[pattern_name, causal]
                heads = HEADS[pattern_name]
                segments, rates = pattern_for(pattern_name, length)
                pattern = DilationPattern(segments, rates)
                key = f"{pattern_name}|{int(causal)}|{int(backward)}"
                ring = model["ringpass"]
                assert ring is not None
                for rank, results in enumerate(per_rank):
                    entry = results[key]
                    fwd_min = ring.minimum[rank]
                    received_min = ring.received[rank]
                    minimum = 2 * fwd_min + received_min if backward else fwd_min
                    ring_sent = entry["ringpass"]["bytes_sent"]
                    for name in COMMUNICATORS:
                        if name not in variants:
                            continue
                        got, base = entry[name], entry.get(f"compute/{name}")
                        t = model[name]
                        assert t is not None
                        expected: int | None = t.sent[rank]
                        expected_received: int | None = t.received[rank]
                        if backward:
                            expected_received = None
                            expected = 2 * t.sent[rank] + received_min if name in SEQUENCE else None
                        where = (
                            f"{pattern_name} causal={causal} backward={backward} P={world} "
                            f"rank {rank} {name}"
                        )
                        if expected is not None:
                            checked += 1
                            if got["bytes_sent"] != expected:
                                mismatches.append(
                                    f"{where}: sent {got['bytes_sent']}, model {expected}"
                                )
                        if expected_received is not None:
                            checked += 1
                            if got["bytes_received"] != expected_received:
                                mismatches.append(
                                    f"{where}: received {got['bytes_received']}, model "
                                    f"{expected_received}"
                                )
                        wait = [1e3 * x for x in got["exchange_seconds"]]
                        in_exchange = _range(wait, ".1f")
                        if name == "hybrid":
                            a2a = [1e3 * p["ulysses"] for p in got["exchange_parts"]]
                            in_exchange += f" (all-to-all {_range(a2a, '.1f')})"
                        over = "-"
                        if name in SEQUENCE and minimum:
                            over = f"{got['bytes_sent'] / minimum:.2f}"
                        versus = f"{got['bytes_sent'] / ring_sent:.1f}" if ring_sent else "-"
                        timing = _range(got["seconds"])
                        compute = ratio = compute_peak = "-"
                        if base is not None:
                            compute = _range(base["seconds"])
                            best = min(got["seconds"]) / min(base["seconds"])
                            median = statistics.median(got["seconds"]) / statistics.median(
                                base["seconds"]
                            )
                            ratio = f"{best:.2f} / {median:.2f}"
                            compute_peak = _mib(base["peak_bytes"])
                        kernel = statistics.median(got["kernel_cpu_seconds"])
                        row = {
                            "L": length,
                            "pattern": pattern_name,
                            "heads": heads,
                            "causal": causal,
                            "pass": "fwd+bwd" if backward else "fwd",
                            "P": world,
                            "grid": list(grid) if name == "hybrid" else None,
                            "rank": rank,
                            "communicator": name,
                            "minimum": minimum,
                            "modelled_sent": expected,
                            "modelled_received": expected_received,
                            **got,
                            "compute_only_seconds": base["seconds"] if base else None,
                            "compute_only_cpu_seconds": base["cpu_seconds"] if base else None,
                            "compute_only_peak_bytes": base["peak_bytes"] if base else None,
                        }
                        rows.append(row)
                        print(
                            f"| {pattern_name} | {'yes' if causal else 'no'} | {row['pass']} "
                            f"| {world} | {rank} | {name} | {got['bytes_sent']} "
                            f"| {got['bytes_received']} | {minimum} | {over} | {versus} "
                            f"| {got['exchanges']} | {timing} | {compute} | {ratio} "
                            f"| {in_exchange} | {kernel:.3f} | {_mib(got['peak_bytes'])} "
                            f"| {compute_peak} |",
                            flush=True,
                        )
                for name in COMMUNICATORS:
                    if name not in variants:
                        continue
                    work, shares = rank_work(pattern, length, heads, world, name, causal, grid)
                    contiguous = "-"
                    if shares is not None:
                        alike = rank_work(
                            pattern, length, heads, world, name, causal, grid, contiguous=True
                        )[0]
                        contiguous = f"{balance(alike):.3f}"
                    kernel = [
                        statistics.median(results[key][name]["kernel_cpu_seconds"])
                        for results in per_rank
                    ]
                    # Compute only: the no-op variant, or the communicator itself where the
                    # sequence communicators move nothing.
                    source = f"compute/{name}" if f"compute/{name}" in variants else name
                    cpu = [
                        statistics.median(results[key][source]["cpu_seconds"])
                        for results in per_rank
                    ]
                    held = (
                        "every head, its shard"
                        if shares is None
                        else " ".join("[" + ",".join(map(str, s)) + "]" for s in shares)
                    )
                    label = f"{name} {grid[0]}x{grid[1]}" if name == "hybrid" else name
                    rows.append(
                        {
                            "balance": True,
                            "L": length,
                            "pattern": pattern_name,
                            "heads": heads,
                            "causal": causal,
                            "backward": backward,
                            "P": world,
                            "communicator": name,
                            "grid": list(grid) if name == "hybrid" else None,
                            "q_heads": shares,
                            "pairs": work,
                            "analytic": balance(work),
                            "contiguous": None if shares is None else float(contiguous),
                            "kernel_cpu_seconds": kernel,
                            "compute_only_cpu_seconds": cpu,
                            "compute_only_source": source,
                        }
                    )
                    balance_lines.append(
                        f"| {pattern_name} | {'yes' if causal else 'no'} "
                        f"| {'fwd+bwd' if backward else 'fwd'} | {world} | {heads} | {label} "
                        f"| {held} | {' / '.join(f'{w / 1e6:.0f}' for w in work)} "
                        f"| {balance(work):.3f} | {contiguous} "
                        f"| {' / '.join(f'{x:.2f}' for x in kernel)} | {balance(kernel):.3f} "
                        f"| {' / '.join(f'{x:.2f}' for x in cpu)} | {balance(cpu):.3f} |"
                    )
            print(f"<!-- P={world} (hybrid {grid[0]}x{grid[1]}): {elapsed:.0f} s -->", flush=True)
        for line in notes:
            print(f"\n- {line}", end="")
        print()
        print(
            f"\n### Balance: L = {length}, max / mean over ranks of each rank's work "
            "(analytic: selected query-key pairs; measured: medians of the rounds)\n"
        )
        print(
            "| pattern | causal | pass | P | H | communicator | query heads per rank "
            "| selected pairs per rank (M) | analytic max / mean "
            "| contiguous dealing max / mean | kernel CPU per rank (s) | kernel CPU max / mean "
            "| compute-only call CPU per rank (s) | compute-only CPU max / mean |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for line in balance_lines:
            print(line)
    if mismatches:
        print("\nBytes differing from ringdilated.core.select.cost.traffic:")
        for line in mismatches:
            print(f"- {line}")
    else:
        print(
            f"\nBytes equal ringdilated.core.select.cost.traffic's model in all {checked} checks "
            "(forward: sent and received; forward+backward: sent, sequence communicators)."
        )


def _per_token(cell: dict[str, Any] | None, field: str = "busiest") -> str:
    return "-" if cell is None else f"{cell[field]:.1f}"


def _versus(cell: dict[str, Any] | None, ring: dict[str, Any], field: str = "busiest") -> str:
    """``cell[field]`` over ringpass's busiest rank's bytes."""
    if cell is None or not ring["busiest"]:
        return "-"
    return f"{cell[field] / ring['busiest']:.2f}"


def _cell_ms(cell: dict[str, Any] | None) -> str:
    return "-" if cell is None else f"{cell['modelled_ms']:.3f}"


def _cell_balance(cell: dict[str, Any] | None) -> str:
    return "-" if cell is None else f"{cell['work_balance']:.2f}"


def project(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    from ringdilated.core.plan.pattern import DilationPattern

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
    heads_lines: list[str] = []
    inner = args.projection_inner
    for length in args.projection_lengths:
        for world in args.projection_worlds:
            tokens = length // world
            grid = (world // inner, inner) if world % inner == 0 else None
            for causal in (False, True):
                model = modelled(
                    pattern,
                    length,
                    world,
                    PROJECTION_H,
                    PROJECTION_D,
                    PROJECTION_BYTES,
                    causal,
                    grid,
                )
                ring = model["ringpass"]
                assert ring is not None
                received = ring.received
                cells: dict[str, Any] = {}
                for name in COMMUNICATORS:
                    t = model[name]
                    if t is None:
                        cells[name] = None
                        continue
                    cells[name] = {
                        "busiest": max(t.sent) / tokens,
                        "mean": sum(t.sent) / world / tokens,
                        "steps": t.steps,
                        "modelled_ms": t.seconds * 1e3,
                        "work_balance": balance(
                            rank_work(pattern, length, PROJECTION_H, world, name, causal, grid)[0]
                        ),
                    }
                    if name in SEQUENCE:
                        both = [2 * s + r for s, r in zip(t.sent, received, strict=True)]
                        cells[name]["fwd_bwd_busiest"] = max(both) / tokens
                hy = cells["hybrid"]
                if hy is not None and grid is not None:
                    across = hybrid_across(
                        pattern, length, PROJECTION_H, PROJECTION_D, PROJECTION_BYTES, causal, grid
                    )
                    hy_sent = model["hybrid"].sent  # type: ignore[union-attr]
                    hy["across_busiest"] = max(across) / tokens
                    hy["across_mean"] = sum(across) / world / tokens
                    hy["within_busiest"] = (
                        max(s - a for s, a in zip(hy_sent, across, strict=True)) / tokens
                    )
                rows.append(
                    {
                        "projection": True,
                        "L": length,
                        "P": world,
                        "causal": causal,
                        "grid": grid,
                        **cells,
                    }
                )
                rp, ag, ul = cells["ringpass"], cells["allgather"], cells["ulysses"]
                ratio = f"{ag['busiest'] / rp['busiest']:.1f}" if rp["busiest"] else "-"
                print(
                    f"| {length} | {world} | {tokens} | {'yes' if causal else 'no'} "
                    f"| {rp['busiest']:.1f} / {rp['mean']:.1f} "
                    f"| {ag['busiest']:.1f} / {ag['mean']:.1f} | {ratio} "
                    f"| {rp['fwd_bwd_busiest']:.1f} | {ag['fwd_bwd_busiest']:.1f} "
                    f"| {rp['steps']} / {ag['steps']} "
                    f"| {rp['modelled_ms']:.3f} / {ag['modelled_ms']:.3f} |",
                    flush=True,
                )

                grid_cell = "-" if grid is None else f"{grid[0]}x{grid[1]}"
                heads_lines.append(
                    f"| {length} | {world} | {'yes' if causal else 'no'} "
                    f"| {rp['busiest']:.1f} | {_per_token(ul)} / {_per_token(ul, 'mean')} "
                    f"| {grid_cell} | {_per_token(hy)} / {_per_token(hy, 'mean')} "
                    f"| {_per_token(hy, 'across_busiest')} / {_per_token(hy, 'across_mean')} "
                    f"| {_per_token(hy, 'within_busiest')} "
                    f"| {_versus(ul, rp)} | {_versus(hy, rp)} "
                    f"| {_versus(hy, rp, 'across_busiest')} "
                    f"| {rp['steps']} / {'-' if ul is None else ul['steps']} / "
                    f"{'-' if hy is None else hy['steps']} "
                    f"| {rp['modelled_ms']:.3f} / {_cell_ms(ul)} / {_cell_ms(hy)} "
                    f"| {rp['work_balance']:.2f} / {_cell_balance(ul)} / {_cell_balance(hy)} |"
                )
    print(
        f"\n### Projected, head parallelism: the same settings; hybrid on (P/{inner}, {inner}) "
        f"(all-to-all within {inner} ranks, a node; ringpass across the P/{inner} chunks); "
        f"ulysses needs H >= P ({PROJECTION_H} heads)\n"
    )
    print(
        "| L | P | causal | ringpass fwd B/token (busiest) | ulysses fwd B/token: busiest / mean "
        "| hybrid grid | hybrid fwd B/token: busiest / mean "
        "| hybrid across chunks B/token: busiest / mean | hybrid within a node B/token (busiest) "
        "| ulysses / ringpass | hybrid / ringpass | hybrid across / ringpass "
        "| steps ringpass / ulysses / hybrid | modelled NCCL ms ringpass / ulysses / hybrid "
        "| work max / mean ringpass / ulysses / hybrid |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for line in heads_lines:
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[65536])
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--patterns", nargs="*", default=list(PATTERNS), choices=PATTERNS)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per variant")
    parser.add_argument(
        "--backward", action="store_true", help="also forward+backward (about 4x the time)"
    )
    parser.add_argument(
        "--p2-grid",
        type=lambda s: tuple(int(x) for x in s.split("x")),
        default=(1, 2),
        choices=[(1, 2), (2, 1)],
        help="hybrid's (outer, inner) mesh at P=2: 1x2 (default) or 2x1",
    )
    parser.add_argument(
        "--projection-lengths", type=int, nargs="*", default=[32768, 262144, 1048576]
    )
    parser.add_argument("--projection-worlds", type=int, nargs="*", default=[8, 16, 32, 64])
    parser.add_argument(
        "--projection-inner", type=int, default=8, help="hybrid's inner size in the projection"
    )
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
            from ringdilated.cli.bench import environment

            machine = environment("cpu")
            # every rank runs one thread (set_num_threads(1)); the rows name their world size
            machine["machine"].update(threads_per_rank=1, ranks=sorted(set(args.worlds)))
            json.dump({"environment": machine, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
