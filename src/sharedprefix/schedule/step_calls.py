"""The public calls on a step's microbatch (``sp.logprobs`` / ``sp.backward`` given ``step.microbatch(k)``;
``schedule.step``): the call's checks and settings as for a ``CallPlan`` (``call.prepare``), the step's prefix mode,
then its rounds as the step's call (``Step.run``).

- ``backward``: the microbatch's passes, its gradient accumulated (the shared segments' on their leaves), the shared
  segments' backward inside the step's last microbatch's call.
- ``logprobs`` with grad: deferred (its forward reads the step's cache, recording the shared segments at the step's
  first call; its backward is the microbatch's ``backward``), or with ``defer=False`` the graph of its own passes kept
  (``step_graph``). Without grad: a call on the microbatch's own rows, outside the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from sharedprefix.model import router
from sharedprefix.model.adapter import unwrap
from sharedprefix.model.forward_mode import in_forward_autocast
from sharedprefix.parallel.detect import detect, sync_enabled
from sharedprefix.schedule import call, rounds, step_aux, step_graph
from sharedprefix.schedule.deferred import defer_logprobs
from sharedprefix.schedule.options import CallOptions, Default, passed
from sharedprefix.schedule.results import BackwardResult, LogProbs
from sharedprefix.schedule.step import Microbatch


def backward(model, mb: Microbatch, loss_fn, given: dict, checks: Sequence[Callable], coef) -> BackwardResult:
    """``sp.backward(model, mb, loss_fn, **given)`` (``coef``: its checked ``aux_loss_coef``: first a no-grad
    forward of the microbatch for its aux loss and each token's gradient of it, ``schedule.step_aux``)."""
    step, k = mb.step, mb.k
    aux = step_aux.wanted(model, step, k, bool(coef), f"aux_loss_coef={coef!r}")
    with in_forward_autocast(model):
        planned = step.begin(model, k, backward=True)
        opts, _, cp, error = call.prepare(model, planned, True, given, checks, coef)
        opts = _options(mb, opts.replace(sync=opts.sync and sync_enabled(model)), given)
        if not aux:
            return step.run(model, planned.step, True, lambda: rounds.backward(model, cp, opts, loss_fn, error=error))
        inner, (first, then) = unwrap(model), step_aux.forward_then_backward(step, k, planned)

        def run():
            with torch.no_grad():  # (the shared segments recorded as the step records them)
                _, own = rounds.forward(model, first, opts.replace(entropy=False), aux=True, error=error)
                grads, value = router.scaled_grads(inner, step_aux.records(step, k, own or []), coef)
            mine, shared = step_aux.split(step, grads)
            step_aux.add_shared(step, shared)
            res = rounds.backward(model, then, opts, loss_fn, aux=(mine, value), aux_coef=coef, error=error)
            recorded = step.splan.shared_tokens if planned.step.records else 0  # (by the forward, for the step)
            return dataclasses.replace(res, tokens_computed=res.tokens_computed + recorded)

        return step.run(model, planned.step, True, run)


def logprobs(model, mb: Microbatch, given: dict, checks: Sequence[Callable], plain: Callable) -> LogProbs:
    """``sp.logprobs(model, mb, **given)``; ``plain``: ``sp.logprobs`` itself, for a no-grad call on the rows."""
    if not torch.is_grad_enabled():  # the keywords left out are the step's (sp.plan_step's), as on a CallPlan
        made = dict(mb.step.cp.given, max_tokens=mb.step.cp.options.max_tokens)
        kw = {k: made.get(k, v) if isinstance(v, Default) else v for k, v in given.items()}
        return plain(model, mb.step.sources[mb.k], **kw)
    graph = passed(given).get("defer") is False
    if graph:  # before the step begins: a refusal leaves it as it was
        step_graph.check_graph_path(model, mb.step, mb.k)
    inner, step, k = unwrap(model), mb.step, mb.k
    setting = passed(given).get("aux_loss", dict(step.cp.given).get("aux_loss"))  # (else the step's)
    on = setting or (setting is None and router.enabled(inner))
    aux = step_aux.wanted(model, step, k, bool(on), f"aux_loss={setting!r}")  # (before the step begins)
    with in_forward_autocast(model):
        planned = step.begin(model, k, backward=False)
        opts, _, cp, error = call.prepare(model, planned, False, given, checks)
        opts = _options(mb, opts.replace(aux_loss=aux), given)

        def run():
            out, own = rounds.forward(model, cp, opts, aux=aux, error=error)
            if not aux:
                return out, None
            recs = step_aux.records(step, k, own or [])
            return dataclasses.replace(out, aux_loss=router.aux_loss(inner, recs)), recs

        if graph:  # the graph kept (one process, no checkpointing: ``call.prepare`` refused the others)
            out, _ = step.run(model, planned.step, False, run)
            return step_graph.graph_outputs(step, model, k, out)
        with torch.no_grad():
            out, recs = step.run(model, planned.step, False, run)
            grads = router.segment_grads(inner, recs) if recs else None
        return defer_logprobs(_deferred_backward, model, mb, out, opts, grads, engine=detect(model, inner))


def _deferred_backward(model, mb: Microbatch, loss_fn, options: CallOptions, aux_grads=None, collect=False):
    """The backward of a step's deferred log-probs: the microbatch's ``backward`` (``schedule.deferred``'s
    contract), synchronising only outside DDP's ``no_sync()``, as DDP's own backward would; ``aux_grads``: the aux
    loss's per-segment gradients (scaled by the gradient that reached it), the shared ones onto the step's cache."""
    cp = mb.step.begin(model, mb.k, backward=True, deferred=True)
    opts = options.replace(sync=options.sync and sync_enabled(model))
    mine, shared = step_aux.split(mb.step, aux_grads)

    def run():
        step_aux.add_shared(mb.step, shared)
        aux = None if mine is None else (mine, None)
        return rounds.backward(model, cp, opts, loss_fn, aux=aux, collect=collect)

    return mb.step.run(model, cp.step, True, run)


def _options(mb: Microbatch, opts: CallOptions, given: dict) -> CallOptions:
    """A step's call runs under the step's prefix mode (what its cache holds between calls); ``given``: the call's
    keywords (a ``prefix_activations`` it passed must be the step's)."""
    if "prefix_activations" not in passed(given):
        return opts.replace(prefix_activations=mb.step.mode)
    if opts.prefix_activations != mb.step.mode:
        raise ValueError(
            f"prefix_activations={opts.prefix_activations!r} in a call of a step planned with "
            f"prefix_activations={mb.step.mode!r}: the step's shared prompts are held in one mode across its calls. "
            "Leave prefix_activations out of the call, or pass it to sp.plan_step."
        )
    return opts
