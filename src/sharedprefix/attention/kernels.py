"""The attention primitive: variable-length segments of queries against keys, with log-sum-exp.

Every device runs the same cascade (``attention.cascade``) over this one primitive; only the
implementation under it differs. The contract, in flash-attention's varlen convention:

    forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale,
            softcap=None) -> (out, lse)
    backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             causal, window, scale, softcap=None) -> (dq, dk, dv)

Notation: B = entries, Tq / Tk = packed queries / keys, H = query heads, Hkv = key/value heads
(H % Hkv == 0: GQA/MQA, never repeated where the kernel takes it natively), D = q/k head dim,
Dv = value head dim.

    q: (Tq, H, D), k: (Tk, Hkv, D), v: (Tk, Hkv, Dv), one dtype.
    cu_seqlens_q / cu_seqlens_k: (B + 1,) int32, offsets of each entry's queries / keys
        (entry b: q[cu_q[b]:cu_q[b+1]] against k[cu_k[b]:cu_k[b+1]]); an entry may have zero queries.
    causal / window: bottom-right aligned, as flash-attention: query i of an entry with Lq queries
        and Lk keys sits on key i + Lk - Lq; ``causal`` hides keys after it; ``window`` (None or an
        int >= 0) hides keys more than ``window`` before it. (A transformers sliding window of w
        tokens is ``window = w - 1``.)
    scale: the softmax scale (``module.scaling``).
    softcap: None, or c > 0: the scores are soft-capped before the softmax, s -> c * tanh(s / c) with
        s = scale * q.k (Gemma 2's attn_logit_softcapping). Only implementations with ``SOFTCAP = True``
        take it (``reference``, ``cpu``, ``flash_attn``); torch's CUDA flash ops have no soft-capping.
    out: (Tq, H, Dv) in q's dtype.
    lse: (Tq, H) natural-log log-sum-exp of the scaled scores, float32 (float64 for float64
        inputs); -inf where a query sees no key (its out is 0).
    An implementation may return a third, opaque value (the CUDA op's RNG state), which the
    caller hands back to its ``backward`` as ``aux``.

``backward`` takes the output and LSE of the *merged* attention the entry is one part of (the
identity ring attention uses): with P = exp(S - lse_merged), dV = P^T dO, dS = P * (dO V^T -
rowsum(dO * out_merged)), it returns exactly this part's share of dQ, dK, dV (with a softcap, dS is
further multiplied by the derivative of the cap, 1 - tanh(s / c)^2).

Implementations: ``reference`` (explicit float64 math, the tests' yardstick), ``cpu`` (torch's CPU
flash kernel, one call per entry, query tiles with a small local mask where a window or a
non-square causal entry needs one; with a softcap, explicit math over query tiles and key blocks merged by
log-sum-exp, which the CPU flash op cannot do), ``cuda`` (torch's own varlen flash ops, no extra dependency),
``flash_attn`` (the flash-attn package, when installed). The two GPU wrappers are kept thin: the
CPU tests cover all the logic around them.
"""

from __future__ import annotations

import torch

TILE = 256  # query rows per CPU kernel call when a local mask is needed
KEY_BLOCK = 1024  # keys per block of the explicit soft-capped CPU path: (TILE, H, KEY_BLOCK) scores at most


def _entries(cu_q: torch.Tensor, cu_k: torch.Tensor):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        yield cq[b], cq[b + 1], ck[b], ck[b + 1]


def _key_range(i0: int, i1: int, lq: int, lk: int, causal: bool, window: int | None) -> tuple[int, int]:
    """Keys any of the queries i0..i1-1 of an entry may see (bottom-right alignment)."""
    off = lk - lq
    lo = 0 if window is None else max(0, i0 + off - window)
    hi = min(lk, i1 - 1 + off + 1) if causal else lk
    return lo, max(lo, hi)


def _allowed(i0: int, i1: int, k0: int, k1: int, lq: int, lk: int, causal: bool, window: int | None, device):
    """(i1 - i0, k1 - k0) bool: which keys each query of the tile may see."""
    qi = torch.arange(i0, i1, device=device)[:, None] + (lk - lq)
    kj = torch.arange(k0, k1, device=device)[None, :]
    ok = torch.ones(i1 - i0, k1 - k0, dtype=torch.bool, device=device)
    if causal:
        ok &= kj <= qi
    if window is not None:
        ok &= kj >= qi - window
    return ok


