"""Pack segments into one row and describe the attention each token is allowed.

A pass computes one packed row (batch size 1, no padding) holding some segments of a
``SegmentTree``. Ancestors of a row segment are either earlier in the same row or were
computed by an earlier pass and come from the prefix cache. The row is cut into attention
*blocks*: a run of consecutive sibling segments (same parent). A block's queries are its
own tokens; its keys are its ancestors' tokens (shared, never copied per sibling) followed
by its own tokens, with a block-diagonal causal mask among the siblings.

Notation: L = row length, Lq = block queries, Lk = block keys, M = predicted completion
tokens in the row, C = cached hidden states the row reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sharedprefix.layout.tree import SegmentTree


@dataclass(frozen=True)
class KeyPart:
    """A contiguous run of keys: ``row[start:end]`` of this pass, or the cached segment ``seg``."""

    seg: int | None = None
    start: int = 0
    end: int = 0

    @property
    def cached(self) -> bool:
        return self.seg is not None


@dataclass
class Block:
    """Queries ``row[q_start:q_end]`` attending to the concatenation of ``keys``."""

    q_start: int
    q_end: int
    keys: list[KeyPart]
    q_seg: torch.Tensor  # (Lq,) int64 segment id of each query
    q_pos: torch.Tensor  # (Lq,) int64 position id of each query
    k_seg: torch.Tensor  # (Lk,) int64 segment id of each key
    k_pos: torch.Tensor  # (Lk,) int64 position id of each key
    ancestors: set[int]  # segments every query of the block may fully attend to
    plain_causal: bool  # one root segment: plain causal attention, no mask needed
    ancestor_keys: list[KeyPart] = field(default_factory=list)  # the ancestors' key runs alone
    siblings: list[tuple[int, int]] = field(default_factory=list)  # row range of each sibling segment
    _masks: dict = field(default_factory=dict)

    def window_bites(self, window: int | None) -> bool:
        return window is not None and window < int(self.q_pos.max() - self.k_pos.min()) + 1

    def mask(self, window: int | None, device) -> torch.Tensor | None:
        """(Lq, Lk) bool mask, True where attention is allowed; None for plain causal attention.

        ``window`` is a sliding window in the transformers convention: a query at position p
        sees keys at positions > p - window.
        """
        if not self.window_bites(window):
            window = None  # the window never bites inside this block: identical to full attention
        if self.plain_causal and window is None:
            return None
        key = (window, str(device))
        if key not in self._masks:
            same = self.q_seg[:, None] == self.k_seg[None, :]
            allowed = same & (self.k_pos[None, :] <= self.q_pos[:, None])
            anc = torch.tensor([int(s) in self.ancestors for s in self.k_seg.tolist()], dtype=torch.bool)
            allowed |= anc[None, :]
            if window is not None:
                allowed &= (self.q_pos[:, None] - self.k_pos[None, :]) < window
            self._masks[key] = allowed.to(device)
        return self._masks[key]

    def additive_mask(self, window: int | None, device, dtype) -> torch.Tensor | None:
        """The same mask as (Lq, Lk) floats, 0 where allowed and -inf elsewhere, built once per pass and dtype.

        Attention kernels convert a bool mask to this form on every call (and keep the copy for
        backward); handing them one shared tensor saves that copy in every layer.
        """
        allowed = self.mask(window, device)
        if allowed is None:
            return None
        key = (window, str(device), dtype)
        if key not in self._masks:
            self._masks[key] = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        return self._masks[key]


@dataclass
class RowLayout:
    """Everything one pass needs to run a packed row and read its completions' log-probs.

    Attributes:
        segments: segment ids in row order.
        input_ids / position_ids: (1, L) int64.
        row_start / row_end: segment id -> offset of its first token / one past its last token.
        blocks: attention blocks covering the row in order.
        cached_reads: ancestor segment ids read from the prefix cache.
        record: segment ids whose per-layer K/V and last hidden state this pass must cache.
        completions: global completion indices n computed in this row, in row order.
        h_sources: segment ids whose cached last hidden state is appended after the row.
        pred_index: (M,) index into ``cat([hidden_row (L, d), cached h (C, d)])``.
        targets: (M,) token ids predicted; out_n / out_t: (M,) local completion and token index.
    """

    segments: list[int]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    row_start: dict[int, int]
    row_end: dict[int, int]
    blocks: list[Block]
    cached_reads: list[int]
    record: list[int]
    completions: list[int]
    h_sources: list[int]
    pred_index: torch.Tensor
    targets: torch.Tensor
    out_n: torch.Tensor
    out_t: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])


def pack_row(tree: SegmentTree, segments: list[int], cached: set[int], record: list[int] = ()) -> RowLayout:
    """Lay out ``segments`` (in that order) as one row; ancestors outside it must be in ``cached``."""
    segs = tree.segments
    row_start, pos, ids, off = {}, [], [], 0
    for s in segments:
        seg = segs[s]
        if s in row_start:
            raise ValueError(f"segment {s} appears twice in one row; each segment is computed once.")
        for a in tree.ancestors(s):
            if a not in row_start and a not in cached:
                raise ValueError(
                    f"segment {s} needs its ancestor {a}, which is neither earlier in the row nor cached; "
                    "the plan must compute ancestors first."
                )
        row_start[s] = off
        ids.append(seg.tokens)
        pos.append(torch.arange(seg.start, seg.end))
        off += seg.length
    position = torch.cat(pos)
    seg_of = torch.cat([torch.full((segs[s].length,), s, dtype=torch.int64) for s in segments])

    blocks, reads = [], []
    i = 0
    while i < len(segments):
        j = i
        parent = segs[segments[i]].parent
        while j + 1 < len(segments) and segs[segments[j + 1]].parent == parent:
            j += 1
        q0, q1 = row_start[segments[i]], row_start[segments[j]] + segs[segments[j]].length
        anc = tree.ancestors(segments[i])
        parts: list[KeyPart] = []
        for a in anc:
            if a in row_start:
                a0 = row_start[a]
                if parts and not parts[-1].cached and parts[-1].end == a0:
                    parts[-1] = KeyPart(start=parts[-1].start, end=a0 + segs[a].length)
                else:
                    parts.append(KeyPart(start=a0, end=a0 + segs[a].length))
            else:
                parts.append(KeyPart(seg=a))
                if a not in reads:
                    reads.append(a)
        anc_parts = list(parts)  # the ancestors alone, for kernels that attend to them separately
        if parts and not parts[-1].cached and parts[-1].end == q0:
            parts[-1] = KeyPart(start=parts[-1].start, end=q1)
        else:
            parts.append(KeyPart(start=q0, end=q1))
        k_seg = torch.cat(
            [
                torch.full((segs[p.seg].length,), p.seg, dtype=torch.int64) if p.cached else seg_of[p.start : p.end]
                for p in parts
            ]
        )
        k_pos = torch.cat(
            [torch.arange(segs[p.seg].start, segs[p.seg].end) if p.cached else position[p.start : p.end] for p in parts]
        )
        blocks.append(
            Block(
                q0, q1, parts, seg_of[q0:q1], position[q0:q1], k_seg, k_pos, set(anc),
                plain_causal=(i == j and not anc),
                ancestor_keys=anc_parts,
                siblings=[(row_start[x], row_start[x] + segs[x].length) for x in segments[i : j + 1]],
            )
        )
        i = j + 1

    # Completion log-probs: token 0 is predicted by the parent's last token, token t by token t-1.
    L = off
    h_sources, pred, tgt, out_n, out_t, comps = [], [], [], [], [], []
    for s in segments:
        seg = segs[s]
        if seg.completion is None:
            continue
        local = len(comps)
        comps.append(seg.completion)
        if seg.parent in row_start:
            first = row_start[seg.parent] + segs[seg.parent].length - 1
        else:
            if seg.parent not in h_sources:
                h_sources.append(seg.parent)
            first = L + h_sources.index(seg.parent)
        r = row_start[s]
        pred.append(torch.cat([torch.tensor([first]), torch.arange(r, r + seg.length - 1)]))
        tgt.append(seg.tokens)
        out_n.append(torch.full((seg.length,), local, dtype=torch.int64))
        out_t.append(torch.arange(seg.length))
    empty = torch.zeros(0, dtype=torch.int64)
    cat = lambda xs: torch.cat(xs) if xs else empty  # noqa: E731
    return RowLayout(
        segments=list(segments),
        input_ids=torch.cat(ids)[None],
        position_ids=position[None],
        row_start=row_start,
        row_end={s: row_start[s] + segs[s].length for s in segments},
        blocks=blocks,
        cached_reads=reads,
        record=list(record),
        completions=comps,
        h_sources=h_sources,
        pred_index=cat(pred),
        targets=cat(tgt),
        out_n=cat(out_n),
        out_t=cat(out_t),
    )
