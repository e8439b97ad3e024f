"""Run a row's attention cascade (``layout.calls``) on the primitive and merge it by log-sum-exp.

Forward: each call (one ``KernelCall`` of the primitive) gives (out_i, lse_i) for its rows; lse = logsumexp_i
lse_i and out = sum_i exp(lse_i - lse) * out_i (``attention.merge``, piece by piece). Backward: each call's
kernel backward, given the *merged* out and lse, is exactly that call's share of dQ, dK, dV (see
``attention.kernels``). Keys enter as views of the row's K/V, as the cached tensors of earlier passes (leaves that
accumulate dK, dV), or, under a window, gathered by one index; autograd routes their gradients.

Notation: L = row length, H = query heads, Hkv = key/value heads, D / Dv = head dims.
"""

from __future__ import annotations

import torch

from sharedprefix.attention.kernels.contract import KernelCall
from sharedprefix.attention.kernels.dense import dense_for
from sharedprefix.attention.merge import merge_parts, sum_parts
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
    parts, auxes = [], []
    for i, c in enumerate(calls):
        ps, aux = _call_forward(
            impl, dense, c, _rows(q, c.q_start, c.q_end), kv[2 * i], kv[2 * i + 1], device, scale, softcap
        )
        parts += [(c.q_start + a, c.q_start + b, o, m) for a, b, o, m in ps]
        auxes.append(aux)
    out, lse = merge_parts(parts, q.shape[0], acc)
    out = out.to(q.dtype)
    if sinks is not None:
        lse_s = torch.logaddexp(lse, sinks.to(acc)[None, :])
        out = (torch.exp(lse - lse_s).nan_to_num_(0.0)[..., None] * out.to(acc)).to(q.dtype)
        lse = lse_s
    return out, lse, auxes


