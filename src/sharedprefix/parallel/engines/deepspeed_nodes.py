"""The autograd pieces of the DeepSpeed engine (``parallel.engines.deepspeed``): ``Deliver``, the node whose backward
hands a call's gradient to autograd inside ``engine.backward``, and ``Release``, which partitions ZeRO-3 parameters
gathered for a deferred call's backward again when that backward ends or fails."""

from __future__ import annotations

import torch


class Release:
    """Leaves a ``GatheredParameters`` block (partitions its parameters again) once: when the backward it was queued
    on ends, or when that backward fails. Autograd runs a queued callback only at the end of a backward that
    succeeded; after a failure it drops it unrun with the failed graph task, as the error leaves
    ``torch.autograd.backward``, and this object is freed then (nothing else refers to it). Without ``__del__`` the
    parameters stayed gathered, and the next deferred call raised DeepSpeed's "Nested GatheredParameters contexts
    cannot overlap parameters". On that failure it also releases what ZeRO-3's backward epilogue, which never ran,
    would have (``leftovers``: ``release_backward_leftovers``, the modules whose post-backward hook never fires, such
    as the embedding, fed token ids that need no gradient, in sharedprefix's passes)."""

    def __init__(self, block, leftovers=None):
        self.block, self.leftovers = block, leftovers

    def __call__(self) -> None:
        block, self.block = self.block, None
        if block is not None:
            block.__exit__(None, None, None)

    def __del__(self) -> None:
        if self.block is not None:  # dropped unrun: the backward failed
            self()
            if self.leftovers is not None:
                self.leftovers()


class Deliver(torch.autograd.Function):
    """A scalar of the parameters whose backward returns the gradients it was given (``ctx.grads``), times the
    gradient that reaches it (1, or what ``engine.backward`` scales the loss by: ``1 / gradient_accumulation_steps``).
    Autograd then runs each parameter's tensor hooks on it, accumulates it into ``.grad`` and runs its
    post-accumulate-grad hooks, inside the running backward."""

    @staticmethod
    def forward(ctx, grads, then, *params):
        ctx.grads, ctx.then = grads, then
        return torch.zeros((), dtype=params[0].dtype, device=params[0].device)

    @staticmethod
    def backward(ctx, g):
        if ctx.then is not None:  # inside this backward, before any parameter's hook
            ctx.then()
        if bool(g == 1):
            return (None, None, *ctx.grads)
        return (None, None, *(x * g.to(x.dtype) for x in ctx.grads))