def _lse_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _repeat_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def _fold_heads(dx: torch.Tensor, n: int) -> torch.Tensor:
    """Gradient w.r.t. repeated heads -> gradient w.r.t. the Hkv original heads."""
    if n == 1:
        return dx
    t, h, d = dx.shape
    return dx.view(t, h // n, n, d).sum(2)


def _capped(s: torch.Tensor, softcap: float | None):
    """(softcap * tanh(s / softcap), its derivative 1 - tanh^2), or (s, 1) without a softcap."""
    if softcap is None:
        return s, 1.0
    t = torch.tanh(s / softcap)
    return t * softcap, 1 - t * t


class Reference:
    """Explicit math in float64: the yardstick every other implementation is tested against."""

    name = "reference"
    SOFTCAP = True

    @staticmethod
    def _scores(q, k, scale, i0, i1, k0, k1, lq, lk, causal, window, softcap=None):
        """(H, Lq, Lk) masked scores and the derivative of the soft-cap (1 where there is none)."""
        n = q.shape[1] // k.shape[1]
        kk = _repeat_heads(k.double(), n)
        s, dcap = _capped(torch.einsum("ihd,jhd->hij", q.double(), kk) * scale, softcap)
        ok = _allowed(i0, i1, k0, k1, lq, lk, causal, window, q.device)
        return s.masked_fill(~ok, float("-inf")), dcap

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale, softcap=None):
        h, n = q.shape[1], q.shape[1] // k.shape[1]
        out = q.new_zeros(q.shape[0], h, v.shape[-1], dtype=torch.float64)
        lse = torch.full((q.shape[0], h), float("-inf"), dtype=torch.float64, device=q.device)
        for q0, q1, k0, k1 in _entries(cu_q, cu_k):
            if q1 == q0 or k1 == k0:
                continue
            s, _ = Reference._scores(q[q0:q1], k[k0:k1], scale, 0, q1 - q0, 0, k1 - k0, q1 - q0, k1 - k0, causal,
                                     window, softcap)
            m = torch.logsumexp(s, dim=-1)  # (H, Lq)
            p = torch.exp(s - m[..., None]).nan_to_num(0.0)
            out[q0:q1] = torch.einsum("hij,jhd->ihd", p, _repeat_heads(v[k0:k1].double(), n))
            lse[q0:q1] = m.t()
        return out.to(q.dtype), lse.to(_lse_dtype(q))

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, window, scale, aux=None, softcap=None):
        n = q.shape[1] // k.shape[1]
        dq = torch.zeros_like(q, dtype=torch.float64)
        dk = torch.zeros(k.shape[0], q.shape[1], k.shape[2], dtype=torch.float64, device=q.device)
        dv = torch.zeros(v.shape[0], q.shape[1], v.shape[2], dtype=torch.float64, device=q.device)
        for q0, q1, k0, k1 in _entries(cu_q, cu_k):
            if q1 == q0 or k1 == k0:
                continue
            s, dcap = Reference._scores(q[q0:q1], k[k0:k1], scale, 0, q1 - q0, 0, k1 - k0, q1 - q0, k1 - k0, causal,
                                        window, softcap)
            m = lse[q0:q1].double().t()
            m = m.masked_fill(torch.isneginf(m), float("inf"))  # a row with no key at all: P = 0, not NaN
            p = torch.exp(s - m[..., None])  # (H, Lq, Lk) under the merged lse
            do, o = dout[q0:q1].double(), out[q0:q1].double()
            vv = _repeat_heads(v[k0:k1].double(), n)
            dv[k0:k1] += torch.einsum("hij,ihd->jhd", p, do)
            dp = torch.einsum("ihd,jhd->hij", do, vv)
            delta = (do * o).sum(-1).t()[..., None]  # (H, Lq, 1)
            ds = p * (dp - delta) * dcap * scale
            dq[q0:q1] += torch.einsum("hij,jhd->ihd", ds, _repeat_heads(k[k0:k1].double(), n))
            dk[k0:k1] += torch.einsum("hij,ihd->jhd", ds, q[q0:q1].double())
        return dq.to(q.dtype), _fold_heads(dk, n).to(k.dtype), _fold_heads(dv, n).to(v.dtype)


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
        k0, k1 = _key_range(i0, i1, lq, lk, causal, window)
        yield i0, i1, k0, k1, True, False


