"""The bf16 rule of the CUDA tests (``tests/gpu/test_cuda.py``, ``tests/gpu/test_dense_cuda.py``): the error of the
fast path against float64 is at most twice the error of the plain bf16 run against float64."""

import torch

import sharedprefix as sp
from helpers import plain_logprobs, tiny_model

# qwen3 with head_dim 12 (padded to 16 for flash) and with head_dim 128 (real models'); mistral with a window
MODELS = {
    "qwen3": ("qwen3", {}),
    "qwen3_d128": ("qwen3", {"head_dim": 128}),
    "mistral_window": ("mistral", {"sliding_window": 64}),
}


def bf16_rule(model64, groups, fn, arch="qwen3", **kw):
    """By the 2x rule: the log-probs ``fn(model16)`` gives on a bfloat16 CUDA copy of the float64 ``model64`` are
    at most twice as far from the float64 plain run as the plain bfloat16 run."""
    model16 = tiny_model(arch, dtype=torch.bfloat16, **kw).cuda()
    model16.load_state_dict({k: v.bfloat16() for k, v in model64.state_dict().items()})
    exact, _ = plain_logprobs(model64, groups)
    with torch.no_grad():
        plain16, _ = plain_logprobs(model16, groups)
    ours = fn(model16)
    plain_err = (plain16.double().cpu() - exact).abs().max()
    ours_err = (ours.double().cpu() - exact).abs().max()
    assert ours_err <= 2 * plain_err + 1e-6, (float(ours_err), float(plain_err))


def backward_logprobs(model, groups, mode):
    """The log-probs sp.backward hands to the loss, batch by batch, put back in completion order."""
    got = {}

    def loss(b):
        got.update({int(i): lp for i, lp in zip(b.index, b.logprobs.detach())})
        return (b.logprobs * b.mask).sum()

    res = sp.backward(model, groups, loss, max_tokens=256, prefix_activations=mode)
    assert res.peak_memory_bytes is not None and res.peak_memory_bytes > 0
    return torch.stack([got[i] for i in range(len(got))])
