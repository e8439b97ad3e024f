"""Dense batched attention kernels for the cascade calls whose entries share one shape (``layout.dense``).

The contract is the varlen primitive's (``attention.kernels``) on B equal entries, in the kernels' own layout,
batch, heads, tokens: the cascade hands them strided views (one ``as_strided`` op, no copy) of the (B * L, H, D)
rows, as transformers hands plain SDPA its (B, H, L, D) views:

    forward(q, k, v, causal, scale) -> (out, lse, aux)
    backward(dout, q, k, v, out, lse, causal, scale, aux) -> (dq, dk, dv)

    q: (B, H, Lq, D), k: (B, Hkv, Lk, D), v: (B, Hkv, Lk, Dv), one dtype, any strides with a unit last stride;
        ``causal`` only with Lq == Lk (the dense kernels align the diagonal top-left, the contract bottom-right: the
        same only for square entries).
    out: (B, H, Lq, Dv) in q's dtype; lse: (B, H, Lq) natural-log log-sum-exp of the scaled scores, float32
        (float64 for float64 inputs), -inf where a query sees no key; aux: opaque, handed back to ``backward``.
    ``backward`` takes dout (B, H, Lq, Dv) and the *merged* out (B, H, Lq, Dv) and lse (B, H, Lq) of the attention
    this call is one part of, and returns exactly this part's share of dQ, dK, dV, shaped as q, k, v, as the varlen
    primitive does.

Implementations: ``DenseCPU`` (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, GQA native),
``CuDNN`` (``aten._scaled_dot_product_cudnn_attention`` and its backward, which take out and logsumexp; not its
varlen path, whose backward on torch 2.11 sizes a buffer by the head dim, pytorch#186142, and whose [heads, tokens]
LSE layout gives zero gradients on cuDNN 9.22-9.26, cudnn-frontend#462), ``DenseFlash`` (torch's dense flash op, the
CUDA fallback), ``DenseReference`` (float64 math through ``Reference``, for tests). On CUDA, ``CuDNN`` is used only
after ``disagreement`` found its LSE units, layout and scale and its merged-LSE backward equal to ``DenseFlash``'s
once per process, device and dtype; otherwise the dense calls take ``DenseFlash`` and a warning says why.

Dense dispatch is on by default; ``SHAREDPREFIX_DENSE=0`` in the environment, or ``with dense_dispatch(False):``,
keeps every call on the varlen primitive (the benchmark's ablation).

Notation: B = entries, Lq / Lk = queries / keys per entry, H / Hkv = query / key-value heads, D / Dv = head dims.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from sharedprefix import settings
from sharedprefix.attention.kernels.common import pad_last
from sharedprefix.attention.kernels.contract import KernelCall
from sharedprefix.attention.kernels.reference import Reference

_STATE: dict = {
    "enabled": None
}  # None: as SHAREDPREFIX_DENSE says now (``settings``); a bool inside ``dense_dispatch``
_CUDA_CHOICE: dict = {}  # (device, dtype) -> CuDNN or DenseFlash, decided once
CUDNN_MAX_HEAD_DIM = 128  # larger head dims take DenseFlash (up to 256)


@contextmanager
def dense_dispatch(enabled: bool):
    """Turn dense dispatch on or off inside the block (off: every cascade call runs on the varlen primitive)."""
    before = _STATE["enabled"]
    _STATE["enabled"] = bool(enabled)
    try:
        yield
    finally:
        _STATE["enabled"] = before


def dense_enabled() -> bool:
    if _STATE["enabled"] is None:
        return settings.read("SHAREDPREFIX_DENSE") == "1"
    return _STATE["enabled"]


def dense_for(impl, device: torch.device, dtype: torch.dtype, head_dim: int):
    """The dense kernel paired with the varlen ``impl`` for these tensors, or None (dispatch off, the reference,
    or no dense kernel for the head size)."""
    if not dense_enabled():
        return None
    if impl.name == "cpu":
        return DenseCPU
    if impl.name in ("cuda", "flash_attn") and device.type == "cuda":
        d = -(-head_dim // 8) * 8
        if d > 256:
            return None
        return DenseFlash if d > CUDNN_MAX_HEAD_DIM else cuda_dense(device, dtype)
    return None


def cuda_dense(device: torch.device, dtype: torch.dtype):
    """CuDNN where it agrees with DenseFlash on this device and dtype (checked once), else DenseFlash with a warning."""
    key = (str(device), dtype)
    if key not in _CUDA_CHOICE:
        reason = _cudnn_refusal(device, dtype)
        if reason:
            warnings.warn(
                f"sharedprefix: cuDNN's dense attention on {torch.cuda.get_device_name(device)} {reason}; the dense "
                "cascade calls use torch's dense flash kernel instead (exact, slower on Hopper).",
                stacklevel=3,
            )
        _CUDA_CHOICE[key] = DenseFlash if reason else CuDNN
    return _CUDA_CHOICE[key]


def _cudnn_refusal(device, dtype) -> str | None:
    if getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None) is None:
        return f"is missing from torch {torch.__version__}"
    if not torch.backends.cudnn.is_available():
        return "is unavailable (torch.backends.cudnn.is_available() is False)"
    try:
        return disagreement(CuDNN, DenseFlash, device, dtype)
    except RuntimeError as e:  # the op refused the probe's shapes, dtype or device
        return f"failed on a probe batch ({str(e).splitlines()[0]})"


def _tol(dtype) -> float:
    return {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 3e-2)


def disagreement(candidate, yardstick, device, dtype, b: int = 2, h: int = 4, hkv: int = 2, d: int = 64) -> str | None:
    """Why ``candidate`` breaks the contract where ``yardstick`` keeps it, or None when they agree: on random
    batches, causal square and non-causal rectangular, the LSE (units, layout, scale) and the outputs must agree,
    and so must the gradients of a merged-LSE backward (the keys split in two parts, each part's backward given the
    merged out and lse, as the cascade calls it), to a relative ``_tol(dtype)``."""
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.float32).to(dtype)  # noqa: E731
    scale = 0.3  # not d ** -0.5: a kernel that ignored the scale would pass with the default one
    for causal, lq, lk in ((True, 80, 80), (False, 48, 144)):
        q, k, v = rnd(b, h, lq, d), rnd(b, hkv, lk, d), rnd(b, hkv, lk, d)
        o1, m1, _ = candidate.forward(q, k, v, causal, scale)
        o2, m2, _ = yardstick.forward(q, k, v, causal, scale)
        if tuple(m1.shape) != (b, h, lq):
            return f"returned a log-sum-exp of shape {tuple(m1.shape)}, expected {(b, h, lq)}"
        if (err := _rel(m1, m2)) > _tol(dtype):
            ratio = (m1.double() / m2.double()).median().item()
            return (
                f"returned a log-sum-exp {err:.3g} away from {yardstick.name}'s (median ratio {ratio:.4g}; "
                "natural-log units of the scaled scores expected)"
            )
        if (err := _rel(o1, o2)) > _tol(dtype):
            return f"returned outputs {err:.3g} away from {yardstick.name}'s"
    dout = rnd(b, h, lq, d)
    half = lk // 2
    parts = [(k[:, :, :half], v[:, :, :half]), (k[:, :, half:], v[:, :, half:])]
    fw = [candidate.forward(q, kk, vv, False, scale) for kk, vv in parts]
    lse = torch.logaddexp(fw[0][1], fw[1][1])
    out = sum(torch.exp(m - lse)[..., None] * o.to(lse.dtype) for o, m, _ in fw).to(dtype)
    grads = [candidate.backward(dout, q, kk, vv, out, lse, False, scale, a) for (kk, vv), (_, _, a) in zip(parts, fw)]
    mine = (
        grads[0][0] + grads[1][0],
        torch.cat([grads[0][1], grads[1][1]], 2),
        torch.cat([grads[0][2], grads[1][2]], 2),
    )
    o2, m2, a2 = yardstick.forward(q, k, v, False, scale)
    for name, x, y in zip(("dq", "dk", "dv"), mine, yardstick.backward(dout, q, k, v, o2, m2, False, scale, a2)):
        if (err := _rel(x, y)) > _tol(dtype):
            zero = " (all zero)" if not x.abs().max() > 0 else ""
            return f"gave a merged-LSE backward whose {name} is {err:.3g} away from {yardstick.name}'s{zero}"
    return None


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()


def _contiguous(x: torch.Tensor, d: int) -> torch.Tensor:
    """(B, H, L, d0) -> contiguous, zero-padded to head size d (the CUDA dense ops want dense inputs)."""
    return pad_last(x, d).contiguous()


def _repeat(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, Hkv, L, d) -> (B, Hkv * n, L, d), each head repeated n times (the kernels without native GQA)."""
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def _fold(dx: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """(B, H, L, d') gradient of repeated, padded heads -> (B, Hkv, L, d)."""
    g = _cut(dx, d)
    if n == 1:
        return g
    b, h, seq, _ = g.shape
    return g.reshape(b, h // n, n, seq, d).sum(2)


def _lse_in(lse: torch.Tensor) -> torch.Tensor:
    """The contract's merged (B, H, Lq) lse with -inf (no key) as +inf, so that the kernels' P = exp(S - lse) is 0
    there, not NaN."""
    inf = float("inf")
    return lse.nan_to_num(posinf=inf, neginf=inf)


class DenseCPU:
    """torch's CPU flash op, GQA native, on the strided views as they come (as plain SDPA hands it them: no copies);
    q, k, v zero-padded to one head size where D != Dv."""

    name = "dense_cpu"

    @staticmethod
    def forward(q, k, v, causal, scale):
        d, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
        t = lambda x: pad_last(x, d)  # noqa: E731
        o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(t(q), t(k), t(v), 0.0, causal, scale=scale)
        return _cut(o, dv), m, None

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, aux=None):
        dh, dvh, d = q.shape[-1], v.shape[-1], max(q.shape[-1], v.shape[-1])
        lse = _lse_in(lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32))
        t = lambda x: pad_last(x, d)  # noqa: E731
        bop = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        gq, gk, gv = bop(t(dout), t(q), t(k), t(v), t(out), lse, 0.0, causal, scale=scale)
        return _cut(gq, dh), _cut(gk, dh), _cut(gv, dvh)


