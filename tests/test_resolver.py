"""The capability resolver, with injected fake environments (no GPU needed)."""

from __future__ import annotations

import attrs
import pytest
import torch

from ringdilated import Environment, KernelSpec, Request, ResolutionError, Resolver
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.backends.sdpa import SDPA_SPEC
from ringdilated.core import Capabilities, PriorityRule, Target

FLASH_LIKE = KernelSpec(
    name="fakeflash",
    factory=ReferenceKernel,
    capabilities=Capabilities(
        targets=(
            Target(
                "cuda",
                frozenset({torch.float16, torch.bfloat16}),
                min_capability=(8, 0),
                max_head_dim=256,
                head_dim_multiple=8,
            ),
        ),
        requires=("flash_attn",),
    ),
    priority=200,
)


def _resolver(packages: frozenset[str] = frozenset()) -> Resolver:
    return Resolver([SDPA_SPEC, REFERENCE_SPEC, FLASH_LIKE], env=Environment(packages=packages))


def cuda(
    cc: tuple[int, int], dtype: torch.dtype = torch.float16, head_dim: int = 64, **kw: bool
) -> Request:
    return Request(device_type="cuda", compute_capability=cc, dtype=dtype, head_dim=head_dim, **kw)


@pytest.mark.parametrize(
    ("request_", "packages", "chosen"),
    [
        (Request(dtype=torch.float32, head_dim=64), frozenset(), "sdpa"),
        (Request(dtype=torch.float64, head_dim=64), frozenset(), "sdpa"),
        (Request(dtype=torch.float32, head_dim=64, dropout=True), frozenset(), "reference"),
        (cuda((6, 1), torch.float32), frozenset({"flash_attn"}), "sdpa"),
        (cuda((6, 1), torch.bfloat16), frozenset({"flash_attn"}), "reference"),
        (cuda((7, 5), torch.float16), frozenset({"flash_attn"}), "sdpa"),
        (cuda((8, 0), torch.bfloat16), frozenset({"flash_attn"}), "fakeflash"),
        (cuda((8, 0), torch.bfloat16), frozenset(), "sdpa"),
        (cuda((9, 0), torch.float16), frozenset({"flash_attn"}), "fakeflash"),
        (cuda((9, 0), torch.float16, head_dim=60), frozenset({"flash_attn"}), "reference"),
        (cuda((9, 0), torch.float32), frozenset({"flash_attn"}), "sdpa"),
    ],
)
def test_highest_priority_kernel_that_fits_is_chosen(
    request_: Request, packages: frozenset[str], chosen: str
) -> None:
    assert _resolver(packages).resolve(request_).kernel_name == chosen


def test_reasons_are_explained() -> None:
    plan = _resolver().resolve(cuda((6, 1), torch.bfloat16))
    text = plan.explain()
    assert "kernel: reference" in text
    assert "rejected fakeflash: package 'flash_attn' is not importable" in text
    assert "needs compute capability >= 8.0" in text and "device has 6.1" in text
    assert "rejected sdpa" in text
    reasons = dict(plan.rejected)
    assert any("bfloat16" in r for r in reasons["sdpa"])


def test_kernels_rejected_on_cpu_carry_their_reasons() -> None:
    plan = _resolver().resolve(Request(dtype=torch.float32, head_dim=64, dropout=True))
    reasons = dict(plan.rejected)
    assert reasons["sdpa"] == ("no dropout on cpu (flash attention for CPU)",)
    assert "runs on cuda, not cpu" in reasons["fakeflash"]


def test_forced_unfit_kernel_raises_with_reasons() -> None:
    with pytest.raises(ResolutionError, match=r"kernel 'sdpa' .* no dropout on cpu"):
        _resolver().resolve(Request(dropout=True), "sdpa")
    with pytest.raises(ResolutionError, match=r"needs compute capability >= 8\.0"):
        _resolver({"flash_attn"}).resolve(cuda((7, 0)), "fakeflash")


def test_forced_fit_kernel_is_used() -> None:
    plan = _resolver().resolve(Request(), "reference")
    assert plan.kernel_name == "reference" and plan.forced_by == "kernel='reference'"


def test_unknown_kernel_name_lists_the_known_kernels() -> None:
    with pytest.raises(
        ValueError, match=r"unknown kernel 'triton'.*known kernels: fakeflash, reference, sdpa"
    ):
        _resolver().resolve(Request(), "triton")