def _pad_last(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


class CPU:
    """torch's CPU flash kernel, one call per entry (query tiles with a local mask for windows).

    The kernel needs one head size for q, k and v: where they differ (latent attention, Dv != D) the
    smaller is zero-padded, which changes neither the scores nor the output's first Dv columns.
    """

    name = "cpu"
    SOFTCAP = True

    @staticmethod
    def _mask(i0, i1, k0, k1, lq, lk, causal, window, dtype, device):
        ok = _allowed(i0, i1, k0, k1, lq, lk, causal, window, device)
        return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale, softcap=None):
        if softcap is not None:
            return _softcap_forward(q, k, v, cu_q, cu_k, causal, window, scale, softcap)
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        n = q.shape[1] // k.shape[1]
        dv_, d = v.shape[-1], max(q.shape[-1], v.shape[-1])
        q, k, v = _pad_last(q, d), _pad_last(k, d), _pad_last(v, d)
        out = q.new_zeros(q.shape[0], q.shape[1], d)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=_lse_dtype(q), device=q.device)
        for q0, q1, e0, e1 in _entries(cu_q, cu_k):
            lq, lk = q1 - q0, e1 - e0
            for i0, i1, k0, k1, masked, sq in _cpu_tiles(lq, lk, causal, window):
                if i1 == i0 or k1 == k0:
                    continue
                qq = q[q0 + i0 : q0 + i1].transpose(0, 1)[None]
                kk = _repeat_heads(k[e0 + k0 : e0 + k1], n).transpose(0, 1)[None]
                vv = _repeat_heads(v[e0 + k0 : e0 + k1], n).transpose(0, 1)[None]
                mask = CPU._mask(i0, i1, k0, k1, lq, lk, causal, window, q.dtype, q.device) if masked else None
                o, m = op(qq, kk, vv, 0.0, sq, attn_mask=mask, scale=scale)
                m = m[0].transpose(0, 1).to(lse.dtype)
                if mask is not None:  # the kernel reports lse = 0 for a row that sees no key
                    m = m.masked_fill(torch.isinf(mask).all(1)[:, None], float("-inf"))
                out[q0 + i0 : q0 + i1] = o[0].transpose(0, 1)
                lse[q0 + i0 : q0 + i1] = m
        return out[..., :dv_], lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, window, scale, aux=None, softcap=None):
        if softcap is not None:
            return _softcap_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, window, scale, softcap)
        bop = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        n = q.shape[1] // k.shape[1]
        dh, dvh, d = q.shape[-1], v.shape[-1], max(q.shape[-1], v.shape[-1])
        q, k, v, dout, out = (_pad_last(x, d) for x in (q, k, v, dout, out))
        dq = torch.zeros_like(q)
        dk = q.new_zeros(k.shape[0], q.shape[1], k.shape[2])
        dv = q.new_zeros(v.shape[0], q.shape[1], v.shape[2])
        for q0, q1, e0, e1 in _entries(cu_q, cu_k):
            lq, lk = q1 - q0, e1 - e0
            for i0, i1, k0, k1, masked, sq in _cpu_tiles(lq, lk, causal, window):
                a, b = q0 + i0, q0 + i1
                if b == a or k1 == k0:
                    continue
                t = lambda x: x.transpose(0, 1)[None].contiguous()  # noqa: E731  (rows, H, d) -> (1, H, rows, d)
                kk, vv = _repeat_heads(k[e0 + k0 : e0 + k1], n), _repeat_heads(v[e0 + k0 : e0 + k1], n)
                m = lse[a:b].to(_lse_dtype(q))
                m = m.masked_fill(torch.isneginf(m), float("inf")).t()[None].contiguous()  # no key at all: P = 0
                mask = CPU._mask(i0, i1, k0, k1, lq, lk, causal, window, q.dtype, q.device) if masked else None
                gq, gk, gv = bop(t(dout[a:b]), t(q[a:b]), t(kk), t(vv), t(out[a:b]), m, 0.0, sq, attn_mask=mask,
                                 scale=scale)
                dq[a:b] += gq[0].transpose(0, 1)
                dk[e0 + k0 : e0 + k1] += gk[0].transpose(0, 1)
                dv[e0 + k0 : e0 + k1] += gv[0].transpose(0, 1)
        return dq[..., :dh], _fold_heads(dk, n)[..., :dh], _fold_heads(dv, n)[..., :dvh]


