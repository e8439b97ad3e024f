"""Split groups across data-parallel ranks, whole groups only, balanced by estimated cost.

The cost of a group is the tokens its plan computes (prompt once plus every completion)
plus its attention work, the number of (query, key) pairs, in token units of the same
order. Assignment is greedy longest-first onto the least-loaded rank (ties: lowest rank,
then lowest group index), so every rank computes the same answer without communication.
"""

from __future__ import annotations

from collections.abc import Sequence

from sharedprefix.layout.groups import Group, validate_groups
from sharedprefix.layout.rows import Tree


def group_cost(g: Group, hidden_equiv: int = 4096) -> float:
    """Estimated cost: tokens, plus attention pairs / ``hidden_equiv`` (pairs cost ~d/12 linear FLOPs)."""
    p = int(g.prompt.shape[-1])  # positions (a frame of K codes is one)
    lens = [int(c.shape[-1]) for c in g.completions]
    tokens = p + sum(lens)
    pairs = p * (p + 1) / 2 + sum(t * p + t * (t + 1) / 2 for t in lens)
    return tokens + pairs / hidden_equiv


def shard_groups(groups: Sequence[Group] | Tree, rank: int, world_size: int) -> list[Group] | Tree:
    """The groups rank ``rank`` of ``world_size`` computes; each group lands whole on one rank.

    For a ``Tree``: the rows are taken in trie order (so rows sharing prefixes stay together) and cut into
    ``world_size`` contiguous runs of about equal new tokens (a row's tokens beyond its common prefix with the
    row before); returns the rank's rows as a ``Tree`` whose ``.index`` gives their positions in ``groups``.
    """
    for name, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}={v!r}; expected an int.")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}; expected world_size >= 1 and 0 <= rank < world_size.")
    if isinstance(groups, Tree):
        return _shard_tree(groups, rank, world_size)
    groups = validate_groups(groups)
    costs = [group_cost(g) for g in groups]
    order = sorted(range(len(groups)), key=lambda i: (-costs[i], i))
    load = [0.0] * world_size
    owner = [0] * len(groups)
    for i in order:
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return [g for i, g in enumerate(groups) if owner[i] == rank]


def _shard_tree(tree: Tree, rank: int, world_size: int) -> Tree:
    keys = [tuple(r.tolist()) for r in tree.rows]
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    new, prev = [], ()
    for i in order:
        k, n = keys[i], 0
        while n < min(len(k), len(prev)) and k[n] == prev[n]:
            n += 1
        new.append(len(k) - n)
        prev = k
    total, acc, mine = sum(new), 0, []
    for i, cost in zip(order, new):
        if min(world_size - 1, acc * world_size // max(1, total)) == rank:
            mine.append(i)
        acc += cost
    return tree.subset(sorted(mine))
