"""The capability resolver, with injected fake environments (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from ringdilated import Environment, KernelSpec, Request, ResolutionError, Resolver
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.backends.sdpa import SDPA_SPEC
from ringdilated.core import Capabilities, Target

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
    assert reasons["sdpa"] == ("does not support dropout_p > 0",)
    assert "runs on cuda, not cpu" in reasons["fakeflash"]


def test_forced_unfit_kernel_raises_with_reasons() -> None:
    with pytest.raises(ResolutionError, match=r"kernel 'sdpa' .* does not support dropout_p > 0"):
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


def test_request_from_tensors() -> None:
    q = torch.randn(1, 4, 4, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    r = Request.for_tensors(q, k, causal=True, dropout=False, backward=False)
    assert r == Request(
        device_type="cpu", dtype=torch.bfloat16, head_dim=16, causal=True, backward=False, gqa=True
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
    from ringdilated.core.communicator_spec import CommunicatorSpec

    def broken() -> object:
        raise ImportError("needs a package that is not installed")

    eager = CommunicatorSpec(name="eager", factory=broken, priority=1000)
    resolver = Resolver([], communicators=[LOCAL_SPEC, RINGPASS_SPEC, eager])
    assert type(resolver.communicator_for(2, False)).__name__ == "RingPassCommunicator"
    with pytest.raises(ResolutionError, match="communicator 'eager' cannot serve 2 rank"):
        resolver.communicator_for(2, False, "eager")
    with pytest.raises(ResolutionError, match="factory failed: ImportError: needs a package"):
        resolver.communicator_for(2, False, "eager")


def test_allgather_declines_segment_groups_narrower_than_the_process_group() -> None:
    """At 4 ranks, segments spanning pairs of shards make groups (0, 1) and (2, 3): one
    all_gather would need subgroups, which a call may not create; ringpass serves instead."""
    from ringdilated.backends.allgather import AllGatherCommunicator, plan_reasons
    from ringdilated.core.pattern import DilationPattern
    from ringdilated.core.shard_plan import shard_plan

    pattern = DilationPattern([16], [1])
    plans = [shard_plan(pattern, 32, 2, 2, rank, 4) for rank in range(4)]
    reasons = plan_reasons(plans, False)
    assert any("segment group (0, 1) is narrower than the process group of 4" in r for r in reasons)
    with pytest.raises(ValueError, match="cannot move these pieces exactly"):
        AllGatherCommunicator().prepare(None, plans, False)  # an instance skips the resolver
    whole = [shard_plan(DilationPattern([32], [1]), 32, 2, 2, rank, 4) for rank in range(4)]
    assert plan_reasons(whole, False) == ()
