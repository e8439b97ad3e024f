"""Pack segments into one row: token ids, position ids and where each completion is predicted.

A pass computes one packed row (batch size 1, no padding) holding some segments of a
``SegmentTree``. Ancestors of a row segment are either in the same row or were computed by an
earlier pass and come from the prefix cache. The row is laid out level by level (all depth-0
segments, then depth 1, ...), each level in tree order, so that the segments of one depth are
one contiguous run of queries and their ancestors at any level are one run of keys: the
attention cascade (``layout.calls``) then describes every kernel call with ``cu_seqlens``
offsets alone, without masks and without copying keys.

Notation: L = row length, M = predicted completion tokens in the row, C = cached hidden states
the row reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from sharedprefix.layout.once import built_once
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
        record: segment ids whose per-layer K/V, last hidden state and token values this pass must cache.
        h_sources: segment ids whose cached last hidden state is appended after the row.
        pred_index: (M,) index into ``cat([hidden_row (L, d), cached h (C, d)])``: the predicting position
            of each computed token of the row's segments, in row order.
        targets: (M,) token ids predicted.
        value_slot: segment id -> (a, b), its computed tokens' range in the M values.
        rows: the output rows this pass reports (``SegmentTree.rows`` indices).
        v_sources: segment ids whose cached token values are appended after the row's M values.
        out_index / out_mask: (n, W) int64 index into ``cat([values (M,), cached values...])`` and bool,
            True where row ``rows[i]`` reports column c.
        blocks: [start, end) row ranges whose tokens also attend to each other bidirectionally (the image
            tokens of a Gemma 3 prompt), set by the caller before the first ``cascade``; sorted, disjoint, each
            inside one segment.
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
    h_sources: list[int]
    pred_index: torch.Tensor
    targets: torch.Tensor
    value_slot: dict[int, tuple[int, int]]
    rows: list[int]
    v_sources: list[int]
    out_index: torch.Tensor
    out_mask: torch.Tensor
    blocks: list[tuple[int, int]] = field(default_factory=list)

    _cascades: dict = field(default_factory=dict, repr=False)
    derived: dict = field(default_factory=dict, repr=False)  # index tensors built once per row (``layout.recurrence``)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    def cascade(self, window: int | None, chunk: int | None = None):
        """The attention calls of this row for a sliding window of ``window`` tokens or attention chunks of
        ``chunk`` positions (both None: full), built once."""
        from sharedprefix.layout.calls import build_cascade

        return built_once(self._cascades, (window, chunk), lambda: build_cascade(self, window, chunk=chunk))


def pack_row(
    tree: SegmentTree, segments: list[int], cached: set[int], record: Sequence[int] = (), rows: Sequence[int] = ()
) -> RowLayout:
    """Lay out ``segments`` as one row, level by level; ancestors outside it must be in ``cached``.

    ``rows``: the output rows this pass reports; their segments must be in the row or cached.
    """
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
                    f"segment {s} needs its ancestor {a}, which is neither in the row nor cached; the plan must "
                    "compute ancestors first."
                )
        depth[s] = len(anc)
    # segment ids number the tree in preorder, so (depth, id) keeps every level in tree order
    order = sorted(segments, key=lambda s: (depth[s], s))
    row_start, off = {}, 0
    for s in order:
        row_start[s] = off
        off += segs[s].length
    reads = []
    for s in order:
        for a in tree.ancestors(s):
            if a not in row_start and a not in reads:
                reads.append(a)
    segments = order
    # (L,); a step's row of cached values only (``planner.plan_step``) has no token: L = 0
    ids = torch.cat([segs[s].tokens for s in order]) if order else torch.zeros(0, dtype=torch.int64)
    position = np.concatenate(
        [np.arange(segs[s].start, segs[s].end, dtype=np.int64) for s in order] or [np.zeros(0, np.int64)]
    )

    # Token values: token j of a segment is predicted by token j - 1, token 0 by the parent's last token.
    L = off
    h_sources: list[int] = []  # ids of cached parents whose last hidden state predicts a token 0
    pred, tgt, slot, m = [], [], {}, 0
    for s in segments:
        seg = segs[s]
        if seg.computed is None:
            continue
        j = seg.cols  # ascending: only j[0] can be 0
        r = row_start[s]
        at = r + j - 1
        if j.size and j[0] == 0:
            if seg.parent in row_start:
                at[0] = row_end_of(row_start, segs, seg.parent) - 1
            else:
                parent = cast(int, seg.parent)  # a token 0 with a prediction has a parent
                if parent not in h_sources:
                    h_sources.append(parent)
                at[0] = L + h_sources.index(parent)
        pred.append(at)
        tgt.append(r + j)
        slot[s] = (m, m + len(j))
        m += len(j)
    out_index, out_mask, v_sources = _row_index(tree, list(rows), slot, m, cached)
    if pred:  # each index is built on the host and becomes a tensor once
        pred_index = torch.from_numpy(np.concatenate(pred))
        targets = ids[torch.from_numpy(np.concatenate(tgt))]
    else:
        pred_index = targets = torch.zeros(0, dtype=torch.int64)
    return RowLayout(
        segments=list(segments),
        input_ids=ids[None],
        position_ids=torch.from_numpy(position[None]),
        row_start=row_start,
        row_end={s: row_end_of(row_start, segs, s) for s in segments},
        tree=tree,
        depth=depth,
        cached_reads=reads,
        record=list(record),
        h_sources=h_sources,
        pred_index=pred_index,
        targets=targets,
        value_slot=slot,
        rows=list(rows),
        v_sources=v_sources,
        out_index=out_index,
        out_mask=out_mask,
    )


def row_end_of(row_start, segs, s) -> int:
    return row_start[s] + segs[s].length


def _row_index(tree: SegmentTree, rows: list[int], slot: dict, m: int, cached: set[int]):
    """(n, W) index into ``cat([values (m,), cached values of v_sources...])``, (n, W) mask, and v_sources.

    Built with numpy on the host: a computed token's value is ``base + rank``, its segment's first value in the
    concatenation plus the number of computed tokens before it in the segment (its place in ``Segment.cols``)."""
    segs, W = tree.segments, tree.width
    index = np.zeros((len(rows), W), dtype=np.int64)
    mask = np.zeros((len(rows), W), dtype=np.bool_)
    v_sources, v_at, off = [], {}, m
    for i, r in enumerate(rows):
        out = tree.rows[r]
        trained = None if out.trained is None else out.trained.numpy()
        for s in tree.path(out.end):
            seg = segs[s]
            if seg.computed is None or seg.end <= out.col0:
                continue
            if s in slot:
                base = slot[s][0]
            elif s in cached:
                if s not in v_at:
                    v_sources.append(s)
                    v_at[s] = off
                    off += seg.n_computed
                base = v_at[s]
            else:
                raise ValueError(
                    f"output row {r} needs segment {s}, which is neither in the pass nor cached; "
                    "the plan must report a row only once all of its segments ran."
                )
            pos = seg.start + seg.cols  # positions of the computed tokens
            keep = pos >= out.col0
            if trained is not None:
                keep &= trained[pos]
            cols = pos[keep] - out.col0
            index[i, cols] = base + np.flatnonzero(keep)
            mask[i, cols] = True
    return torch.from_numpy(index), torch.from_numpy(mask), v_sources
