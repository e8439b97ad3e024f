"""The tree of segments that both mechanisms of sharedprefix work on.

A segment is a run of tokens with an optional parent segment. A token attends to every
token of its ancestor segments and to the earlier tokens of its own segment; its position
id continues from its parent's end. A group is a chain of prompt segments (one, or several
when the prompt is longer than a pass may hold) with its G completions as leaves below the
last one. Deeper trees (shared multi-turn prefixes) use the same structure.

Notation: S = segments, N = completions over all groups (in group order), P = prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sharedprefix.layout.groups import Group


@dataclass(frozen=True)
class Segment:
    """One run of tokens in the tree.

    Attributes:
        id: index of this segment in ``SegmentTree.segments``.
        tokens: (length,) int64 token ids.
        parent: id of the parent segment, or None for a root.
        start: position id of the first token (the parent's ``end``, or 0 for a root).
        group: index of the group this segment belongs to.
        completion: global completion index in 0..N-1 for a leaf completion, None for prompt segments.
    """

    id: int
    tokens: torch.Tensor
    parent: int | None
    start: int
    group: int
    completion: int | None = None

    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    @property
    def end(self) -> int:
        return self.start + self.length


class SegmentTree:
    """Segments of a list of groups; prompts are split into chains of at most ``prompt_chunk`` tokens."""

    def __init__(self, groups: list[Group], prompt_chunk: int | None = None):
        if prompt_chunk is not None and prompt_chunk < 1:
            raise ValueError(f"prompt_chunk={prompt_chunk}; expected a positive number of tokens or None.")
        self.groups = groups
        self.segments: list[Segment] = []
        self.prompt_chain: list[list[int]] = []  # per group: ids of its prompt segments, root first
        self.completion_ids: list[int] = []  # per completion n: its segment id
        self.group_completions: list[list[int]] = []  # per group: completion indices n
        for gi, g in enumerate(groups):
            chain, parent, pos = [], None, 0
            step = prompt_chunk or g.prompt.numel()
            for s in range(0, g.prompt.numel(), step):
                parent = self._add(g.prompt[s : s + step], parent, pos, gi)
                pos = self.segments[parent].end
                chain.append(parent)
            self.prompt_chain.append(chain)
            ns = []
            for c in g.completions:
                n = len(self.completion_ids)
                self.completion_ids.append(self._add(c, parent, pos, gi, completion=n))
                ns.append(n)
            self.group_completions.append(ns)

    def _add(self, tokens, parent, start, group, completion=None) -> int:
        sid = len(self.segments)
        self.segments.append(Segment(sid, tokens, parent, start, group, completion))
        return sid

    def ancestors(self, sid: int) -> list[int]:
        """Ids of the ancestors of segment ``sid``, root first (excluding ``sid`` itself)."""
        out, p = [], self.segments[sid].parent
        while p is not None:
            out.append(p)
            p = self.segments[p].parent
        return out[::-1]

    @property
    def num_completions(self) -> int:
        return len(self.completion_ids)

    def completion_lengths(self) -> list[int]:
        return [self.segments[s].length for s in self.completion_ids]

    def plain_tokens(self) -> int:
        """Tokens a plain run computes: every completion with its full prompt, ``sum_i (P + T_i)``."""
        return sum(self.segments[s].end for s in self.completion_ids)
