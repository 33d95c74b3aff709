"""Faults injected into sharded calls, run on every rank of a gloo pool (``Workers``).

Each task makes one call in which some rank misbehaves, and reports, per rank, whether it
raised, the exception's type and message, how long it took, and whether its inputs survived.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def caught_as(exc: BaseException) -> str:
    """The class a caller catches ``exc`` as: its own name, except for ringdilated's own
    exceptions (``PeerRejectedError``, ``AgreementError``, ``ResolutionError``, ...), named by
    the built-in they derive from (``ValueError``, ...), which is what these tests state; the
    exact classes are tests/test_errors.py's."""
    from ringdilated.core.support.errors import RingDilatedError

    if isinstance(exc, RingDilatedError):
        return next(c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins")
    return type(exc).__name__


__all__ = ["call_with_fault", "module_with_fault", "slow_peer"]


def _inputs(rank: int, world: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(3, 1, 8 * world, 2, 8, generator=g, dtype=torch.float64)
    return tuple(x[:, 8 * rank : 8 * (rank + 1)].contiguous() for x in full)


def _outcome(call: Callable[[], object]) -> dict[str, Any]:
    """``call()``'s outcome on this rank: what it raised (``None``), its message, and seconds."""
    start = time.monotonic()
    try:
        call()
    except Exception as exc:
        result: dict[str, Any] = {"raised": caught_as(exc), "message": str(exc)}
    else:
        result = {"raised": None, "message": ""}
    result["seconds"] = time.monotonic() - start
    return result


def call_with_fault(payload: dict[str, Any]) -> dict[str, Any]:
    """Rank ``payload['rank']`` gets fault ``payload['fault']``; every rank calls
    ``dilated_attention`` on its shard of a 2-head, head dim 8 problem."""
    import ringdilated

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v = _inputs(rank, world)
    kwargs: dict[str, Any] = {"process_group": dist.group.WORLD}
    segments, rates = [16], [1]
    if payload["fault"] == "shard length":  # every rank's documents span equal shards
        kwargs["cu_seqlens"] = torch.tensor([0, 5, 8 * world])
    if rank == payload["rank"]:
        fault = payload["fault"]
        if fault == "bad pattern":
            segments, rates = [4], [8]
        elif fault == "sparse q":
            q = q.to_sparse()
        elif fault == "dtype":
            q, k, v = q.float(), k.float(), v.float()
        elif fault == "shard length":
            q, k, v = q[:, :4].contiguous(), k[:, :4].contiguous(), v[:, :4].contiguous()
        elif fault == "empty shard":
            q, k, v = q[:, :0].contiguous(), k[:, :0].contiguous(), v[:, :0].contiguous()
        elif fault == "causal":
            kwargs["causal"] = True
        elif fault == "head dim":
            k = k[..., :4].contiguous()
        elif fault == "unknown kernel":
            kwargs["kernel"] = "nonexistent"
        elif fault == "return_lse":
            kwargs["return_lse"] = "yes"
        elif fault == "mode":
            kwargs["mode"] = "dilated"
        elif fault == "scale":
            kwargs["scale"] = 0.5
        elif fault == "unpicklable scale":
            kwargs["scale"] = lambda: 0.5  # cannot be pickled: its repr travels instead
        elif fault == "backward":
            q.requires_grad_()
        elif fault == "nested q":
            q = torch.nested.nested_tensor([q[0], q[0]], layout=torch.strided)
        elif fault == "unreadable shape":
            q = _UnreadableShape()  # type: ignore[assignment]
        elif fault == "surrogate":
            segments = [_SurrogateRepr()]  # type: ignore[list-item]
        elif fault == "transfer_stats":
            kwargs["transfer_stats"] = 5
        elif fault == "documents":
            kwargs["cu_seqlens"] = torch.tensor([0, 5, 8 * world])
        elif fault == "bad documents":
            kwargs["cu_seqlens"] = torch.tensor([0, 8 * world + 4])
        elif fault == "padding":
            kwargs["key_padding_mask"] = torch.zeros(1, 8 * world, dtype=torch.bool)
        else:
            raise AssertionError(f"unknown fault {fault!r}")
    before = [_snapshot(x) for x in (q, k, v)]
    result = _outcome(lambda: ringdilated.dilated_attention(q, k, v, segments, rates, **kwargs))
    after = [_snapshot(x) for x in (q, k, v)]
    result["inputs_unchanged"] = all(_same(a, b) for a, b in zip(after, before, strict=True))
    return result


class _UnreadableShape:
    """An argument whose ``shape`` is not a sequence and whose ``requires_grad`` raises: no
    check can even describe it."""

    shape = 5

    @property
    def requires_grad(self) -> bool:
        raise RuntimeError("requires_grad cannot be read")


class _SurrogateRepr:
    """A pattern value whose repr holds a lone surrogate (not encodable as UTF-8)."""

    def __repr__(self) -> str:
        return "\ud800"


def _snapshot(x: object) -> object:
    if not isinstance(x, torch.Tensor):
        return x
    if x.is_nested:
        return [t.clone() for t in x.unbind()]
    return x.clone() if x.layout == torch.strided else x.to_dense()


def _same(a: object, b: object) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a is b


def collectives_of_the_agreement(payload: dict[str, Any]) -> dict[str, Any]:
    """Counts the agreement's collectives in one call that agrees, one whose shards are uneven
    (rank 1 holds 4 positions) and one in which rank 1 passes a different causal flag; returns
    the counts and the last call's exception."""
    import ringdilated
    from ringdilated.core.call import agreement

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v = _inputs(rank, world)
    counts = {"all_gather": 0, "all_gather_object": 0}
    kw = {"process_group": dist.group.WORLD, "communicator": "ringpass"}
    real = {name: getattr(agreement.dist, name) for name in counts}

    def counting(name: str) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return real[name](*args, **kwargs)

        return collective

    result: dict[str, Any] = {}
    try:
        for name in counts:
            setattr(agreement.dist, name, counting(name))
        ringdilated.dilated_attention(q, k, v, [16], [1], **kw)
        result["agreed"] = dict(counts)
        counts.update(all_gather=0, all_gather_object=0)
        n = 4 if rank == 1 else 8
        ringdilated.dilated_attention(q[:, :n], k[:, :n], v[:, :n], [16], [1], **kw)
        result["uneven"] = dict(counts)
        counts.update(all_gather=0, all_gather_object=0)
        try:
            ringdilated.dilated_attention(q, k, v, [16], [1], causal=rank == 1, **kw)
        except ValueError as exc:
            result["message"] = str(exc)
        result["disagreed"] = dict(counts)
    finally:
        for name, function in real.items():
            setattr(agreement.dist, name, function)
    return result


def module_with_fault(payload: dict[str, Any]) -> dict[str, Any]:
    """Every rank runs a sharded ``MultiheadDilatedAttention`` (or, with ``payload['block']``,
    a ``DilatedTransformerBlock``); rank ``payload['rank']`` passes a faulty input, which the
    module itself rejects before the call: ``payload['fault']`` is ``"width"`` (the wrong embed
    dim), ``"nested"`` (a nested tensor), ``"device"`` (an input on the meta device) or
    ``"hook"`` (a forward pre-hook on the query projection that raises)."""
    import ringdilated

    rank = dist.get_rank()
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {
        "segment_lengths": [16],
        "dilation_rates": [1],
        "process_group": dist.group.WORLD,
        "dtype": torch.float64,
    }
    module = (
        ringdilated.DilatedTransformerBlock(16, 2, **kwargs)
        if payload["block"]
        else ringdilated.MultiheadDilatedAttention(16, 2, **kwargs)
    )
    fault = payload.get("fault", "width") if rank == payload["rank"] else None
    x = torch.randn(1, 8, 12 if fault == "width" else 16, dtype=torch.float64)
    if fault == "nested":
        x = torch.nested.nested_tensor([x[0], x[0, :4]], layout=torch.strided)
    elif fault == "device":
        x = x.to("meta")
    elif fault == "hook":

        def failing(*args: Any) -> None:
            raise KeyError("a forward hook failed")

        layer = module.attn.q_proj if payload["block"] else module.q_proj
        layer.register_forward_pre_hook(failing)
    return _outcome(lambda: module(x) if payload["block"] else module(x, x, x))


def slow_peer(payload: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 arrives ``payload['delay']`` seconds late; returns each rank's outcome and its
    error against the oracle when it succeeded."""
    import ringdilated
    from ringdilated.testing import oracle

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 1:
        time.sleep(payload["delay"])
    q, k, v = _inputs(rank, world)
    start = time.monotonic()
    try:
        out = ringdilated.dilated_attention(q, k, v, [16], [1], process_group=dist.group.WORLD)
    except Exception as exc:
        return {"raised": caught_as(exc), "seconds": time.monotonic() - start}
    shards = [_inputs(r, world) for r in range(world)]
    full = [torch.cat(parts, 1) for parts in zip(*shards, strict=True)]
    expected = oracle(*full, [16], [1])[:, 8 * rank : 8 * (rank + 1)]
    return {
        "raised": None,
        "seconds": time.monotonic() - start,
        "error": float((out - expected).abs().max()),
    }


def nan_on_a_shard(payload: dict[str, Any]) -> dict[str, Any]:
    """Position ``payload['position']`` of ``payload['tensor']`` is NaN; returns whether this
    rank's ``out`` and ``lse`` meet the non-finite rule (docs/spec.md section 4) against the
    single-process oracle's slice: non-finite wherever it is, NaN elsewhere only where
    :func:`ringdilated.testing.nan_allowed` says (a NaN input in the row's own block)."""
    import ringdilated
    from ringdilated.testing import dense_attention, nan_allowed, non_finite_violation, oracle

    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [_inputs(r, world) for r in range(world)]
    full = [torch.cat(parts, 1) for parts in zip(*shards, strict=True)]
    which = "qkv".index(payload["tensor"])
    full[which][0, payload["position"], 0, 0] = float("nan")
    mine = [x[:, 8 * rank : 8 * (rank + 1)].contiguous() for x in full]
    kwargs = {"causal": payload["causal"], "mode": payload["mode"]}
    out, lse = ringdilated.dilated_attention(
        *mine, [16], [2], **kwargs, return_lse=True, process_group=dist.group.WORLD
    )
    expected, expected_lse = oracle(*full, [16], [2], **kwargs, return_lse=True)
    baseline, baseline_lse = dense_attention(*full, [16], [2], **kwargs)
    may = nan_allowed(*full, [16], [2], mode=payload["mode"])
    rows = slice(8 * rank, 8 * (rank + 1))
    out_problem = non_finite_violation(
        out, expected[:, rows], baseline[:, rows], may[:, rows].unsqueeze(-1), out.dtype
    )
    lse_problem = non_finite_violation(
        lse,
        expected_lse[..., rows],
        baseline_lse[..., rows],
        may[:, rows].transpose(1, 2),
        lse.dtype,
    )
    return {
        "out": out_problem is None,
        "lse": lse_problem is None,
        "problems": [out_problem, lse_problem],
        "nan_rows": int(out.isnan().any(-1).sum()),
    }


def batch_limited_shards(payload: dict[str, Any]) -> dict[str, Any]:
    """A sharded call on a kernel that takes one problem a call: a segment of 16 over two
    shards of 8 crosses the boundary, so its pieces (one problem per batch row, 3 rows here)
    go through the crossing path and must be split too. Returns the largest call seen and the
    error against the oracle."""
    import attrs

    from ringdilated.backends.local import LOCAL_SPEC
    from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
    from ringdilated.backends.ringpass import RINGPASS_SPEC
    from ringdilated.core import Resolver
    from ringdilated.core.select.capabilities import BatchLimit
    from ringdilated.functional import attend
    from ringdilated.testing import oracle

    seen = []

    class Spy(ReferenceKernel):
        def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
            seen.append(q.shape[0])
            return super().forward(q, k, v, options)

        def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
            seen.append(q.shape[0])
            return super().backward(dout, q, k, v, out, lse, options)

    capabilities = attrs.evolve(REFERENCE_SPEC.capabilities, batch_limit=BatchLimit(problems=1))
    spec = attrs.evolve(REFERENCE_SPEC, name="spy", factory=Spy, capabilities=capabilities)
    resolver = Resolver([spec], communicators=[LOCAL_SPEC, RINGPASS_SPEC])
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(3, 16, 2, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    mine = [x[:, 8 * rank : 8 * (rank + 1)].contiguous().requires_grad_() for x in full]
    out, _, _ = attend(
        ([16], [1]), *mine, causal=True, scale=None, dropout_p=0.0, kernel="spy",
        process_group=dist.group.WORLD, resolver=resolver,
    )  # fmt: skip
    out.sum().backward()
    expected = oracle(*full, [16], [1], causal=True)[:, 8 * rank : 8 * (rank + 1)]
    return {"most": max(seen), "error": float((out - expected).abs().max())}


def row_limited_shards(payload: dict[str, Any]) -> dict[str, Any]:
    """A sharded call on a kernel bounded to ``payload['bound']`` query elements a call: shards
    of 16, a 32-segment crossing them, 4 query heads on 2 key/value heads, causal, the lse
    returned with a gradient. Returns the most query rows and elements a call held and the
    largest errors of ``out``, ``lse``, ``dq``, ``dk``, ``dv`` against the oracle."""
    import attrs

    from ringdilated.backends.local import LOCAL_SPEC
    from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
    from ringdilated.backends.ringpass import RINGPASS_SPEC
    from ringdilated.core import Resolver
    from ringdilated.core.select.capabilities import BatchLimit
    from ringdilated.functional import attend
    from ringdilated.testing import oracle

    seen: list[tuple[int, int]] = []

    class Spy(ReferenceKernel):
        def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
            seen.append((q.shape[2], q.numel()))
            return super().forward(q, k, v, options)

        def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
            seen.append((q.shape[2], q.numel()))
            return super().backward(dout, q, k, v, out, lse, options)

    limit = BatchLimit(query_elements=payload["bound"])
    capabilities = attrs.evolve(REFERENCE_SPEC.capabilities, batch_limit=limit)
    spec = attrs.evolve(REFERENCE_SPEC, name="spy", factory=Spy, capabilities=capabilities)
    resolver = Resolver([spec], communicators=[LOCAL_SPEC, RINGPASS_SPEC])
    rank, mine = dist.get_rank(), slice(16 * dist.get_rank(), 16 * (dist.get_rank() + 1))
    g = torch.Generator().manual_seed(9)
    full = [torch.randn(2, 32, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    dout = torch.randn(2, 32, 4, 8, generator=g, dtype=torch.float64)
    dlse = torch.randn(2, 4, 32, generator=g, dtype=torch.float64)
    shard = [x[:, mine].contiguous().requires_grad_() for x in full]
    out, lse, _ = attend(
        ([16, 32], [1, 2]), *shard, causal=True, scale=None, dropout_p=0.0, kernel="spy",
        process_group=dist.group.WORLD, resolver=resolver, communicator="ringpass",
        return_lse=True, full_precision_lse=True,
    )  # fmt: skip
    exact = [x.clone().requires_grad_() for x in full]
    expected, expected_lse = oracle(*exact, [16, 32], [1, 2], causal=True, return_lse=True)
    finite = expected_lse.isfinite()  # a head's positions its pattern leaves out: -inf, no gradient
    wanted = torch.autograd.grad(
        (expected * dout).sum() + (expected_lse * dlse)[finite].sum(), exact
    )
    grads = torch.autograd.grad(
        (out * dout[:, mine]).sum() + (lse * dlse[..., mine])[finite[..., mine]].sum(), shard
    )
    errors = [
        (out - expected[:, mine]).abs().max(),
        (lse - expected_lse[..., mine])[finite[..., mine]].abs().max(),
        *((got - want[:, mine]).abs().max() for got, want in zip(grads, wanted, strict=True)),
    ]
    return {
        "rows": max(r for r, _ in seen),
        "elements": max(e for _, e in seen),
        "errors": [float(e.detach()) for e in errors],
        "rank": rank,
        "same_lse_rows": bool(torch.equal(lse.isfinite(), finite[..., mine])),
    }


def interleaved_groups(payload: dict[str, Any]) -> dict[str, Any]:
    """A 4-rank world split into the interleaved groups [0, 2] and [1, 3] (created once, on
    every rank, in the same order, outside any call), each pair running its own problem with
    ``payload['communicator']``: this rank's output, its pair's full inputs, the time taken."""
    import ringdilated

    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[rank % 2]
    g = torch.Generator().manual_seed(10 + rank % 2)  # each pair its own problem
    full = torch.randn(3, 1, 32, 2, 8, generator=g, dtype=torch.float64)
    index = dist.get_rank(mine)
    q, k, v = (x[:, 16 * index : 16 * (index + 1)].contiguous() for x in full)
    real_new_group = dist.new_group

    def no_new_group(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a process group was created inside a call")

    start = time.monotonic()
    dist.new_group = no_new_group  # the call must work on the groups it was given
    try:
        # Pair [0, 2] has a segment across its shards; pair [1, 3] none (nothing moves), so
        # only one pair reaches the communicator's setup, as independent groups do.
        out = ringdilated.dilated_attention(
            q, k, v, [32 if rank % 2 == 0 else 16], [2], causal=payload["causal"],
            process_group=mine, communicator=payload["communicator"],
        )  # fmt: skip
    except Exception as exc:
        return {"raised": caught_as(exc), "message": str(exc), "seconds": 0.0}
    finally:
        dist.new_group = real_new_group
    return {
        "raised": None,
        "out": out,
        "full": full,
        "index": index,
        "segment": 32 if rank % 2 == 0 else 16,
        "seconds": time.monotonic() - start,
    }


def mesh_dimension(payload: dict[str, Any]) -> dict[str, Any]:
    """A 2 x 2 CPU mesh ("dp", "cp") on gloo, made once outside any call: each "cp" group runs
    its own problem, given as ``(mesh, "cp")`` or as the 1-D sub-mesh ``mesh["cp"]``."""
    from torch.distributed.device_mesh import init_device_mesh

    import ringdilated

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    group = (mesh, "cp") if payload["form"] == "tuple" else mesh["cp"]
    dp = mesh.get_local_rank("dp")
    cp = mesh.get_local_rank("cp")
    g = torch.Generator().manual_seed(20 + dp)  # each data-parallel replica its own problem
    full = torch.randn(3, 1, 32, 2, 8, generator=g, dtype=torch.float64)
    cut = payload.get("cut", 16)  # cp rank 0 holds [0, cut), cp rank 1 [cut, 32)
    shard = slice(0, cut) if cp == 0 else slice(cut, 32)
    q, k, v = (x[:, shard].contiguous() for x in full)
    start = time.monotonic()
    out = ringdilated.dilated_attention(
        q, k, v, [32], [2], causal=True, process_group=group, communicator=payload["communicator"]
    )
    return {"out": out, "full": full, "cp": cp, "shard": shard, "seconds": time.monotonic() - start}


def layout_fault(payload: dict[str, Any]) -> dict[str, Any]:
    """Every rank passes the same wrong layout for its communicator: ``"ulysses on a mesh"``
    (a 2-D mesh for a communicator of process groups), ``"hybrid on a group"`` (the world group
    for the 2-D communicator) or ``"3-D mesh"``; returns what this rank raised, and how fast."""
    from torch.distributed.device_mesh import init_device_mesh

    import ringdilated

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v = _inputs(rank, world)
    fault = payload["fault"]
    if fault == "3-D mesh":
        group: Any = init_device_mesh("cpu", (1, 2, world // 2), mesh_dim_names=("a", "b", "c"))
        communicator = "hybrid"
    elif fault == "ulysses on a mesh":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("outer", "inner"))
        group, communicator = (mesh, ("outer", "inner")), "ulysses"
    elif fault == "ulysses instance on a mesh":
        from ringdilated.backends.ulysses import UlyssesCommunicator

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("outer", "inner"))
        group, communicator = (mesh, ("outer", "inner")), UlyssesCommunicator()
    elif fault == "hybrid instance on a group":
        from ringdilated.backends.hybrid import HybridCommunicator

        group, communicator = dist.group.WORLD, HybridCommunicator()
    elif fault == "inconsistent grid":  # rows {0, 1}, {2, 3}; columns {0, 3}, {1, 2}
        groups = [dist.new_group(r) for r in ([0, 1], [2, 3], [0, 3], [1, 2])]
        inner = groups[0] if rank in (0, 1) else groups[1]
        outer = groups[2] if rank in (0, 3) else groups[3]
        group, communicator = (outer, inner), "hybrid"
    elif fault == "unequal columns":  # rows {0, 1}, {2, 3}; columns {0, 2}, {1}, {3}
        groups = [dist.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1], [3])]
        inner = groups[0] if rank in (0, 1) else groups[1]
        outer = {0: groups[2], 2: groups[2], 1: groups[3], 3: groups[4]}[rank]
        group, communicator = (outer, inner), "hybrid"
    elif fault == "not a grid":
        group, communicator = (dist.group.WORLD, dist.group.WORLD), "hybrid"
    elif fault == "2-D mesh alone":
        group = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
        communicator = "auto"
    else:
        group, communicator = dist.group.WORLD, "hybrid"
    start = time.monotonic()
    try:
        ringdilated.dilated_attention(
            q, k, v, [16], [1], process_group=group, communicator=communicator
        )
    except Exception as exc:
        return {
            "raised": caught_as(exc),
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    return {"raised": None, "message": "", "seconds": time.monotonic() - start}


def rotary_on_one_rank(payload: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's module places rotary positions, rank 1's does not (shards of
    ``payload['lengths']``): what each raised, and how fast."""
    import ringdilated
    from ringdilated.rotary import rotary_embedding

    rank = dist.get_rank()
    torch.manual_seed(0)
    module = ringdilated.MultiheadDilatedAttention(
        16, 4, segment_lengths=[8], dilation_rates=[1], dtype=torch.float64,
        process_group=dist.group.WORLD, rotary=rotary_embedding if rank == 0 else None,
    )  # fmt: skip
    x = torch.randn(1, payload["lengths"][rank], 16, dtype=torch.float64)
    start = time.monotonic()
    try:
        module(x, x, x)
    except Exception as exc:
        return {
            "raised": caught_as(exc),
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    return {"raised": None, "message": "", "seconds": time.monotonic() - start}


def layout_faults(payload: dict[str, Any]) -> dict[str, Any]:
    """Faults around a ``SequenceLayout`` on the world group (``payload['fault']``), reported
    per rank: what raised, its message, how long it took, and the control collectives (the
    agreement's) of each call made."""
    import os

    import ringdilated
    from ringdilated.testing.hot_path import HotPathCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    fault, culprit = payload["fault"], payload.get("rank", 1)
    q, k, v = _inputs(rank, world)
    group = dist.group.WORLD
    every_call = payload.get("every_call", False)  # pinned unless a test asks
    controls: list[int] = []

    def layout(**kwargs: Any) -> Any:
        return ringdilated.SequenceLayout(
            process_group=group, agree_every_call=every_call, **kwargs
        )

    def call(on: Any, **kwargs: Any) -> Any:
        with HotPathCounter() as counts:
            out = ringdilated.dilated_attention(q, k, v, [16], [1], layout=on, **kwargs)
        controls.append(counts.control_collectives)
        return out

    start = time.monotonic()
    result: dict[str, Any] = {"raised": None, "message": ""}
    try:
        if fault == "different documents":
            bounds = [0, 5, 8 * world] if rank == culprit else [0, 8 * world]
            layout(cu_seqlens=torch.tensor(bounds))
        elif fault == "bad documents":
            bounds = [0, 9, 5, 8 * world] if rank == culprit else [0, 8 * world]
            layout(cu_seqlens=torch.tensor(bounds))
        elif fault == "documents past the shards":
            layout(cu_seqlens=torch.tensor([0, 8 * world + 1]), shard_length=8)
        elif fault == "first call differs":
            call(layout(), causal=rank == culprit)
        elif fault == "later call":  # every rank's later call contradicts the layout
            on = layout()
            call(on)
            call(on)
            q, k, v = (x[:, :4] for x in (q, k, v))
            call(on)
        elif fault == "later call differs":  # with agree_every_call: raised on every rank
            on = layout()
            call(on)
            call(on, causal=rank == culprit)
        elif fault == "environment":
            before = os.environ.get("RINGDILATED_AGREE_EVERY_CALL")
            os.environ["RINGDILATED_AGREE_EVERY_CALL"] = payload["value"]
            try:
                result["agree_every_call"] = ringdilated.SequenceLayout(
                    process_group=group
                ).agree_every_call
            finally:  # restored: a tox environment may have set it for the whole run
                if before is None:
                    del os.environ["RINGDILATED_AGREE_EVERY_CALL"]
                else:
                    os.environ["RINGDILATED_AGREE_EVERY_CALL"] = before
        elif fault == "none":
            on = layout()
            for _ in range(3):
                call(on)
    except Exception as exc:
        result["raised"], result["message"] = caught_as(exc), str(exc)
    result["seconds"] = time.monotonic() - start
    result["controls"] = controls
    return result


def layered_module_fault(payload: dict[str, Any]) -> dict[str, Any]:
    """Two identical ``MultiheadDilatedAttention`` layers on one planned layout; at the second
    step every rank's second layer gets ``need_weights=True`` (its own check fails). Reports
    what raised and the control collectives of that step: a module's failed check on a layout
    that has planned calls raises at once, joining no agreement."""
    import ringdilated
    from ringdilated.testing.hot_path import HotPathCounter

    torch.manual_seed(0)
    kw: dict[str, Any] = {"segment_lengths": [8], "dilation_rates": [1], "dtype": torch.float64}
    layers = [
        ringdilated.MultiheadDilatedAttention(8, 2, process_group=dist.group.WORLD, **kw)
        for _ in range(2)
    ]
    layout = ringdilated.SequenceLayout(process_group=dist.group.WORLD, agree_every_call=False)
    x = torch.randn(1, 8, 8, dtype=torch.float64)
    for layer in layers:  # plans the call
        layer(x, x, x, layout=layout)
    result: dict[str, Any] = {"raised": None}
    start = time.monotonic()
    with HotPathCounter() as counts:
        try:
            y = layers[0](x, x, x, layout=layout)[0]
            layers[1](y, y, y, need_weights=True, layout=layout)
        except ValueError as exc:
            result["raised"], result["message"] = caught_as(exc), str(exc)
    result["seconds"] = time.monotonic() - start
    result["controls"] = counts.control_collectives
    return result


def nccl_only_group(payload: dict[str, Any]) -> dict[str, Any]:
    """With every group taken for an NCCL-only one (``agreement._has_cpu_backend`` says no),
    builds a layout on WORLD (``payload['grid']``: on a 2 x 2 mesh), calls on it twice, then
    makes a call that rank 1 passes with ``causal=True``. Reports the groups made, which group
    each collective ran on (the agreements' int64 flags and pickled reports, the data's float64
    pieces), the output's largest difference from the one-process call, and the failing call's
    message."""
    import ringdilated
    from ringdilated.core.call import agreement

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(5)
    full = torch.randn(3, 1, 8 * world, 4, 8, generator=g, dtype=torch.float64)
    q, k, v = (x[:, 8 * rank : 8 * (rank + 1)].contiguous() for x in full)
    segments = [8 * world]
    group: Any = dist.group.WORLD
    if payload.get("grid"):  # a 2 x 2 mesh: the hybrid communicator, one twin per dimension
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
        group = (mesh, ("ring", "ulysses"))
        mesh["ring"].get_group().set_timeout(datetime.timedelta(seconds=41))
    made: list[object] = []
    used: list[tuple[str, str, str]] = []  # (collective, dtype, "twin" or "caller's")
    names = ("all_gather", "all_gather_object", "all_to_all_single", "batch_isend_irecv")
    real = {name: getattr(dist, name) for name in (*names, "new_group")}
    real_has_cpu = agreement._has_cpu_backend

    def recording(name: str) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            items = [a for a in args if isinstance(a, torch.Tensor)]
            items += [t for a in args if isinstance(a, list) for t in a]
            if items and isinstance(items[0], dist.P2POp):  # batch_isend_irecv
                group, items = items[0].group, [items[0].tensor]
            first = items[0] if items else None
            dtype = str(first.dtype) if isinstance(first, torch.Tensor) else ""
            where = "twin" if group in agreement._cpu_twins.values() else "caller's"
            used.append((name, dtype, where))
            return real[name](*args, **kwargs)

        return collective

    def new_group(*args: Any, **kwargs: Any) -> Any:
        timeout = kwargs.get("timeout")
        seconds = timeout.total_seconds() if timeout is not None else None
        made.append((kwargs.get("backend"), kwargs.get("use_local_synchronization"), seconds))
        return real["new_group"](*args, **kwargs)

    result: dict[str, Any] = {}
    agreement._cpu_twins.clear()
    try:
        for name in names:
            setattr(dist, name, recording(name))
        dist.new_group = new_group  # type: ignore[assignment]
        agreement._has_cpu_backend = lambda group: False  # type: ignore[assignment]
        layout = ringdilated.SequenceLayout(process_group=group)
        for _ in range(2):
            out = ringdilated.dilated_attention(q, k, v, segments, [1], layout=layout)
        whole = ringdilated.dilated_attention(*full, segments, [1])
        result["error"] = float((out - whole[:, 8 * rank : 8 * (rank + 1)]).abs().max())
        try:
            ringdilated.dilated_attention(
                q, k, v, segments, [1], causal=rank == 1, process_group=group
            )
        except ValueError as exc:
            result["message"] = str(exc)
    finally:
        for name, function in real.items():
            setattr(dist, name, function)
        agreement._has_cpu_backend = real_has_cpu  # type: ignore[assignment]
        agreement._cpu_twins.clear()
    result["made"] = made
    result["used"] = used
    return result


def hook_on_the_attention_module(payload: dict[str, Any]) -> dict[str, Any]:
    """Every rank runs a sharded ``MultiheadDilatedAttention`` (with ``payload['block']``, a
    ``DilatedTransformerBlock``); on rank ``payload['rank']`` a forward pre-hook registered on
    that module itself raises, before the module's forward (and so its checks) starts. Returns
    each rank's outcome and how long it took."""
    import ringdilated

    torch.manual_seed(0)
    kwargs: dict[str, Any] = {
        "segment_lengths": [16],
        "dilation_rates": [1],
        "process_group": dist.group.WORLD,
        "dtype": torch.float64,
    }
    block = payload["block"]
    module = (
        ringdilated.DilatedTransformerBlock(16, 2, **kwargs)
        if block
        else ringdilated.MultiheadDilatedAttention(16, 2, **kwargs)
    )
    if dist.get_rank() == payload["rank"]:

        def failing(*args: Any) -> None:
            raise KeyError("a forward pre-hook failed")

        module.register_forward_pre_hook(failing)
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    return _outcome(lambda: module(x) if block else module(x, x, x))


def mesh_group_timeouts(payload: dict[str, Any]) -> dict[str, float]:
    """The timeout, in seconds, of the world group and of this rank's "cp" group of a 2 x 2
    ``init_device_mesh``: plain, with ``backend_override`` giving gloo options with a timeout,
    and of a ``new_group(timeout=...)``."""
    import datetime

    from torch.distributed.device_mesh import init_device_mesh

    def timeout_s(group: Any) -> float:
        backend = group._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())

    world = dist.get_world_size()
    bound = datetime.timedelta(seconds=payload["seconds"])
    plain = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
    options = dist.ProcessGroupGloo.Options("gloo", timeout=bound)
    bounded = init_device_mesh(
        "cpu", (2, world // 2), mesh_dim_names=("dp", "cp"), backend_override={"cp": options}
    )
    rows = [list(range(r, r + world // 2)) for r in range(0, world, world // 2)]
    mine = None
    for ranks in rows:  # new_group is a collective over the whole default group
        group = dist.new_group(ranks, timeout=bound)
        if dist.get_rank() in ranks:
            mine = group
    return {
        "world": timeout_s(dist.group.WORLD),
        "mesh": timeout_s(plain.get_group("cp")),
        "mesh_override": timeout_s(bounded.get_group("cp")),
        "new_group": timeout_s(mine),
    }
