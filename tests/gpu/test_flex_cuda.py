"""CUDA: Gemma 2's attention-score soft-capping (in Gemma 2, and in Gemma 3 with the same caps) through
FlexAttention (``attention.kernels.flex``), by the bf16 2x rule, compiled once: no recompilation after warm-up while
the layouts change from step to step (skipped without a GPU)."""

import pytest
import torch
import transformers as tf
from packaging.version import Version

import sharedprefix as sp
from helpers import plain_logprobs, random_groups, tiny_model
from sharedprefix.model import versions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _softcapped(model_type, dtype):
    """A tiny soft-capped model of ``model_type`` (Gemma 2, or Gemma 3 with Gemma 2's caps set), skipped with the
    reason where the installed transformers is older than the release sharedprefix verified the family on (the GPU
    image's transformers 5.17 runs Gemma 3, verified from 5.10.4, and refuses Gemma 2, verified from 5.25)."""
    need = versions.verified_from(model_type)
    if Version(tf.__version__).release < Version(need).release:
        pytest.skip(f"{model_type} runs from transformers {need}; {tf.__version__} is installed")
    dims = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        head_dim=64,
        max_position_embeddings=1024,
        sliding_window=32,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=30.0,
    )
    if model_type == "gemma3_text":
        dims["layer_types"] = ["sliding_attention", "full_attention"]
    # eager: transformers' own soft-capped attention for the plain rows
    model = tiny_model(model_type, dtype=dtype, attn="eager", **dims)
    return model if dtype == torch.float64 else model.cuda()


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_softcapped_logprobs_and_backward_bf16_within_twice_plain_error(model_type):
    model64 = _softcapped(model_type, torch.float64)
    model16 = _softcapped(model_type, torch.bfloat16)
    model16.load_state_dict({k: v.bfloat16() for k, v in model64.state_dict().items()})
    groups = random_groups(2, 2, [90, 40], [[30, 5, 12], [50, 3]])
    exact = plain_logprobs(model64, groups)[0]
    with torch.no_grad():
        plain_err = (plain_logprobs(model16, groups)[0].double().cpu() - exact).abs().max()
        ours = sp.logprobs(model16, groups).logprobs
    assert (ours.double().cpu() - exact).abs().max() <= 2 * plain_err + 1e-6
    got = {}

    def loss(b):
        got.update({int(i): lp for i, lp in zip(b.index, b.logprobs.detach())})
        return (b.logprobs * b.mask).sum()

    sp.backward(model16, groups, loss, max_tokens=64)  # the prompts cached, 90 cut into a chain
    ours = torch.stack([got[i] for i in range(len(got))])
    assert (ours.double().cpu() - exact).abs().max() <= 2 * plain_err + 1e-6
    assert all(
        p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model16.parameters() if p.requires_grad
    )


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_no_recompilation_after_warm_up_while_layouts_change(model_type):
    from torch._dynamo.utils import counters

    model = _softcapped(model_type, torch.bfloat16)
    layouts = [random_groups(s, 2, [60 + 7 * s, 20 + s], [[10 + s, 3], [4, 9 + 2 * s]]) for s in range(6)]
    for groups in layouts[:2]:  # warm-up: the first compiles, the second may add the dynamic-shape graph
        sp.backward(model, groups, lambda b: (b.logprobs * b.mask).sum(), max_tokens=80)
    frames = counters["frames"]["ok"]  # frames compiled so far (flex_attention's and the block masks')
    for groups in layouts[2:]:
        sp.backward(model, groups, lambda b: (b.logprobs * b.mask).sum(), max_tokens=80)
    assert counters["frames"]["ok"] == frames, dict(counters["frames"])
