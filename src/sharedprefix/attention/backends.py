"""Attention kernels for one block: queries against a shared key run, with an optional mask.

Notation: H = query heads, Hkv = key/value heads (H % Hkv == 0, GQA/MQA), Lq = queries,
Lk = keys, D = head dim. Every function takes
    q: (1, H, Lq, D), k: (1, Hkv, Lk, D), v: (1, Hkv, Lk, Dv)
    mask: (Lq, Lk) additive float mask in q's dtype, 0 where attention is allowed and -inf
          elsewhere, or None for plain causal attention (then Lq == Lk)
    scale: the softmax scale the attention module itself uses (``module.scaling``)
and returns (1, H, Lq, Dv) in the dtype of q. Keys are shared by all queries of the block:
a prompt's K/V is never copied per completion.

The SDPA backend runs on CPU and GPU; the eager backend is the readable reference. GPU-only
backends (flash-attn varlen, FlexAttention) plug in through ``BACKENDS``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)


def sdpa_block(q, k, v, mask, scale):
    """Attention through ``torch.nn.functional.scaled_dot_product_attention``."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def eager_block(q, k, v, mask, scale):
    """Reference attention with explicit scores; softmax in float32 for half-precision inputs."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is None:
        lq, lk = q.shape[2], k.shape[2]
        causal = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    else:
        scores = scores + mask
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    probs = torch.softmax(scores, dim=-1, dtype=acc).to(q.dtype)
    return torch.matmul(probs, v)


BACKENDS = {"sdpa": sdpa_block, "eager": eager_block}
PLANNED_BACKENDS = ("flash_varlen", "flex")


def get_backend(name: str):
    if name in BACKENDS:
        return BACKENDS[name]
    if name in PLANNED_BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is planned but not implemented in this version; "
            f"use one of {sorted(BACKENDS)} (sdpa runs on CPU and GPU)."
        )
    raise ValueError(f"attention backend {name!r} is unknown; expected one of {sorted(BACKENDS)}.")
