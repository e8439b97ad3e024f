"""The tree of segments that both mechanisms of sharedprefix work on.

A segment is a run of tokens with an optional parent segment. A token attends to every
token of its ancestor segments and to the earlier tokens of its own segment; its position
id continues from its parent's end. Everything is built by one generic ``add``:

- a list of groups: each prompt is a root (a chain of roots-and-children when it is longer
  than a pass may hold), its G completions are leaves below it;
- any rows (``sharedprefix.Tree``): a token trie, compressed, so that every common prefix,
  across groups and prompts too, is one segment.

Results are read out per *output row* (``OutRow``): a path from a root to the segment where
the row ends. For groups an output row is a completion (columns start at the prompt's end);
for rows it is the whole row (columns are positions).

Segment ids number the tree in preorder (a parent before its subtree, a subtree contiguous),
which the packing relies on to keep each level of a row in tree order.

Notation: S = segments, N = output rows, W = output width (longest row in columns).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from sharedprefix.layout.groups import Group


@dataclass(frozen=True)
class Segment:
    """One run of tokens in the tree.

    Attributes:
        id: index of this segment in ``SegmentTree.segments`` (preorder).
        tokens: (length,) int64 token ids.
        parent: id of the parent segment, or None for a root.
        start: position id of the first token (the parent's ``end``, or 0 for a root).
        group: index of the group (or of the top-level subtree) this segment belongs to.
        completion: for groups, the global completion index of a leaf completion, else None.
        computed: (length,) bool, the tokens whose log-prob is computed (predicted by the token
            before them), or None for none.
    """

    id: int
    tokens: torch.Tensor
    parent: int | None
    start: int
    group: int
    completion: int | None = None
    computed: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    @property
    def end(self) -> int:
        return self.start + self.length

    @cached_property
    def cols(self) -> np.ndarray:
        """(n_computed,) int64, the offsets in this segment of its computed tokens, ascending; read once from
        ``computed`` on the host (packing builds its index tensors from it with numpy)."""
        if self.computed is None:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.computed.numpy()).astype(np.int64, copy=False)

    @property
    def n_computed(self) -> int:
        return len(self.cols)


@dataclass(frozen=True)
class OutRow:
    """One row of the results: the path ending at segment ``end``, read from position ``col0`` on.

    ``trained``: (end position,) bool per position of the path, the tokens this row reports, or None
    for every computed token of the path.
    """

    end: int
    col0: int
    trained: torch.Tensor | None = None


class SegmentTree:
    """Segments and output rows; ``SegmentTree(groups, prompt_chunk)`` for groups, ``from_trie`` for rows."""

    def __init__(self, groups: Sequence[Group] = (), prompt_chunk: int | None = None):
        if prompt_chunk is not None and prompt_chunk < 1:
            raise ValueError(f"prompt_chunk={prompt_chunk}; expected a positive number of tokens or None.")
        self.chunk = prompt_chunk
        groups = list(groups)
        self.num_groups = len(groups)  # (the tree keeps its segments, not the groups)
        self.segments: list[Segment] = []
        self.children: list[list[int]] = []
        self.rows: list[OutRow] = []
        self.prompt_chain: list[list[int]] = []  # per group: ids of its prompt segments, root first
        self.completion_ids: list[int] = []  # per completion n: its segment id
        self.group_completions: list[list[int]] = []  # per group: completion indices n
        # every completion token is computed: one mask for all completions, one view of it per completion
        lengths = [int(c.numel()) for g in groups for c in g.completions]
        masks = iter(torch.ones(sum(lengths), dtype=torch.bool).split(lengths) if lengths else ())
        for gi, g in enumerate(groups):
            chain = self.add(None, g.prompt, group=gi, chunk=prompt_chunk)
            self.prompt_chain.append(chain)
            ns = []
            for c in g.completions:
                n = len(self.completion_ids)
                (sid,) = self.add(chain[-1], c, computed=next(masks), group=gi, completion=n)
                self.completion_ids.append(sid)
                self.rows.append(OutRow(sid, int(g.prompt.numel())))
                ns.append(n)
            self.group_completions.append(ns)

    def add(
        self,
        parent: int | None,
        tokens: torch.Tensor,
        computed: torch.Tensor | None = None,
        group: int = 0,
        completion: int | None = None,
        chunk: int | None = None,
    ) -> list[int]:
        """Append ``tokens`` below ``parent`` (as a chain of pieces of at most ``chunk`` tokens); returns their ids."""
        start = 0 if parent is None else self.segments[parent].end
        n = int(tokens.numel())
        step = chunk or max(1, n)
        whole = step >= n  # one piece: the tensors as given, no slices
        ids = []
        for a in range(0, n, step):
            part = computed if computed is None or whole else computed[a : a + step]
            sid = len(self.segments)
            if parent is not None and self._subtree_end(parent) != sid:
                raise ValueError("segments must be added in preorder (a subtree contiguous); this is a bug.")
            seg = Segment(sid, tokens if whole else tokens[a : a + step], parent, start, group, completion, part)
            if part is not None and not seg.cols.size:  # nothing computed: None, as for a prompt
                seg = dataclasses.replace(seg, computed=None)
            self.segments.append(seg)
            self.children.append([])
            if parent is not None:
                self.children[parent].append(sid)
            start += min(step, n - a)
            parent = sid
            ids.append(sid)
        return ids

    def _subtree_end(self, sid: int) -> int:
        """One past the last id of ``sid``'s subtree as built so far."""
        while self.children[sid]:
            sid = self.children[sid][-1]
        return sid + 1

    def ancestors(self, sid: int) -> list[int]:
        """Ids of the ancestors of segment ``sid``, root first (excluding ``sid`` itself)."""
        out, p = [], self.segments[sid].parent
        while p is not None:
            out.append(p)
            p = self.segments[p].parent
        return out[::-1]

    def path(self, sid: int) -> list[int]:
        return self.ancestors(sid) + [sid]

    def subtree_tokens(self) -> list[int]:
        """Tokens in each segment's subtree (itself included)."""
        size = [s.length for s in self.segments]
        for s in reversed(self.segments):  # preorder: children after parents
            if s.parent is not None:
                size[s.parent] += size[s.id]
        return size

    @property
    def num_completions(self) -> int:
        return len(self.completion_ids)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        """W: the longest output row, in columns."""
        return max(self.segments[r.end].end - r.col0 for r in self.rows)

    def completion_lengths(self) -> list[int]:
        return [self.segments[s].length for s in self.completion_ids]

    def plain_tokens(self) -> int:
        """Tokens a plain run computes: every output row with its whole prefix, ``sum_i len(row_i)``."""
        return sum(self.segments[r.end].end for r in self.rows)

    def longest_row(self) -> int:
        """The longest plain row, prefix included: ``max_i len(row_i)``."""
        return max((self.segments[r.end].end for r in self.rows), default=0)

    @classmethod
    def from_trie(cls, rows: list[torch.Tensor], trained: list[torch.Tensor], chunk: int | None = None) -> SegmentTree:
        """Every common prefix of ``rows`` as one segment (a compressed token trie); rows keep their order.

        ``trained[i]``: (len(rows[i]),) bool; a token is computed where any row through it trains it (t >= 1).
        """
        nodes = _compressed_trie(rows)
        end_node = {r: n for n, node in enumerate(nodes) for r in node["ends"]}
        tree = cls(prompt_chunk=chunk)
        computed: dict[int, torch.Tensor] = {}
        for i in range(len(rows)):
            n = end_node[i]
            while n is not None:
                s, e = nodes[n]["start"], nodes[n]["end"]
                c = computed.setdefault(n, torch.zeros(e - s, dtype=torch.bool))
                c |= trained[i][s:e]
                n = nodes[n]["parent"]
        last = {}  # trie node -> id of its last segment
        roots = [n for n, node in enumerate(nodes) if node["parent"] is None]
        for top, root in enumerate(roots):
            todo: list[tuple[int, int | None]] = [(root, None)]
            while todo:  # preorder, children in trie order
                n, parent = todo.pop()
                node = nodes[n]
                toks = rows[node["row"]][node["start"] : node["end"]]
                last[n] = tree.add(parent, toks, computed=computed.get(n), group=top, chunk=chunk)[-1]
                todo += [(ch, last[n]) for ch in reversed(node["children"])]
        for i in range(len(rows)):
            tree.rows.append(OutRow(last[end_node[i]], 0, trained[i]))
        return tree


def _compressed_trie(rows: list[torch.Tensor]) -> list[dict]:
    """Nodes {row, start, end, parent, children, ends}: a node holds rows[row][start:end]; ``ends``: rows ending there.

    Rows are sorted (indices only: nothing the caller gave is reordered) and consecutive longest common
    prefixes decide where segments split.
    """
    keys = [tuple(r.tolist()) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: keys[i])
    nodes: list[dict] = []
    stack: list[int] = []  # the previous row's path

    def new(row, start, end, parent):
        nodes.append(dict(row=row, start=start, end=end, parent=parent, children=[], ends=[]))
        if parent is not None:
            nodes[parent]["children"].append(len(nodes) - 1)
        return len(nodes) - 1

    prev = None
    for i in order:
        key = keys[i]
        lcp = 0
        if prev is not None:
            a = keys[prev]
            m = min(len(a), len(key))
            while lcp < m and a[lcp] == key[lcp]:
                lcp += 1
        while stack and nodes[stack[-1]]["start"] >= lcp:
            stack.pop()
        if stack and nodes[stack[-1]]["end"] > lcp:  # split the node at lcp
            top = nodes[stack[-1]]
            low = dict(
                row=top["row"], start=lcp, end=top["end"], parent=stack[-1], children=top["children"], ends=top["ends"]
            )
            nodes.append(low)
            li = len(nodes) - 1
            for ch in low["children"]:
                nodes[ch]["parent"] = li
            top["end"], top["children"], top["ends"] = lcp, [li], []
        if len(key) > lcp:
            stack.append(new(i, lcp, len(key), stack[-1] if stack else None))
        nodes[stack[-1]]["ends"].append(i)
        prev = i
    return nodes
