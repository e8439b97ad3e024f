"""Pack segments into one row: token ids, position ids and where each completion is predicted.

A pass computes one packed row (batch size 1, no padding) holding some segments of a
``SegmentTree``. Ancestors of a row segment are either in the same row or were computed by an
earlier pass and come from the prefix cache. The row is laid out level by level (all depth-0
segments, then depth 1, ...), each level in tree order, so that the segments of one depth are
one contiguous run of queries and their ancestors at any level are one run of keys: the
attention cascade (``layout.cascade``) then describes every kernel call with ``cu_seqlens``
offsets alone, without masks and without copying keys.

Notation: L = row length, M = predicted completion tokens in the row, C = cached hidden states
the row reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sharedprefix.layout.tree import SegmentTree


@dataclass
class RowLayout:
    """Everything one pass needs to run a packed row and read its completions' log-probs.

    Attributes:
        segments: segment ids in row order.
        input_ids / position_ids: (1, L) int64.
        row_start / row_end: segment id -> offset of its first token / one past its last token.
        tree: the segment tree the row belongs to; depth: segment id -> number of ancestors.
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
    tree: SegmentTree
    depth: dict[int, int]
    cached_reads: list[int]
    record: list[int]
    completions: list[int]
    h_sources: list[int]
    pred_index: torch.Tensor
    targets: torch.Tensor
    out_n: torch.Tensor
    out_t: torch.Tensor

    _cascades: dict = field(default_factory=dict, repr=False)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    def cascade(self, window: int | None):
        """The attention calls of this row for a sliding window of ``window`` tokens (None: full), built once."""
        from sharedprefix.layout.cascade import build_cascade

        if window not in self._cascades:
            self._cascades[window] = build_cascade(self, window)
        return self._cascades[window]


def pack_row(tree: SegmentTree, segments: list[int], cached: set[int], record: list[int] = ()) -> RowLayout:
    """Lay out ``segments`` as one row, level by level; ancestors outside it must be in ``cached``."""
    segs = tree.segments
    if len(set(segments)) != len(segments):
        raise ValueError(f"a segment appears twice in one row {list(segments)}; each segment is computed once.")
    inrow = set(segments)
    depth = {}
    for s in segments:
        anc = tree.ancestors(s)
        for a in anc:
            if a not in inrow and a not in cached:
                raise ValueError(
                    f"segment {s} needs its ancestor {a}, which is neither in the row nor cached; "
                    "the plan must compute ancestors first."
                )
        depth[s] = len(anc)
    # segment ids number the tree in preorder, so (depth, id) keeps every level in tree order
    order = sorted(segments, key=lambda s: (depth[s], s))
    row_start, pos, ids, off = {}, [], [], 0
    for s in order:
        seg = segs[s]
        row_start[s] = off
        ids.append(seg.tokens)
        pos.append(torch.arange(seg.start, seg.end))
        off += seg.length
    position = torch.cat(pos)
    reads = []
    for s in order:
        for a in tree.ancestors(s):
            if a not in row_start and a not in reads:
                reads.append(a)
    segments = order

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
        tree=tree,
        depth=depth,
        cached_reads=reads,
        record=list(record),
        completions=comps,
        h_sources=h_sources,
        pred_index=cat(pred),
        targets=cat(tgt),
        out_n=cat(out_n),
        out_t=cat(out_t),
    )
