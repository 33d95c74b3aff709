"""The communicator conformance kit: a communicator on real gloo groups of 2 and 4 ranks must
give every rank exactly what one process computes (the ``local`` path) for its shard.

    from ringdilated.testing import check_communicator
    report = check_communicator("mycomm")                  # spawns 2- and 4-rank pools
    report = check_communicator("mycomm", pools={2: pool}) # reuse a test session's pool

Hypothesis draws whole problems (pattern, mode, causal, a key window or none, heads,
grouped-query heads, dtype, scale, packed documents or padded rows, equal or uneven shards,
attention sinks, and a logit cap where the kernel declares one) and each rank runs its shard
through ``dilated_attention(..., communicator=name)``.
Check ``matches-local``: each rank's ``out``, ``lse`` and the gradients of a loss through both
meet the tolerance rule (docs/spec.md, section 4) against the float64 oracle with the
single-process result's own error as the allowance, i.e. the communicator adds nothing
measurable to what ``local`` does; with sinks, so does their gradient summed over the ranks
(each rank's is its positions' share). A communicator may decline a problem it cannot move exactly
(a :class:`ResolutionError` with reasons), but then every rank must decline it alike; declining
every drawn problem fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from ringdilated.pool import Workers
from ringdilated.testing._oracle import oracle
from ringdilated.testing._tolerance import allowed_error, max_error
from ringdilated.testing.conformance import ConformanceError

__all__ = [
    "COMMUNICATOR_CHECKS",
    "CommunicatorReport",
    "case_inputs",
    "case_sinks",
    "check_communicator",
    "communicator_cases",
    "grid_shape",
    "shard_slice",
    "sharded_run",
    "windows",
]

COMMUNICATOR_CHECKS = ("matches-local",)
_TASK = f"{__name__}:sharded_run"


@attrs.frozen
class CommunicatorReport:
    """The world sizes on which ``matches-local`` passed and how many problems each ran."""

    communicator: str
    world_sizes: tuple[int, ...]
    problems: tuple[int, ...]


@st.composite
def communicator_cases(
    draw: st.DrawFn, world: int, *, sinks: bool = False, softcap: bool = False
) -> dict[str, Any]:
    """A whole problem for ``world`` ranks as a picklable dict (see :func:`case_inputs`); its
    ``shard_lengths`` are equal or not (each rank holds at least one position). ``sinks``:
    half the problems have attention sinks (``case['sinks']``, one logit per query head,
    :func:`case_sinks`); ``softcap``: half have a logit cap (``case['softcap']``)."""
    equal = draw(st.booleans())
    if equal:
        shard_lengths = [draw(st.integers(1, 10))] * world
    else:
        shard_lengths = draw(st.lists(st.integers(1, 10), min_size=world, max_size=world))
    seq_len = sum(shard_lengths)
    count = draw(st.integers(1, 3))
    segments = [draw(st.integers(1, 2 * seq_len)) for _ in range(count)]
    rates = [draw(st.integers(1, min(4, w))) for w in segments]
    mode = draw(st.sampled_from(["head_groups", "longnet"]))
    heads = draw(st.integers(count if mode == "head_groups" else 1, 4))
    kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    # Packed documents or padded rows (global positions; they may cross shard boundaries),
    # or neither.
    batch = draw(st.integers(1, 2))
    layout = draw(st.sampled_from(["whole", "documents", "padding"]))
    documents, padding = None, None
    if layout == "documents":
        cuts = draw(st.sets(st.integers(1, seq_len - 1), max_size=3)) if seq_len > 1 else set()
        documents = [0, *sorted(cuts), seq_len]
    elif layout == "padding":
        padding = []
        for _ in range(batch):
            valid = draw(st.integers(0, seq_len))
            start = draw(st.integers(0, seq_len - valid))  # left, right or both sides padded
            padding.append([start, start + valid])
    causal = draw(st.booleans())
    return {
        "seed": draw(st.integers(0, 2**31 - 1)),
        "batch": batch,
        "seq_len": seq_len,
        "shard_lengths": shard_lengths,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": draw(st.sampled_from([4, 8])),
        "dtype": draw(st.sampled_from(["float64", "float32"])),
        "segments": segments,
        "rates": rates,
        "mode": mode,
        "causal": causal,
        "window": draw(windows(seq_len, causal)),
        "scale": draw(st.none() | st.floats(0.1, 1.0)),
        "cu_seqlens": documents,
        "valid_runs": padding,
        "sinks": _sinks(draw, heads) if sinks and draw(st.booleans()) else None,
        "softcap": draw(st.floats(0.5, 10.0)) if softcap and draw(st.booleans()) else None,
    }


def _sinks(draw: st.DrawFn, heads: int) -> list[float]:
    """One logit per head, from well below to well above a typical lse."""
    return [draw(st.floats(-4.0, 6.0)) for _ in range(heads)]


def case_sinks(case: Mapping[str, Any]) -> torch.Tensor | None:
    """The case's attention sinks as a fresh leaf requiring a gradient (float64 for a float64
    case, else float32), or ``None``."""
    if case.get("sinks") is None:
        return None
    dtype = torch.float64 if case["dtype"] == "float64" else torch.float32
    return torch.tensor(case["sinks"], dtype=dtype).requires_grad_()


def windows(seq_len: int, causal: bool) -> st.SearchStrategy[tuple[int | None, int | None] | None]:
    """A call's key window for a sequence of ``seq_len``, or ``None`` (half the time): bounds
    from ``0`` (a query's own position) past the sequence, or ``None``; with ``causal`` the right
    bound is ``None`` or ``0``."""
    bound = st.none() | st.integers(0, seq_len + 1)
    right = st.sampled_from([None, 0]) if causal else bound
    return st.none() | st.tuples(bound, right)


def case_layout(case: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The case's ``cu_seqlens`` or ``key_padding_mask`` keyword (global positions), if any."""
    if case.get("cu_seqlens") is not None:
        return {"cu_seqlens": torch.tensor(case["cu_seqlens"])}
    if case.get("valid_runs") is not None:
        p = torch.arange(case["seq_len"])
        mask = torch.stack([(p < s) | (p >= e) for s, e in case["valid_runs"]])
        return {"key_padding_mask": mask}
    return {}


def shard_slice(case: Mapping[str, Any], rank: int, world: int) -> slice:
    """Rank ``rank``'s positions of the case's sequence: its ``shard_lengths``, or ``world``
    equal shards of ``seq_len`` where it has none; contiguous in rank order."""
    lengths = case.get("shard_lengths") or [case["seq_len"] // world] * world
    start = sum(lengths[:rank])
    return slice(start, start + lengths[rank])


def _call_keywords(case: Mapping[str, Any]) -> dict[str, Any]:
    """The pattern and layout keywords of the case, as ``dilated_attention`` and :func:`oracle`
    both take them."""
    return {
        "segment_lengths": case["segments"],
        "dilation_rates": case["rates"],
        "mode": case["mode"],
        "causal": case["causal"],
        "window": case.get("window"),
        "scale": case["scale"],
        "softcap": case.get("softcap"),
        **case_layout(case),
    }


def case_inputs(case: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, dout, dlse)`` of the whole sequence, drawn from ``case['seed']``."""
    g = torch.Generator().manual_seed(case["seed"])
    b, length, h, hkv, d = (case[n] for n in ("batch", "seq_len", "heads", "kv_heads", "head_dim"))
    dtype = getattr(torch, case["dtype"])
    q, k, v = (
        torch.randn(b, length, n, d, generator=g, dtype=torch.float64).to(dtype)
        for n in (h, hkv, hkv)
    )
    dout = torch.randn(b, length, h, d, generator=g, dtype=torch.float64).to(dtype)
    dlse = torch.randn(b, h, length, generator=g, dtype=torch.float64).float()
    return q, k, v, dout, dlse


def _loss(
    out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor
) -> torch.Tensor:
    finite = lse.masked_fill(torch.isneginf(lse), 0).double()
    return (out.double() * dout.double()).sum() + (finite * dlse.double()).sum()


def _attend(
    case: Mapping[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    from ringdilated.core.support.errors import PaddingMaskWarning
    from ringdilated.functional import dilated_attention

    with warnings.catch_warnings():
        # Rows of padding only are drawn on purpose (their outputs are zeros, docs/spec.md):
        # not the inverted mask this warning is for.
        warnings.simplefilter("ignore", PaddingMaskWarning)
        out, lse = dilated_attention(
            q, k, v, kernel=case.get("kernel", "auto"), return_lse=True, **_call_keywords(case),
            **kw,
        )  # fmt: skip
    return out, lse


def sharded_run(case: dict[str, Any]) -> dict[str, Any]:
    """A :class:`Workers` task: this rank's shard of :func:`case_inputs`, run with
    ``case['communicator']``; its out, lse, gradients and bytes sent, or ``{"declined": why}``."""
    from ringdilated.core.contract.communicator import TransferStats
    from ringdilated.core.select.resolver import ResolutionError

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout, dlse = case_inputs(case)
    shard = shard_slice(case, rank, world)
    q, k, v = (x[:, shard].clone().requires_grad_() for x in (q, k, v))
    sinks = case_sinks(case)
    stats = TransferStats()
    try:
        out, lse = _attend(
            case,
            q,
            k,
            v,
            process_group=_layout(case["communicator"], world),
            communicator=case["communicator"],
            transfer_stats=stats,
            sinks=sinks,
        )
    except ResolutionError as exc:
        return {"declined": str(exc)}
    forward_bytes, forward_received = stats.bytes_sent, stats.bytes_received
    if case.get("lse_grad", True):
        loss = _loss(out, lse, dout[:, shard], dlse[:, :, shard])
    else:
        loss = (out.double() * dout[:, shard].double()).sum()
    torch.autograd.backward(loss)
    return {
        "out": out.detach(),
        "lse": lse.detach(),
        "dq": q.grad,
        "dk": k.grad,
        "dv": v.grad,
        "dsinks": None if sinks is None else sinks.grad,
        "forward_bytes_sent": forward_bytes,
        "forward_bytes_received": forward_received,
        "total_bytes_sent": stats.bytes_sent,
    }


_MESHES: dict[tuple[int, int], object] = {}


def grid_shape(world: int) -> tuple[int, int]:
    """The 2-D layout the kit gives a communicator of 2-D layouts on ``world`` ranks:
    ``(world // 2, 2)`` for an even world (``(1, 2)`` on 2 ranks: one chunk, all heads
    parallel), ``(1, world)`` for an odd one."""
    return (world // 2, 2) if world % 2 == 0 else (1, world)


def _layout(name: object, world: int) -> object:
    """The process layout for communicator ``name``: the world group, or for a communicator of
    2-D layouts a 2-D CPU ``DeviceMesh`` of :func:`grid_shape` over the world (made once per
    process, in the same order on every rank, outside any call)."""
    from ringdilated.registry import default_resolver

    spec = default_resolver().communicator_specs.get(name) if isinstance(name, str) else None
    if spec is None or spec.dims != 2:
        return dist.group.WORLD
    shape = grid_shape(world)
    if shape not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("outer", "inner"))
    return (_MESHES[shape], ("outer", "inner"))


def _compare(case: dict[str, Any], results: Sequence[dict[str, Any]]) -> None:
    q, k, v, dout, dlse = case_inputs(case)
    sinks, exact_sinks = case_sinks(case), case_sinks(case)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    local = _attend(case, leaves[0], leaves[1], leaves[2], sinks=sinks)
    wrt = leaves if sinks is None else [*leaves, sinks]
    local_grads = torch.autograd.grad(_loss(local[0], local[1], dout, dlse), wrt)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    truth = oracle(
        exact[0], exact[1], exact[2], return_lse=True, sinks=exact_sinks, **_call_keywords(case)
    )
    wrt = exact if exact_sinks is None else [*exact, exact_sinks]
    truth_grads = torch.autograd.grad(_loss(truth[0], truth[1], dout, dlse), wrt)
    references = zip((*truth, *truth_grads), (*local, *local_grads), strict=True)  # exact, local
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for name, (expected, single) in zip(names, references, strict=False):
        if name == "dsinks":  # each rank's positions' share
            actual = torch.stack([r[name] for r in results]).sum(0)
        else:
            actual = torch.cat([r[name] for r in results], 2 if name == "lse" else 1)
        allowed = allowed_error(expected, single, q.dtype)
        error = max_error(actual, expected)
        if not error <= allowed:
            raise ConformanceError(
                "matches-local",
                f"{name}: sharded error {error:.3e} vs float64 exceeds {allowed:.3e} (twice the "
                f"single-process error plus the floor) on {len(results)} ranks for {case}",
            )


def check_communicator(
    name: str,
    *,
    world_sizes: Sequence[int] = (2, 4),
    pools: Mapping[int, Workers] | None = None,
    kernel: str = "reference",
    max_examples: int = 15,
) -> CommunicatorReport:
    """Run ``matches-local`` for communicator ``name`` on each of ``world_sizes``.

    ``pools`` supplies already-started :class:`Workers` by world size (the rest are started
    here and closed afterwards). Every rank must have ``name`` registered (installed plugins
    load in the spawned ranks as in the parent). Raises :class:`ConformanceError`.
    """
    counts = []
    for world in world_sizes:
        pool = (pools or {}).get(world)
        own = pool is None
        pool = pool or Workers(world)
        try:
            counts.append(_check_on(pool, name, kernel, max_examples))
        finally:
            if own:
                pool.close()
    return CommunicatorReport(name, tuple(world_sizes), tuple(counts))


def _claims_softcap(kernel: str) -> bool:
    """Whether the registered kernel ``kernel`` declares a logit cap (``"auto"``: some kernel
    does)."""
    from ringdilated.registry import default_resolver

    specs = default_resolver().specs
    chosen = specs.values() if kernel == "auto" else [specs[kernel]] if kernel in specs else []
    return any(spec.capabilities.softcap for spec in chosen)


def _check_on(pool: Workers, name: str, kernel: str, max_examples: int) -> int:
    ran = [0]

    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=communicator_cases(pool.world_size, sinks=True, softcap=_claims_softcap(kernel)))
    def run(case: dict[str, Any]) -> None:
        case = {**case, "communicator": name, "kernel": kernel}
        outcomes = pool.run(_TASK, case)
        failed = [value for ok, value in outcomes if not ok]
        if failed:
            raise ConformanceError(
                "matches-local", f"a rank raised {failed[0][0]}: {failed[0][1]} for {case}"
            )
        declined = [value.get("declined") for _, value in outcomes]
        if any(declined):
            if not all(declined) or len(set(declined)) > 1:
                raise ConformanceError(
                    "matches-local", f"ranks disagree on declining {case}: {declined}"
                )
            reject()
        _compare(case, [value for _, value in outcomes])
        ran[0] += 1

    try:
        run()
    except Unsatisfiable as exc:
        raise ConformanceError(
            "matches-local", f"{name!r} declined every problem drawn for {pool.world_size} ranks"
        ) from exc
    if not ran[0]:
        raise ConformanceError("matches-local", f"{name!r} ran no problem on {pool.world_size}")
    return ran[0]
