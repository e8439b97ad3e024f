"""The merge of two attention states: the same queries attended over two disjoint sets of keys, combined by
log-sum-exp into the attention over their union (flashinfer's ``merge_state``, in natural-log units); and the merge of
a row's cascade calls, part by part (``merge_parts``), with the matching sum of their dq (``sum_parts``).

Notation: ... = any leading shape (here (Tq, H): packed queries, heads), Dv = value head dim.
"""

from __future__ import annotations

import torch


def merge_state(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the keys of a and of b, from the attention over each.

    With lse = logaddexp(lse_a, lse_b): out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b, computed as
    lerp(out_a, out_b, exp(lse_b - lse)) (the two weights sum to 1; one fused op). A query that sees
    no key in one part (lse -inf there, its out 0) keeps the other part's state; one that sees no key in either keeps
    lse = -inf and out = 0, never NaN.

    Args:
        out_a, out_b: (..., Dv) outputs of the two parts, any floating dtype.
        lse_a, lse_b: (...) natural-log log-sum-exp of the scaled scores of each part, float32 (float64 for float64
            states); -inf where a query sees no key of that part.

    Returns:
        (out (..., Dv), lse (...)), both in ``lse_a``'s dtype (the accumulation dtype: cast ``out`` back to the
        inputs' dtype after the last merge).

    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(n, 2, 4, generator=g, dtype=torch.float64) for n in (5, 7, 7))  # (T, H, D)
    >>> def attend(k, v):  # q over these keys: out (5, 2, 4), lse (5, 2)
    ...     s = torch.einsum("ihd,jhd->ihj", q, k)
    ...     return torch.einsum("ihj,jhd->ihd", s.softmax(-1), v), s.logsumexp(-1)
    >>> out, lse = merge_state(*attend(k[:3], v[:3]), *attend(k[3:], v[3:]))
    >>> want, want_lse = attend(k, v)
    >>> torch.allclose(out, want, rtol=0, atol=1e-12) and torch.allclose(lse, want_lse, rtol=0, atol=1e-12)
    True
    >>> none = torch.full_like(lse, float("-inf"))  # a part in which no query sees any key
    >>> out, lse = merge_state(torch.zeros_like(out), none, torch.zeros_like(out), none)
    >>> bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    True
    """
    acc = lse_a.dtype
    lse = torch.logaddexp(lse_a, lse_b.to(acc))
    # w_a = 1 - w_b in exact arithmetic: out_a + w_b * (out_b - out_a), one fused op (lerp)
    w_b = torch.exp(lse_b - lse).nan_to_num_(0.0)  # -inf - -inf: a query with no key in either part
    return torch.lerp(out_a.to(acc), out_b.to(acc), w_b[..., None]), lse


def _tiles(parts: list, length: int) -> list | None:
    """The parts, in order, of the first call when they tile the row 0..length, else None."""
    tiles, r = [], 0
    for p in parts:
        if p[0] != r:
            break
        tiles.append(list(p))
        r = p[1]
        if r == length:
            return tiles
    return None


def _tile(tiles: list, r0: int, r1: int) -> list:
    """The tile that holds rows r0..r1; where none does, the tiles are first joined into one (they tile the row)."""
    for t in tiles:
        if t[0] <= r0 and r1 <= t[1]:
            return t
    joined = [tiles[0][0], tiles[-1][1], *(torch.cat([t[i] for t in tiles]) for i in range(2, len(tiles[0])))]
    tiles[:] = [joined]
    return joined


def merge_parts(parts: list, length: int, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge (r0, r1, out (r1 - r0, H, Dv), lse (r1 - r0, H)) parts of the row's calls into (out (L, H, Dv), lse
    (L, H)) in ``acc``: the first call's parts tile the row (its causal call over every segment); a later part on the
    same rows as a tile merges into it (``merge_state``), one inside a tile merges into those rows of it."""
    tiles = _tiles(parts, length)
    if tiles is None:  # no call covers the row: merge everything into an empty state
        h, dv, like = parts[0][3].shape[-1], parts[0][2].shape[-1], parts[0][3]
        tiles = [[0, length, like.new_zeros(length, h, dv, dtype=acc), like.new_full((length, h), float("-inf"))]]
        rest = parts
    else:
        rest = parts[len(tiles) :]
    for r0, r1, o, m in rest:
        t = _tile(tiles, r0, r1)
        if (t[0], t[1]) == (r0, r1):
            t[2], t[3] = merge_state(t[2], t[3].to(acc), o, m)
            continue
        to, tl = t[2].to(acc), t[3].to(acc)  # a copy where the dtype changes: written below
        s = slice(r0 - t[0], r1 - t[0])
        to[s], tl[s] = merge_state(to[s], tl[s], o, m)
        t[2], t[3] = to, tl
    if len(tiles) == 1:
        return tiles[0][2], tiles[0][3].to(acc)
    return torch.cat([t[2] for t in tiles]), torch.cat([t[3] for t in tiles]).to(acc)


def sum_parts(parts: list, q: torch.Tensor) -> torch.Tensor:
    """dq (L, H, D): the sum of the parts' (r0, r1, dq of rows r0..r1), as ``merge_parts`` merged them."""
    tiles = _tiles(parts, q.shape[0])
    if tiles is None:
        tiles, rest = [[0, q.shape[0], torch.zeros_like(q)]], parts
    else:
        rest = parts[len(tiles) :]
    for r0, r1, g in rest:
        t = _tile(tiles, r0, r1)
        if (t[0], t[1]) == (r0, r1):
            t[2] = t[2] + g
        else:  # the tile is a fresh gradient of the kernels (or zeros): added to in place
            t[2][r0 - t[0] : r1 - t[0]] += g
    return tiles[0][2] if len(tiles) == 1 else torch.cat([t[2] for t in tiles])
