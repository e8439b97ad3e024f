"""The CUDA dense kernels under the cascade (``attention.kernels.dense`` has the contract): ``CuDNN``
(``aten._scaled_dot_product_cudnn_attention`` and its backward, which take out and logsumexp) and ``DenseFlash``
(torch's dense flash op, the fallback), and ``cuda_dense``, which picks CuDNN only where ``dense.disagreement`` found it
keeping the contract (once per process, device and dtype). Both take the contract's (B, H, L, D) tensors, repeat the
K/V heads to H and pad q, k, v to one head size (a multiple of 8), dense.

Notation: B = entries, Lq / Lk = queries / keys per entry, H / Hkv = query / key-value heads, D / Dv = head dims.
"""

from __future__ import annotations

import warnings

import torch

from sharedprefix.attention.kernels.common import cut_last, lse_in, pad_last

_CUDA_CHOICE: dict = {}  # (device, dtype) -> CuDNN or DenseFlash, decided once
CUDNN_MAX_HEAD_DIM = 128  # larger head dims take DenseFlash (up to 256)


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
    g = cut_last(dx, d)
    if n == 1:
        return g
    b, h, seq, _ = g.shape
    return g.reshape(b, h // n, n, seq, d).sum(2)


class _CudaDense:
    """Shared by the CUDA dense ops: K/V heads repeated to H, one head size (a multiple of 8) for q, k, v, dense."""

    @staticmethod
    def _inputs(q, k, v):
        n, d = q.shape[1] // k.shape[1], -(-max(q.shape[-1], v.shape[-1]) // 8) * 8
        return n, d, _contiguous(q, d), _contiguous(_repeat(k, n), d), _contiguous(_repeat(v, n), d)

    @staticmethod
    def _grads(q, k, v, n, gq, gk, gv):
        return cut_last(gq, q.shape[-1]), _fold(gk, n, k.shape[-1]), _fold(gv, n, v.shape[-1])


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
        return cut_last(out, v.shape[-1]), lse.reshape(b, h, lq).float(), aux

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, aux=None):
        shape, cq, ck, mq, mk, seed, offset = aux
        n, d, qq, kk, vv = CuDNN._inputs(q, k, v)
        m = lse_in(lse.float()).contiguous().view(shape)
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
        return cut_last(res[0], v.shape[-1]), res[1].float(), tuple(res[2:8])

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, aux=None):
        cq, ck, mq, mk, rng, unused = aux
        n, d, qq, kk, vv = DenseFlash._inputs(q, k, v)
        m = lse_in(lse.float()).contiguous()
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
