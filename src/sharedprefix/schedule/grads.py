"""A call's gradient contribution as a transaction: committed when the call succeeds, removed when it fails.

``sp.backward`` accumulates into ``.grad`` over several passes. If it raises part-way (a NaN loss on
the third pass, a refusal, an out-of-memory error), the passes that already ran must not leave their
share behind, or a trainer that catches the error and skips the batch would step on a partial
gradient. Gradients present at the start are moved aside (no copy), the call accumulates from
zero, and at the end they are added back (success) or put back as they were (failure).

DDP: gradients already synchronised are kept aside across ``sync=False`` calls (only what those
calls add is all-reduced by the syncing call); contributions of earlier ``sync=False`` calls stay in
``.grad`` so that the all-reduce sums them, and a failing call restores them from a copy. The state
kept between calls lives here, keyed weakly by the model, never on the user's model.
"""

from __future__ import annotations

import weakref

import torch

from sharedprefix.parallel.sequence import reduce_grads

_SYNCED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DDP: model -> {param: grad set aside}


def _take(model: torch.nn.Module) -> dict:
    out = {}
    for p in model.parameters():
        if p.grad is not None:
            out[p] = p.grad
            p.grad = None
    return out


def _give_back(stash: dict) -> None:
    for p, g in stash.items():
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


class GradTransaction:
    def __init__(self, model: torch.nn.Module, ddp: bool):
        self.model, self.ddp = model, ddp
        self.stash, self.backup, self.created = {}, {}, False
        if not ddp:
            self.stash = _take(model)
        elif model not in _SYNCED:
            _SYNCED[model] = _take(model)
            self.created = True
        else:  # contributions of earlier sync=False calls: kept in .grad for the all-reduce, copied for a rollback
            self.backup = {p: p.grad.detach().clone() for p in model.parameters() if p.grad is not None}

    def commit(self, synced: bool) -> None:
        """After success: add back what was set aside (DDP: once this call synchronised)."""
        if not self.ddp:
            _give_back(self.stash)
        elif synced:
            _give_back(_SYNCED.pop(self.model, {}))

    def rollback(self) -> None:
        """After failure: every ``.grad`` exactly as the call found it."""
        for p in self.model.parameters():
            p.grad = self.backup.get(p)
        if not self.ddp:
            _give_back(self.stash)
        elif self.created:
            _give_back(_SYNCED.pop(self.model, {}))


def synced(par, model, sync: bool, grad_reduction: str, fn):
    """``fn()`` inside a gradient transaction (a failure leaves ``.grad`` as it was); under DDP with ``sync``, whose
    passes run no collective, the ranks agree on any error first (every rank raises, none waits), then one
    all-reduce of the gradients (sum, or mean)."""
    tx = GradTransaction(model, ddp=par.kind == "ddp")
    ddp = par.kind == "ddp" and sync
    try:
        error, out = None, None
        try:
            out = fn()
        except Exception as e:  # agreed on below, before the all-reduce the other ranks will join
            if not ddp:
                raise
            error = e
        if par.sequence is not None and not par.fsdp:  # this call's share of each rank, summed over the group
            reduce_grads(model, par.sequence)
        if ddp:
            par.agree_on_error(error, where="during")
            par.all_reduce_grads(model)
            if grad_reduction == "mean":
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.div_(par.data_size)
    except BaseException:
        tx.rollback()  # no partial gradient is left behind
        raise
    finally:
        par.set_sync(True)  # FSDP2's default, whatever happened
    tx.commit(synced=sync)
    par.fire_hooks()  # the plain run's one backward: each post-accumulate-grad hook once, on the whole gradient
    return out
