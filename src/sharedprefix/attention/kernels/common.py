"""Helpers shared by the kernels: entries of the cu_seqlens, visible key ranges, head repetition, the soft-cap.

Notation as in ``attention.kernels``: Tq / Tk packed queries / keys, H query heads, Hkv key/value heads.
"""

from __future__ import annotations

import torch


def entry_bounds(cu_q: torch.Tensor, cu_k: torch.Tensor):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        yield cq[b], cq[b + 1], ck[b], ck[b + 1]


def key_range(i0: int, i1: int, lq: int, lk: int, causal: bool, window: int | None) -> tuple[int, int]:
    """Keys any of the queries i0..i1-1 of an entry may see (bottom-right alignment)."""
    off = lk - lq
    lo = 0 if window is None else max(0, i0 + off - window)
    hi = min(lk, i1 - 1 + off + 1) if causal else lk
    return lo, max(lo, hi)


def allowed_mask(i0: int, i1: int, k0: int, k1: int, lq: int, lk: int, causal: bool, window: int | None, device):
    """(i1 - i0, k1 - k0) bool: which keys each query of the tile may see."""
    qi = torch.arange(i0, i1, device=device)[:, None] + (lk - lq)
    kj = torch.arange(k0, k1, device=device)[None, :]
    ok = torch.ones(i1 - i0, k1 - k0, dtype=torch.bool, device=device)
    if causal:
        ok &= kj <= qi
    if window is not None:
        ok &= kj >= qi - window
    return ok


def lse_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def repeat_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def fold_heads(dx: torch.Tensor, n: int) -> torch.Tensor:
    """Gradient w.r.t. repeated heads -> gradient w.r.t. the Hkv original heads."""
    if n == 1:
        return dx
    t, h, d = dx.shape
    return dx.view(t, h // n, n, d).sum(2)


def softcapped(s: torch.Tensor, softcap: float | None):
    """(softcap * tanh(s / softcap), its derivative 1 - tanh^2), or (s, 1) without a softcap."""
    if softcap is None:
        return s, 1.0
    t = torch.tanh(s / softcap)
    return t * softcap, 1 - t * t


def pad_last(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def cut_last(x: torch.Tensor, d: int) -> torch.Tensor:
    """The first ``d`` columns of the last dim; no op where that is all of them."""
    return x if x.shape[-1] == d else x[..., :d]


def lse_in(lse: torch.Tensor) -> torch.Tensor:
    """A merged lse with -inf (a query that sees no key) as +inf, so that a kernel's backward P = exp(S - lse) is 0
    there, not NaN (one op)."""
    inf = float("inf")
    return lse.nan_to_num(posinf=inf, neginf=inf)