def _softcap_blocks(lq: int, lk: int, causal: bool, window: int | None):
    """(i0, i1, b0, b1): query tiles of TILE rows and, for each, blocks of KEY_BLOCK of the keys it may see."""
    for i0 in range(0, lq, TILE):
        i1 = min(lq, i0 + TILE)
        k0, k1 = _key_range(i0, i1, lq, lk, causal, window)
        for b0 in range(k0, k1, KEY_BLOCK):
            yield i0, i1, b0, min(k1, b0 + KEY_BLOCK)


def _softcap_scores(q, k, i0, i1, b0, b1, lq, lk, causal, window, scale, softcap, n):
    """(H, tile, block) soft-capped, masked scores in the accumulation dtype, and the cap's derivative."""
    s, dcap = _capped(torch.einsum("ihd,jhd->hij", q, _repeat_heads(k, n)) * scale, softcap)
    ok = _allowed(i0, i1, b0, b1, lq, lk, causal, window, q.device)
    return s.masked_fill(~ok, float("-inf")), dcap


def _softcap_forward(q, k, v, cu_q, cu_k, causal, window, scale, softcap):
    """Soft-capped attention on the CPU: explicit scores per (query tile, key block), merged by log-sum-exp in
    float32 (float64 for float64 inputs); never more than (TILE, H, KEY_BLOCK) scores at once."""
    acc = _lse_dtype(q)
    n = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    for q0, q1, e0, e1 in _entries(cu_q, cu_k):
        lq, lk = q1 - q0, e1 - e0
        for i0, i1, b0, b1 in _softcap_blocks(lq, lk, causal, window):
            a, b = q0 + i0, q0 + i1
            s, _ = _softcap_scores(q[a:b].to(acc), k[e0 + b0 : e0 + b1].to(acc), i0, i1, b0, b1, lq, lk, causal,
                                   window, scale, softcap, n)
            m_blk = torch.logsumexp(s, -1).t()  # (tile, H)
            m_new = torch.logaddexp(lse[a:b], m_blk)
            p = torch.exp(s - m_new.t()[..., None]).nan_to_num_(0.0)  # -inf - -inf: no key yet
            keep = torch.exp(lse[a:b] - m_new).nan_to_num_(0.0)
            vv = _repeat_heads(v[e0 + b0 : e0 + b1].to(acc), n)
            out[a:b] = out[a:b] * keep[..., None] + torch.einsum("hij,jhd->ihd", p, vv)
            lse[a:b] = m_new
    return out.to(q.dtype), lse


def _softcap_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, window, scale, softcap):
    """The contract's backward for ``_softcap_forward``: P = exp(capped S - lse), dS = P (dO V^T - rowsum(dO out))
    (1 - tanh^2) scale, block by block."""
    acc = _lse_dtype(q)
    n = q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape[0], q.shape[1], k.shape[2], dtype=acc, device=q.device)
    dv = torch.zeros(v.shape[0], q.shape[1], v.shape[2], dtype=acc, device=q.device)
    m_all = lse.to(acc).masked_fill(torch.isneginf(lse), float("inf"))  # a query with no key: P = 0
    delta_all = (dout.to(acc) * out.to(acc)).sum(-1)  # (Tq, H)
    for q0, q1, e0, e1 in _entries(cu_q, cu_k):
        lq, lk = q1 - q0, e1 - e0
        for i0, i1, b0, b1 in _softcap_blocks(lq, lk, causal, window):
            a, b, c, d = q0 + i0, q0 + i1, e0 + b0, e0 + b1
            qq, kk = q[a:b].to(acc), k[c:d].to(acc)
            s, dcap = _softcap_scores(qq, kk, i0, i1, b0, b1, lq, lk, causal, window, scale, softcap, n)
            p = torch.exp(s - m_all[a:b].t()[..., None])  # (H, tile, block)
            do = dout[a:b].to(acc)
            dv[c:d] += torch.einsum("hij,ihd->jhd", p, do)
            dp = torch.einsum("ihd,jhd->hij", do, _repeat_heads(v[c:d].to(acc), n))
            ds = p * (dp - delta_all[a:b].t()[..., None]) * dcap * scale
            dq[a:b] += torch.einsum("hij,jhd->ihd", ds, _repeat_heads(kk, n))
            dk[c:d] += torch.einsum("hij,ihd->jhd", ds, qq)
    return dq.to(q.dtype), _fold_heads(dk, n).to(k.dtype), _fold_heads(dv, n).to(v.dtype)


