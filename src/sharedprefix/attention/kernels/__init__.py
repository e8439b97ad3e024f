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

Beside them: ``dense`` (the dense batched kernels that run a call's equal-shape entries as one call: the CPU flash
op, cuDNN, dense flash; ``SHAREDPREFIX_DENSE=0`` turns that dispatch off) and ``flex`` (attention-score soft-capping
on CUDA through FlexAttention, where the flash ops cannot soft-cap).
"""

from __future__ import annotations

from typing import Protocol

import torch

from sharedprefix.attention.kernels.cpu import CPU
from sharedprefix.attention.kernels.cuda import CUDA, FlashAttn
from sharedprefix.attention.kernels.reference import Reference

__all__ = [
    "ALIASES",
    "CPU",
    "CUDA",
    "IMPLEMENTATIONS",
    "AttentionKernel",
    "FlashAttn",
    "Reference",
    "missing_cuda_ops",
    "select",
]


class AttentionKernel(Protocol):
    """What every implementation of the primitive provides (the contract above; ``softcap`` only where
    ``SOFTCAP``). ``forward`` returns (out, lse) or (out, lse, aux); ``backward`` returns (dq, dk, dv)."""

    name: str
    SOFTCAP: bool

    @staticmethod
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        window: int | None,
        scale: float,
    ) -> tuple: ...

    @staticmethod
    def backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        window: int | None,
        scale: float,
        aux: object = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


IMPLEMENTATIONS: dict[str, type[AttentionKernel]] = {c.name: c for c in (Reference, CPU, CUDA, FlashAttn)}
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


def select(name: str, device: torch.device, dtype: torch.dtype | None = None) -> type[AttentionKernel]:
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
            raise ValueError(
                "attention backend 'flash_attn' needs the flash-attn package: pip install flash-attn"
            ) from None
    return IMPLEMENTATIONS[name]
