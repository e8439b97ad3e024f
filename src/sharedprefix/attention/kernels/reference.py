"""``Reference``: the contract's forward and backward in explicit float64 math, the tests' yardstick."""

from __future__ import annotations

import torch

from sharedprefix.attention.kernels.common import (
    allowed_mask,
    entry_bounds,
    fold_heads,
    lse_dtype,
    repeat_heads,
    softcapped,
)
from sharedprefix.attention.kernels.contract import KernelCall


class Reference:
    """Explicit math in float64: the yardstick every other implementation is tested against."""

    name = "reference"
    SOFTCAP = True

    @staticmethod
    def _scores(q, k, scale, i0, i1, k0, k1, lq, lk, causal, window, softcap=None):
        """(H, Lq, Lk) masked scores and the derivative of the soft-cap (1 where there is none)."""
        n = q.shape[1] // k.shape[1]
        kk = repeat_heads(k.double(), n)
        s, dcap = softcapped(torch.einsum("ihd,jhd->hij", q.double(), kk) * scale, softcap)
        ok = allowed_mask(i0, i1, k0, k1, lq, lk, causal, window, q.device)
        return s.masked_fill(~ok, float("-inf")), dcap

    @staticmethod
    def forward(call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, causal, window, scale, softcap = (
            call.q,
            call.k,
            call.v,
            call.causal,
            call.window,
            call.scale,
            call.softcap,
        )
        h, n = q.shape[1], q.shape[1] // k.shape[1]
        out = q.new_zeros(q.shape[0], h, v.shape[-1], dtype=torch.float64)
        lse = torch.full((q.shape[0], h), float("-inf"), dtype=torch.float64, device=q.device)
        for q0, q1, k0, k1 in entry_bounds(call.cu_seqlens_q, call.cu_seqlens_k):
            if q1 == q0 or k1 == k0:
                continue
            s, _ = Reference._scores(
                q[q0:q1], k[k0:k1], scale, 0, q1 - q0, 0, k1 - k0, q1 - q0, k1 - k0, causal, window, softcap
            )
            m = torch.logsumexp(s, dim=-1)  # (H, Lq)
            p = torch.exp(s - m[..., None]).nan_to_num(0.0)
            out[q0:q1] = torch.einsum("hij,jhd->ihd", p, repeat_heads(v[k0:k1].double(), n))
            lse[q0:q1] = m.t()
        return out.to(q.dtype), lse.to(lse_dtype(q))

    @staticmethod
    def backward(call: KernelCall, dout, out, lse, aux=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, causal, window, scale, softcap = (
            call.q,
            call.k,
            call.v,
            call.causal,
            call.window,
            call.scale,
            call.softcap,
        )
        n = q.shape[1] // k.shape[1]
        dq = torch.zeros_like(q, dtype=torch.float64)
        dk = torch.zeros(k.shape[0], q.shape[1], k.shape[2], dtype=torch.float64, device=q.device)
        dv = torch.zeros(v.shape[0], q.shape[1], v.shape[2], dtype=torch.float64, device=q.device)
        for q0, q1, k0, k1 in entry_bounds(call.cu_seqlens_q, call.cu_seqlens_k):
            if q1 == q0 or k1 == k0:
                continue
            s, dcap = Reference._scores(
                q[q0:q1], k[k0:k1], scale, 0, q1 - q0, 0, k1 - k0, q1 - q0, k1 - k0, causal, window, softcap
            )
            m = lse[q0:q1].double().t()
            m = m.masked_fill(torch.isneginf(m), float("inf"))  # a row with no key at all: P = 0, not NaN
            p = torch.exp(s - m[..., None])  # (H, Lq, Lk) under the merged lse
            do, o = dout[q0:q1].double(), out[q0:q1].double()
            vv = repeat_heads(v[k0:k1].double(), n)
            dv[k0:k1] += torch.einsum("hij,ihd->jhd", p, do)
            dp = torch.einsum("ihd,jhd->hij", do, vv)
            delta = (do * o).sum(-1).t()[..., None]  # (H, Lq, 1)
            ds = p * (dp - delta) * dcap * scale
            dq[q0:q1] += torch.einsum("hij,jhd->ihd", ds, repeat_heads(k[k0:k1].double(), n))
            dk[k0:k1] += torch.einsum("hij,ihd->jhd", ds, q[q0:q1].double())
        return dq.to(q.dtype), fold_heads(dk, n).to(k.dtype), fold_heads(dv, n).to(v.dtype)
