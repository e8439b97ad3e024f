"""``CPU``: torch's CPU flash kernel, one call per entry, with query tiles and a local mask where a window or a
non-square causal entry needs one; with a softcap, explicit math over query tiles and key blocks merged by
log-sum-exp (which the CPU flash op cannot do).
"""

from __future__ import annotations

import torch

from sharedprefix.attention.kernels.common import (
    allowed_mask,
    entry_bounds,
    fold_heads,
    key_range,
    lse_dtype,
    pad_last,
    repeat_heads,
    softcapped,
)
from sharedprefix.attention.kernels.contract import KernelCall

TILE = 256  # query rows per CPU kernel call when a local mask is needed
KEY_BLOCK = 1024  # keys per block of the explicit soft-capped CPU path: (TILE, H, KEY_BLOCK) scores at most


def _cpu_tiles(lq, lk, causal, window):
    """(i0, i1, k0, k1, needs_mask, square_causal) calls covering one entry on the CPU kernel."""
    if not causal and window is None:
        yield 0, lq, 0, lk, False, False
        return
    if causal and window is None and lq == lk:
        yield 0, lq, 0, lk, False, True
        return
    for i0 in range(0, lq, TILE):
        i1 = min(lq, i0 + TILE)
        k0, k1 = key_range(i0, i1, lq, lk, causal, window)
        yield i0, i1, k0, k1, True, False


class CPU:
    """torch's CPU flash kernel, one call per entry (query tiles with a local mask for windows).

    The kernel needs one head size for q, k and v: where they differ (latent attention, Dv != D) the
    smaller is zero-padded, which changes neither the scores nor the output's first Dv columns.
    """

    name = "cpu"
    SOFTCAP = True

    @staticmethod
    def _mask(i0, i1, k0, k1, lq, lk, causal, window, dtype, device):
        ok = allowed_mask(i0, i1, k0, k1, lq, lk, causal, window, device)
        return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))

    @staticmethod
    def forward(call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, causal, window, scale = call.q, call.k, call.v, call.causal, call.window, call.scale
        cu_seqlens_q, cu_seqlens_k = call.cu_seqlens_q, call.cu_seqlens_k
        if call.softcap is not None:
            return _softcap_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window, scale, call.softcap)
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        n = q.shape[1] // k.shape[1]
        dv_, d = v.shape[-1], max(q.shape[-1], v.shape[-1])
        q, k, v = pad_last(q, d), pad_last(k, d), pad_last(v, d)
        out = q.new_zeros(q.shape[0], q.shape[1], d)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=lse_dtype(q), device=q.device)
        for q0, q1, e0, e1 in entry_bounds(cu_seqlens_q, cu_seqlens_k):
            lq, lk = q1 - q0, e1 - e0
            for i0, i1, k0, k1, masked, sq in _cpu_tiles(lq, lk, causal, window):
                if i1 == i0 or k1 == k0:
                    continue
                qq = q[q0 + i0 : q0 + i1].transpose(0, 1)[None]
                kk = repeat_heads(k[e0 + k0 : e0 + k1], n).transpose(0, 1)[None]
                vv = repeat_heads(v[e0 + k0 : e0 + k1], n).transpose(0, 1)[None]
                mask = CPU._mask(i0, i1, k0, k1, lq, lk, causal, window, q.dtype, q.device) if masked else None
                o, m = op(qq, kk, vv, 0.0, sq, attn_mask=mask, scale=scale)
                m = m[0].transpose(0, 1).to(lse.dtype)
                if mask is not None:  # the kernel reports lse = 0 for a row that sees no key
                    m = m.masked_fill(torch.isinf(mask).all(1)[:, None], float("-inf"))
                out[q0 + i0 : q0 + i1] = o[0].transpose(0, 1)
                lse[q0 + i0 : q0 + i1] = m
        return out[..., :dv_], lse

    @staticmethod
    def backward(call: KernelCall, dout, out, lse, aux=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, causal, window, scale = call.q, call.k, call.v, call.causal, call.window, call.scale
        cu_seqlens_q, cu_seqlens_k = call.cu_seqlens_q, call.cu_seqlens_k
        if call.softcap is not None:
            return _softcap_backward(
                dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, window, scale, call.softcap
            )
        bop = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        n = q.shape[1] // k.shape[1]
        dh, dvh, d = q.shape[-1], v.shape[-1], max(q.shape[-1], v.shape[-1])
        q, k, v, dout, out = (pad_last(x, d) for x in (q, k, v, dout, out))
        dq = torch.zeros_like(q)
        dk = q.new_zeros(k.shape[0], q.shape[1], k.shape[2])
        dv = q.new_zeros(v.shape[0], q.shape[1], v.shape[2])
        for q0, q1, e0, e1 in entry_bounds(cu_seqlens_q, cu_seqlens_k):
            lq, lk = q1 - q0, e1 - e0
            for i0, i1, k0, k1, masked, sq in _cpu_tiles(lq, lk, causal, window):
                a, b = q0 + i0, q0 + i1
                if b == a or k1 == k0:
                    continue
                t = lambda x: x.transpose(0, 1)[None].contiguous()  # noqa: E731  (rows, H, d) -> (1, H, rows, d)
                kk, vv = repeat_heads(k[e0 + k0 : e0 + k1], n), repeat_heads(v[e0 + k0 : e0 + k1], n)
                m = lse[a:b].to(lse_dtype(q))
                m = m.masked_fill(torch.isneginf(m), float("inf")).t()[None].contiguous()  # no key at all: P = 0
                mask = CPU._mask(i0, i1, k0, k1, lq, lk, causal, window, q.dtype, q.device) if masked else None
                gq, gk, gv = bop(
                    t(dout[a:b]), t(q[a:b]), t(kk), t(vv), t(out[a:b]), m, 0.0, sq, attn_mask=mask, scale=scale
                )
                dq[a:b] += gq[0].transpose(0, 1)
                dk[e0 + k0 : e0 + k1] += gk[0].transpose(0, 1)
                dv[e0 + k0 : e0 + k1] += gv[0].transpose(0, 1)
        return dq[..., :dh], fold_heads(dk, n)[..., :dh], fold_heads(dv, n)[..., :dvh]


def _softcap_blocks(lq: int, lk: int, causal: bool, window: int | None):
    """(i0, i1, b0, b1): query tiles of TILE rows and, for each, blocks of KEY_BLOCK of the keys it may see."""
    for i0 in range(0, lq, TILE):
        i1 = min(lq, i0 + TILE)
        k0, k1 = key_range(i0, i1, lq, lk, causal, window)
        for b0 in range(k0, k1, KEY_BLOCK):
            yield i0, i1, b0, min(k1, b0 + KEY_BLOCK)


def _softcap_scores(q, k, i0, i1, b0, b1, lq, lk, causal, window, scale, softcap, n):
    """(H, tile, block) soft-capped, masked scores in the accumulation dtype, and the cap's derivative."""
    s, dcap = softcapped(torch.einsum("ihd,jhd->hij", q, repeat_heads(k, n)) * scale, softcap)
    ok = allowed_mask(i0, i1, b0, b1, lq, lk, causal, window, q.device)
    return s.masked_fill(~ok, float("-inf")), dcap


def _softcap_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window, scale, softcap):
    """Soft-capped attention on the CPU: explicit scores per (query tile, key block), merged by log-sum-exp in
    float32 (float64 for float64 inputs); never more than (TILE, H, KEY_BLOCK) scores at once."""
    acc = lse_dtype(q)
    n = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    for q0, q1, e0, e1 in entry_bounds(cu_seqlens_q, cu_seqlens_k):
        lq, lk = q1 - q0, e1 - e0
        for i0, i1, b0, b1 in _softcap_blocks(lq, lk, causal, window):
            a, b = q0 + i0, q0 + i1
            s, _ = _softcap_scores(
                q[a:b].to(acc), k[e0 + b0 : e0 + b1].to(acc), i0, i1, b0, b1, lq, lk, causal, window, scale, softcap, n
            )
            m_blk = torch.logsumexp(s, -1).t()  # (tile, H)
            m_new = torch.logaddexp(lse[a:b], m_blk)
            p = torch.exp(s - m_new.t()[..., None]).nan_to_num_(0.0)  # -inf - -inf: no key yet
            keep = torch.exp(lse[a:b] - m_new).nan_to_num_(0.0)
            vv = repeat_heads(v[e0 + b0 : e0 + b1].to(acc), n)
            out[a:b] = out[a:b] * keep[..., None] + torch.einsum("hij,jhd->ihd", p, vv)
            lse[a:b] = m_new
    return out.to(q.dtype), lse


