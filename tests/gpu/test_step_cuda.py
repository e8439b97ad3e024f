"""CUDA: ``sp.plan_step`` over a trainer's microbatches in bf16, by the 2x rule (skipped without a GPU; the float64
exactness of steps is ``tests/schedule/test_step.py``'s, on the CPU).

The exact gradient is the float64 plain accumulation (each microbatch's rows through the model's own forward, its
backward, summed over the microbatches) on the CPU; the baseline is that accumulation in bf16 on the GPU. A step's
gradient (``sp.backward`` per microbatch, deferred log-probs, or log-probs that keep their graph) must be at most
twice as far from the exact one as the baseline, over all parameters together."""

import pytest
import torch

import sharedprefix as sp
from helpers import plain_logprobs, random_groups, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def split_groups():
    """Two groups whose completions fall across three microbatches (TRL's shuffle), prompts long enough that the
    shared prompts dominate."""
    g = random_groups(7, 2, [300, 180], [[40, 3, 90, 9, 12, 5], [20, 64, 7]])

    def sub(i, idx):
        return sp.Group(g[i].prompt, [g[i].completions[j] for j in idx])

    return [[sub(0, [0, 1]), sub(1, [0])], [sub(0, [2, 3])], [sub(1, [1, 2]), sub(0, [4, 5])]]


def grad_vector(model, names):
    return torch.cat([model.get_parameter(n).grad.double().cpu().flatten() for n in names])


def accumulate(model, mbs):
    """The plain accumulation: each microbatch's sum of log-probs backpropagated through the model's own forward."""
    for mb in mbs:
        plain_logprobs(model, mb)[0].sum().backward()


def run_step(model, mbs, how, mode, max_tokens=None):
    step = sp.plan_step(model, mbs, prefix_activations=mode, max_tokens=max_tokens)
    for k in range(len(mbs)):
        if how == "backward":
            sp.backward(model, step.microbatch(k), lambda b: (b.logprobs * b.mask).sum())
        else:
            out = sp.logprobs(model, step.microbatch(k), **({"defer": False} if how == "graph" else {}))
            out.logprobs.sum().backward()
    assert step.state == "finished"


def step_against_plain(device, dtype, how, mode, max_tokens=None):
    """(our error, the plain low-precision accumulation's error) against float64, L2 over every parameter."""
    mbs = split_groups()
    model64 = tiny_model("qwen3", dtype=torch.float64)
    names = [n for n, _ in model64.named_parameters()]
    accumulate(model64, mbs)
    exact = grad_vector(model64, names)
    low = tiny_model("qwen3", dtype=dtype).to(device)
    low.load_state_dict({k: v.to(dtype) for k, v in model64.state_dict().items()})
    accumulate(low, mbs)
    plain = grad_vector(low, names)
    low.zero_grad(set_to_none=True)
    run_step(low, mbs, how, mode, max_tokens)
    ours = grad_vector(low, names)
    return float((ours - exact).norm()), float((plain - exact).norm())


@pytest.mark.parametrize("mode", ["keep", "offload", "recompute"])
@pytest.mark.parametrize("how", ["backward", "deferred", "graph"])
def test_step_bf16_within_twice_plain_error(how, mode):
    ours, plain = step_against_plain("cuda", torch.bfloat16, how, mode)
    assert ours <= 2 * plain, (ours, plain)


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_step_under_a_budget_bf16_within_twice_plain_error(mode):
    ours, plain = step_against_plain("cuda", torch.bfloat16, "backward", mode, max_tokens=128)
    assert ours <= 2 * plain, (ours, plain)
