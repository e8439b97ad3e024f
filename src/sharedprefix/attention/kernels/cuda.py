"""The GPU kernels: ``CUDA`` (torch's own varlen flash ops, no extra dependency) and ``FlashAttn`` (the flash-attn
package, when installed). Both wrappers are kept thin: the CPU tests cover all the logic around them.
"""

from __future__ import annotations

import torch

from sharedprefix.attention.kernels.common import pad_last
from sharedprefix.attention.kernels.contract import KernelCall, refuse_softcap


def _flash_window(causal: bool, window: int | None, max_seqlen_k: int) -> tuple[int, int]:
    """flash's (window_size_left, window_size_right), bottom-right aligned like the contract.

    No window is passed as ``max_seqlen_k`` rather than -1: same attention (the kernels reset any left window >=
    max_seqlen_k to -1), but only after they choose their single-query GQA path (max_seqlen_q == 1, both
    windows < 0), which reshapes q as if every entry had exactly one query and fails on an entry with none.
    """
    return (max_seqlen_k if window is None else window, 0 if causal else -1)


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
    def forward(call: KernelCall) -> tuple:
        refuse_softcap(CUDA.name, call)
        wl, wr = _flash_window(call.causal, call.window, call.max_seqlen_k)
        dv_, d = call.v.shape[-1], _flash_dim(call.q, call.v)
        q, k, v = (pad_last(x, d).contiguous() for x in (call.q, call.k, call.v))
        res = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            call.cu_seqlens_q,
            call.cu_seqlens_k,
            call.max_seqlen_q,
            call.max_seqlen_k,
            0.0,
            call.causal,
            False,
            scale=call.scale,
            window_size_left=wl,
            window_size_right=wr,
        )
        # (output, softmax_logsumexp (H, Tq), rng_state, unused, debug_attn_mask); the RNG state for the backward
        return _cut_last(res[0], dv_), _lse_from_flash(res[1]), (res[2], res[3])

    @staticmethod
    def backward(call: KernelCall, dout, out, lse, aux=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        refuse_softcap(CUDA.name, call)
        wl, wr = _flash_window(call.causal, call.window, call.max_seqlen_k)
        q, k, v = call.q, call.k, call.v
        if aux is None:  # the kernel reads the RNG state only under dropout, which is 0 here
            aux = (torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device))
        rng, unused = aux
        dh, dvh, d = q.shape[-1], v.shape[-1], _flash_dim(q, v)
        q, k, v, dout, out = (pad_last(x, d).contiguous() for x in (q, k, v, dout, out))
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            _lse_to_flash(lse),
            call.cu_seqlens_q,
            call.cu_seqlens_k,
            call.max_seqlen_q,
            call.max_seqlen_k,
            0.0,
            call.causal,
            rng,
            unused,
            scale=call.scale,
            window_size_left=wl,
            window_size_right=wr,
        )
        return _cut_last(dq, dh), _cut_last(dk, dh), _cut_last(dv, dvh)


def _flash_attn_interface():
    """flash-attn's interface module; 2.7 or newer (2.6 and older take ``window_size=(l, r)`` and return 8 values)."""
    import flash_attn
    from flash_attn import flash_attn_interface

    version = tuple(int(x) for x in flash_attn.__version__.split(".")[:2] if x.isdigit())
    if version < (2, 7):
        raise ValueError(
            f"attention backend 'flash_attn' needs flash-attn>=2.7, found {flash_attn.__version__}; "
            "upgrade it, or use backend='cuda' (torch's own flash kernels)."
        )
    return flash_attn_interface


class FlashAttn:
    """The flash-attn package's varlen kernels (2.7 or newer). Never run: the GPU machine had no flash-attn."""

    name = "flash_attn"
    SOFTCAP = True  # flash-attn's varlen kernels take softcap (not run here: see the class docstring)

    @staticmethod
    def forward(call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
        fa = _flash_attn_interface()
        wl, wr = _flash_window(call.causal, call.window, call.max_seqlen_k)
        dv_, d = call.v.shape[-1], _flash_dim(call.q, call.v)
        q, k, v = (pad_last(x, d).contiguous() for x in (call.q, call.k, call.v))
        out, lse, _, _ = fa._flash_attn_varlen_forward(
            q,
            k,
            v,
            call.cu_seqlens_q,
            call.cu_seqlens_k,
            call.max_seqlen_q,
            call.max_seqlen_k,
            0.0,
            call.scale,
            causal=call.causal,
            window_size_left=wl,
            window_size_right=wr,
            softcap=float(call.softcap or 0.0),
        )
        return _cut_last(out, dv_), _lse_from_flash(lse)  # (out, softmax_lse (H, Tq), S_dmask, rng_state)

    @staticmethod
    def backward(call: KernelCall, dout, out, lse, aux=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fa = _flash_attn_interface()
        wl, wr = _flash_window(call.causal, call.window, call.max_seqlen_k)
        q, k, v = call.q, call.k, call.v
        dh, dvh, d = q.shape[-1], v.shape[-1], _flash_dim(q, v)
        q, k, v, dout, out = (pad_last(x, d).contiguous() for x in (q, k, v, dout, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # positional after the scale: causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic
        fa._flash_attn_varlen_backward(
            dout,
            q,
            k,
            v,
            out,
            _lse_to_flash(lse),
            dq,
            dk,
            dv,
            call.cu_seqlens_q,
            call.cu_seqlens_k,
            call.max_seqlen_q,
            call.max_seqlen_k,
            0.0,
            call.scale,
            call.causal,
            wl,
            wr,
            float(call.softcap or 0.0),
            None,
            False,
        )
        return _cut_last(dq, dh), _cut_last(dk, dh), _cut_last(dv, dvh)
