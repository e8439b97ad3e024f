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


class _MergedCPUAttention(torch.autograd.Function):
    """Attention over several key runs, each by the CPU flash kernel, merged by log-sum-exp.

    Part 0: all queries against the shared ancestor keys (dense, no mask). Parts 1..: each sibling's
    queries against its own keys (causal). Forward: out = sum_i exp(lse_i - lse) * out_i with
    lse = logsumexp_i lse_i. Backward: the flash backward of each part, given the *merged* output and
    log-sum-exp, yields that part's exact share of dQ, dK, dV (the identity ring attention uses).
    No mask is built, no key is copied, and no (query, key) pair outside the layout is computed.
    """

    @staticmethod
    def forward(ctx, q, k_anc, v_anc, k_own, v_own, siblings, scale):
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out_a, lse_a = op(q, k_anc, v_anc, 0.0, False, scale=scale)
        out_b, lse_b = torch.empty_like(out_a), torch.empty_like(lse_a)
        for s0, s1 in siblings:
            o, lse = op(q[:, :, s0:s1], k_own[:, :, s0:s1], v_own[:, :, s0:s1], 0.0, True, scale=scale)
            out_b[:, :, s0:s1], lse_b[:, :, s0:s1] = o, lse
        lse = torch.logaddexp(lse_a, lse_b)
        out = torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_anc, v_anc, k_own, v_own, out, lse)
        ctx.siblings, ctx.scale = siblings, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k_anc, v_anc, k_own, v_own, out, lse = ctx.saved_tensors
        bop = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        g = g.contiguous()
        dq, dk_anc, dv_anc = bop(g, q, k_anc, v_anc, out, lse, 0.0, False, scale=ctx.scale)
        dk_own, dv_own = torch.zeros_like(k_own), torch.zeros_like(v_own)
        for s0, s1 in ctx.siblings:
            dq_j, dk_j, dv_j = bop(g[:, :, s0:s1], q[:, :, s0:s1], k_own[:, :, s0:s1], v_own[:, :, s0:s1],
                                   out[:, :, s0:s1], lse[:, :, s0:s1], 0.0, True, scale=ctx.scale)
            dq[:, :, s0:s1] += dq_j
            dk_own[:, :, s0:s1], dv_own[:, :, s0:s1] = dk_j, dv_j
        return dq, dk_anc, dv_anc, dk_own, dv_own, None, None


def merged_cpu_block(q, k_anc, v_anc, k_own, v_own, siblings, scale):
    """Siblings attending to shared ancestors and causally to themselves, without a mask.

    q, k_own, v_own: (1, H|Hkv, Lq, D) for the block's own tokens; k_anc, v_anc: (1, Hkv, La, D);
    siblings: (start, end) of each sibling within the block. CPU only (uses the CPU flash kernel).
    """
    n_rep = q.shape[1] // k_anc.shape[1]
    k_anc, v_anc = _repeat_kv(k_anc, n_rep), _repeat_kv(v_anc, n_rep)
    k_own, v_own = _repeat_kv(k_own, n_rep), _repeat_kv(v_own, n_rep)
    return _MergedCPUAttention.apply(q.contiguous(), k_anc.contiguous(), v_anc.contiguous(), k_own.contiguous(),
                                     v_own.contiguous(), siblings, scale)