def _rows(x: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """``x[r0:r1]``, without an op where that is all of ``x``."""
    return x if r0 == 0 and r1 == x.shape[0] else x[r0:r1]


def merged_backward(ctx, dout, q, out, lse, sinks, kv, sinks_grad: bool) -> tuple:
    """(dq, [dk_0, dv_0, dk_1, ...], dsinks or None) of ``merged_forward``; ``ctx`` holds its impl, dense, calls,
    device, scale, softcap and auxes."""
    parts, grads = [], []
    for i, c in enumerate(ctx.calls):
        r = (c.q_start, c.q_end)
        ps, gk, gv = _call_backward(
            ctx,
            c,
            ctx.auxes[i],
            _rows(dout, *r),
            _rows(q, *r),
            kv[2 * i],
            kv[2 * i + 1],
            _rows(out, *r),
            _rows(lse, *r),
        )
        parts += [(c.q_start + a, c.q_start + b, g) for a, b, g in ps]
        grads += [gk, gv]
    dsinks = None
    if sinks_grad:
        acc = lse.dtype
        delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (L, H)
        dsinks = -(torch.exp(sinks.to(acc)[None, :] - lse) * delta).sum(0).to(sinks.dtype)
    return sum_parts(parts, q), grads, dsinks


def _call_forward(impl, dense, c, q, k, v, device, scale, softcap) -> tuple[list, object]:
    """One call's parts [(r0, r1, out, lse)] (rows r0..r1 of the call's queries) and its aux: the varlen primitive
    (one part), or, where ``dense`` is a kernel and the call splits into dense pieces (``layout.dense``), each piece
    on its kernel (a part each)."""
    parts = c.pieces(device) if dense is not None else None
    if parts is None:
        cu_q, cu_k, _ = c.on(device)
        call = KernelCall(q, k, v, cu_q, cu_k, c.max_seqlen_q, c.max_seqlen_k, c.causal, c.window, scale, softcap)
        o, m, *aux = impl.forward(call)
        return [(0, q.shape[0], o, m)], aux[0] if aux else None
    outs, auxes = [], []
    for p, (cu_q, cu_k), pad in parts:
        if p.shape is None:
            qp, kp, vp = _rows(q, p.q0, p.q1), _rows(k, p.k0, p.k1), _rows(v, p.k0, p.k1)
            o, m, *aux = impl.forward(KernelCall(qp, kp, vp, cu_q, cu_k, p.max_q, p.max_k, c.causal, None, scale))
            aux = aux[0] if aux else None
        elif pad is None:
            (lq, lk), b = p.shape, p.batch
            qb, kb, vb = _bhld(q, p.q0, b, lq), _bhld(k, p.k0, b, lk), _bhld(v, p.k0, b, lk)
            o, m, aux = dense.forward(qb, kb, vb, c.causal, scale)
            o, m = _unbhld(o), _unbhld(m)  # (B * Lq, H, Dv), (B * Lq, H)
        else:  # right-padded to (B, W): every padded row a copy of a real one (``Piece.padding``)
            gather, entry, at = pad
            qb, kb, vb = (_bhld(x.index_select(0, gather), 0, p.batch, p.shape[0]) for x in (q, k, v))
            o, m, aux = dense.forward(qb, kb, vb, c.causal, scale)
            o, m = o.transpose(1, 2)[entry, at], m.transpose(1, 2)[entry, at]  # the real rows: (n, H, Dv), (n, H)
        outs.append((p.q0, p.q1, o, m))
        auxes.append(aux)
    return outs, auxes


def _bhld(x: torch.Tensor, r0: int, b: int, n: int) -> torch.Tensor:
    """Rows r0 .. r0 + b * n of ``x`` (T, H, ...) as (b, H, n, ...): a strided view, one op."""
    st = x.stride()
    shape, stride = (b, x.shape[1], n, *x.shape[2:]), (n * st[0], st[1], st[0], *st[2:])
    return x.as_strided(shape, stride, x.storage_offset() + r0 * st[0])


def _unbhld(x: torch.Tensor) -> torch.Tensor:
    """(b, H, n, ...) -> (b * n, H, ...): a strided view (one op) for b = 1, else a copy."""
    b, h, n = x.shape[:3]
    if b > 1:
        return x.transpose(1, 2).reshape(b * n, h, *x.shape[3:])
    st = x.stride()
    return x.as_strided((n, h, *x.shape[3:]), (st[2], st[1], *st[3:]), x.storage_offset())


def _call_backward(ctx, c, aux, dout, q, k, v, out, lse) -> tuple[list, torch.Tensor, torch.Tensor]:
    """One call's share of the merged attention's gradient, piece by piece as it ran forward: its dq parts
    [(r0, r1, dq of the call's query rows r0..r1)], dk, dv. A padded piece's pad rows are copies of real rows
    (``Piece.padding``), with zero dout: their dV share P^T dO is 0, their dS = P * (dO V^T - rowsum(dO * out)) is 0
    (P <= 1: a pad query copies the last real query of its entry and sees only keys that query sees), so they add
    nothing to dK, dV; their own dq, dk, dv are dropped."""
    parts = c.pieces(ctx.device) if ctx.dense is not None else None
    if parts is None:
        cu_q, cu_k, _ = c.on(ctx.device)
        call = KernelCall(
            q, k, v, cu_q, cu_k, c.max_seqlen_q, c.max_seqlen_k, c.causal, c.window, ctx.scale, ctx.softcap
        )
        gq, gk, gv = ctx.impl.backward(call, dout, out, lse, aux)
        return [(0, q.shape[0], gq)], gk, gv
    dqs, dks, dvs = [], [], []
    for (p, (cu_q, cu_k), pad), a in zip(parts, aux):
        if p.shape is None:
            rq, rk = (p.q0, p.q1), (p.k0, p.k1)
            d_o, qq, oo, mm = (_rows(x, *rq) for x in (dout, q, out, lse))
            call = KernelCall(qq, _rows(k, *rk), _rows(v, *rk), cu_q, cu_k, p.max_q, p.max_k, c.causal, None, ctx.scale)
            gq, gk, gv = ctx.impl.backward(call, d_o, oo, mm, a)
        elif pad is None:
            (lq, lk), b = p.shape, p.batch
            d_o, qq, oo, mm = (_bhld(x, p.q0, b, lq) for x in (dout, q, out, lse))
            kk, vv = _bhld(k, p.k0, b, lk), _bhld(v, p.k0, b, lk)
            grads = ctx.dense.backward(d_o, qq, kk, vv, oo, mm, c.causal, ctx.scale, a)
            gq, gk, gv = (_unbhld(g) for g in grads)
        else:
            gather, entry, at = pad
            qq, kk, vv, oo, mm = (_bhld(x.index_select(0, gather), 0, p.batch, p.shape[0]) for x in (q, k, v, out, lse))
            d_o = dout.new_zeros(p.batch, p.shape[0], *dout.shape[1:])
            d_o[entry, at] = _rows(dout, p.q0, p.q1)
            grads = ctx.dense.backward(d_o.transpose(1, 2), qq, kk, vv, oo, mm, c.causal, ctx.scale, a)
            gq, gk, gv = (g.transpose(1, 2)[entry, at] for g in grads)
        dqs.append((p.q0, p.q1, gq))
        dks.append(gk)
        dvs.append(gv)
    return dqs, _cat(dks), _cat(dvs)


def _cat(xs: list[torch.Tensor]) -> torch.Tensor:
    return xs[0] if len(xs) == 1 else torch.cat(xs)


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
