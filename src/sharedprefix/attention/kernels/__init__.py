"""The attention primitive: variable-length segments of queries against keys, with log-sum-exp.

Every device runs the same cascade (``attention.cascade``) over this one primitive; only the
implementation under it differs. The contract, in flash-attention's varlen convention, takes one typed value,
``KernelCall`` (``attention.kernels.contract``), holding every argument below:

    forward(call) -> (out, lse)
    backward(call, dout, out, lse, aux=None) -> (dq, dk, dv)

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
        take it (``reference``, ``cpu``, ``flash_attn``); torch's CUDA flash ops have no soft-capping and refuse it.
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

Which implementation runs where is one table, ``BACKENDS``: each entry's device types, dtypes, soft-capping
and availability check; ``select`` reads it (and ``"auto"`` picks the first entry marked ``auto`` for the device).

Beside them: ``dense`` (the dense batched kernels that run a call's equal-shape entries as one call: the CPU flash
op, cuDNN, dense flash; ``SHAREDPREFIX_DENSE=0`` turns that dispatch off) and ``flex`` (attention-score soft-capping
on CUDA through FlexAttention, where the flash ops cannot soft-cap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sharedprefix.attention.kernels.contract import AttentionKernel, KernelCall
from sharedprefix.attention.kernels.cpu import CPU
from sharedprefix.attention.kernels.cuda import CUDA, FlashAttn
from sharedprefix.attention.kernels.reference import Reference

__all__ = [
    "ALIASES",
    "BACKENDS",
    "CPU",
    "CUDA",
    "IMPLEMENTATIONS",
    "AttentionKernel",
    "Backend",
    "FlashAttn",
    "KernelCall",
    "Reference",
    "missing_cuda_ops",
    "select",
]


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


def _cuda_missing() -> str | None:
    if missing := missing_cuda_ops():
        return (
            f"attention backend 'cuda' needs {', '.join(missing)}, which torch {torch.__version__} lacks; install "
            "torch>=2.5 built with flash attention, or the flash-attn package and pass backend='flash_attn'."
        )
    return None


def _flash_attn_missing() -> str | None:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "attention backend 'flash_attn' needs the flash-attn package: pip install flash-attn"
    return None


_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Backend:
    """One implementation of the primitive and the rules of where it runs.

    Attributes:
        kernel: the implementation (``AttentionKernel``).
        devices: the device types whose tensors it takes ("cpu", "cuda").
        dtypes: the dtypes it takes, or None for any.
        auto: ``"auto"`` picks it on these device types (the first such entry of ``BACKENDS`` wins).
        missing: None where it can run in this process, else a function that says why not (or None).
    """

    kernel: type[AttentionKernel]
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] | None = None
    auto: tuple[str, ...] = ()
    missing: Callable[[], str | None] | None = None

    @property
    def name(self) -> str:
        return self.kernel.name

    @property
    def softcap(self) -> bool:
        """Whether it soft-caps the scores itself (else soft-capped layers run on FlexAttention, CUDA only)."""
        return self.kernel.SOFTCAP


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(CUDA, devices=("cuda",), dtypes=_HALF, auto=("cuda",), missing=_cuda_missing),
        Backend(CPU, devices=("cpu",), auto=("cpu",)),
        Backend(FlashAttn, devices=("cuda",), dtypes=_HALF, missing=_flash_attn_missing),
        Backend(Reference, devices=("cpu", "cuda")),
    )
}
IMPLEMENTATIONS: dict[str, type[AttentionKernel]] = {n: b.kernel for n, b in BACKENDS.items()}
ALIASES = {"sdpa": "auto", "eager": "reference"}  # names of earlier versions


def _auto(device: torch.device) -> str:
    for name, b in BACKENDS.items():
        if device.type in b.auto:
            return name
    return "cpu"  # any other device type: the CPU entry's device check below says why it cannot run


def select(name: str, device: torch.device, dtype: torch.dtype | None = None) -> type[AttentionKernel]:
    """The implementation for ``name`` ("auto" or a key of ``BACKENDS``) on ``device`` (and for tensors of
    ``dtype``, when known), by the rules of its ``BACKENDS`` entry."""
    name = ALIASES.get(name, name)
    if name == "auto":
        name = _auto(device)
    if name not in BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is unknown; expected one of {['auto', *sorted(BACKENDS)]} "
            "('auto' picks 'cuda' on CUDA tensors and 'cpu' otherwise)."
        )
    b = BACKENDS[name]
    if device.type not in b.devices:
        if b.devices == ("cpu",):
            raise ValueError(f"attention backend {name!r} got tensors on {device}; use backend='auto'.")
        raise ValueError(
            f"attention backend {name!r} needs {' or '.join(d.upper() for d in b.devices)} tensors, got {device}; "
            "use backend='auto' on CPU."
        )
    if b.dtypes is not None and dtype is not None and dtype not in b.dtypes:
        takes = " or ".join(str(d).removeprefix("torch.") for d in b.dtypes)
        raise ValueError(
            f"attention backend {name!r} takes {takes} tensors, got {dtype}. Run the model in bf16 "
            "(model.to(torch.bfloat16), or torch.autocast('cuda', dtype=torch.bfloat16)), or pass backend='reference' "
            "(explicit float64 math per entry: for checks, its memory grows with entry length "
            "squared)."
        )
    if b.missing is not None and (why := b.missing()) is not None:
        raise ValueError(why)
    return b.kernel
