"""No tensor of (row x row) size is created anywhere in sp.logprobs / sp.backward, with or without a window."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import sharedprefix as sp
from helpers import random_groups, tiny_model


class _Largest(TorchDispatchMode):
    """Records the largest tensor any operator returns (forward and backward run on this thread on CPU)."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), func
        return out


@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize(
    "max_tokens", [pytest.param(None, id="one_row", marks=pytest.mark.slow), pytest.param(1500, id="schedule")]
)
def test_no_row_by_row_tensor(window, max_tokens):
    # the shape: one 1000-token prompt with 24 completions of 120 tokens (a 3880-token row)
    model = tiny_model("mistral", dtype=torch.float32, sliding_window=window)
    groups = random_groups(0, 1, [1000], [[120] * 24])
    row = 1000 + 24 * 120
    spy = _Largest()
    with spy:
        out = sp.logprobs(model, groups)
        res = sp.backward(model, groups, lambda b: (b.logprobs * b.mask).sum(), max_tokens=max_tokens)
    assert out.mask.sum() == 24 * 120 and res.passes >= 1
    # the largest tensors are (tokens, hidden) activations and the head's chunk of logits; a row x row mask
    # (15M elements here) or a per-block mask (1000 x 3880) would exceed this by far
    assert spy.numel <= row * row // 20, (spy.numel, spy.op)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