def _flash_window(causal: bool, window: int | None, max_k: int) -> tuple[int, int]:
    """flash's (window_size_left, window_size_right), bottom-right aligned like the contract.

    No window is passed as ``max_k`` rather than -1: same attention (the kernels reset any left window >=
    max_seqlen_k to -1), but only after they choose their single-query GQA path (max_seqlen_q == 1, both
    windows < 0), which reshapes q as if every entry had exactly one query and fails on an entry with none.
    """
    return (max_k if window is None else window, 0 if causal else -1)


def _flash_dim(q: torch.Tensor, v: torch.Tensor) -> int:
    """The head size the flash kernels get: one for q, k and v (they require it), a multiple of 8 (likewise).

    Zero columns change neither the scores (the scale is passed explicitly) nor the first Dv output columns;
    the wrappers pad up to it and slice the results back, as ``CPU`` does for Dv != D.
    """
    return -(-max(q.shape[-1], v.shape[-1]) // 8) * 8


def _cut_last(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if x.shape[-1] == d else x[..., :d]


def _lse_from_flash(lse: torch.Tensor) -> torch.Tensor:
    """flash's varlen LSE (H, Tq) -> (Tq, H); flash writes +inf where a query sees no key, the contract -inf."""
    lse = lse.t().float()
    return lse.masked_fill(lse == float("inf"), float("-inf"))


def _lse_to_flash(lse: torch.Tensor) -> torch.Tensor:
    """(Tq, H) -> flash's contiguous (H, Tq) float32; -inf (no key) back to flash's +inf, so that P = 0 there."""
    lse = lse.float()
    return lse.masked_fill(lse == float("-inf"), float("inf")).t().contiguous()


class CUDA:
    """torch's own varlen flash ops (``aten._flash_attention_forward/backward``); GQA native.

    The ops take float16 / bfloat16, head sizes up to 256 and sm80 or newer. Run on an H200 (torch 2.11,
    CUDA 13): tests/gpu passes (``scripts/dev gpu-check``, benchmarks/gpu_nvidia_h200.txt).
    """

    name = "cuda"
    SOFTCAP = False

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale):
        wl, wr = _flash_window(causal, window, max_k)
        dv_, d = v.shape[-1], _flash_dim(q, v)
        q, k, v = (_pad_last(x, d).contiguous() for x in (q, k, v))
        res = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                      scale=scale, window_size_left=wl, window_size_right=wr)
        # (output, softmax_logsumexp (H, Tq), rng_state, unused, debug_attn_mask); the RNG state for the backward
        return _cut_last(res[0], dv_), _lse_from_flash(res[1]), (res[2], res[3])

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, window, scale, aux=None):
        wl, wr = _flash_window(causal, window, max_k)
        if aux is None:  # the kernel reads the RNG state only under dropout, which is 0 here
            aux = (torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device))
        rng, unused = aux
        dh, dvh, d = q.shape[-1], v.shape[-1], _flash_dim(q, v)
        q, k, v, dout, out = (_pad_last(x, d).contiguous() for x in (q, k, v, dout, out))
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, _lse_to_flash(lse), cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused,
            scale=scale, window_size_left=wl, window_size_right=wr)
        return _cut_last(dq, dh), _cut_last(dk, dh), _cut_last(dv, dvh)


def _flash_attn_interface():
    """flash-attn's interface module; 2.7 or newer (2.6 and older take ``window_size=(l, r)`` and return 8 values)."""
    import flash_attn
    from flash_attn import flash_attn_interface

    version = tuple(int(x) for x in flash_attn.__version__.split(".")[:2] if x.isdigit())
    if version < (2, 7):
        raise ValueError(f"attention backend 'flash_attn' needs flash-attn>=2.7, found {flash_attn.__version__}; "
                         "upgrade it, or use backend='cuda' (torch's own flash kernels).")
    return flash_attn_interface


