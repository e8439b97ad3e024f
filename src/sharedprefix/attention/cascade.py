"""Run a row's attention cascade (``layout.calls``) on the primitive and merge it by log-sum-exp.

Forward: each call (one ``KernelCall`` of the primitive) gives (out_i, lse_i) for its rows; lse = logsumexp_i
lse_i and out = sum_i exp(lse_i - lse) * out_i (``attention.merge.merge_state``, call by call). Backward: each call's
kernel backward, given the *merged* out and lse, is exactly that call's share of dQ, dK, dV (see
``attention.kernels``). Keys enter as views of the row's K/V, as the cached tensors of earlier passes (leaves that
accumulate dK, dV), or, under a window, gathered by one index; autograd routes their gradients.

Notation: L = row length, H = query heads, Hkv = key/value heads, D / Dv = head dims.
"""

from __future__ import annotations

import torch

from sharedprefix.attention.kernels.contract import KernelCall
from sharedprefix.attention.kernels.dense import dense_for
from sharedprefix.attention.merge import merge_state
from sharedprefix.layout.calls import Cascade


class _Merged(torch.autograd.Function):
    """q (L, H, D), optional sinks (H,) and per call (k_i, v_i) -> merged out (L, H, Dv) in q's dtype.

    An attention sink (GPT-OSS ``s_aux``) is one more logit per head in every query's softmax denominator,
    with no value: lse_s = logaddexp(lse, sink) and out_s = exp(lse - lse_s) * out. The kernels' backward,
    given out_s and lse_s, is then exact for q, k and v (P = exp(S - lse_s) are the probabilities with the
    sink, and rowsum(dO * out_s) is the sum over the keys, the sink having no value); the sink's own
    gradient is -sum over queries of exp(sink - lse_s) * rowsum(dO * out_s).
    """

    @staticmethod
    def forward(ctx, impl, dense, calls, device, scale, softcap, sinks, q, *kv):
        out, lse, auxes = merged_forward(impl, dense, calls, device, scale, softcap, sinks, q, kv)
        ctx.save_for_backward(q, out, lse, sinks, *kv)
        ctx.impl, ctx.dense, ctx.calls, ctx.device, ctx.scale, ctx.auxes, ctx.softcap = (
            impl,
            dense,
            calls,
            device,
            scale,
            auxes,
            softcap,
        )
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, sinks, *kv = ctx.saved_tensors
        dq, grads, dsinks = merged_backward(
            ctx, dout, q, out, lse, sinks, kv, sinks is not None and ctx.needs_input_grad[6]
        )
        return (None, None, None, None, None, None, dsinks, dq, *grads)


