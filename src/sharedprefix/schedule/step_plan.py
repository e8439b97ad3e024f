"""The passes of one optimizer step over K microbatches (``sp.plan_step``, ``schedule.step``): ``plan_step`` finds the
segments that rows of two or more microbatches pass through (shared: recorded once for the step, level by level in
packed passes, and backpropagated once after its last microbatch) and plans each microbatch's own segments as a
call's passes are planned (``planner.plan_units``); ``RowView`` is the rows one microbatch reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from sharedprefix.layout.tree import SegmentTree
from sharedprefix.schedule.planner import Pass, Plan, PrefixBackward, ends_of, plan_units


@dataclass(frozen=True)
class RowView:
    """The rows one microbatch of a step reports, out of its step's tree: ``rows[i]`` is the tree row of the
    microbatch's row i; ``width``: its longest row in columns (its results are (n, width))."""

    rows: tuple[int, ...]
    width: int

    @cached_property
    def local(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self.rows)}


@dataclass(frozen=True)
class StepPlan:
    """The passes of one optimizer step of K microbatches over one segment tree (the seed's schedule across the
    trainer's own microbatches, ``schedule.step``).

    ``shared``: the segments the rows of two or more microbatches pass through, in preorder (ancestors first): each
    is computed once for the step, by ``record`` (a pass per segment that caches it), read by every microbatch's
    passes, and backpropagated once by ``backward`` after the step's last microbatch. ``microbatches[k]``: the steps
    of microbatch k alone (what only its rows pass through, planned under the budget as a call's passes are, a part
    larger than the budget expanded inside the microbatch); ``views[k]``: its rows. A call of one microbatch is the
    special case with nothing shared: ``plan_tree``."""

    tree: SegmentTree
    shared: tuple[int, ...]
    microbatches: tuple[tuple, ...]
    views: tuple[RowView, ...]
    max_tokens: int | None

    def microbatch_plan(self, k: int) -> Plan:
        """Microbatch ``k``'s own passes as a call's ``Plan`` over its rows (their tokens, plain tokens, passes)."""
        return Plan(self.tree, list(self.microbatches[k]), self.max_tokens, self.views[k])

    @property
    def shared_tokens(self) -> int:
        """Tokens of the shared segments: what the step's cache holds between its calls."""
        return sum(self.tree.segments[s].length for s in self.shared)

    @property
    def record(self) -> list[Pass]:
        """The shared segments' recording passes: level by level (a segment after its parent), the segments of one
        level packed first-fit under the budget, so that K shared prompts take one pass, not K."""
        depth: dict[int, int] = {}
        for s in self.shared:  # preorder: a parent before its children
            p = self.tree.segments[s].parent
            depth[s] = 0 if p is None else depth[p] + 1
        out: list[Pass] = []
        for d in sorted(set(depth.values())):
            bins: list[list[int]] = []
            used: list[int] = []
            for s in (s for s in self.shared if depth[s] == d):
                n = self.tree.segments[s].length
                cap = self.max_tokens
                b = next((i for i, u in enumerate(used) if cap is None or u + n <= cap), None)
                if b is None:
                    bins.append([])
                    used.append(0)
                    b = len(bins) - 1
                bins[b].append(s)
                used[b] += n
            out += [Pass(tuple(b), record=tuple(b)) for b in bins]
        return out

    @property
    def backward(self) -> list:
        """The shared segments' backward: one per recording pass, the last recorded first."""
        return [PrefixBackward(p.record, together=True) for p in reversed(self.record)]

    def describe(self) -> str:
        """The step's plan, microbatch by microbatch (each as ``Plan.describe`` prints a call)."""
        segs = self.tree.segments
        shared = sum(segs[s].length for s in self.shared)
        lines = [f"step: {len(self.views)} microbatches, {len(self.shared)} shared segment(s) of {shared} tokens"]
        for k, steps in enumerate(self.microbatches):
            lines.append(f"microbatch {k}: {len(self.views[k].rows)} row(s)")
            lines += ["  " + ln for ln in Plan(self.tree, list(steps), self.max_tokens).describe().splitlines()[1:-1]]
        return "\n".join(lines)


def plan_step(tree: SegmentTree, members: Sequence[Sequence[int]], max_tokens: int | None) -> StepPlan:
    """Plan a step whose microbatch k reports the rows ``members[k]`` of ``tree`` (each row in exactly one)."""
    owner: dict[int, int] = {}
    for k, rows in enumerate(members):
        for r in rows:
            owner[r] = k
    users: list[set[int]] = [set() for _ in tree.segments]
    for r, k in owner.items():
        for s in tree.path(tree.rows[r].end):
            users[s].add(k)
    shared = tuple(s for s in range(len(tree.segments)) if len(users[s]) > 1)
    inshared = set(shared)
    per_mb = []
    for k, rows in enumerate(members):
        mine = set(rows)
        units = [
            s.id
            for s in tree.segments
            if s.id not in inshared and users[s.id] == {k} and (s.parent is None or s.parent in inshared)
        ]
        steps = plan_units(
            tree, units, ends_of(tree, [r for r in rows if tree.rows[r].end not in inshared]), max_tokens
        )
        cached_rows = tuple(r for r in rows if tree.rows[r].end in inshared)
        if cached_rows:  # rows that end in a shared segment: their values are cached; reported by a pass of theirs
            last = max((i for i, st in enumerate(steps) if isinstance(st, Pass) and not st.record), default=None)
            if last is None:
                steps.append(Pass((), rows=cached_rows))  # values only: no token to compute
            else:
                st = steps[last]
                steps[last] = Pass(st.segments, st.record, st.rows + cached_rows)
        assert {r for st in steps if isinstance(st, Pass) for r in st.rows} == mine
        per_mb.append(tuple(steps))
    views = tuple(
        RowView(tuple(rows), max(tree.segments[tree.rows[r].end].end - tree.rows[r].col0 for r in rows))
        for rows in members
    )
    return StepPlan(tree, shared, tuple(per_mb), views, max_tokens)
