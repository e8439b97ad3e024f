"""CUDA: decoder layers compiled in place (``layer.compile()``, inductor generating Triton) under sharedprefix, on
the GPU kernels: no graph break, no graph compiled after the second of five layouts, and log-probs and parameter
gradients by the bf16 2x rule against float64 (skipped without a GPU).

The CPU suite (``tests/attention/test_compiled.py``) checks the same in float64 on CPU inductor; here the cascade's
custom operators run their CUDA kernels (varlen flash, cuDNN) under the compiler, whose fake implementations must
give the shapes and strides those kernels return.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import sharedprefix as sp
from helpers import plain_logprobs, random_groups, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (groups, prompt lengths, completion lengths, max_tokens): counts, lengths and budgets change from step to step
LAYOUTS = [
    (1, [300], [[120, 3, 90]], None),
    (2, [180, 7], [[5, 50, 5], [20]], None),
    (1, [290], [[100, 60, 9, 40]], 256),
    (3, [64, 200, 33], [[12], [30, 8], [7, 70]], None),
    (2, [310, 90], [[44, 3, 2], [60, 5]], 384),
]


def _counts() -> tuple[int, int]:
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def _grads(model) -> torch.Tensor:
    out = torch.cat([p.grad.double().cpu().flatten() for _, p in model.named_parameters()])
    model.zero_grad(set_to_none=True)
    return out


def check_compiled_layers(kind: str, device: str = "cuda") -> list[tuple[int, int]]:
    """Run the five layouts with ``kind`` ("logprobs" or "backward") on a bf16 model whose layers are compiled, each
    step checked by the 2x rule; returns (graph breaks, graphs compiled) per step. ``device`` is a parameter so the
    logic can be tried on CPU inductor."""
    torch._dynamo.reset()
    counters.clear()
    model64 = tiny_model("qwen3", torch.float64, head_dim=128)
    plain16, model16 = (tiny_model("qwen3", torch.bfloat16, head_dim=128).to(device) for _ in range(2))
    for m in (plain16, model16):
        m.load_state_dict({k: v.bfloat16() for k, v in model64.state_dict().items()})
    for layer in model16.model.layers:
        layer.compile()
    per_step = []
    for i, (n, prompts, completions, budget) in enumerate(LAYOUTS):
        groups = random_groups(i, n, prompts, completions)
        before = _counts()
        if kind == "logprobs":
            exact = plain_logprobs(model64, groups)[0]
            with torch.no_grad():
                plain = plain_logprobs(plain16, groups)[0]
                ours = sp.logprobs(model16, groups, max_tokens=budget).logprobs
            plain_err = (plain.double().cpu() - exact).abs().max()
            ours_err = (ours.double().cpu() - exact).abs().max()
        else:
            plain_logprobs(model64, groups)[0].sum().backward()  # zero on padding
            exact = _grads(model64)
            plain_logprobs(plain16, groups)[0].sum().backward()
            plain = _grads(plain16)
            sp.backward(model16, groups, lambda b: (b.logprobs * b.mask).sum(), max_tokens=budget)
            ours = _grads(model16)
            plain_err, ours_err = (plain - exact).norm(), (ours - exact).norm()
        assert ours_err <= 2 * plain_err + 1e-6, (i, float(ours_err), float(plain_err))
        per_step.append(tuple(a - b for a, b in zip(_counts(), before)))
    assert all(b == 0 for b, _ in per_step), f"graph breaks per step: {per_step}"
    assert all(g == 0 for _, g in per_step[2:]), f"graphs compiled after the second step: {per_step}"
    assert sum(g for _, g in per_step) >= 1, "the layers did not run compiled"
    return per_step


@pytest.mark.parametrize("kind", ["logprobs", "backward"])
def test_compiled_layers_on_cuda_no_break_no_recompile_within_twice_plain_error(kind):
    check_compiled_layers(kind)