def _cut(x: torch.Tensor, d: int) -> torch.Tensor:
    """The first ``d`` columns of the last dim; no op where that is all of them."""
    return x if x.shape[-1] == d else x[..., :d]


class _CudaDense:
    """Shared by the CUDA dense ops: K/V heads repeated to H, one head size (a multiple of 8) for q, k, v, dense."""

    @staticmethod
    def _inputs(q, k, v):
        n, d = q.shape[1] // k.shape[1], -(-max(q.shape[-1], v.shape[-1]) // 8) * 8
        return n, d, _contiguous(q, d), _contiguous(_repeat(k, n), d), _contiguous(_repeat(v, n), d)

    @staticmethod
    def _grads(q, k, v, n, gq, gk, gv):
        return _cut(gq, q.shape[-1]), _fold(gk, n, k.shape[-1]), _fold(gv, n, v.shape[-1])


class CuDNN(_CudaDense):
    """``aten._scaled_dot_product_cudnn_attention`` (dense, batch-major) and its backward."""

    name = "cudnn"

    @staticmethod
    def forward(q, k, v, causal, scale):
        b, h, lq = q.shape[:3]
        n, d, qq, kk, vv = CuDNN._inputs(q, k, v)
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qq, kk, vv, None, True, 0.0, causal, False, scale=scale
        )
        out, lse = res[0], res[1]  # then cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset
        aux = (tuple(lse.shape), *res[2:8])
        return _cut(out, v.shape[-1]), lse.reshape(b, h, lq).float(), aux

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, aux=None):
        shape, cq, ck, mq, mk, seed, offset = aux
        n, d, qq, kk, vv = CuDNN._inputs(q, k, v)
        m = _lse_in(lse.float()).contiguous().view(shape)
        bop = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
        gq, gk, gv = bop(
            _contiguous(dout, d),
            qq,
            kk,
            vv,
            _contiguous(out, d),
            m,
            seed,
            offset,
            None,
            cq,
            ck,
            mq,
            mk,
            0.0,
            causal,
            scale=scale,
        )
        return CuDNN._grads(q, k, v, n, gq, gk, gv)


