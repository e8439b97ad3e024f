"""The typed contract of the attention primitive: one ``KernelCall`` value in, (out, lse) out.

A kernel call is one frozen value (``KernelCall``) holding the packed tensors and the index tensors of a call in
flash-attention's varlen convention, built by the cascade (``attention.cascade``) once per layer and cascade call
from the index tensors the row's layout built once per pass (``layout.calls.Call.on``). Every implementation of
the primitive (``AttentionKernel``) takes it whole:

    forward(call) -> (out, lse) or (out, lse, aux)
    backward(call, dout, out, lse, aux=None) -> (dq, dk, dv)

Notation: B = entries, Tq / Tk = packed queries / keys, H = query heads, Hkv = key/value heads (H % Hkv == 0),
D = q/k head dim, Dv = value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class KernelCall:
    """One call of the varlen attention primitive: entry b is the queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``
    against the keys ``k[cu_seqlens_k[b]:cu_seqlens_k[b+1]]`` (an entry may have no queries or no keys).

    Attributes:
        q: (Tq, H, D) queries, float16 / bfloat16 / float32 / float64.
        k: (Tk, Hkv, D) keys, q's dtype.
        v: (Tk, Hkv, Dv) values, q's dtype.
        cu_seqlens_q: (B + 1,) int32, offsets of each entry's queries into ``q`` (first 0, last Tq), on q's device.
        cu_seqlens_k: (B + 1,) int32, offsets of each entry's keys into ``k`` (first 0, last Tk), on q's device.
        max_seqlen_q: the longest entry's queries, in tokens.
        max_seqlen_k: the longest entry's keys, in tokens.
        causal: bottom-right aligned causal mask: query i of an entry with Lq queries and Lk keys sits on key
            i + Lk - Lq and sees no key after it.
        window: None, or keys (>= 0): query i also sees no key more than ``window`` before its own (bottom-right
            aligned). A transformers sliding window of w tokens is ``window = w - 1``.
        scale: the softmax scale of the scores, s = scale * q.k (``module.scaling``).
        softcap: None, or c > 0: scores soft-capped before the softmax, s -> c * tanh(s / c) (Gemma 2); only for
            implementations whose ``SOFTCAP`` is True.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    window: int | None
    scale: float
    softcap: float | None = None


class AttentionKernel(Protocol):
    """What every implementation of the primitive provides.

    ``forward(call)`` returns ``out`` (Tq, H, Dv) in q's dtype and ``lse`` (Tq, H), the natural-log log-sum-exp of
    the scaled scores, float32 (float64 for float64 inputs), -inf where a query sees no key (its out is 0); and
    optionally a third, opaque value ``aux`` (the CUDA op's RNG state) that the caller hands back to ``backward``.

    ``backward(call, dout, out, lse, aux)`` takes dout (Tq, H, Dv) and the output and LSE of the *merged* attention
    this call is one part of (``attention.merge.merge_state``): with P = exp(S - lse), dV = P^T dO,
    dS = P * (dO V^T - rowsum(dO * out)), it returns exactly this call's share (dq (Tq, H, D), dk (Tk, Hkv, D),
    dv (Tk, Hkv, Dv)), each in its input's dtype (with a softcap, dS is further multiplied by 1 - tanh(s / c)^2).
    """

    name: str
    SOFTCAP: bool

    @staticmethod
    def forward(call: KernelCall) -> tuple: ...

    @staticmethod
    def backward(
        call: KernelCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, aux: object = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def refuse_softcap(name: str, call: KernelCall) -> None:
    """Raise where ``call`` asks an implementation without soft-capping (``name``) to soft-cap."""
    if call.softcap is not None:
        raise ValueError(
            f"attention backend {name!r} has no attention-score soft-capping, but the call asks for softcap="
            f"{call.softcap}; the cascade runs soft-capped layers on a backend whose SOFTCAP is True, or on "
            "FlexAttention (attention.kernels.flex)."
        )