def test_kernel_argument_must_be_auto_or_a_name() -> None:
    with pytest.raises(TypeError, match="kernel must be 'auto', a backend name"):
        _resolver().resolve(Request(), None)  # type: ignore[arg-type]


def test_environment_variable_forces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGDILATED_KERNEL", "reference")
    plan = _resolver().resolve(Request())
    assert plan.kernel_name == "reference" and plan.forced_by == "RINGDILATED_KERNEL=reference"
    monkeypatch.setenv("RINGDILATED_KERNEL", "sdpa")
    with pytest.raises(ResolutionError, match="RINGDILATED_KERNEL=sdpa"):
        _resolver().resolve(Request(dropout=True))


def test_no_kernel_fits() -> None:
    resolver = Resolver([SDPA_SPEC], env=Environment(packages=frozenset()))
    with pytest.raises(ResolutionError, match="no kernel can serve"):
        resolver.resolve(Request(dropout=True))


def test_resolution_is_cached_and_kernels_built_once() -> None:
    calls = []

    def factory() -> ReferenceKernel:
        calls.append(1)
        return ReferenceKernel()

    spec = KernelSpec(name="counted", factory=factory, capabilities=REFERENCE_SPEC.capabilities)
    resolver = Resolver([spec])
    first = resolver.resolve(Request(head_dim=8))
    assert resolver.resolve(Request(head_dim=8)) is first
    resolver.resolve(Request(head_dim=16))
    assert len(calls) == 1


def test_factory_returning_a_non_kernel_is_rejected() -> None:
    spec = KernelSpec(name="liar", factory=object, capabilities=REFERENCE_SPEC.capabilities)
    with pytest.raises(
        ResolutionError, match="factory failed: TypeError: kernel 'liar': factory returned"
    ):
        Resolver([spec]).resolve(Request())


def test_kernels_and_communicators_are_built_by_one_helper() -> None:
    """One builder for both kinds: a factory's instance of the wrong kind is a ``TypeError``
    naming the spec and the methods it lacks; a name shared by a kernel and a communicator
    builds each."""
    from ringdilated.backends.ringpass import RingPassCommunicator
    from ringdilated.core.select.communicator_spec import CommunicatorSpec

    assert Resolver._kernel is Resolver._communicator
    kernel = KernelSpec(name="liar", factory=object, capabilities=REFERENCE_SPEC.capabilities)
    liar, ring = CommunicatorSpec("liar", object), CommunicatorSpec("ref", RingPassCommunicator)
    reference = attrs.evolve(REFERENCE_SPEC, name="ref")
    resolver = Resolver([kernel, reference], communicators=[liar, ring])
    with pytest.raises(TypeError, match=r"communicator 'liar': factory returned .*lacks schedule"):
        resolver._communicator(liar)
    with pytest.raises(TypeError, match=r"kernel 'liar': factory returned .*lacks forward"):
        resolver.kernel("liar")
    assert isinstance(resolver.kernel("ref"), ReferenceKernel)
    assert isinstance(resolver._communicator(ring), RingPassCommunicator)
    assert resolver.kernel("ref") is resolver.kernel("ref")


