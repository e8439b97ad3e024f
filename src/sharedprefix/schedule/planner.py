"""Plan the passes of a call under a token budget.

A group that fits ``max_tokens`` (prompt plus all its completions) is computed whole in one
pass, packed first-fit with other whole groups. A group that does not fit is split: its
prompt is computed once (as a chain of chunks of at most ``max_tokens`` tokens, each
reading the earlier chunks' cached K/V), its completions then run in as few passes as the
budget allows reading the cached prompt K/V and last hidden state, and finally the prompt's
backward runs once with the accumulated gradients (chunks in reverse order).

Token counts: a plain run computes ``sum_i (P_g(i) + T_i)`` tokens; a plan computes each
prompt token once.
"""

from __future__ import annotations

from dataclasses import dataclass

from sharedprefix.layout.groups import Group
from sharedprefix.layout.tree import SegmentTree


@dataclass(frozen=True)
class Pass:
    """One packed row: ``segments`` in row order; ``record`` are cached for later passes."""

    segments: tuple[int, ...]
    record: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefixBackward:
    """Backward of a cached prompt chain (ids root first; runs in reverse order), then release it."""

    segments: tuple[int, ...]


@dataclass
class Plan:
    tree: SegmentTree
    steps: list
    max_tokens: int | None

    @property
    def splits(self) -> bool:
        """True when some group is split across passes (its prompt is cached and backpropagated later)."""
        return any(isinstance(s, PrefixBackward) for s in self.steps)

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
        return self.tree.plain_tokens()

    def describe(self) -> str:
        """A human-readable table of the passes."""
        segs = self.tree.segments
        lines = [f"plan: {len(self.passes)} passes under max_tokens={self.max_tokens}"]
        for i, step in enumerate(self.steps):
            if isinstance(step, Pass):
                kinds = []
                for s in step.segments:
                    seg = segs[s]
                    kind = "prompt" if seg.completion is None else f"c{seg.completion}"
                    kinds.append(f"g{seg.group}:{kind}[{seg.length}]")
                rec = f" (cache {len(step.record)} prompt segment(s))" if step.record else ""
                lines.append(f"  step {i}: pass {self.pass_tokens(step):>7} tokens  {' '.join(kinds)}{rec}")
            else:
                g = segs[step.segments[0]].group
                lines.append(f"  step {i}: prompt backward of group {g} ({len(step.segments)} chunk(s), reverse order)")
        ratio = self.plain_tokens / max(1, self.tokens_computed)
        lines.append(
            f"tokens computed {self.tokens_computed}, plain run {self.plain_tokens} ({ratio:.2f}x fewer)"
        )
        return "\n".join(lines)


def _check_budget(max_tokens) -> int | None:
    if max_tokens is None:
        return None
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise TypeError(f"max_tokens={max_tokens!r}; expected a positive int (tokens one pass may hold) or None.")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}; expected a positive number of tokens one pass may hold, or None.")
    return max_tokens


def plan(groups: list[Group], max_tokens: int | None = None) -> Plan:
    """Plan passes for ``groups`` so that no pass holds more than ``max_tokens`` tokens."""
    max_tokens = _check_budget(max_tokens)
    tree = SegmentTree(groups, prompt_chunk=max_tokens)
    if max_tokens is None:
        segs = [s for gi in range(len(groups)) for s in _group_segments(tree, gi)]
        return Plan(tree, [Pass(tuple(segs))], None)
    whole_bins: list[list[int]] = []  # per bin: segment ids
    bin_tokens: list[int] = []
    split_steps: list = []
    for gi, g in enumerate(groups):
        lens = [int(c.numel()) for c in g.completions]
        cost = int(g.prompt.numel()) + sum(lens)
        if cost <= max_tokens:
            fits = [b for b, used in enumerate(bin_tokens) if used + cost <= max_tokens]
            if fits:
                b = fits[0]  # first fit
            else:
                whole_bins.append([])
                bin_tokens.append(0)
                b = len(bin_tokens) - 1
            whole_bins[b].extend(_group_segments(tree, gi))
            bin_tokens[b] += cost
            continue
        for i, t in enumerate(lens):
            if t > max_tokens:
                raise ValueError(
                    f"groups[{gi}].completions[{i}] has {t} tokens but max_tokens={max_tokens}; a completion is never "
                    f"split across passes, so no plan can make progress. Set max_tokens >= {max(lens)}."
                )
        chain = tree.prompt_chain[gi]
        split_steps += [Pass((s,), record=(s,)) for s in chain]
        sids = [tree.completion_ids[n] for n in tree.group_completions[gi]]
        split_steps += [Pass(tuple(r)) for r in _balanced_rows(sids, lens, max_tokens)]
        split_steps.append(PrefixBackward(tuple(chain)))
    steps = [Pass(tuple(b)) for b in whole_bins] + split_steps
    return Plan(tree, steps, max_tokens)


def _group_segments(tree: SegmentTree, gi: int) -> list[int]:
    return tree.prompt_chain[gi] + [tree.completion_ids[n] for n in tree.group_completions[gi]]


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
