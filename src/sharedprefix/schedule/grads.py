"""A call's gradient as a transaction, delivered to the parameters as one plain backward would deliver it.

A plain step runs one backward: each parameter's tensor hooks (``p.register_hook``) run once on the step's gradient,
that gradient is added in place into the ``.grad`` already there (a new tensor only where there is none), then the
post-accumulate-grad hooks run. sharedprefix runs several backwards per call (one per pass under a budget, a cached
prompt's deferred backward, the MoE aux term), so here:

1. At the start the ``.grad`` tensors present are held aside (no copy) and the call accumulates its contribution
   ``c`` from zero, with every parameter's tensor and post-accumulate-grad hooks set aside
   (``parallel.grad_hooks``).
2. If the call raises, every held ``.grad`` is put back untouched: a trainer that catches the error and skips the
   batch steps on no partial gradient.
3. On success ``c`` is *delivered*: the tensor hooks run once on it (in registration order, each may replace it),
   it is added in place into the held tensor (bucket views and flat buffers stay valid), then the post-accumulate
   hooks run once. Or, for a deferred call (``sp.logprobs(defer=True)``), ``c`` is *collected* and returned as the
   gradient of the parameters through the caller's own backward, where autograd sums it with any other term of
   the caller's loss before it runs the hooks once and accumulates (``schedule.deferred``).

Sequence parallelism: ``c`` is this rank's share, summed over the group before delivery. FSDP2: ``c`` reaches the
sharded parameters through FSDP2's reduce-scatter, whose plain run fires no tensor hook on them; the unsharded
parameters' post-accumulate hooks run in the call's last backward (``parallel.grad_hooks``).

DDP (``sync=False`` accumulates, the syncing call all-reduces): the ``.grad`` held at the start of an accumulation
(already synchronised) is kept aside across its ``sync=False`` calls, which accumulate into tensors of their own;
the syncing call all-reduces their sum with its own contribution and adds the result into the tensors held at the
start, so those are the ``.grad`` afterwards. The state kept between calls lives here, keyed weakly by the model.
"""

from __future__ import annotations

import weakref

import torch

from sharedprefix.parallel.grad_hooks import run_tensor_hooks
from sharedprefix.parallel.sequence import reduce_grads

_SYNCED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DDP: model -> {param: grad held at its start}


class GradTransaction:
    """One call's gradient: ``.grad`` held aside at the start; ``deliver`` / ``collect`` / ``rollback`` at the end.

    ``hooks``: the call's ``DeferredGradHooks`` (its tensor hooks are run on delivery), or None (FSDP2, whose sharded
    parameters get no tensor hook in a plain run either)."""

    def __init__(self, model: torch.nn.Module, hooks=None):
        self.model, self.hooks = model, hooks
        self.held: dict[torch.Tensor, torch.Tensor] = {}
        for p in model.parameters():
            if p.grad is not None and p not in self.held:
                self.held[p] = p.grad
                p.grad = None

    def contribution(self) -> dict[torch.Tensor, torch.Tensor]:
        """The call's own gradient, by parameter (what accumulated since the start)."""
        return {p: p.grad for p in _unique(self.model) if p.grad is not None}

    def rollback(self) -> None:
        """After failure: every ``.grad`` exactly as the call found it (the held tensors, never written)."""
        for p in _unique(self.model):
            p.grad = self.held.get(p)

    def collect(self) -> dict[torch.Tensor, torch.Tensor]:
        """A deferred call's end: ``.grad`` as the call found it; returns the contribution for the caller's backward."""
        c = self.contribution()
        self.rollback()
        return c

    def deliver(self, into: dict | None = None) -> None:
        """The contribution through the tensor hooks, added in place into ``into`` (default: the held tensors), as
        plain autograd accumulates; a parameter with nothing held keeps the contribution as its ``.grad``."""
        into = self.held if into is None else into
        with torch.no_grad():
            for p, c in self.contribution().items():
                if self.hooks is not None:
                    c = run_tensor_hooks(p, c)
                old = into.get(p)
                if old is None:
                    p.grad = c
                else:
                    old.add_(c)
                    p.grad = old
        for p, old in into.items():  # held tensors the call did not reach stay where they were
            if p.grad is None:
                p.grad = old


def _unique(model: torch.nn.Module) -> list[torch.Tensor]:
    return list({id(p): p for p in model.parameters()}.values())


def _ddp_finish(tx: GradTransaction, par, model, sync: bool, grad_reduction: str) -> None:
    """DDP: deliver this call's contribution into the accumulation's own tensors; at the syncing call, all-reduce
    them and add the result into the ``.grad`` held at the accumulation's start."""
    start = _SYNCED.get(model)
    if start is None:  # this call starts an accumulation: what it holds was synchronised before
        tx.deliver(into={})
        start = tx.held
    else:  # what it holds is the accumulation so far (earlier sync=False calls)
        tx.deliver()
    if not sync:
        _SYNCED[model] = start
        return
    _SYNCED.pop(model, None)
    par.all_reduce_grads(model)
    with torch.no_grad():
        if grad_reduction == "mean":
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(par.data_size)
        for p, old in start.items():
            if p.grad is None:
                p.grad = old
            elif old is not p.grad:
                old.add_(p.grad)
                p.grad = old


def synced(par, model, sync: bool, grad_reduction: str, fn, collect: bool = False):
    """``fn()`` inside a gradient transaction (a failure leaves ``.grad`` as it was); under DDP with ``sync``, whose
    passes run no collective, the ranks agree on any error first (every rank raises, none waits), then one
    all-reduce of the gradients (sum, or mean). ``collect``: a deferred call's backward (not under DDP, which
    synchronises inside the call): returns ``(fn(), contribution)`` with ``.grad`` untouched and no hook run."""
    ddp = par.kind == "ddp"
    tx = GradTransaction(model, hooks=None if par.fsdp else par.hooks)
    try:
        error, out = None, None
        try:
            out = fn()
        except Exception as e:  # agreed on below, before the all-reduce the other ranks will join
            if not (ddp and sync):
                raise
            error = e
        if par.sequence is not None and not par.fsdp:  # this call's share of each rank, summed over the group
            reduce_grads(model, par.sequence)
        if ddp and sync:
            par.agree_on_error(error, where="during")
    except BaseException:
        tx.rollback()  # no partial gradient is left behind
        raise
    finally:
        par.set_sync(True)  # FSDP2's default, whatever happened
    if collect and not ddp:
        return out, tx.collect()
    if ddp:
        _ddp_finish(tx, par, model, sync, grad_reduction)
    else:
        tx.deliver()
    par.fire_hooks()  # the plain run's one backward: each post-accumulate-grad hook once, on the whole gradient
    return (out, {}) if collect else out
