"""Which entries of a cascade call run as one dense batched kernel call instead of the varlen primitive.

The fastest attention kernels (cuDNN on Hopper) are dense: B rows of Lq queries against Lk keys each. A call's
entries (``layout.calls.Call``: entry b is queries cu_q[b]:cu_q[b+1] against keys cu_k[b]:cu_k[b+1]) that share
one shape are such a batch. ``pieces`` splits a call into at most two pieces, in entry order:

- the leading run of entries shaped like the first: with one group per pass, the prompt's causal entry, or the
  completions' one rectangular entry against their prompt (G*T queries, P keys);
- the rest: dense when its entries share one shape; for a causal call of square entries (the completions' own
  causal part), a right-padded batch of B rows of the longest length W, when the padding at most doubles the
  tokens; otherwise varlen (its entries' own cu_seqlens, rebased).

Right padding is exact under causal attention: a real query never sees a later key, so it never sees a pad key,
and the pad queries' outputs are dropped (``attention.cascade`` gives them zero queries and zero gradients, so they
add nothing to dK, dV). Causal dense entries must be square: the dense kernels align the causal diagonal top-left,
the contract bottom-right, which agree only where Lq == Lk. A call with a window stays varlen.

Notation: B = entries of a piece, Lq / Lk = queries / keys per entry, W = padded length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_LIMIT = 2.0  # a padded piece may hold at most this many times its real tokens


@dataclass(frozen=True)
class Piece:
    """Entries ``e0:e1`` of a call as one kernel call: rows ``q0:q1`` of the call's queries, ``k0:k1`` of its keys.

    Attributes:
        shape: (Lq, Lk) of every entry of a dense piece (a padded piece: (W, W)); None for a varlen piece.
        lens: the B real lengths of a right-padded piece, else None.
        cu_q, cu_k, max_q, max_k: a varlen piece's own (B + 1,) int32 offsets (from 0) and longest entries.
    """

    e0: int
    e1: int
    q0: int
    q1: int
    k0: int
    k1: int
    shape: tuple[int, int] | None
    lens: tuple[int, ...] | None = None
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0

    @property
    def batch(self) -> int:
        return self.e1 - self.e0

    def pad_index(self) -> torch.Tensor:
        """(sum lens,) int64: where each real row of a padded piece sits among its B * W padded rows."""
        assert self.shape is not None and self.lens is not None, "pad_index of a piece that is not padded"
        w = self.shape[0]
        return torch.tensor([b * w + i for b, n in enumerate(self.lens) for i in range(n)], dtype=torch.int64)

    def padding(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A padded piece's index tensors, int64: ``gather`` (B * W,), for each padded row the call's row it copies
        (its own, or for a pad row the last real row of its entry: a pad query then sees only keys that row sees, so
        its probabilities stay at most 1, and a pad key or value is never seen by a real query, causal); ``entry`` and
        ``at`` (sum lens,), the entry and the place in it of each real row (where it sits in the (B, H, W) output)."""
        assert self.shape is not None and self.lens is not None, "padding of a piece that is not padded"
        assert self.q0 == self.k0, "a padded piece is causal with square entries: its queries and keys align"
        w, gather, entry, at, r = self.shape[0], [], [], [], self.q0
        for b, n in enumerate(self.lens):
            gather += [r + min(i, n - 1) for i in range(w)]
            entry += [b] * n
            at += list(range(n))
            r += n
        g, e, a = (torch.tensor(x, dtype=torch.int64) for x in (gather, entry, at))
        return g, e, a


def pieces(call) -> list[Piece] | None:
    """The dense split of ``call``, or None where it stays one varlen call (no entry run would go dense)."""
    if call.window is not None:
        return None
    cq, ck = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
    shapes = [(cq[b + 1] - cq[b], ck[b + 1] - ck[b]) for b in range(len(cq) - 1)]
    if not shapes or any(lq == 0 or lk == 0 for lq, lk in shapes):
        return None  # an entry without queries or keys: the varlen kernel handles it (lse = -inf)
    if call.causal and any(lq != lk for lq, lk in shapes):
        return None
    n = 1
    while n < len(shapes) and shapes[n] == shapes[0]:
        n += 1
    out = [_piece(0, n, cq, ck, shapes)]
    if n < len(shapes):
        out.append(_piece(n, len(shapes), cq, ck, shapes, pad=call.causal))
    return out if any(p.shape is not None for p in out) else None


def _piece(e0: int, e1: int, cq: list[int], ck: list[int], shapes: list, pad: bool = False) -> Piece:
    run = shapes[e0:e1]
    span: dict = dict(e0=e0, e1=e1, q0=cq[e0], q1=cq[e1], k0=ck[e0], k1=ck[e1])
    if all(s == run[0] for s in run):
        return Piece(**span, shape=run[0])
    w, lens = max(lq for lq, _ in run), tuple(lq for lq, _ in run)
    if pad and len(run) * w <= PAD_LIMIT * sum(lens):
        return Piece(**span, shape=(w, w), lens=lens)
    rebase = lambda xs: torch.tensor([x - xs[0] for x in xs], dtype=torch.int32)  # noqa: E731
    return Piece(
        **span,
        shape=None,
        cu_q=rebase(cq[e0 : e1 + 1]),
        cu_k=rebase(ck[e0 : e1 + 1]),
        max_q=max(lq for lq, _ in run),
        max_k=max(lk for _, lk in run),
    )
