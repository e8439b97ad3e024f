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

from collections.abc import Callable, Sequence

import torch

from sharedprefix.model.adapter import unwrap
from sharedprefix.model.forward_mode import in_forward_autocast
from sharedprefix.parallel.detect import detect, sync_enabled
from sharedprefix.schedule import call, rounds, step_graph
from sharedprefix.schedule.deferred import defer_logprobs
from sharedprefix.schedule.options import CallOptions, Default, passed
from sharedprefix.schedule.results import BackwardResult, LogProbs
from sharedprefix.schedule.step import Microbatch

_AUX = (
    "a step (sp.plan_step) does not carry the MoE load-balancing loss, which is each microbatch's own. Run each "
    "microbatch as its own call (sp.backward(model, rows, ..., aux_loss_coef=...))."
)


def backward(model, mb: Microbatch, loss_fn, given: dict, checks: Sequence[Callable], coef) -> BackwardResult:
    """``sp.backward(model, mb, loss_fn, **given)`` (``coef``: its checked ``aux_loss_coef``, refused)."""
    if coef:
        raise ValueError(f"aux_loss_coef={coef!r} with a step's microbatch; {_AUX}")
    with in_forward_autocast(model):
        planned = mb.step.begin(model, mb.k, backward=True)
        opts, _, cp, error = call.prepare(model, planned, True, given, checks)
        opts = _options(mb, opts.replace(sync=opts.sync and sync_enabled(model)), given)
        return mb.step.run(model, planned.step, True, lambda: rounds.backward(model, cp, opts, loss_fn, error=error))


def logprobs(model, mb: Microbatch, given: dict, checks: Sequence[Callable], plain: Callable) -> LogProbs:
    """``sp.logprobs(model, mb, **given)``; ``plain``: ``sp.logprobs`` itself, for a no-grad call on the rows."""
    if not torch.is_grad_enabled():  # the keywords left out are the step's (sp.plan_step's), as on a CallPlan
        made = dict(mb.step.cp.given, max_tokens=mb.step.cp.options.max_tokens)
        kw = {k: made.get(k, v) if isinstance(v, Default) else v for k, v in given.items()}
        return plain(model, mb.step.sources[mb.k], **kw)
    own = passed(given)  # the keywords the call passed
    if own.get("aux_loss"):
        raise ValueError(f"aux_loss=True with a step's microbatch; {_AUX}")
    graph = own.get("defer") is False
    if graph:  # before the step begins: a refusal leaves it as it was
        step_graph.check_graph_path(model, mb.step, mb.k)
    with in_forward_autocast(model):
        planned = mb.step.begin(model, mb.k, backward=False)
        opts, _, cp, error = call.prepare(model, planned, False, given, checks)
        opts = _options(mb, opts.replace(aux_loss=False), given)

        def run():
            return rounds.forward(model, cp, opts, aux=False, error=error)[0]

        if graph:  # the graph kept (one process, no checkpointing: ``call.prepare`` refused the others)
            out = mb.step.run(model, planned.step, False, run)
            return step_graph.graph_outputs(mb.step, model, mb.k, out)
        with torch.no_grad():
            out = mb.step.run(model, planned.step, False, run)
        return defer_logprobs(_deferred_backward, model, mb, out, opts, None, engine=detect(model, unwrap(model)))


def _deferred_backward(model, mb: Microbatch, loss_fn, options: CallOptions, aux_grads=None, collect=False):
    """The backward of a step's deferred log-probs: the microbatch's ``backward`` (``schedule.deferred``'s
    contract), synchronising only outside DDP's ``no_sync()``, as DDP's own backward would."""
    cp = mb.step.begin(model, mb.k, backward=True, deferred=True)
    opts = options.replace(sync=options.sync and sync_enabled(model))
    return mb.step.run(model, cp.step, True, lambda: rounds.backward(model, cp, opts, loss_fn, collect=collect))


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
