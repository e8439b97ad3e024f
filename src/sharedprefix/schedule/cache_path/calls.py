"""The public calls' branch for hybrid models on the cache path (``cache_path.run``): the engine's checks, the
ranks' error agreement and the deferral decision around ``run.logprobs`` / ``run.backward``.

Notation: N = completions, W = the longest completion.
"""

from __future__ import annotations

import contextlib

import torch

from sharedprefix.attention.kernels import select
from sharedprefix.layout.rows import copied
from sharedprefix.model.adapter import unwrap
from sharedprefix.model.support import inline_mixer_reason
from sharedprefix.parallel.detect import detect
from sharedprefix.parallel.engine import Engine
from sharedprefix.schedule.cache_path import run as cache_run
from sharedprefix.schedule.compiled import user_context
from sharedprefix.schedule.deferred import defer_logprobs
from sharedprefix.schedule.grads import synced
from sharedprefix.schedule.options import CallOptions
from sharedprefix.schedule.results import LogProbs


def hybrid_logprobs(model, groups, options: CallOptions) -> LogProbs:
    """``sp.logprobs`` of a model on the cache path; a deferred call's backward is ``hybrid_backward``."""
    defer = options.defer
    engine = check_hybrid(model, options.backend)
    needs = engine.must_defer  # the engine synchronises gradients inside a call (DDP)
    if torch.is_grad_enabled() and needs and defer is False:
        raise ValueError(
            f"sharedprefix.logprobs with grad enabled and defer=False on {needs}: the hybrid path runs the "
            "wrapped module, so only a deferred backward (defer=None or True) synchronises the gradients over "
            "the ranks. Leave defer=None."
        )
    deferred = torch.is_grad_enabled() and (defer or needs is not None)  # no graph now, cache_run.backward later
    error, out = None, None
    try:
        with torch.no_grad() if deferred else contextlib.nullcontext():
            out = cache_run.logprobs(unwrap(model), groups, options)
    except (ValueError, TypeError) as e:  # several ranks (DDP): every rank stops, none waits in a later collective
        error = e
    engine.agree_on_error(error)  # one process: the error is raised here as it is
    assert out is not None  # an error was raised above, on every rank
    if deferred:
        # the backward runs the forward again: from a copy of the groups, which no later edit of the caller's reaches
        return defer_logprobs(hybrid_backward, model, copied(groups), out, options, engine=engine)
    return out


def hybrid_backward(model, groups, loss_fn, options: CallOptions, aux_grads=None, collect: bool = False):
    """``sp.backward`` on the cache path, inside the call's gradient transaction (``schedule.grads.synced``: hooks
    once, ``.grad`` in place, DDP's one sync). ``collect``: a deferred call's backward (``defer_logprobs``);
    ``aux_grads``: always None here (the load-balancing loss is refused on this path)."""
    inner = unwrap(model)
    par = check_hybrid(model, options.backend)
    par.start()  # the call's gradient hooks (``par.hooks``), run once by ``synced``
    run = lambda: cache_run.backward(inner, groups, loss_fn, options, par.hooks)  # noqa: E731
    return synced(par, inner, options.sync, options.grad_reduction, run, collect=collect)  # the module, then one sync


def check_hybrid(model, backend: str) -> Engine:
    """A hybrid model runs its own attention (``cache_path.run``): the backend name is checked, not used; the engine
    refuses what it cannot run there (FSDP2, tensor parallelism). Returns the call's engine."""
    select(backend, unwrap(model).get_input_embeddings().weight.device)
    if user_context(model, unwrap(model)) is not None:
        raise TypeError(
            f"{type(unwrap(model)).__name__} is a hybrid model on sharedprefix's cache path and was compiled as a "
            "whole (torch.compile(model) or model.compile()); that path runs the model's own cache-aware forward, "
            "which has not been run compiled, so the compile would silently not apply. Pass the uncompiled model."
        )
    engine = detect(model, unwrap(model))
    reason = inline_mixer_reason(getattr(unwrap(model).config, "model_type", None))
    engine.check_cache_path(type(unwrap(model)).__name__, reason)
    return engine
