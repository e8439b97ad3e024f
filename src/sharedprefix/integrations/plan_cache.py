"""The plans of the batches a TRL trainer is working on, by content: the old-policy, reference and policy log-probs of
one microbatch (and every PPO epoch over it) plan once (``sp.plan_call``'s ``CallPlan``) and reuse the plan.

A plan is looked up by the microbatch's tensors (their bytes) and the fingerprint of the model that runs it
(``CallPlan.fingerprint``: the policy and a reference model of the same configuration share one); ``capacity``
plans are kept, the least recently used dropped first. Planning here does not agree across ranks (the ranks' hits
and misses need not match): a rank whose planning fails passes its source instead, and the call raises the same
refusal on every rank through its own agreement.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from sharedprefix.schedule.call import plan_unagreed
from sharedprefix.schedule.call_plan import CallPlan, fingerprint
from sharedprefix.schedule.results import PREFIX_MODES


class PlanCache:
    """``lookup(model, tensors, extra, make_source, **options)`` -> (the source's plan, or the source where planning
    failed; what ``make_source`` returned alongside it). ``plannings``: how many plans were made."""

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self.entries: OrderedDict[tuple, tuple[Any, Any]] = OrderedDict()
        self.plannings = 0

    def lookup(
        self,
        model: torch.nn.Module,
        tensors: tuple[torch.Tensor, ...],
        extra: tuple,
        make_source: Callable[[], tuple[Any, Any]],
        **options,
    ) -> tuple[Any, Any]:
        digest = hashlib.blake2b(digest_size=16)
        for t in tensors:
            digest.update(str((t.dtype, tuple(t.shape))).encode())
            digest.update(t.detach().cpu().contiguous().numpy().tobytes())
        key = (digest.hexdigest(), extra, fingerprint(model), tuple(sorted(options.items(), key=lambda kv: kv[0])))
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        source, aside = make_source()
        if source is None:
            return None, aside
        plan, error = plan_unagreed(model, source, options)
        self.plannings += 1
        if error is not None:  # the call itself raises it, on every rank together
            return source, aside
        self.entries[key] = (plan, aside)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        assert isinstance(plan, CallPlan)
        return plan, aside


def plan_capacity(trainer) -> int:
    """How many plans a TRL ``trainer`` keeps: those of one generation batch (its old-policy and reference calls on
    the whole batch, one per policy microbatch) twice over."""
    return 2 * (int(getattr(trainer.args, "steps_per_generation", None) or 1) + 1)


def log_plan(trainer, plan, mode: str | None = None) -> None:
    """Put what sharedprefix computes for one call of ``plan`` (a ``CallPlan``) into TRL's own metrics
    (``trainer._metrics[mode]``, averaged and logged by TRL each step): ``sharedprefix/tokens_computed`` against
    ``sharedprefix/tokens_plain`` (what the plain per-row forward computes), ``sharedprefix/passes``,
    ``sharedprefix/prefix_mode`` (the index of the trainer's ``sharedprefix_prefix_activations`` in "keep",
    "offload", "recompute") and, on CUDA, ``sharedprefix/peak_memory_gib`` (the device's peak so far). Nothing for a
    source that is not a plan (one whose planning failed, and raises)."""
    if not isinstance(plan, CallPlan) or not hasattr(trainer, "_metrics"):
        return
    mode = mode or ("train" if trainer.model.training else "eval")
    metrics = trainer._metrics[mode]
    p = plan.plan
    metrics["sharedprefix/tokens_computed"].append(float(sum(p.pass_tokens(s) for s in p.passes)))
    metrics["sharedprefix/tokens_plain"].append(float(p.plain_tokens))
    metrics["sharedprefix/passes"].append(float(len(p.passes)))
    metrics["sharedprefix/prefix_mode"].append(float(PREFIX_MODES.index(trainer._sp_mode)))
    if plan.device.type == "cuda":
        metrics["sharedprefix/peak_memory_gib"].append(torch.cuda.max_memory_allocated(plan.device) / 2**30)
