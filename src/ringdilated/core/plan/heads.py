"""Head parallelism's plan: which query heads each rank attends, and their blocks.

Under head parallelism (``ulysses``) each rank attends the whole sequence for a share of the
query heads, so the work a rank does is the work of its heads. A head's work depends on its
pattern: a block of ``num_segments`` segments with ``count`` selected positions each costs
``num_segments * count**2`` (about ``L * w_i / r_i**2`` for a pattern of segment ``w_i`` and rate
``r_i``: ``4 : 2 : 1`` for segments ``[2048, 4096, 8192]`` with rates ``[1, 2, 4]``).

**The dealing rule** (:func:`deal_heads`). The units dealt are the key/value heads with their
query heads (grouped-query attention) when there are at least as many key/value heads as ranks,
else single query heads (a key/value head whose query heads land on several ranks is then sent
to each of them). Units go, most costly first (ties: lowest index first), to the rank with the
least work so far (ties: the lowest rank): the longest-processing-time rule, which balances
equal costs exactly and any costs to within one unit's. Then, within each set of units of equal
cost, each rank's units are renumbered to be consecutive (same work, fewer kernel calls).
``longnet`` mode gives every head the same work, so its heads are dealt in equal consecutive
runs (one more to the first ``H % P`` ranks when ``P`` does not divide ``H``).

Every rank computes the same shares from the same arguments: nothing about them is sent.
"""

from __future__ import annotations

import functools
import itertools

import attrs

from ringdilated.core.plan.pattern import Block, DilationPattern, HeadRun, split_by_kv
from ringdilated.core.plan.shards import Crossing, ShardPlan

__all__ = ["HeadShare", "deal_heads", "head_costs", "share_blocks", "share_plan"]


@attrs.frozen
class HeadShare:
    """The query heads one rank attends (global indices, increasing) and the key/value heads
    they read (likewise); ``cost`` is their work, in selected pairs per batch row."""

    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    cost: int


def head_costs(
    pattern: DilationPattern, seq_len: int, num_heads: int, num_kv_heads: int
) -> tuple[int, ...]:
    """Each query head's work for a sequence of ``seq_len``: selected query-key pairs."""
    costs = [0] * num_heads
    for block in pattern.blocks(seq_len, num_heads, num_kv_heads):
        n, sel = block.selection.count, block.selection
        for h in range(block.heads.q_start, block.heads.q_stop):
            costs[h] += sel.num_segments * n * n
    return tuple(costs)


@functools.lru_cache(maxsize=256)
def deal_heads(
    pattern: DilationPattern, seq_len: int, num_heads: int, num_kv_heads: int, world_size: int
) -> tuple[HeadShare, ...]:
    """Every rank's :class:`HeadShare` by the dealing rule of the module docstring. Raises
    ``ValueError`` when there are fewer query heads than ranks (a rank would attend nothing)."""
    if num_heads < world_size:
        raise ValueError(
            f"head parallelism needs at least one query head per rank: {num_heads} heads over "
            f"{world_size} ranks"
        )
    group = num_heads // num_kv_heads
    costs = head_costs(pattern, seq_len, num_heads, num_kv_heads)
    if num_kv_heads >= world_size:
        units = [tuple(range(j * group, (j + 1) * group)) for j in range(num_kv_heads)]
    else:
        units = [(h,) for h in range(num_heads)]
    unit_cost = [sum(costs[h] for h in unit) for unit in units]
    if pattern.mode == "longnet" or len(set(unit_cost)) == 1:
        base, extra = divmod(len(units), world_size)
        bounds = itertools.accumulate((base + (r < extra) for r in range(world_size)), initial=0)
        owned = [list(range(first, stop)) for first, stop in itertools.pairwise(bounds)]
    else:
        owned = _longest_first(unit_cost, world_size)
    shares = []
    for units_of_rank in owned:
        q = tuple(sorted(h for u in units_of_rank for h in units[u]))
        kv = tuple(sorted({h // group for h in q}))
        shares.append(HeadShare(q, kv, sum(costs[h] for h in q)))
    return tuple(shares)


def _longest_first(unit_cost: list[int], world_size: int) -> list[list[int]]:
    """Units per rank: most costly first to the least loaded rank, then each cost class's
    units renumbered consecutively in rank order (the same counts per rank and class)."""
    load = [0] * world_size
    taken: list[dict[int, int]] = [{} for _ in range(world_size)]  # cost -> units taken
    for u in sorted(range(len(unit_cost)), key=lambda u: (-unit_cost[u], u)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += unit_cost[u]
        taken[rank][unit_cost[u]] = taken[rank].get(unit_cost[u], 0) + 1
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for cost in sorted(set(unit_cost), reverse=True):
        members = [u for u in range(len(unit_cost)) if unit_cost[u] == cost]
        for rank in range(world_size):
            count = taken[rank].get(cost, 0)
            owned[rank].extend(members[:count])
            members = members[count:]
    return owned


def share_blocks(
    blocks: tuple[Block, ...], share: HeadShare, num_heads: int, num_kv_heads: int
) -> tuple[Block, ...]:
    """``blocks`` (of all ``num_heads`` heads) restricted to ``share``'s heads, renumbered to
    the rank's local tensors: query head ``share.q_heads[i]`` is local head ``i``, key/value
    head ``share.kv_heads[j]`` local key/value head ``j``."""
    group = num_heads // num_kv_heads
    local_q = {h: i for i, h in enumerate(share.q_heads)}
    local_kv = {h: j for j, h in enumerate(share.kv_heads)}
    out: list[Block] = []
    for block in blocks:
        run = block.heads
        mine = [h for h in range(run.q_start, run.q_stop) if h in local_q]
        for first, stop in consecutive_runs(mine):
            for part in split_by_kv(first, stop, group):
                heads = HeadRun(
                    local_q[part.q_start],
                    local_q[part.q_stop - 1] + 1,
                    local_kv[part.kv_start],
                    local_kv[part.kv_stop - 1] + 1,
                )
                out.append(attrs.evolve(block, heads=heads))
    return tuple(out)


def consecutive_runs(heads: list[int]) -> list[tuple[int, int]]:
    """Maximal runs ``[first, stop)`` of consecutive integers in sorted ``heads``."""
    runs: list[tuple[int, int]] = []
    for h in heads:
        if runs and runs[-1][1] == h:
            runs[-1] = (runs[-1][0], h + 1)
        else:
            runs.append((h, h + 1))
    return runs


def share_plan(plan: ShardPlan, share: HeadShare) -> ShardPlan:
    """``plan`` restricted to ``share``'s heads, renumbered to the rank's local head tensors
    (its inner blocks and its crossings' blocks, :func:`share_blocks`; the pieces, which are
    positions, stay): the shard plan of one outer rank of a 2-D layout (``hybrid``)."""
    heads, kv_heads = plan.num_heads, plan.num_kv_heads
    crossings = tuple(
        Crossing(block, crossing.pieces)
        for crossing in plan.crossings
        for block in share_blocks((crossing.block,), share, heads, kv_heads)
    )
    return attrs.evolve(
        plan,
        inner=share_blocks(plan.inner, share, heads, kv_heads),
        crossings=crossings,
        num_heads=len(share.q_heads),
        num_kv_heads=len(share.kv_heads),
    )