def test_request_from_tensors() -> None:
    q = torch.randn(1, 4, 4, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    r = Request.for_tensors(q, k, window=True, dropout=False, backward=False)
    assert r == Request(
        device_type="cpu", dtype=torch.bfloat16, head_dim=16, window=True, backward=False, gqa=True
    )


def _with_communicators() -> Resolver:
    from ringdilated.backends.local import LOCAL_SPEC
    from ringdilated.backends.ringpass import RINGPASS_SPEC

    return Resolver([REFERENCE_SPEC], communicators=[LOCAL_SPEC, RINGPASS_SPEC])


def test_one_rank_gets_local_and_several_get_ringpass() -> None:
    from ringdilated.backends.local import LocalCommunicator
    from ringdilated.backends.ringpass import RingPassCommunicator

    resolver = _with_communicators()
    assert isinstance(resolver.communicator_for(1, False), LocalCommunicator)
    assert isinstance(resolver.communicator_for(4, True), RingPassCommunicator)


def test_a_communicator_is_built_once_per_resolver() -> None:
    resolver = _with_communicators()
    assert resolver.communicator_for(4, True) is resolver.communicator_for(2, False)


def test_forced_unfit_communicator_raises_with_reasons() -> None:
    resolver = _with_communicators()
    with pytest.raises(
        ResolutionError, match=r"communicator 'local' cannot serve 4 rank.*one process only"
    ):
        resolver.communicator_for(4, False, "local")
    with pytest.raises(ResolutionError, match="communicator 'ringpass' cannot serve 1 rank"):
        resolver.communicator_for(1, False, "ringpass")
    with pytest.raises(
        ValueError, match="unknown communicator 'allgather'; known communicators: local, ringpass"
    ):
        resolver.communicator_for(2, False, "allgather")


def test_ringpass_schedule_meets_every_peer_once() -> None:
    from ringdilated.backends.ringpass import RingPassCommunicator

    ring = RingPassCommunicator()
    for world in (1, 2, 3, 4, 7):
        for rank in range(world):
            peers = [p for step in ring.schedule(rank, world) for p in step]
            assert sorted(peers) == [p for p in range(world) if p != rank]


def test_communicator_explanation_names_each_rejection() -> None:
    resolver = _with_communicators()
    text = resolver.explain_communicator(4, True)
    assert (
        text.splitlines()[0] == "communicator: ringpass (highest priority that fits) for 4 rank(s)"
    )
    assert "rejected local: serves one process only, the group has 4 ranks" in text
    single = resolver.explain_communicator(1, False)
    assert single.startswith("communicator: local")
    assert "rejected ringpass: a group of one rank needs no communication" in single


def test_a_communicator_whose_factory_fails_falls_back_with_the_reason() -> None:
    from ringdilated.backends.local import LOCAL_SPEC
    from ringdilated.backends.ringpass import RINGPASS_SPEC
    from ringdilated.core.select.communicator_spec import CommunicatorSpec

    def broken() -> object:
        raise ImportError("needs a package that is not installed")

    eager = CommunicatorSpec(name="eager", factory=broken, priority=1000)
    resolver = Resolver([], communicators=[LOCAL_SPEC, RINGPASS_SPEC, eager])
    assert type(resolver.communicator_for(2, False)).__name__ == "RingPassCommunicator"
    with pytest.raises(ResolutionError, match="communicator 'eager' cannot serve 2 rank"):
        resolver.communicator_for(2, False, "eager")
    with pytest.raises(ResolutionError, match="factory failed: ImportError: needs a package"):
        resolver.communicator_for(2, False, "eager")


def _plans(segments: list[int], rates: list[int], length: int, world: int) -> list:
    from ringdilated.core.plan.pattern import DilationPattern
    from ringdilated.core.plan.shards import shard_plan

    pattern = DilationPattern(segments, rates)
    return [shard_plan(pattern, length, 1, 1, rank, world) for rank in range(world)]


def _builtin_communicators() -> Resolver:
    from ringdilated.backends.allgather import ALLGATHER_SPEC
    from ringdilated.backends.local import LOCAL_SPEC
    from ringdilated.backends.ringpass import RINGPASS_SPEC

    return Resolver([], communicators=[LOCAL_SPEC, RINGPASS_SPEC, ALLGATHER_SPEC])


# One position of one head: key and value, batch 1, head dim 4, float32.
_SIZE_BYTES = 2 * 1 * 4 * 4


def test_traffic_counts_bytes_and_steps_by_hand() -> None:
    """L = 16 over 4 ranks of 4. Pattern [16] (rate 1, one segment spanning every shard): each
    rank's 4 positions go to 3 peers. ringpass: 3 steps (distance 1, 2, 3), the minimum;
    allgather: one step, the same bytes (every peer needs the whole piece)."""
    from ringdilated.core.select.cost import PieceSize, traffic

    resolver, size = _builtin_communicators(), PieceSize(1, 4, 4)
    plans = _plans([16], [1], 16, 4)
    ring = traffic(resolver.choose_communicator(4, False, "ringpass"), plans, False, size)
    gather = traffic(resolver.choose_communicator(4, False, "allgather"), plans, False, size)
    assert ring.sent == ring.minimum == ring.received == (3 * 4 * _SIZE_BYTES,) * 4
    assert ring.steps == 3 and ring.above_minimum == 0
    assert gather.sent == gather.received == ring.sent and gather.steps == 1
    # Causal: rank r sends its 4 positions to the 3 - r later ranks only; allgather still sends
    # them to all 3 peers (rank 3's 4 positions too), so rank 3 sends 12 positions above its 0.
    ring_c = traffic(resolver.choose_communicator(4, True, "ringpass"), plans, True, size)
    gather_c = traffic(resolver.choose_communicator(4, True, "allgather"), plans, True, size)
    assert ring_c.sent == tuple((3 - r) * 4 * _SIZE_BYTES for r in range(4))
    assert ring_c.received == tuple(r * 4 * _SIZE_BYTES for r in range(4))
    assert gather_c.sent == (3 * 4 * _SIZE_BYTES,) * 4 and gather_c.minimum == ring_c.sent
    assert gather_c.above_minimum == 3 * 4 * _SIZE_BYTES


def test_traffic_pads_uneven_broadcast_payloads_to_the_largest() -> None:
    """L = 16 over shards of 2, 6, 5, 3; pattern [16] rate 2 (even positions): rank r holds
    1, 3, 3, 1 selected positions (global 0; 2, 4, 6; 8, 10, 12; 14). allgather pads every
    payload to 3 positions and sends it to 3 peers."""
    from ringdilated.core.plan.pattern import DilationPattern
    from ringdilated.core.plan.shards import shard_plan
    from ringdilated.core.select.cost import PieceSize, traffic

    pattern, lengths = DilationPattern([16], [2]), (2, 6, 5, 3)
    plans = [shard_plan(pattern, 16, 1, 1, r, 4, None, lengths) for r in range(4)]
    resolver, size = _builtin_communicators(), PieceSize(1, 4, 4)
    gather = traffic(resolver.choose_communicator(4, False, "allgather"), plans, False, size)
    assert gather.minimum == tuple(3 * n * _SIZE_BYTES for n in (1, 3, 3, 1))
    assert gather.sent == (3 * 3 * _SIZE_BYTES,) * 4
    assert gather.above_minimum == 3 * 2 * _SIZE_BYTES


@pytest.mark.parametrize(
    ("segments", "rates", "length", "causal", "batch", "winner"),
    [
        # Every rank needs every other's equal piece: the same bytes in one step, not three.
        ([64], [1], 64, False, 1, "allgather"),
        # Neighbours only (segments of 24 over shards of 16): ringpass moves the minimum in one
        # step; allgather would send each piece to all three peers.
        ([24], [1], 64, False, 64, "ringpass"),
        # Causal with large pieces: allgather's copies to earlier ranks outweigh its fewer steps.
        ([64], [1], 64, True, 4096, "ringpass"),
    ],
)
def test_auto_chooses_the_communicator_of_least_modelled_time(
    segments: list[int], rates: list[int], length: int, causal: bool, batch: int, winner: str
) -> None:
    from ringdilated.core.select.cost import PieceSize

    resolver, size = _builtin_communicators(), PieceSize(batch, 4, 4)
    plans = _plans(segments, rates, length, 4)
    chosen = resolver.communicator_for(4, causal, "auto", plans, size)
    assert resolver.communicator_for(4, causal, winner) is chosen
    text = resolver.explain_communicator(4, causal, "auto", plans, size)
    assert text.splitlines()[0] == (
        f"communicator: {winner} (least modelled time that fits) for 4 rank(s)"
    )
    assert "ringpass: " in text and "allgather: " in text and "step(s), about" in text


def test_a_communicator_whose_traffic_cannot_be_modelled_comes_after_those_that_can() -> None:
    """A schedule that raises: the communicator still fits but ranks after every modelled one;
    a spec forged around its validators with an unknown ``delivery``: rejected with the rule,
    given plans."""
    from ringdilated.backends.ringpass import RingPassCommunicator
    from ringdilated.core.select.communicator_spec import CommunicatorSpec
    from ringdilated.core.select.cost import PieceSize

    class Odd(RingPassCommunicator):
        pass

    class Unscheduled(RingPassCommunicator):
        def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
            raise RuntimeError("no schedule today")

    odd = CommunicatorSpec(name="odd", factory=Odd, priority=1000)
    object.__setattr__(odd, "delivery", "multicast")  # forged around the validators
    unscheduled = CommunicatorSpec(name="unscheduled", factory=Unscheduled, priority=900)
    base = _builtin_communicators()
    resolver = Resolver([], communicators=[*base.communicator_specs.values(), odd, unscheduled])
    plans, size = _plans([64], [1], 64, 4), PieceSize(1, 4, 4)
    chosen = resolver.communicator_for(4, False, "auto", plans, size)
    assert type(chosen).__name__ == "AllGatherCommunicator"
    text = resolver.explain_communicator(4, False, "auto", plans, size)
    assert (
        "rejected odd: CommunicatorSpec.delivery must be one of ('pairwise', 'broadcast'), got"
        in text
    )
    assert (
        "not chosen unscheduled: fits; traffic not modelled (RuntimeError: no schedule today)"
        in text
    )
    lines = text.splitlines()
    assert lines.index(next(x for x in lines if "unscheduled" in x)) > lines.index(
        next(x for x in lines if "ringpass" in x)
    )
    with pytest.raises(ResolutionError, match="communicator 'odd' cannot serve 4 rank"):
        resolver.communicator_for(4, False, "odd", plans)
    assert type(resolver.communicator_for(4, False)).__name__ == "Odd"  # no plans: priority


def test_head_parallel_and_hybrid_traffic_by_hand() -> None:
    """L = 16 over 4 ranks of 4, pattern [16] (one segment spanning every shard), float32,
    head dim 4, batch 1: one position of one head weighs 16 B, its lse 4 B.

    ulysses, 4 heads (one per rank): each rank sends each of 3 peers its 4 positions of the
    peer's q, k and v head (3 x 4 x 3 x 16 = 576 B), then each peer's 4 positions of its own
    head's out and lse (3 x 4 x 20 = 240 B): 816 B, in 2 steps.

    hybrid on a 2 x 2 grid, 2 heads (one per inner rank): within the inner pair, 4 x 3 x 16 =
    192 B out and 4 x 20 = 80 B of results back; across the outer pair, each chunk of 8 sends
    the other its 8 positions of the share's key and value head (8 x 2 x 16 = 256 B): 528 B, in
    2 + 1 steps."""
    from ringdilated.backends.hybrid import HYBRID_SPEC
    from ringdilated.backends.ringpass import RINGPASS_SPEC
    from ringdilated.backends.ulysses import ULYSSES_SPEC
    from ringdilated.core.plan.pattern import DilationPattern
    from ringdilated.core.plan.shards import shard_plan
    from ringdilated.core.select.cost import PieceSize, traffic

    resolver = Resolver([], communicators=[RINGPASS_SPEC, ULYSSES_SPEC, HYBRID_SPEC])
    ulysses = resolver.choose_communicator(4, False, "ulysses")
    hybrid = resolver.choose_communicator(4, False, "hybrid", grid=(2, 2))
    size = PieceSize(1, 4, 4)
    plans = [shard_plan(DilationPattern([16], [1]), 16, 4, 4, r, 4) for r in range(4)]
    heads = traffic(ulysses, plans, False, size)
    assert heads.sent == heads.received == (816,) * 4 and heads.steps == 2
    plans = [shard_plan(DilationPattern([16], [1]), 16, 2, 2, r, 4) for r in range(4)]
    grid = traffic(hybrid, plans, False, size, (2, 2))
    assert grid.sent == grid.received == (528,) * 4 and grid.steps == 3
    with pytest.raises(ValueError, match="runs on a 2-D layout: its traffic needs"):
        traffic(hybrid, plans, False, size)


def test_auto_chooses_ulysses_where_every_rank_needs_every_piece_and_bytes_dominate() -> None:
    """Pattern [64] over 4 ranks, 4 heads: ringpass and allgather send each rank's 16 positions
    of 4 key and value heads to 3 peers (384 rows); ulysses sends 3 x 16 x (1 + 2) rows and
    returns 48 rows of results (192 rows and some lse): half the bytes."""
    from ringdilated.backends.allgather import ALLGATHER_SPEC
    from ringdilated.backends.local import LOCAL_SPEC
    from ringdilated.backends.ringpass import RINGPASS_SPEC
    from ringdilated.backends.ulysses import ULYSSES_SPEC
    from ringdilated.core.plan.pattern import DilationPattern
    from ringdilated.core.plan.shards import shard_plan
    from ringdilated.core.select.cost import PieceSize

    specs = [LOCAL_SPEC, RINGPASS_SPEC, ALLGATHER_SPEC, ULYSSES_SPEC]
    resolver = Resolver([], communicators=specs)
    plans = [shard_plan(DilationPattern([64], [1]), 64, 4, 4, r, 4) for r in range(4)]
    size = PieceSize(4096, 4, 4)
    chosen = resolver.communicator_for(4, False, "auto", plans, size)
    assert type(chosen).__name__ == "UlyssesCommunicator"
    text = resolver.explain_communicator(4, False, "auto", plans, size)
    assert (
        text.splitlines()[0]
        == "communicator: ulysses (least modelled time that fits) for 4 rank(s)"
    )
    # Two heads over four ranks: ulysses cannot serve, and says why.
    few = [shard_plan(DilationPattern([64], [1]), 64, 2, 2, r, 4) for r in range(4)]
    text = resolver.explain_communicator(4, False, "auto", few, size)
    assert "rejected ulysses: head parallelism needs at least one query head per rank" in text


def test_layouts_pick_their_communicators() -> None:
    """A 2-D layout is served by hybrid only; a process group by everything else."""
    from ringdilated.backends.hybrid import HYBRID_SPEC
    from ringdilated.backends.local import LOCAL_SPEC
    from ringdilated.backends.ringpass import RINGPASS_SPEC
    from ringdilated.backends.ulysses import ULYSSES_SPEC

    resolver = Resolver([], communicators=[LOCAL_SPEC, RINGPASS_SPEC, ULYSSES_SPEC, HYBRID_SPEC])
    assert type(resolver.communicator_for(4, False, "auto", grid=(2, 2))).__name__ == (
        "HybridCommunicator"
    )
    with pytest.raises(ResolutionError, match="runs on a process group, the call has a 2-D"):
        resolver.communicator_for(4, False, "ulysses", grid=(2, 2))
    with pytest.raises(
        ResolutionError, match=r"runs on a 2-D process layout .* the call has a pro"
    ):
        resolver.communicator_for(4, False, "hybrid")


def _every_builtin_communicator() -> Resolver:
    from ringdilated.backends.allgather import ALLGATHER_SPEC
    from ringdilated.backends.hybrid import HYBRID_SPEC
    from ringdilated.backends.local import LOCAL_SPEC
    from ringdilated.backends.ringpass import RINGPASS_SPEC
    from ringdilated.backends.ulysses import ULYSSES_SPEC

    specs = [LOCAL_SPEC, RINGPASS_SPEC, ALLGATHER_SPEC, ULYSSES_SPEC, HYBRID_SPEC]
    return Resolver([], communicators=specs)


def test_a_hybrid_resolves_its_parts_by_name_as_forced_names() -> None:
    """The spec's parts, each the resolver's one instance of that name; a part that is unknown,
    of the wrong parallelism or not causal where the call is: the hybrid cannot serve, and the
    reason names the part."""
    import attrs

    from ringdilated.backends.hybrid import HYBRID_SPEC
    from ringdilated.backends.ringpass import RINGPASS_SPEC
    from ringdilated.backends.ulysses import ULYSSES_SPEC

    resolver = _every_builtin_communicator()
    chosen = resolver.choose_communicator(4, True, "hybrid", grid=(2, 2))
    assert chosen.spec is HYBRID_SPEC and chosen.parallelism == "hybrid"
    assert [(p.name, p.parallelism) for p in chosen.parts] == [
        ("ulysses", "heads"),
        ("ringpass", "sequence"),
    ]
    assert chosen.parts[0].instance is resolver.communicator_for(4, True, "ulysses")
    missing = Resolver([], communicators=[RINGPASS_SPEC, HYBRID_SPEC])
    with pytest.raises(
        ResolutionError,
        match=r"'hybrid' cannot serve 4 rank\(s\): its heads part 'ulysses' is no known comm",
    ):
        missing.communicator_for(4, False, "hybrid", grid=(2, 2))
    with pytest.raises(ResolutionError, match="no communicator can serve 4 rank"):
        missing.communicator_for(4, False, "auto", grid=(2, 2))
    swapped = attrs.evolve(HYBRID_SPEC, name="swapped", parts=("ringpass", "ulysses"))
    acausal = attrs.evolve(RINGPASS_SPEC, name="acausal", causal=False)
    loose = attrs.evolve(HYBRID_SPEC, name="loose", parts=("ulysses", "acausal"))
    resolver = Resolver([], communicators=[RINGPASS_SPEC, ULYSSES_SPEC, swapped, acausal, loose])
    with pytest.raises(
        ResolutionError, match="its heads part 'ringpass' has parallelism 'sequence', not 'heads'"
    ):
        resolver.communicator_for(4, False, "swapped", grid=(2, 2))
    assert resolver.choose_communicator(4, False, "loose", grid=(2, 2)).parts[1].name == "acausal"
    with pytest.raises(ResolutionError, match="its sequence part 'acausal' cannot restrict"):
        resolver.communicator_for(4, True, "loose", grid=(2, 2))


def test_an_instance_of_a_registered_class_is_described_by_that_spec() -> None:
    """Its class, or its nearest registered base, is what a registered factory builds: no
    attribute is read and nothing warns (warnings are errors here); a hybrid's parts by name."""
    from ringdilated.backends.allgather import AllGatherCommunicator
    from ringdilated.backends.hybrid import HybridCommunicator
    from ringdilated.backends.ulysses import UlyssesCommunicator

    class Quieter(UlyssesCommunicator):
        parallelism = "heads"  # what the spec of its registered base says: nothing warns

    resolver = _every_builtin_communicator()
    for instance, name in (
        (UlyssesCommunicator(), "ulysses"),
        (Quieter(), "ulysses"),
        (AllGatherCommunicator(), "allgather"),
    ):
        chosen = resolver.choose_communicator(4, False, instance)
        assert chosen.spec is resolver.communicator_specs[name] and chosen.instance is instance
    hybrid = HybridCommunicator()
    chosen = resolver.choose_communicator(4, False, hybrid, grid=(2, 2))
    assert chosen.instance is hybrid and [p.name for p in chosen.parts] == ["ulysses", "ringpass"]
    with pytest.raises(ResolutionError, match=r"HybridCommunicator instance .* runs on a 2-D"):
        resolver.choose_communicator(4, False, hybrid)


def test_a_class_attribute_against_its_registered_spec_is_refused() -> None:
    """0.1 read a communicator's ``delivery`` and ``parallelism`` attributes; its spec alone is
    read now, so an attribute that contradicts it is refused, naming the attribute and the spec
    field to set (a registered 0.1 broadcast communicator ran pairwise, silently): forced, a
    ``ResolutionError``; under ``"auto"`` a reason against it; an instance passed, refused."""
    from ringdilated.backends.ringpass import RingPassCommunicator
    from ringdilated.core.select.communicator_spec import CommunicatorSpec

    class Broadcast(RingPassCommunicator):  # a 0.1 plugin's class
        delivery = "broadcast"

    old = CommunicatorSpec("old", Broadcast, priority=10**6)  # its 0.1 spec
    resolver = Resolver(
        [], communicators=[*_every_builtin_communicator().communicator_specs.values(), old]
    )
    said = r"Broadcast.delivery is 'broadcast', which is not read: say it as delivery= of its spec"
    with pytest.raises(ResolutionError, match=f"communicator 'old' cannot serve 4 .*{said} 'old'"):
        resolver.communicator_for(4, False, "old")
    assert resolver.choose_communicator(4, False).name == "ringpass"  # old: a reason against
    with pytest.raises(
        ResolutionError, match=f"communicator Broadcast instance: field delivery: {said}"
    ):
        resolver.choose_communicator(4, False, Broadcast())


def test_a_hybrid_instance_holding_other_parts_than_its_spec_s_is_refused() -> None:
    """0.1's ``HybridCommunicator`` held its ``heads`` and ``sequence`` parts; parts set on one
    now are refused unless they are the spec's (they were replaced by the spec's, silently)."""
    from ringdilated.backends.allgather import AllGatherCommunicator
    from ringdilated.backends.hybrid import HybridCommunicator

    resolver = _every_builtin_communicator()
    hybrid = HybridCommunicator()
    hybrid.sequence = AllGatherCommunicator()  # type: ignore[attr-defined]
    with pytest.raises(
        ResolutionError,
        match=r"HybridCommunicator.sequence is <.*AllGatherCommunicator.*, which is not read: "
        "say it as parts= of its spec 'hybrid'",
    ):
        resolver.choose_communicator(4, False, hybrid, grid=(2, 2))
    hybrid.sequence = resolver.communicator_for(4, False, "ringpass")  # type: ignore[attr-defined]
    chosen = resolver.choose_communicator(4, False, hybrid, grid=(2, 2))
    assert chosen.parts[1].instance is hybrid.sequence  # type: ignore[attr-defined]


class _Transport:
    """A user's own communicator class, registered nowhere (it moves nothing)."""

    def schedule(self, rank: int, world_size: int) -> tuple[tuple[int, ...], ...]:
        return tuple((p,) for p in range(world_size) if p != rank)

    def prepare(self, group: object, plans: object, window: object) -> None:
        return None

    def exchange(self, group: object, sends: object, recvs: object, uniform: bool = False) -> None:
        raise AssertionError("not exchanged here")


def test_an_unregistered_instance_is_described_by_its_attributes_with_a_warning() -> None:
    """For one release: ``delivery``/``parallelism`` attributes (defaults pairwise, sequence),
    a ``DeprecationWarning`` once per class that declares one; a hybrid's ``heads`` and
    ``sequence`` instances described alike; an unknown value or missing part raises."""
    from ringdilated.backends.ringpass import RingPassCommunicator

    class Broadcast(_Transport):
        delivery = "broadcast"

    class Heads(_Transport):
        parallelism = "heads"

    class Hybrid(_Transport):
        parallelism = "hybrid"

        def __init__(self) -> None:
            self.heads, self.sequence = Heads(), RingPassCommunicator()

    class Multicast(_Transport):
        delivery = "multicast"

    resolver = _every_builtin_communicator()
    plain = resolver.choose_communicator(4, False, _Transport())  # declares nothing: no warning
    assert (plain.spec.delivery, plain.parallelism) == ("pairwise", "sequence")
    declare = "declares its delivery or parallelism as an attribute: declare them in a Commun"
    with pytest.warns(DeprecationWarning, match=f"Broadcast {declare}"):
        chosen = resolver.choose_communicator(4, False, Broadcast())
    assert chosen.broadcast and chosen.parallelism == "sequence"
    assert resolver.choose_communicator(4, False, Broadcast()).broadcast  # warned once
    with pytest.warns(DeprecationWarning, match=declare) as caught:
        chosen = resolver.choose_communicator(4, False, Hybrid(), grid=(2, 2))
    assert sorted(str(w.message).split()[0] for w in caught) == ["Heads", "Hybrid"]
    assert [(p.parallelism, type(p.instance).__name__) for p in chosen.parts] == [
        ("heads", "Heads"),
        ("sequence", "RingPassCommunicator"),
    ]
    assert chosen.parts[1].spec is resolver.communicator_specs["ringpass"]
    with pytest.raises(ResolutionError, match=r"Hybrid instance \(parallelism 'hybrid'\) runs on"):
        resolver.choose_communicator(4, False, Hybrid())
    with (
        pytest.warns(DeprecationWarning, match="Multicast declares"),
        pytest.raises(
            ResolutionError,
            match=r"Multicast instance: Multicast.delivery must be one of \('pairwise', 'broad",
        ),
    ):
        resolver.choose_communicator(4, False, Multicast())
    hollow = Hybrid()
    del hollow.heads
    with pytest.raises(ResolutionError, match="its 'heads' must be a Communicator of parallelism"):
        resolver.choose_communicator(4, False, hollow, grid=(2, 2))


def test_priority_rules_for_ranks_by_the_resolvers_environment_when_asked() -> None:
    """``priority_rules_for`` is called with the resolver's ``Environment`` each time a request
    is ranked, never when the spec is built; its rules come before ``priority_rules``."""
    calls: list[Environment] = []

    def machine(env: Environment) -> tuple[PriorityRule, ...]:
        calls.append(env)
        return (PriorityRule(300, "cuda"),) if env.rocm is False else ()

    spec = attrs.evolve(
        FLASH_LIKE, priority_rules=(PriorityRule(150, "cuda"),), priority_rules_for=machine
    )
    assert calls == [], "building the spec calls nothing"
    env = Environment(packages=frozenset({"flash_attn"}), rocm=False)
    hopper = cuda((9, 0))
    assert Resolver([spec, SDPA_SPEC], env=env).resolve(hopper).priorities[0] == ("fakeflash", 300)
    assert calls == [env]
    assert spec.priority_for(hopper, Environment(rocm=True)) == 150, "then priority_rules"
    assert spec.priority_for(Request(head_dim=64)) == 200, "then priority"
