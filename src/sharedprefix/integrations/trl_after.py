"""The policy pass of the synchronous TRL trainers (``integrations.trl``) on an engine that refuses grad-enabled
``sp.logprobs`` (``Engine.check_grad_logprobs``: FSDP2): its backward runs after TRL's, as ``sp.backward``.

Under FSDP2 neither form of a grad-enabled ``sp.logprobs`` runs FSDP2 as a plain backward does: a kept graph would be
backpropagated outside sharedprefix's rounds (which set FSDP2's gradient sync and run the ranks' agreed collectives),
and a deferred one inside the caller's backward, where FSDP2 takes every forward for an activation-checkpointing
recomputation and reshards no unit after it (measured: every decoder layer gathered at once). So here:

1. the hook computes the policy's log-probs (and entropies) without grad, and hands TRL leaves that require grad in
   their place: ``values`` (N, W), the call's output rows, which the hook maps to TRL's (B, C) layout with a graph
   (``trl_batch.to_rows``);
2. TRL builds its loss from them and backpropagates it (``accelerator.backward``): the leaves' ``.grad`` are exactly
   dL/dlogp (and dL/dentropy) of the micro-step's loss, every TRL scaling (gradient accumulation, token
   normalisers) included; the loss reaches no parameter;
3. after TRL's ``training_step`` (still inside accelerate's ``no_sync`` on a micro-step that does not end the optimizer
   step) ``backward_pending`` runs ``sp.backward(model, source, sum(dL/dlogp * logp + dL/dH * H))`` on the same
   source (a ``CallPlan``, or the micro-step's ``Microbatch`` of its window's step), whose parameter gradient is
   exactly dL/dtheta (chain rule), with ``sync=accelerator.sync_gradients``: FSDP2 reduce-scatters only at the
   optimizer step's last micro-step, as accelerate's own accumulation does.

Cost: as a deferred pass, one forward without grad more than the plain run (the values); a step's microbatch
computes those values on its own rows (its shared prompts once per microbatch without grad, once per step with grad).

Notation: N = the call's output rows, W = its columns, B = rows of TRL's microbatch, C = completion columns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import sharedprefix as sp
from sharedprefix.model.adapter import unwrap
from sharedprefix.parallel.detect import detect

__all__ = ["Pending", "backward_pending", "hold", "refusal_of"]


@dataclasses.dataclass
class Pending:
    """One policy call whose backward runs after TRL's: ``model`` and ``source`` as the call got them, ``values``
    (N, W) and ``entropy`` (N, W) or None: the leaves handed to TRL (entropy only where a loss uses it), ``options``:
    ``sp.backward``'s keywords (temperature, budget, prefix mode, reduction)."""

    model: torch.nn.Module
    source: Any
    values: torch.Tensor
    entropy: torch.Tensor | None
    options: dict


def refusal_of(model) -> str | None:
    """Why ``model``'s engine refuses a grad-enabled ``sp.logprobs`` (then the policy pass runs here), or None."""
    try:
        detect(model, unwrap(model)).check_grad_logprobs()
    except ValueError as e:
        return str(e)
    return None


def hold(trainer, model, source, out, entropy_grad: bool, options: dict):
    """``out`` (no-grad log-probs of ``source``) with its values (and entropies, where ``entropy_grad``: a loss uses
    them) replaced by leaves that require grad, recorded in ``trainer._sp_pending`` for ``backward_pending``."""
    values = out.logprobs.detach().requires_grad_()
    ent = out.entropy.detach().requires_grad_() if entropy_grad and out.entropy is not None else None
    trainer._sp_pending.append(Pending(model, source, values, ent, options))
    return dataclasses.replace(out, logprobs=values, entropy=ent if ent is not None else out.entropy)


def backward_pending(trainer) -> None:
    """Run the backward of each policy call of the micro-step that just ran TRL's backward (``hold``): ``sp.backward``
    of the linear loss of the gradients TRL's backward left on the leaves, synchronising where accelerate does. A leaf
    TRL's loss did not reach gives a zero loss, still run: every rank of FSDP2 runs the same collectives, and a
    step's microbatch must run its backward."""
    pending, trainer._sp_pending = trainer._sp_pending, []
    sync = bool(trainer.accelerator.sync_gradients)
    for p in pending:
        g_lp = p.values.grad if p.values.grad is not None else torch.zeros_like(p.values)
        g_ent = None if p.entropy is None else p.entropy.grad
        if p.entropy is not None and g_ent is None:
            g_ent = torch.zeros_like(p.entropy)

        def loss_fn(b, g_lp=g_lp, g_ent=g_ent):
            loss = (b.logprobs * g_lp[b.index].to(b.logprobs.dtype)).sum()
            if g_ent is not None:
                loss = loss + (b.entropy * g_ent[b.index].to(b.entropy.dtype)).sum()
            return loss

        with trainer.accelerator.autocast():  # as TRL's own forward
            sp.backward(p.model, p.source, loss_fn, entropy=g_ent is not None, sync=sync, **p.options)
