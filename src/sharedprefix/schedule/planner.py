"""Plan the passes of a call under a token budget, at every depth of the tree.

Segments longer than ``max_tokens`` are first cut into chains. A top-level subtree (a group,
or the rows below one root) that fits the budget is computed whole in one pass, packed
first-fit with other whole subtrees. A subtree that does not fit is expanded: its root
segment runs alone in a pass that caches its per-layer K/V, last hidden state and token
values; its children's subtrees that fit then run in as few balanced passes as the budget
allows, reading the cache; children that do not fit are expanded the same way; finally the
root segment's backward runs once with the gradients its subtree accumulated. Every output
row is reported in exactly one pass, once all of its segments have run.

Token counts: a plain run computes ``sum_i len(row_i)`` tokens; a plan computes each
segment once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sharedprefix.layout import frames
from sharedprefix.layout.groups import Group, validate_groups
from sharedprefix.layout.rows import Tree
from sharedprefix.layout.tree import SegmentTree
from sharedprefix.schedule.options import check_budget


@dataclass(frozen=True)
class Pass:
    """One packed row of ``segments``; ``record`` are cached for later passes; ``rows`` are the output rows
    reported by this pass (their loss is computed here)."""

    segments: tuple[int, ...]
    record: tuple[int, ...] = ()
    rows: tuple[int, ...] = ()


Segments = int | tuple[int, ...]  # a cached segment, or the segments one pass recorded together (``PrefixBackward``)


@dataclass(frozen=True)
class PrefixBackward:
    """Backward of cached segments (runs in reverse order), then release them. ``together``: the segments were
    recorded by one pass, and their backward is one (the sum of their surrogates through that pass's graph)."""

    segments: tuple[int, ...]
    together: bool = False


@dataclass(frozen=True)
class Dummy:
    """A 2-token pass run only to take part in another FSDP2 rank's collectives; adds exactly zero."""

    backward: bool


@dataclass
class Plan:
    """``steps`` over ``tree`` under ``max_tokens``; ``view``: the rows a step's microbatch reports (``RowView``), or
    None for every row of the tree."""

    tree: SegmentTree
    steps: list
    max_tokens: int | None
    view: Any = None  # a step's ``step_plan.RowView``

    @property
    def splits(self) -> bool:
        """True when some group is split across passes (its prompt is cached and backpropagated later)."""
        return any(isinstance(s, PrefixBackward) for s in self.steps)

    @property
    def fsdp_rounds(self) -> tuple[int, int]:
        """(forward-only rounds, forward+backward rounds) this plan runs under FSDP2."""
        n_f = sum(isinstance(s, Pass) and bool(s.record) for s in self.steps)
        n_fb = sum(
            1
            if isinstance(s, Pass) and not s.record
            else (1 if s.together else len(s.segments))
            if isinstance(s, PrefixBackward)
            else 0
            for s in self.steps
        )
        return n_f, n_fb

    def for_fsdp(self, forward_rounds: int, backward_rounds: int) -> Plan:
        """The order FSDP2 runs: every recording pass first (their collectives carry no backward), then the rest,
        each part padded with ``Dummy`` steps to the counts all ranks agreed on."""
        n_f, n_fb = self.fsdp_rounds
        if forward_rounds < n_f or backward_rounds < n_fb:
            raise ValueError(f"agreed rounds ({forward_rounds}, {backward_rounds}) below this plan's ({n_f}, {n_fb}).")
        rec = [s for s in self.steps if isinstance(s, Pass) and s.record]
        rest = [s for s in self.steps if not (isinstance(s, Pass) and s.record)]
        steps = rec + [Dummy(False)] * (forward_rounds - n_f) + rest + [Dummy(True)] * (backward_rounds - n_fb)
        return Plan(self.tree, steps, self.max_tokens)

    @property
    def passes(self) -> list[Pass]:
        return [s for s in self.steps if isinstance(s, Pass)]

    def pass_tokens(self, p: Pass) -> int:
        return sum(self.tree.segments[s].length for s in p.segments)

    @property
    def tokens_computed(self) -> int:
        return sum(self.pass_tokens(p) for p in self.passes)

    @property
    def plain_tokens(self) -> int:
        if self.view is not None:
            return sum(self.tree.segments[self.tree.rows[r].end].end for r in self.view.rows)
        return self.tree.plain_tokens()

    def describe(self) -> str:
        """A human-readable table of the steps, in the order they run."""
        segs = self.tree.segments
        lines = [f"plan: {len(self.passes)} passes under max_tokens={self.max_tokens}"]
        for i, step in enumerate(self.steps):
            if isinstance(step, Pass):
                kinds = []
                for s in step.segments:
                    seg = segs[s]
                    kind = (
                        f"c{seg.completion}"
                        if seg.completion is not None
                        else "prompt"
                        if self.tree.num_groups
                        else f"s{s}"
                    )
                    kinds.append(f"g{seg.group}:{kind}[{seg.length}]")
                rec = f" (cache {len(step.record)} segment(s))" if step.record else ""
                rows = f", {len(step.rows)} row(s) reported" if step.rows else ""
                lines.append(f"  step {i}: pass {self.pass_tokens(step):>7} tokens  {' '.join(kinds)}{rec}{rows}")
            elif isinstance(step, Dummy):
                what = "forward and zero backward" if step.backward else "forward"
                lines.append(f"  step {i}: dummy 2-token {what} (FSDP2: matches another rank's collectives)")
            else:
                g = segs[step.segments[0]].group
                what = "prompt" if self.tree.num_groups else "prefix"
                lines.append(f"  step {i}: {what} backward of group {g} (segment(s) {list(step.segments)})")
        ratio = self.plain_tokens / max(1, self.tokens_computed)
        lines.append(f"tokens computed {self.tokens_computed}, plain run {self.plain_tokens} ({ratio:.2f}x fewer)")
        return "\n".join(lines)


def segment_tree(source, chunk: int | None) -> SegmentTree:
    """The segment tree of a list of groups or of a ``Tree``, with segments of at most ``chunk`` tokens."""
    if isinstance(source, Tree):
        return SegmentTree.from_trie(list(source.rows), list(source.trained), chunk)
    return SegmentTree(source, prompt_chunk=chunk)


def plan(source: Sequence[Group] | Tree, max_tokens: int | None = None) -> Plan:
    """Plan passes for ``source`` (a list of groups or a ``Tree``) so that no pass holds more than ``max_tokens``
    (``sp.plan``: the groups are checked here; a call checks them once and plans with ``plan_checked``)."""
    return plan_checked(source if isinstance(source, Tree) else validate_groups(source), check_budget(max_tokens))


def plan_checked(source, max_tokens: int | None = None) -> Plan:
    """``plan`` of a ``Tree`` or of groups ``validate_groups`` returned, under a budget ``CallOptions`` checked."""
    if not isinstance(source, Tree):
        if any(g.streams for g in source):  # frames (K codes per position): planned as one frame id per position
            source = frames.encode(source)[0]
        for gi, g in enumerate(source):
            lens = [int(c.numel()) for c in g.completions]
            for i, t in enumerate(lens):
                if max_tokens is not None and t > max_tokens:
                    raise ValueError(
                        f"groups[{gi}].completions[{i}] has {t} tokens but max_tokens={max_tokens}; a completion is "
                        f"never split across passes, so no plan can make progress. Set max_tokens >= {max(lens)}."
                    )
    return plan_tree(segment_tree(source, max_tokens), max_tokens)


def plan_tree(tree: SegmentTree, max_tokens: int | None) -> Plan:
    """The passes of a call over every row of ``tree``: a step of one microbatch (``step_plan.plan_step``), whose units
    are the tree's roots."""
    roots = [seg.id for seg in tree.segments if seg.parent is None]
    return Plan(tree, plan_units(tree, roots, ends_of(tree, range(tree.num_rows)), max_tokens), max_tokens)


def ends_of(tree: SegmentTree, rows) -> dict[int, list[int]]:
    """Segment -> the ``rows`` that end at it."""
    ends: dict[int, list[int]] = {}
    for i in rows:
        ends.setdefault(tree.rows[i].end, []).append(i)
    return ends


def plan_units(tree: SegmentTree, roots: list[int], ends: dict, max_tokens: int | None) -> list:
    """Steps computing the subtrees of ``roots`` (their ancestors cached) and reporting the rows ``ends`` names."""
    nseg = len(tree.segments)
    count = [1] * nseg  # segments in each subtree (a contiguous id range: preorder)
    for seg in reversed(tree.segments):
        if seg.parent is not None:
            count[seg.parent] += count[seg.id]

    def unit(ids: list[int]) -> Pass:
        segs = tuple(x for v in ids for x in range(v, v + count[v]))
        return Pass(segs, rows=tuple(r for x in segs for r in ends.get(x, ())))

    if not roots:
        return []
    if max_tokens is None:
        whole = unit(roots)
        return [Pass(whole.segments, rows=tuple(sorted(whole.rows)))]
    size = tree.subtree_tokens()
    bins: list[list[int]] = []
    used: list[int] = []
    split: list = []
    for r in roots:
        if size[r] > max_tokens:
            _expand(tree, r, size, max_tokens, unit, ends, split)
            continue
        b = next((b for b, u in enumerate(used) if u + size[r] <= max_tokens), None)  # first fit
        if b is None:
            bins.append([])
            used.append(0)
            b = len(bins) - 1
        bins[b].append(r)
        used[b] += size[r]
    return [unit(b) for b in bins] + split


def _expand(tree: SegmentTree, v: int, size: list[int], budget: int, unit, ends: dict, steps: list) -> None:
    """Steps for the subtree of ``v``, which does not fit one pass: record v, run its children, v's backward."""
    steps.append(Pass((v,), record=(v,)))
    first = len(steps)
    kids = tree.children[v]
    small = [c for c in kids if size[c] <= budget]
    if small:
        steps += [unit(r) for r in _balanced_rows(small, [size[c] for c in small], budget)]
    for c in kids:
        if size[c] > budget:
            _expand(tree, c, size, budget, unit, ends, steps)
    if ends.get(v):  # rows ending at v itself: reported by the last pass of its subtree that computes a loss
        k = max(i for i in range(first, len(steps)) if isinstance(steps[i], Pass) and not steps[i].record)
        st = steps[k]
        steps[k] = Pass(st.segments, st.record, st.rows + tuple(ends[v]))
    steps.append(PrefixBackward((v,)))


def _fill(lens: list[int], cap: int) -> list[int]:
    """Sizes of consecutive rows when filling completions in order up to ``cap`` tokens each."""
    rows, used = [0], 0
    for t in lens:
        if used + t > cap and rows[-1]:
            rows.append(0)
            used = 0
        rows[-1] += 1
        used += t
    return rows


def _balanced_rows(sids: list[int], lens: list[int], max_tokens: int) -> list[list[int]]:
    """Completions in order, in the fewest rows the budget allows, with the largest row as small as possible
    (so that peak memory follows the work, not the budget: 8192 tokens under 6144 run as 2 x 4096)."""
    k = len(_fill(lens, max_tokens))
    lo, hi = max(max(lens), -(-sum(lens) // k)), max_tokens
    while lo < hi:  # smallest cap that still needs only k rows
        mid = (lo + hi) // 2
        if len(_fill(lens, mid)) <= k:
            hi = mid
        else:
            lo = mid + 1
    out, i = [], 0
    for n in _fill(lens, lo):
        out.append(sids[i : i + n])
        i += n
    return out
