"""The 2x rule in bfloat16 on the CPU, across architectures: bf16 weights, and float32 weights under
``torch.autocast("cpu", dtype=torch.bfloat16)``. Against the float64 plain per-row run, our error is at most twice
the plain same-precision run's (each row through the model's own forward in that precision; gradients of its
per-row backward, summed), for log-probs (largest absolute error) and for gradients (largest error over every
parameter, relative to the model's largest float64 gradient).

Gradients are held model-wide, not per tensor: a bf16 gradient's error on one tensor is a few roundings, and on a
small tensor (Qwen3.5's 4-entry ``dt_bias`` / ``A_log``) the plain run's own error is at times accidentally tiny, so
a second valid plain computation (the rows batched with right padding) also exceeds twice it there. MoE models are
left out: where a token's top-k routing is a near-tie (float64 margin below the router logits' bf16 error), either
run may route it the other way, and the rule does not hold across that jump (measured: one flipped token in GPT-OSS
gives a log-prob error 14x the plain run's, whose routing happened to agree with float64); DeepSeek-V3's latent
attention and Llama 4's chunked attention run here with dense MLPs instead.
"""

import contextlib

import pytest
import torch

import sharedprefix as sp
from helpers import grads_of, plain_logprobs, random_groups, tiny_model
from sharedprefix.tools.reference import Float64Inside
from support.schedule import SPEC, microbatch_weights, split_groups

# name -> (model type, settings): windows (Mistral, Phi-3, Gemma 3), soft-capping (Gemma 2), QK-norms (OLMo 2),
# latent attention (DeepSeek-V3), chunked attention (Llama 4), conv and gated delta-net hybrids (LFM2, Qwen3.5)
ARCHS = {
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", dict(sliding_window=4)),
    "phi3": ("phi3", dict(sliding_window=4)),
    "olmo2": ("olmo2", {}),
    "gemma2": ("gemma2", dict(attn="eager")),
    "lfm2": ("lfm2", {}),
    "deepseek_v3": ("deepseek_v3", dict(first_k_dense_replace=2)),
    "llama4_text": ("llama4_text", dict(moe_layers=[])),
    "gemma3_text": ("gemma3_text", {}),
    "qwen3_5_text": ("qwen3_5_text", {}),
}
SLOW = {"gemma3_text", "qwen3_5_text", "llama4_text", "deepseek_v3"}  # 4-6 layers, or latent attention's many ops
PRECISIONS = ("bf16", "autocast")


def _model_pair(name, precision):
    arch, kw = ARCHS[name]
    m64 = tiny_model(arch, dtype=torch.float64, **kw)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    low = tiny_model(arch, dtype=dtype, **kw)
    low.load_state_dict({k: v.to(dtype) for k, v in m64.state_dict().items()})
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "autocast" else contextlib.nullcontext
    return m64, low, ctx


def _grad_err(got, exact):
    """Largest error over every parameter's gradient, relative to the largest float64 gradient."""
    assert got.keys() == exact.keys(), sorted(got.keys() ^ exact.keys())
    scale = max(float(e.abs().max()) for e in exact.values())
    return max(float((got[n].double() - e).abs().max()) for n, e in exact.items()) / scale


def _within_twice(ours, plain, what, floor=1e-6):
    assert ours <= 2 * plain + floor, f"{what}: our error {ours:.3g} > 2 x the plain run's {plain:.3g}"


def _params(slow):
    """(name, precision) for every architecture and precision, the pairs ``slow(name, precision)`` marked slow."""
    return [pytest.param(n, p, marks=pytest.mark.slow) if slow(n, p) else (n, p) for n in ARCHS for p in PRECISIONS]


@pytest.mark.parametrize("name, precision", _params(lambda n, p: n in SLOW))
def test_logprobs_and_backward_within_twice_plain_error(name, precision):
    """No-grad ``sp.logprobs`` and ``sp.backward`` of a linear loss under a budget that splits the groups (their
    prompts cached, completions in later passes)."""
    m64, low, ctx = _model_pair(name, precision)
    groups = random_groups(4, 3, *SPEC)
    with Float64Inside():  # the float64 reference computes the model's own float32 casts in float64 too
        exact = plain_logprobs(m64, groups)[0].detach()
        W = torch.randn(exact.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        exact_g = grads_of(m64, lambda: (plain_logprobs(m64, groups)[0] * W).sum())
    with ctx():
        with torch.no_grad():
            plain = plain_logprobs(low, groups)[0]
            ours = sp.logprobs(low, groups, max_tokens=20).logprobs
        plain_g = grads_of(low, lambda: (plain_logprobs(low, groups)[0] * W.float()).sum())
        loss = lambda b: (b.logprobs * W.to(b.logprobs.dtype)[b.index] * b.mask).sum()  # noqa: E731
        ours_g = grads_of(low, lambda: sp.backward(low, groups, loss, max_tokens=20) and None)
    lp_err = lambda x: float((x.detach().double() - exact).abs().max())  # noqa: E731
    _within_twice(lp_err(ours), lp_err(plain), "log-probs")
    _within_twice(_grad_err(ours_g, exact_g), _grad_err(plain_g, exact_g), "gradients")


@pytest.mark.parametrize("name, precision", _params(lambda n, p: n in SLOW or n == "lfm2" or p == "autocast"))
def test_step_deferred_logprobs_within_twice_plain_error(name, precision):
    """A step over three microbatches splitting two groups: grad-enabled log-probs per microbatch, the caller's
    backward, the shared prompts' backward recomputed at the last; gradients against the plain accumulation."""
    m64, low, ctx = _model_pair(name, precision)
    mbs = split_groups()
    Ws = microbatch_weights(mbs)
    with Float64Inside():
        exact = [plain_logprobs(m64, mb)[0].detach() for mb in mbs]
        exact_g = grads_of(m64, lambda: sum((plain_logprobs(m64, mb)[0] * W).sum() for mb, W in zip(mbs, Ws)))
    with ctx():
        with torch.no_grad():
            plain = [plain_logprobs(low, mb)[0] for mb in mbs]
        plain_g = grads_of(low, lambda: sum((plain_logprobs(low, mb)[0] * W.float()).sum() for mb, W in zip(mbs, Ws)))
        low.zero_grad(set_to_none=True)
        step = sp.plan_step(low, mbs, max_tokens=12, prefix_activations="recompute")
        ours = []
        for k, W in enumerate(Ws):
            out = sp.logprobs(low, step.microbatch(k)).logprobs
            (out * W.float()).sum().backward()
            ours.append(out.detach())
        ours_g = {n: p.grad.detach().clone() for n, p in low.named_parameters() if p.grad is not None}
        low.zero_grad(set_to_none=True)
    assert step.state == "finished"
    lp_err = lambda xs: max(float((x.double() - e).abs().max()) for x, e in zip(xs, exact))  # noqa: E731
    _within_twice(lp_err(ours), lp_err(plain), "log-probs")
    _within_twice(_grad_err(ours_g, exact_g), _grad_err(plain_g, exact_g), "gradients")