class DenseFlash(_CudaDense):
    """``aten._scaled_dot_product_flash_attention`` (torch's dense flash op) and its backward."""

    name = "dense_flash"

    @staticmethod
    def forward(q, k, v, causal, scale):
        n, d, qq, kk, vv = DenseFlash._inputs(q, k, v)
        res = torch.ops.aten._scaled_dot_product_flash_attention(qq, kk, vv, 0.0, causal, False, scale=scale)
        # (output, logsumexp (B, H, Lq), cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask)
        return _cut(res[0], v.shape[-1]), res[1].float(), tuple(res[2:8])

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, aux=None):
        cq, ck, mq, mk, rng, unused = aux
        n, d, qq, kk, vv = DenseFlash._inputs(q, k, v)
        m = _lse_in(lse.float()).contiguous()
        bop = torch.ops.aten._scaled_dot_product_flash_attention_backward
        gq, gk, gv = bop(
            _contiguous(dout, d),
            qq,
            kk,
            vv,
            _contiguous(out, d),
            m,
            cq,
            ck,
            mq,
            mk,
            0.0,
            causal,
            rng,
            unused,
            scale=scale,
        )
        return DenseFlash._grads(q, k, v, n, gq, gk, gv)


class DenseReference:
    """``Reference`` over the B entries (float64 math): the yardstick of the dense tests."""

    name = "dense_reference"

    @staticmethod
    def _call(q, k, v, causal, scale) -> KernelCall:
        b, lq, lk = q.shape[0], q.shape[2], k.shape[2]
        ar = torch.arange(b + 1, dtype=torch.int32, device=q.device)
        return KernelCall(_rows(q), _rows(k), _rows(v), ar * lq, ar * lk, lq, lk, causal, None, scale)

    @staticmethod
    def forward(q, k, v, causal, scale):
        b, h, lq = q.shape[:3]
        o, m = Reference.forward(DenseReference._call(q, k, v, causal, scale))
        return o.view(b, lq, h, -1).transpose(1, 2), m.view(b, lq, h).transpose(1, 2), None

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, aux=None):
        g = Reference.backward(DenseReference._call(q, k, v, causal, scale), _rows(dout), _rows(out), _rows(lse))
        return tuple(x.view(y.shape[0], y.shape[2], y.shape[1], -1).transpose(1, 2) for x, y in zip(g, (q, k, v)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, ...) -> (B * L, H, ...)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], *x.shape[3:])
