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
parameters' post-accumulate hooks run in the call's last backward (``parallel.grad_hooks``). The transaction reads
the sharded parameters only (``Engine.before_grads``, at its start and again after the rounds): the ``.grad`` of an
unsharded one is FSDP2's own accumulation of backwards that did not reduce (``sync=False``,
``set_requires_gradient_sync(False)``), and a unit that does not reshard after backward
(``set_reshard_after_backward(False)``) leaves its unsharded parameters registered after the call's last backward,
the sharded ones (holding the call's reduced gradient) out of ``model.parameters()``.

DDP: the engine finishes the transaction (``parallel.engines.ddp``: the contribution added as DDP's own backward
would add it, every ``.grad`` averaged over the ranks by one all-reduce at the syncing call); the other engines
deliver it as above (``Engine.finish_grads``).
"""

from __future__ import annotations

import torch

from sharedprefix.parallel.engine import Engine
from sharedprefix.parallel.grad_hooks import run_tensor_hooks


class GradTransaction:
    """One call's gradient: ``.grad`` held aside at the start; ``deliver`` / ``collect`` / ``rollback`` at the end.

    ``replay_hooks``: the parameters' tensor hooks run on delivery (not under FSDP2, whose sharded parameters get no
    tensor hook in a plain run either, nor DeepSpeed, whose delivering backward runs them)."""

    def __init__(self, model: torch.nn.Module, replay_hooks: bool = True):
        self.model, self.replay_hooks = model, replay_hooks
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
                if self.replay_hooks:
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


def synced(par: Engine, model, sync: bool, grad_reduction: str, fn, collect: bool = False):
    """``fn()`` inside a gradient transaction (a failure leaves ``.grad`` as it was), finished by the engine ``par``
    (``Engine.finish_grads``). An engine that reduces the gradient after the rounds (DDP with ``sync``, whose passes
    run no collective) has the ranks agree on any error first (every rank raises, none waits). ``collect``: a
    deferred call's backward: returns ``(fn(), contribution)`` with ``.grad`` untouched and no hook run (under DDP,
    which synchronises inside the call, ``.grad`` is written and the contribution is empty)."""
    at_end = par.reduces_at_end(sync)
    par.before_grads()  # FSDP2: its sharded parameters registered, their own gradient accumulation left alone
    tx = GradTransaction(model, replay_hooks=par.replays_tensor_hooks)
    try:
        error, out = None, None
        try:
            out = fn()
            par.check_rounds()  # the engine's refusals of what the rounds revealed (DDP: its reducer fired)
        except Exception as e:  # agreed on below, before the all-reduce the other ranks will join
            if not at_end:
                raise
            error = e
        finally:  # FSDP2: units that do not reshard after backward resharded again, so that the contribution (or
            par.before_grads()  # the rollback) reads the sharded parameters, where the held gradients are
        par.sum_sequence_shares(model)  # this call's share of each rank, summed over the sequence group
        if at_end:
            par.agree_on_error(error, where="during")
    except BaseException:
        tx.rollback()  # no partial gradient is left behind
        raise
    finally:
        par.set_sync(True)  # FSDP2's default, whatever happened
    grads = par.finish_grads(tx, model, sync, grad_reduction, collect)
    if grads is not None:  # collected for the caller's backward, which runs the hooks
        return out, grads
    par.fire_hooks()  # the plain run's one backward: each post-accumulate-grad hook once, on the whole gradient
    return (out, {}) if collect else out
