"""Index tensors for token mixing outside attention on a packed row: causal convolutions and recurrent scans.

A segment's scan starts from the final state of its parent segment, and a causal convolution of kernel k reads, before
a segment's first token, the last K = k - 1 inputs of its parent's path (zeros before position 0). Both follow the
row's segment tree, never the row's order, so siblings never see each other's tokens. The packed row (``packing``) is
laid out level by level, which makes each level one contiguous run of segments, scanned together.

- ``conv_index``: the convolution's input as one row with every segment preceded by its K path inputs, gathered from
  ``source = cat([zero (1,), row inputs (L,), K inputs of each cached segment...])``; the convolution over it (zero
  padding on the left, as transformers' own ``causal_conv1d_fn`` pads) gives each token exactly the plain row's window;
  ``out`` picks the row's tokens back. ``record``: the K path inputs ending at each recorded segment's end (its
  cached conv tail).
- ``level_index``: per level, a (B, T) index of its B segments right-padded to the longest (T), the pad index ``L``
  pointing at a zero row, and the flat positions of the real tokens, in row order.

Notation: L = row length, K = kernel - 1, S = segments of the row, E = L + K * S (the extended row), B = segments of
one level, T = the longest of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sharedprefix.layout.packing import RowLayout


@dataclass(frozen=True)
class ConvIndex:
    """``cached``: segment ids whose K-input tails follow the row in the source, in order; ``ext``: (E,) int64 into the
    source; ``out``: (L,) int64 into the extended row; ``record``: segment id -> (K,) int64 into the source."""

    cached: list[int]
    ext: torch.Tensor
    out: torch.Tensor
    record: dict[int, torch.Tensor]


@dataclass(frozen=True)
class Level:
    """``segments``: ids of one depth, in row order; ``gather``: (B, T) int64 into the row (L = a zero pad);
    ``valid``: (n,) int64 into the flattened (B * T) positions, the level's tokens in row order."""

    segments: list[int]
    gather: torch.Tensor
    valid: torch.Tensor


def conv_index(layout: RowLayout, K: int) -> ConvIndex:
    """Where every input of a causal convolution with K = kernel - 1 past inputs comes from (see the module)."""
    segs, L, inrow = layout.tree.segments, layout.length, layout.row_start
    cached: list[int] = []
    at: dict[int, int] = {}

    def locate(path: list[int], p: int) -> int:
        """Source index of the input at position ``p`` of the path ``path`` (root first)."""
        if p < 0:
            return 0
        for a in reversed(path):  # cached ancestors are a prefix of the path: everything below them is in the row
            if a not in inrow:
                end = segs[a].end
                if not end - K <= p < end:
                    raise RuntimeError(
                        f"position {p} of segment {path[-1]}'s path is outside the cached tail of {a}; a bug."
                    )
                if a not in at:
                    at[a] = len(cached)
                    cached.append(a)
                return 1 + L + K * at[a] + p - (end - K)
            if segs[a].start <= p:
                return 1 + inrow[a] + p - segs[a].start
        raise RuntimeError(f"position {p} is on no segment of the path {path}; a bug.")

    ext: list = []
    out: list = []
    e = 0
    for s in layout.segments:  # row order
        seg, path = segs[s], layout.tree.ancestors(s)
        ext += [locate(path, seg.start - K + t) for t in range(K)]
        ext += range(1 + inrow[s], 1 + inrow[s] + seg.length)
        out += range(e + K, e + K + seg.length)
        e += K + seg.length
    record = {  # (int64 also when K = 0: a kernel of 1 has an empty tail)
        r: torch.tensor([locate(layout.tree.path(r), segs[r].end - K + t) for t in range(K)], dtype=torch.int64)
        for r in layout.record
    }
    return ConvIndex(cached, torch.tensor(ext, dtype=torch.int64), torch.tensor(out, dtype=torch.int64), record)


def level_index(layout: RowLayout) -> list[Level]:
    """The row's levels, shallowest first (see the module)."""
    segs, L = layout.tree.segments, layout.length
    by_depth: dict[int, list[int]] = {}
    for s in layout.segments:
        by_depth.setdefault(layout.depth[s], []).append(s)
    out = []
    for d in sorted(by_depth):
        ids = by_depth[d]
        T = max(segs[s].length for s in ids)
        gather = torch.full((len(ids), T), L, dtype=torch.int64)
        valid: list = []
        for b, s in enumerate(ids):
            n, r = segs[s].length, layout.row_start[s]
            gather[b, :n] = torch.arange(r, r + n)
            valid += range(b * T, b * T + n)
        out.append(Level(ids, gather, torch.tensor(valid, dtype=torch.int64)))
    return out
