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
once per process, device and dtype; otherwise the dense calls take ``DenseFlash`` and a warning says why. The CUDA
ones, ``cuda_dense`` and ``disagreement`` live in ``attention.kernels.dense_cuda``; this module re-exports them.

Dense dispatch is on by default; ``SHAREDPREFIX_DENSE=0`` in the environment, or ``with dense_dispatch(False):``,
keeps every call on the varlen primitive (the benchmark's ablation).

Notation: B = entries, Lq / Lk = queries / keys per entry, H / Hkv = query / key-value heads, D / Dv = head dims.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from sharedprefix import settings
from sharedprefix.attention.kernels.common import cut_last, lse_in, pad_last
from sharedprefix.attention.kernels.contract import KernelCall
from sharedprefix.attention.kernels.dense_cuda import CUDNN_MAX_HEAD_DIM, CuDNN, DenseFlash, cuda_dense, disagreement
from sharedprefix.attention.kernels.reference import Reference

__all__ = [
    "CuDNN",
    "DenseCPU",
    "DenseFlash",
    "DenseReference",
    "cuda_dense",
    "dense_dispatch",
    "dense_enabled",
    "dense_for",
    "disagreement",
]

_STATE: dict = {
    "enabled": None
}  # None: as SHAREDPREFIX_DENSE says now (``settings``); a bool inside ``dense_dispatch``


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


class DenseCPU:
    """torch's CPU flash op, GQA native, on the strided views as they come (as plain SDPA hands it them: no copies);
    q, k, v zero-padded to one head size where D != Dv."""

    name = "dense_cpu"

    @staticmethod
    def forward(q, k, v, causal, scale):
        d, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
        t = lambda x: pad_last(x, d)  # noqa: E731
        o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(t(q), t(k), t(v), 0.0, causal, scale=scale)
        return cut_last(o, dv), m, None

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, aux=None):
        dh, dvh, d = q.shape[-1], v.shape[-1], max(q.shape[-1], v.shape[-1])
        lse = lse_in(lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32))
        t = lambda x: pad_last(x, d)  # noqa: E731
        bop = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        gq, gk, gv = bop(t(dout), t(q), t(k), t(v), t(out), lse, 0.0, causal, scale=scale)
        return cut_last(gq, dh), cut_last(gk, dh), cut_last(gv, dvh)


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
