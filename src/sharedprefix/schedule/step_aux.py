"""The MoE load-balancing loss of a step's microbatch (``schedule.step``; ``model.router`` for one call's).

Microbatch k's loss is the plain run's over its rows only: E * sum_e f_e^(k) P_e^(k) over the tokens of its rows, a
shared prompt's tokens weighted by the number of *its* rows through them (TRL computes the loss per microbatch
forward). Its gradient is a linear term per token (f has no gradient): d aux^(k) / d z_t = g_t^(k), which depends on
microbatch k's own tokens, known only when it runs. A shared segment's router logits z are computed once, by the
step's recording pass, and cached like its K/V (``PrefixCache.routed``: leaves that require grad, the recorded graph
kept, offloaded or recomputed with the rest). Each microbatch's call reads them: its loss's value from its own passes'
router logits and the cached ones, each weighted by its own rows (``records``); the shared tokens' share of its
gradient, g^(k) scaled by what reaches the loss (``sp.backward``'s ``aux_loss_coef``, the caller's gradient of
``LogProbs.aux_loss``), accumulates on the cached leaves (``add_shared``; through autograd where the graph is kept),
inside the call's gradient transaction; its own tokens' share joins its own passes as a call's does. The step's
prefix backward, inside its last microbatch's call, pushes sum_k g^(k) through the shared segments' graph with their
K/V gradients (``PrefixCache.surrogate``): exact by the chain rule, whatever the budget and prefix mode.

Notation: E = experts, n_s = tokens of segment s.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from sharedprefix.model import router
from sharedprefix.model.adapter import unwrap
from sharedprefix.schedule.call_plan import CallPlan
from sharedprefix.schedule.planner import Plan
from sharedprefix.schedule.step import Step, StepCall


def wanted(model, step: Step, k: int, aux: bool, what: str) -> bool:
    """``aux``: microbatch ``k``'s call takes the loss (``what``: the setting that asks for it, for the message);
    refused where the step was planned without it (its shared router logits were not cached)."""
    if not aux:
        return False
    if not step.aux:
        raise ValueError(
            f"{what} on microbatch {k + step.offset} of a step planned without the MoE load-balancing loss: the step "
            "caches its shared prompts' router logits only when planned with it. Plan the step with "
            "sp.plan_step(model, microbatches, aux_loss=True) (config.output_router_logits=True does it too), or "
            "leave the loss out of the call."
        )
    router.check_checkpointing(unwrap(model))
    return True


def forward_then_backward(step: Step, k: int, planned: CallPlan) -> tuple[CallPlan, CallPlan]:
    """``sp.backward``'s call of microbatch ``k`` (``planned``: ``Step.begin``'s) as its no-grad forward (the
    shared segments' recording passes where it records them, then its own passes) and its backward (the rest: its
    own passes again, the step's prefix backward at its last microbatch)."""
    steps, tree, cap, view = planned.plan.steps, step.splan.tree, step.splan.max_tokens, step.views[k]
    recorded = len(step.splan.record) if planned.step.records else 0
    own = recorded + len(step.splan.microbatches[k])
    first = dataclasses.replace(planned, plan=Plan(tree, steps[:own], cap, view))
    then = dataclasses.replace(
        planned, plan=Plan(tree, steps[recorded:], cap, view), step=StepCall(step, k, frozenset())
    )
    return first, then


def records(step: Step, k: int, own: list) -> list:
    """Microbatch ``k``'s router records (``router.aux_loss``'s): its own passes' (``own``) and, per shared segment
    its rows pass through, the cached router logits weighted by the number of its rows through it."""
    tree = step.splan.tree
    count = Counter(s for r in step.views[k].rows for s in tree.path(tree.rows[r].end) if s in step.cache.routed)
    out = list(own)
    for s in sorted(count):
        zs = step.cache.router(s)
        n = zs[0].shape[0]
        out.append((zs, torch.full((n,), float(count[s]), dtype=torch.float64), [(s, 0, n)]))
    return out


def split(step: Step, grads: dict | None) -> tuple[dict | None, dict]:
    """Per-segment aux gradients (``router.segment_grads``, scaled) as (the microbatch's own segments', the shared
    segments')."""
    if grads is None:
        return None, {}
    routed = step.cache.routed
    return {s: g for s, g in grads.items() if s not in routed}, {s: g for s, g in grads.items() if s in routed}


def add_shared(step: Step, grads: dict) -> None:
    """The shared segments' aux gradients (``split``) accumulated on their cached router logits (out of place)."""
    for s, gs in grads.items():
        for leaf, g in zip(step.cache.router(s), gs):
            g = g.to(leaf.device, leaf.dtype)
            leaf.grad = g if leaf.grad is None else leaf.grad + g
