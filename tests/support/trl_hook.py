"""TRL's log-prob hook (``_get_per_token_logps_and_entropies``) called without a trainer: the rows TRL hands it
(left-padded prompts, right-padded completions), a stand-in for the trainer it reads, and one call with a backward
through its log-probs and entropies."""

import contextlib
import types

import torch


def padded_rows(prompts, G, C, g):
    """TRL's rows for ``prompts`` (1-d token tensors): G rows each, the prompt left-padded to the longest, then a
    completion of 1 to C random tokens right-padded to C. Returns (input_ids, attention_mask, each row's prompt)."""
    P = max(p.numel() for p in prompts)
    rows, masks, which = [], [], []
    for i, p in enumerate(prompts):
        for _ in range(G):
            t = int(torch.randint(1, C + 1, (1,), generator=g))
            comp = torch.randint(0, 90, (t,), generator=g)
            rows.append(
                torch.cat([torch.zeros(P - p.numel(), dtype=torch.long), p, comp, torch.zeros(C - t, dtype=torch.long)])
            )
            masks.append(torch.cat([torch.zeros(P - p.numel()), torch.ones(p.numel() + t), torch.zeros(C - t)]))
            which.append(i)
    return torch.stack(rows), torch.stack(masks).long(), which


def trainer_stub(budget=None, mode="keep"):
    """What the hook reads of its trainer: temperature 0.8, a main-process accelerator with a no-op autocast, and the
    sharedprefix budget and prefix-activation mode."""
    accelerator = types.SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True)
    return types.SimpleNamespace(temperature=0.8, accelerator=accelerator, _sp_budget=budget, _sp_mode=mode)


def run_hook(hook, stub, model, batch):
    """``hook(stub, model, ...)`` on ``batch`` (input_ids, attention_mask, C, extra inputs) with entropies, then a
    backward of a fixed weighting of its log-probs plus 0.1 x its entropies. Returns (log-probs, entropies, gradients
    by parameter name), padding zeroed."""
    input_ids, attention_mask, C, extra = batch
    model.zero_grad(set_to_none=True)
    lp, ent, _ = hook(stub, model, input_ids, attention_mask, C, compute_entropy=True, **extra)
    mask = attention_mask[:, -C:].bool()
    w = torch.linspace(-1.0, 2.0, lp.numel(), dtype=lp.dtype).reshape(lp.shape)
    ((lp * w).masked_fill(~mask, 0).sum() + 0.1 * ent.masked_fill(~mask, 0).sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach().masked_fill(~mask, 0), ent.detach().masked_fill(~mask, 0), grads