def _softcap_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, window, scale, softcap):
    """The contract's backward for ``_softcap_forward``: P = exp(capped S - lse), dS = P (dO V^T - rowsum(dO out))
    (1 - tanh^2) scale, block by block."""
    acc = lse_dtype(q)
    n = q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape[0], q.shape[1], k.shape[2], dtype=acc, device=q.device)
    dv = torch.zeros(v.shape[0], q.shape[1], v.shape[2], dtype=acc, device=q.device)
    m_all = lse.to(acc).masked_fill(torch.isneginf(lse), float("inf"))  # a query with no key: P = 0
    delta_all = (dout.to(acc) * out.to(acc)).sum(-1)  # (Tq, H)
    for q0, q1, e0, e1 in entry_bounds(cu_seqlens_q, cu_seqlens_k):
        lq, lk = q1 - q0, e1 - e0
        for i0, i1, b0, b1 in _softcap_blocks(lq, lk, causal, window):
            a, b, c, d = q0 + i0, q0 + i1, e0 + b0, e0 + b1
            qq, kk = q[a:b].to(acc), k[c:d].to(acc)
            s, dcap = _softcap_scores(qq, kk, i0, i1, b0, b1, lq, lk, causal, window, scale, softcap, n)
            p = torch.exp(s - m_all[a:b].t()[..., None])  # (H, tile, block)
            do = dout[a:b].to(acc)
            dv[c:d] += torch.einsum("hij,ihd->jhd", p, do)
            dp = torch.einsum("ihd,jhd->hij", do, repeat_heads(v[c:d].to(acc), n))
            ds = p * (dp - delta_all[a:b].t()[..., None]) * dcap * scale
            dq[a:b] += torch.einsum("hij,jhd->ihd", ds, repeat_heads(kk, n))
            dk[c:d] += torch.einsum("hij,ihd->jhd", ds, qq)
    return dq.to(q.dtype), fold_heads(dk, n).to(k.dtype), fold_heads(dv, n).to(v.dtype)
