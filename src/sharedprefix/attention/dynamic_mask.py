"""Doge's dynamic mask attention: a learned per-key, per-head bias added to the scores, folded into Q and K.

Doge (``DogeAttention.prepare_dynamic_mask``) adds to every score of head h a bias b[h, j] that depends on key j
alone (``exp(A * softplus(dt_proj(v_j)))``), and, once a row holds more than ``keep_window_size`` keys, keeps
only the top ``keep_window_size`` keys of each query by that bias. In a sharedprefix pass transformers builds no
causal mask (the attention is ours), so the mask the layer hands the attention function is the bias alone,
broadcast over queries: (1, H, L, L) with ``mask[0, h, i, j] = b[h, j]`` for every i.

A bias per key is a dot product with one more dimension: with q' = [q, 1] and k'_h = [k_h, b[h] / scale],
scale * q'.k' = scale * q.k + b exactly up to one rounding of b / scale * scale, so the cascade, the kernels and
the prompt K/V cache run unchanged on (q', k', v) with the key heads repeated to the query heads (the bias is per
query head). The cached K of a prompt carries its bias with it.

Refused: a plain row or a pass longer than ``keep_window_size`` (the model's top-k selection then bites, and
would select over the packed row's keys, not each plain row's): before any pass, by the executor; here, a mask
that is not one finite bias per key for every query (which a selection that bit would also produce).

Notation: H = query heads, Hkv = key/value heads, L = row length, D = head dim.
"""

from __future__ import annotations

import torch


def has_dynamic_mask(module) -> bool:
    """Whether ``module`` is an attention with Doge's dynamic mask (it adds a learned bias per key)."""
    return callable(getattr(type(module), "prepare_dynamic_mask", None))


def fold_key_bias(module, query, key, value, mask: torch.Tensor, scale: float):
    """(q', k', v') with the per-key bias of ``mask`` (1, H, L, L) folded in: query (1, H, L, D + 1),
    key (1, H, L, D + 1), value (1, H, L, Dv), as transformers' attention functions take them."""
    name = type(module).__name__
    H, L = query.shape[1], query.shape[2]
    if tuple(mask.shape) != (1, H, L, L) or not mask.is_floating_point():
        raise ValueError(
            f"{name} passed a dynamic mask of shape {tuple(mask.shape)} ({mask.dtype}); sharedprefix "
            f"expects a float (1, {H}, {L}, {L}) bias broadcast over queries, and refuses other masks."
        )
    bias = mask[0, :, 0, :]  # (H, L)
    if not (
        torch.equal(mask[0, :, -1, :], bias)
        and bool(torch.isfinite(bias).all())
        and bool((bias > torch.finfo(bias.dtype).min / 2).all())
    ):
        raise ValueError(
            f"{name} passed a dynamic mask that is not one finite bias per key for every query; "
            "sharedprefix refuses it rather than guess which keys it masks."
        )
    n = H // key.shape[1]
    key, value = key.repeat_interleave(n, 1), value.repeat_interleave(n, 1)
    one = torch.ones_like(query[..., :1])
    q = torch.cat([query, one], -1)
    k = torch.cat([key, (bias / scale).to(key.dtype)[None, :, :, None]], -1)
    return q, k, value