def merged_forward(impl, dense, calls, device, scale: float, softcap, sinks, q: torch.Tensor, kv) -> tuple:
    """(out (L, H, Dv) in q's dtype, lse (L, H) float32 / float64, per-call kernel aux) of the calls merged by
    log-sum-exp, with the sinks' logits; ``kv``: each call's keys and values in turn (k_0, v_0, k_1, v_1, ...)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses, auxes = [], [], []
    for i, c in enumerate(calls):
        o, m, aux = _call_forward(
            impl, dense, c, q[c.q_start : c.q_end], kv[2 * i], kv[2 * i + 1], device, scale, softcap
        )
        outs.append(o)
        lses.append(m.to(acc))
        auxes.append(aux)
    if len(calls) == 1:
        out, lse = outs[0], lses[0]
    else:
        lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
        merged = torch.zeros(q.shape[0], q.shape[1], outs[0].shape[-1], dtype=acc, device=q.device)
        for c, o, m in zip(calls, outs, lses):
            s = slice(c.q_start, c.q_end)
            merged[s], lse[s] = merge_state(merged[s], lse[s], o, m)
        out = merged.to(q.dtype)
    if sinks is not None:
        lse_s = torch.logaddexp(lse, sinks.to(acc)[None, :])
        out = (torch.exp(lse - lse_s).nan_to_num_(0.0)[..., None] * out.to(acc)).to(q.dtype)
        lse = lse_s
    return out, lse, auxes


def merged_backward(ctx, dout, q, out, lse, sinks, kv, sinks_grad: bool) -> tuple:
    """(dq, [dk_0, dv_0, dk_1, ...], dsinks or None) of ``merged_forward``; ``ctx`` holds its impl, dense, calls,
    device, scale, softcap and auxes."""
    dq = torch.zeros_like(q)
    grads = []
    for i, c in enumerate(ctx.calls):
        s = slice(c.q_start, c.q_end)
        gq, gk, gv = _call_backward(ctx, c, ctx.auxes[i], dout[s], q[s], kv[2 * i], kv[2 * i + 1], out[s], lse[s])
        dq[s] += gq
        grads += [gk, gv]
    dsinks = None
    if sinks_grad:
        acc = lse.dtype
        delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (L, H)
        dsinks = -(torch.exp(sinks.to(acc)[None, :] - lse) * delta).sum(0).to(sinks.dtype)
    return dq, grads, dsinks


def _call_forward(impl, dense, c, q, k, v, device, scale, softcap):
    """One call's (out, lse, aux): the varlen primitive, or, where ``dense`` is a kernel and the call splits into
    dense pieces (``layout.dense``), each piece on its kernel, concatenated along the queries."""
    parts = c.pieces(device) if dense is not None else None
    if parts is None:
        cu_q, cu_k, _ = c.on(device)
        call = KernelCall(q, k, v, cu_q, cu_k, c.max_seqlen_q, c.max_seqlen_k, c.causal, c.window, scale, softcap)
        o, m, *aux = impl.forward(call)
        return o, m, aux[0] if aux else None
    outs, lses, auxes = [], [], []
    for p, (cu_q, cu_k), pad in parts:
        qp, kp, vp = q[p.q0 : p.q1], k[p.k0 : p.k1], v[p.k0 : p.k1]
        if p.shape is None:
            o, m, *aux = impl.forward(KernelCall(qp, kp, vp, cu_q, cu_k, p.max_q, p.max_k, c.causal, None, scale))
            aux = aux[0] if aux else None
        else:
            bq, bk = (p.batch, p.shape[0]), (p.batch, p.shape[1])
            if pad is not None:
                qp, kp, vp = (_padded(x, pad, p.batch * p.shape[0]) for x in (qp, kp, vp))
            o, m, aux = dense.forward(
                qp.view(*bq, *qp.shape[1:]), kp.view(*bk, *kp.shape[1:]), vp.view(*bk, *vp.shape[1:]), c.causal, scale
            )
            o, m = o.reshape(-1, *o.shape[2:]), m.reshape(-1, m.shape[-1])  # (B * Lq, H, Dv), (B * Lq, H)
            if pad is not None:
                o, m = o.index_select(0, pad), m.index_select(0, pad)
        outs.append(o)
        lses.append(m)
        auxes.append(aux)
    return torch.cat(outs), torch.cat(lses), auxes


def _call_backward(ctx, c, aux, dout, q, k, v, out, lse):
    """One call's share (dq, dk, dv) of the merged attention's gradient, piece by piece as it ran forward. A padded
    piece's pad rows get zero queries, zero dout, zero out and lse = 0: their probabilities are finite (exp(0 - 0)
    over visible keys) and their dS = P * (dO V^T - rowsum(dO * out)) is exactly 0, so they add nothing."""
    parts = c.pieces(ctx.device) if ctx.dense is not None else None
    if parts is None:
        cu_q, cu_k, _ = c.on(ctx.device)
        call = KernelCall(
            q, k, v, cu_q, cu_k, c.max_seqlen_q, c.max_seqlen_k, c.causal, c.window, ctx.scale, ctx.softcap
        )
        return ctx.impl.backward(call, dout, out, lse, aux)
    dqs, dks, dvs = [], [], []
    for (p, (cu_q, cu_k), pad), a in zip(parts, aux):
        rq, rk = slice(p.q0, p.q1), slice(p.k0, p.k1)
        xs = [dout[rq], q[rq], k[rk], v[rk], out[rq], lse[rq]]
        if p.shape is None:
            d_o, qq, kk, vv, oo, mm = xs
            call = KernelCall(qq, kk, vv, cu_q, cu_k, p.max_q, p.max_k, c.causal, None, ctx.scale)
            gq, gk, gv = ctx.impl.backward(call, d_o, oo, mm, a)
        else:
            if pad is not None:
                xs = [_padded(x, pad, p.batch * p.shape[0]) for x in xs]
            lq, lk = p.shape
            b = p.batch
            d_o, qq, kk, vv, oo, mm = (x.view(b, lk if i in (2, 3) else lq, *x.shape[1:]) for i, x in enumerate(xs))
            gq, gk, gv = (
                g.reshape(-1, *g.shape[2:]) for g in ctx.dense.backward(d_o, qq, kk, vv, oo, mm, c.causal, ctx.scale, a)
            )
            if pad is not None:
                gq, gk, gv = (g.index_select(0, pad) for g in (gq, gk, gv))
        dqs.append(gq)
        dks.append(gk)
        dvs.append(gv)
    return torch.cat(dqs), torch.cat(dks), torch.cat(dvs)


def _padded(x: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """(n, ...) real rows -> (rows, ...) with them at ``index`` and zeros elsewhere (a right-padded batch)."""
    return x.new_zeros(rows, *x.shape[1:]).index_copy_(0, index, x)


def call_keys(call, k: torch.Tensor, v: torch.Tensor, read_kv):
    """The call's (K, Hkv, D) keys and values: a view of the row's, the cached ones, or their concatenation."""
    ks, vs = [], []
    for src in call.keys:
        if src.cached:
            ck, cv = read_kv(src.seg)  # (1, Hkv, len, D) as cached
            ks.append(ck[0].transpose(0, 1))
            vs.append(cv[0].transpose(0, 1))
        else:
            ks.append(k[src.start : src.end])
            vs.append(v[src.start : src.end])
    kk = ks[0] if len(ks) == 1 else torch.cat(ks)
    vv = vs[0] if len(vs) == 1 else torch.cat(vs)
    _, _, index = call.on(k.device)
    if index is not None:
        kk, vv = kk.index_select(0, index), vv.index_select(0, index)
    return kk, vv


def cascade_attention(
    impl, cascade: Cascade, query, key, value, read_kv, scale: float, sinks=None, softcap: float | None = None
) -> torch.Tensor:
    """Shared-prefix attention of a packed row.

    Args:
        impl: an implementation of the primitive (``attention.kernels``).
        query: (1, H, L, D); key, value: (1, Hkv, L, D | Dv) as transformers passes them.
        read_kv: segment id -> its cached (k, v), each (1, Hkv, len, D | Dv).
        sinks: None, or (H,) attention-sink logits (natural-log units, unscaled), one per query head.
        softcap: None, or the soft-cap of the scores (s -> softcap * tanh(s / softcap)), for an ``impl`` whose
            ``SOFTCAP`` is True.

    Returns:
        (1, L, H, Dv) in query's dtype, as transformers' attention functions return it.
    """
    q = query[0].transpose(0, 1)  # (L, H, D), a view
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    kv = []
    for c in cascade.calls:
        kv += call_keys(c, k, v, read_kv)
    dense = None if softcap is not None else dense_for(impl, q.device, q.dtype, max(q.shape[-1], v.shape[-1]))
    out = _Merged.apply(impl, dense, cascade.calls, q.device, scale, softcap, sinks, q, *kv)
    return out[None]
