"""The attention of a packed row as a few variable-length kernel calls: index tensors, no masks.

A token attends to every token of its ancestor segments and causally to its own segment. For a row laid out level by
level (``layout.packing``) that is, per layer:

- one causal call over every segment of the row against its own keys (entries = segments);
- for each depth d >= 1 present and each ancestor level a < d, one dense call of the depth-d queries (one contiguous
  run) against the level-a keys (one contiguous run, or the cached segments'), one entry per level-a segment holding
  the queries of all its depth-d descendants: a prompt's keys are read once by all of its completions, of every group
  of the row;

merged by log-sum-exp. The number of calls is 1 + D(D+1)/2 for a tree of depth D, independent of the number of groups
and completions.

A sliding window of w tokens (a query at position p sees keys at positions > p - w) that bites somewhere in the row
turns this into one causal call with ``window = w - 1`` in which each segment's keys are the at most w - 1 ancestor
keys its window can reach followed by its own: gathered with one index (``k_index``), so the copy is bounded by the
window per segment, never by the prompt, and no query-key pair outside the window is computed. Positions along the
ancestor chain are contiguous, which is what makes the bottom-right alignment of the kernels exact.

Chunked attention of C positions (Llama 4: a query at position p sees the keys at positions floor(p / C) * C .. p) is
a left limit aligned to positions, not to the query: one causal call with one entry per (segment, chunk) piece; a
piece's keys are its ancestors' keys from the chunk's first position on (only a segment's first piece reaches them, at
most C - 1 keys), then its own from the chunk's start. The chunk boundaries are positions, so a completion continues
its prompt's chunk exactly as the plain row ``[prompt, completion]`` does.

Notation: L = row length, B = entries of a call, K = keys of a call.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from sharedprefix.layout.dense import pieces as dense_pieces
from sharedprefix.layout.once import built_once


@dataclass(frozen=True)
class KeySource:
    """A run of keys: ``row[start:end]`` of this pass, or the cached segment ``seg`` (all of it)."""

    seg: int | None = None
    start: int = 0
    end: int = 0

    @property
    def cached(self) -> bool:
        return self.seg is not None


@dataclass
class Call:
    """One call of the attention primitive for queries ``row[q_start:q_end]``.

    Attributes:
        keys: the key runs, concatenated in order (one run: a view, no copy).
        k_index: (K,) int64 rows of that concatenation to gather, or None to take it whole.
        cu_seqlens_q / cu_seqlens_k: (B + 1,) int32 entry offsets into the queries / keys.
        causal, window: as in ``attention.kernels`` (window in the kernels' convention, w - 1).
    """

    q_start: int
    q_end: int
    keys: list[KeySource]
    k_index: torch.Tensor | None
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    window: int | None = None
    _on: dict = field(default_factory=dict, repr=False)

    def on(self, device) -> tuple:
        """(cu_seqlens_q, cu_seqlens_k, k_index) on ``device``, moved once per pass."""

        def build():
            ki = None if self.k_index is None else self.k_index.to(device)
            return (self.cu_seqlens_q.to(device), self.cu_seqlens_k.to(device), ki)

        return built_once(self._on, str(device), build)

    def pieces(self, device) -> list | None:
        """The call's dense split (``layout.dense.pieces``), None where it stays one varlen call; each piece with
        its index tensors on ``device``: (piece, (cu_q, cu_k) of a varlen piece, ``Piece.padding()`` of a padded
        piece or None)."""

        def build():
            ps = dense_pieces(self)
            on = lambda t: None if t is None else t.to(device)  # noqa: E731
            pad = lambda p: None if p.lens is None else tuple(on(t) for t in p.padding())  # noqa: E731
            return None if ps is None else [(p, (on(p.cu_q), on(p.cu_k)), pad(p)) for p in ps]

        return built_once(self._on, ("pieces", str(device)), build)


@dataclass
class Cascade:
    """The calls of one row for one window; ``copied_keys`` is how many key rows are gathered (0 without a window)."""

    calls: list[Call]
    copied_keys: int = 0


def _cu(lengths: list[int]) -> torch.Tensor:
    """(len(lengths) + 1,) int32 offsets 0, l0, l0 + l1, ...: summed on the host, one tensor (one op)."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def build_cascade(layout, window: int | None, repeat_prefix: bool = False, chunk: int | None = None) -> Cascade:
    """The kernel calls of ``layout`` (a ``RowLayout``) for a sliding window of ``window`` tokens or None, or for
    attention chunks of ``chunk`` positions (not both).

    ``repeat_prefix=True`` gives every segment its ancestors' keys by gathering them (the whole prefix, copied per
    segment, as Prefix Grouper does): exact too, and only used as the benchmark's point of comparison.

    ``layout.blocks`` (bidirectional runs, e.g. a Gemma 3 prompt's image tokens) add one call, ``_upper``."""
    casc = _causal_cascade(layout, window, repeat_prefix, chunk)
    blocks = [(a, b) for a, b in layout.blocks if b - a > 1]  # a block of one token adds no key
    if blocks:
        if chunk is not None and max(layout.tree.segments[s].end for s in layout.segments) > chunk:
            raise ValueError(
                f"bidirectional blocks {layout.blocks} in a row with attention chunks of {chunk} positions: no model "
                "combines the two, and sharedprefix does not define their combination."
            )
        casc = Cascade(casc.calls + [_upper(blocks)], casc.copied_keys)
    return casc


def _upper(blocks: list[tuple[int, int]]) -> Call:
    """The keys a bidirectional block adds to the causal cascade: query i of block [a, b) also sees the keys
    i + 1 .. b - 1 (a Gemma 3 image token sees the rest of its image; under a sliding window too, whose mask is
    AND(window, OR(causal, block)): the later keys of the block are never outside the window).

    One non-causal call with ``window = 0`` over views of the row. The entry of block [a, b) has the queries
    a .. b - 2 and the keys a + 1 .. b - 1, as many of each: bottom-right aligned, query a + t sits on key a + 1 + t
    and the window of 0 hides the keys before it, leaving a + t + 1 .. b - 1. Between two blocks, one entry holds the
    gap's queries and no keys (lse = -inf, which the merge ignores), and one the gap's keys and no queries, so that
    queries and keys stay two contiguous runs of the row."""
    cu_q, cu_k = [0], [0]
    q0, k0 = blocks[0][0], blocks[0][0] + 1
    for i, (a, b) in enumerate(blocks):
        if i:
            prev_b = blocks[i - 1][1]
            cu_q += [cu_q[-1] + a - (prev_b - 1), cu_q[-1] + a - (prev_b - 1)]  # gap queries b'-1 .. a-1, no keys
            cu_k += [cu_k[-1], cu_k[-1] + (a + 1) - prev_b]  # then gap keys b' .. a, no queries
        cu_q.append(cu_q[-1] + b - 1 - a)
        cu_k.append(cu_k[-1] + b - 1 - a)
    q1, k1 = q0 + cu_q[-1], k0 + cu_k[-1]
    lq = [cu_q[j + 1] - cu_q[j] for j in range(len(cu_q) - 1)]
    lk = [cu_k[j + 1] - cu_k[j] for j in range(len(cu_k) - 1)]
    return Call(q0, q1, [KeySource(start=k0, end=k1)], None, _cu(lq), _cu(lk), max(lq), max(lk), causal=False, window=0)


def _causal_cascade(layout, window: int | None, repeat_prefix: bool, chunk: int | None) -> Cascade:
    if window is not None and window < 1:
        raise ValueError(f"sliding window {window}: expected a positive number of tokens or None.")
    if chunk is not None and (chunk < 1 or window is not None):
        raise ValueError(
            f"attention chunk {chunk} with window {window}: expected a positive chunk size and no window (no model "
            "combines the two)."
        )
    segs = layout.tree.segments
    order = layout.segments
    if chunk is not None and max(segs[s].end for s in order) > chunk:  # else every position is in chunk 0
        return _chunked(layout, chunk)
    if repeat_prefix:
        return _windowed(layout, window or max(segs[s].end for s in order) + 1)
    if window is not None and max(segs[s].end for s in order) <= window:
        window = None  # every key of every query lies inside the window: identical to full attention
    if window is not None:
        return _windowed(layout, window)
    lens = [segs[s].length for s in order]
    row = [KeySource(start=0, end=layout.length)]
    cu = _cu(lens)  # one tensor for queries and keys: every segment on itself
    calls = [Call(0, layout.length, row, None, cu, cu, max(lens), max(lens), causal=True)]
    for d in sorted({layout.depth[s] for s in order} - {0}):
        xs = [s for s in order if layout.depth[s] == d]
        q0, q1 = layout.row_start[xs[0]], layout.row_end[xs[-1]]
        for a in range(d):
            calls.append(_dense(layout, xs, a, q0, q1))
    return Cascade(calls)


def _dense(layout, xs: list[int], a: int, q0: int, q1: int) -> Call:
    """Depth-d queries ``xs`` (row order) against their level-a ancestors' keys, one entry per ancestor."""
    segs, tree = layout.tree.segments, layout.tree
    ys, nq = list[int](), list[int]()  # entries: level-a segment, number of queries
    for x in xs:
        y = tree.ancestors(x)[a]
        if ys and ys[-1] == y:
            nq[-1] += segs[x].length
            continue
        if ys and ys[-1] in layout.row_start and y in layout.row_start:
            # in-row level-a segments are one contiguous run: fill the gap with entries that have no queries
            r = layout.row_end[ys[-1]]
            while r < layout.row_start[y]:
                filler = next(s for s in layout.segments if layout.row_start[s] == r)
                ys.append(filler)
                nq.append(0)
                r = layout.row_end[filler]
        ys.append(y)
        nq.append(segs[x].length)
    keys: list[KeySource] = []
    for y in ys:
        if y in layout.row_start:
            r0, r1 = layout.row_start[y], layout.row_end[y]
            if keys and not keys[-1].cached and keys[-1].end == r0:
                keys[-1] = KeySource(start=keys[-1].start, end=r1)
            else:
                keys.append(KeySource(start=r0, end=r1))
        else:
            keys.append(KeySource(seg=y))
    nk = [segs[y].length for y in ys]
    return Call(q0, q1, keys, None, _cu(nq), _cu(nk), max(nq), max(nk), causal=False)


def _gathered_keys(layout) -> tuple[list[KeySource], dict[int, int]]:
    """The key sources [row, cached reads...] and where each cached segment starts in their concatenation."""
    base, off = {}, layout.length
    for c in layout.cached_reads:
        base[c] = off
        off += layout.tree.segments[c].length
    return [KeySource(start=0, end=layout.length)] + [KeySource(seg=c) for c in layout.cached_reads], base


def _ancestor_keys(layout, base: dict[int, int], x: int, lo: int) -> list[torch.Tensor]:
    """Indices (into the concatenated key sources) of segment ``x``'s ancestor keys at positions >= ``lo``."""
    segs, parts = layout.tree.segments, []
    for y in layout.tree.ancestors(x):
        ys = segs[y]
        p0, p1 = max(lo, ys.start), ys.end
        if p0 >= p1:
            continue
        at = layout.row_start[y] if y in layout.row_start else base[y]
        parts.append(torch.arange(at + p0 - ys.start, at + p1 - ys.start))
    return parts


def _windowed(layout, window: int) -> Cascade:
    """One causal windowed call; each segment's keys: its ancestors' last ``window - 1`` positions, then its own."""
    segs = layout.tree.segments
    keys, base = _gathered_keys(layout)
    index, nk, nq = [], [], []
    for x in layout.segments:
        seg = segs[x]
        parts = _ancestor_keys(layout, base, x, max(0, seg.start - (window - 1)))
        r = layout.row_start[x]
        parts.append(torch.arange(r, r + seg.length))
        idx = torch.cat(parts)
        index.append(idx)
        nk.append(idx.numel())
        nq.append(seg.length)
    k_index = torch.cat(index)
    full = window > max(segs[s].end for s in layout.segments)
    call = Call(
        0,
        layout.length,
        keys,
        k_index,
        _cu(nq),
        _cu(nk),
        max(nq),
        max(nk),
        causal=True,
        window=None if full else window - 1,
    )
    return Cascade([call], copied_keys=int(k_index.numel()))


def _chunked(layout, chunk: int) -> Cascade:
    """One causal call, one entry per (segment, chunk) piece; a piece whose positions are p0..p1-1 in chunk
    [c0, c0 + chunk) sees its ancestors' keys at positions c0..start-1 (if c0 < start) and its own from
    max(c0, start) on. Keys end at the piece's last query, so the kernels' bottom-right causal alignment holds."""
    segs = layout.tree.segments
    keys, base = _gathered_keys(layout)
    index, nk, nq = [], [], []
    for x in layout.segments:
        seg, r = segs[x], layout.row_start[x]
        for c0 in range(seg.start // chunk * chunk, seg.end, chunk):
            p0, p1 = max(c0, seg.start), min(c0 + chunk, seg.end)
            parts = _ancestor_keys(layout, base, x, c0) if c0 < seg.start else []
            parts.append(torch.arange(r + p0 - seg.start, r + p1 - seg.start))
            idx = torch.cat(parts)
            index.append(idx)
            nk.append(idx.numel())
            nq.append(p1 - p0)
    k_index = torch.cat(index)
    call = Call(0, layout.length, keys, k_index, _cu(nq), _cu(nk), max(nq), max(nk), causal=True)
    return Cascade([call], copied_keys=int(k_index.numel()))
