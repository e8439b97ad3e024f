"""The schedule's shared test case: a three-group layout, the token budgets that split it every way, a weighted
loss and its plain per-row reference (``tests/schedule/test_backward.py``, ``tests/invariant``)."""

import torch

import sharedprefix as sp
from helpers import grads_of, plain_logprobs, random_groups

MODES = ("keep", "offload", "recompute")
# group 0: prompt 12, group 1: tiny, group 2: prompt 28 (longest completion 7)
SPEC = ([12, 3, 28], [[3, 4, 1, 5], [2], [6, 6, 2, 1, 7]])
# budgets: everything in one pass, groups split, one completion per pass, prompt in 4 chunks (28 -> 4 x 7)
BUDGETS = [None, 80, 20, 7]


def split_groups(**kw):
    """Two groups (prompts of 20 and 9 tokens) whose completions are spread over three microbatches, as TRL's shuffle
    spreads them: group 0's six rows fall in all three, microbatches 0 and 2 hold rows of both prompts. ``kw``:
    ``random_groups``'s (``vocab``)."""
    g = random_groups(3, 2, [20, 9], [[3, 4, 1, 5, 2, 6], [2, 5, 3]], **kw)

    def sub(x, idx):
        return sp.Group(x.prompt, [x.completions[i] for i in idx])

    return [[sub(g[0], [0, 1]), sub(g[1], [0])], [sub(g[0], [2, 3])], [sub(g[1], [1, 2]), sub(g[0], [4, 5])]]


def microbatch_weights(mbs, seed=1):
    """Per microbatch (a list of groups, or a tree), (rows, longest row or completion) float64 random weights, drawn in
    order from one generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for mb in mbs:
        if isinstance(mb, sp.Tree):
            n, w = len(mb.rows), max(len(r) for r in mb.rows)
        else:
            n, w = sum(len(x.completions) for x in mb), max(len(c) for x in mb for c in x.completions)
        out.append(torch.randn(n, w, dtype=torch.float64, generator=gen))
    return out


def weighted_loss(W):
    """sum(W * log-probs) over a batch's rows: W (N, T) float, one weight per completion token."""
    return lambda b: (b.logprobs * W.to(b.logprobs.dtype)[b.index] * b.mask).sum()


def plain_reference(model, groups, W):
    """(gradients, loss) of ``weighted_loss(W)`` by the plain per-row forward."""
    want = grads_of(model, lambda: (plain_logprobs(model, groups)[0] * W).sum())
    with torch.no_grad():
        loss = float((plain_logprobs(model, groups)[0] * W).sum())
    return want, loss


def run_backward(model, groups, loss_fn, **kw):
    """(``sp.backward``'s result, the gradients it accumulated), the model's ``.grad`` cleared before and after."""
    model.zero_grad(set_to_none=True)
    res = sp.backward(model, groups, loss_fn, **kw)
    got = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return res, got