class FlashAttn:
    """The flash-attn package's varlen kernels (2.7 or newer). Never run: the GPU machine had no flash-attn."""

    name = "flash_attn"
    SOFTCAP = True  # flash-attn's varlen kernels take softcap (not run here: see the class docstring)

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale, softcap=None):
        fa = _flash_attn_interface()
        wl, wr = _flash_window(causal, window, max_k)
        dv_, d = v.shape[-1], _flash_dim(q, v)
        q, k, v = (_pad_last(x, d).contiguous() for x in (q, k, v))
        out, lse, _, _ = fa._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, causal=causal,
                                                       window_size_left=wl, window_size_right=wr,
                                                       softcap=float(softcap or 0.0))
        return _cut_last(out, dv_), _lse_from_flash(lse)  # (out, softmax_lse (H, Tq), S_dmask, rng_state)

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, window, scale, aux=None, softcap=None):
        fa = _flash_attn_interface()
        wl, wr = _flash_window(causal, window, max_k)
        dh, dvh, d = q.shape[-1], v.shape[-1], _flash_dim(q, v)
        q, k, v, dout, out = (_pad_last(x, d).contiguous() for x in (q, k, v, dout, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # positional after the scale: causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic
        fa._flash_attn_varlen_backward(dout, q, k, v, out, _lse_to_flash(lse), dq, dk, dv, cu_q, cu_k, max_q, max_k,
                                       0.0, scale, causal, wl, wr, float(softcap or 0.0), None, False)
        return _cut_last(dq, dh), _cut_last(dk, dh), _cut_last(dv, dvh)


IMPLEMENTATIONS = {c.name: c for c in (Reference, CPU, CUDA, FlashAttn)}
ALIASES = {"sdpa": "auto", "eager": "reference"}  # names of earlier versions


def missing_cuda_ops() -> list[str]:
    """The aten varlen flash ops (or the keyword arguments) this torch lacks, for a clear error at selection."""
    out = []
    for op, kw in (("_flash_attention_forward", "window_size_left"), ("_flash_attention_backward", "window_size_left")):
        packet = getattr(torch.ops.aten, op, None)
        if packet is None:
            out.append(f"torch.ops.aten.{op}")
        elif kw not in {a.name for a in packet.default._schema.arguments}:
            out.append(f"torch.ops.aten.{op}(..., {kw}=)")
    return out


def select(name: str, device: torch.device, dtype: torch.dtype | None = None):
    """The implementation for ``name`` ("auto", "cpu", "cuda", "flash_attn", "reference") on ``device``
    (and for tensors of ``dtype``, when known)."""
    name = ALIASES.get(name, name)
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "cpu"
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention backend {name!r} is unknown; expected one of {['auto', *sorted(IMPLEMENTATIONS)]} "
            "('auto' picks 'cuda' on CUDA tensors and 'cpu' otherwise)."
        )
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention backend 'cpu' got tensors on {device}; use backend='auto'.")
    if name in ("cuda", "flash_attn") and device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs CUDA tensors, got {device}; use backend='auto' on CPU.")
    if name in ("cuda", "flash_attn") and dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"attention backend {name!r} (the CUDA flash kernels) takes bfloat16 or float16 tensors, got {dtype}. Run "
            "the model in bf16 (model.to(torch.bfloat16), or torch.autocast('cuda', dtype=torch.bfloat16)), or pass "
            "backend='reference' (explicit float64 math per entry: for checks, its memory grows with entry length "
            "squared)."
        )
    if name == "cuda" and (missing := missing_cuda_ops()):
        raise ValueError(
            f"attention backend 'cuda' needs {', '.join(missing)}, which torch {torch.__version__} lacks; install "
            "torch>=2.5 built with flash attention, or the flash-attn package and pass backend='flash_attn'."
        )
    if name == "flash_attn":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise ValueError("attention backend 'flash_attn' needs the flash-attn package: pip install flash-attn") from None
    return IMPLEMENTATIONS[name]
