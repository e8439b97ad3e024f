"""The merge of two attention states: the same queries attended over two disjoint sets of keys, combined by
log-sum-exp into the attention over their union (flashinfer's ``merge_state``, in natural-log units).

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
