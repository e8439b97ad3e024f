"""Grad-enabled log-probs of a step's microbatch that keep their graph (``sp.logprobs(model, step.microbatch(k),
defer=False)``; ``schedule.step``): one process without checkpointing, no second forward. The outputs carry an identity
node (``_AfterBackward``) whose backward queues ``after_backward`` to run when the caller's backward ends, once autograd
has accumulated every gradient (the shared leaves' included): the microbatch is then done, and at the step's last the
shared segments' backward runs there."""

from __future__ import annotations

import dataclasses

import torch

from sharedprefix.model.adapter import unwrap
from sharedprefix.parallel.detect import detect
from sharedprefix.schedule import step_rules
from sharedprefix.schedule.step import Step


def keeps_graph(step: Step, k: int) -> bool:
    """Whether microbatch ``k``'s grad-enabled log-probs can keep their graph (``check_graph_path``)."""
    return not any(getattr(st, "record", ()) for st in step.splan.microbatches[k])


def check_graph_path(model, step: Step, k: int) -> None:
    """``sp.logprobs(model, step.microbatch(k), defer=False)`` keeps the graph of microbatch k's own passes, read
    from the step's cache: refused where k expands a part larger than the budget inside itself (its cached
    segments would be leaves no backward of the caller reaches), and under an engine that says why not
    (``Engine.step_graph_refusal``)."""
    why = detect(model, unwrap(model)).step_graph_refusal
    if why is not None:
        raise ValueError(
            f"defer=False on microbatch {k + step.offset} of a step under {why}. Leave defer out (the microbatch's "
            "log-probs defer, and their backward runs inside your backward: exact)."
        )
    if not keeps_graph(step, k):
        raise ValueError(
            f"defer=False on microbatch {k + step.offset} of a step whose own rows are larger than "
            f"max_tokens={step.splan.max_tokens}: their prompt would be cached inside the call, where only a "
            "deferred backward reaches it. Leave defer out (the microbatch defers), or raise max_tokens."
        )


def graph_outputs(step: Step, model, k: int, out):
    """``out`` (microbatch k's grad-enabled log-probs, their graph reading the step's cache) as outputs whose
    backward, once the caller's backward has ended, marks k done, and at the step's last microbatch runs the
    shared segments' backward (``after_backward``)."""
    view, tree = step.views[k], step.splan.tree
    read = {s for r in view.rows for s in tree.path(tree.rows[r].end)} & set(step.splan.shared)
    leaves = step.cache.grad_marks(read)
    extra = [t for t in (out.entropy, out.aux_loss) if t is not None]  # (the MoE aux loss: ``step_aux``)
    wrapped = _AfterBackward.apply(_Tail(step, model, k, leaves), out.logprobs, *extra)
    if not isinstance(wrapped, tuple):
        wrapped = (wrapped,)
    rest = iter(wrapped[1:])
    ent = next(rest) if out.entropy is not None else None
    aux = next(rest) if out.aux_loss is not None else None
    return dataclasses.replace(out, logprobs=wrapped[0], entropy=ent, aux_loss=aux)


def after_backward(step: Step, model, k: int, marks: list) -> None:
    """At the end of the caller's backward through microbatch k's outputs: k is done; a backward that did not
    reach the shared leaves it read (``torch.autograd.grad``, or ``backward(inputs=...)``, which accumulate into no
    other leaf) is refused, since their gradient would be dropped; at the step's last microbatch, the shared
    segments' backward."""
    if k in step.done or step.state != "open":
        raise RuntimeError(
            f"microbatch {k + step.offset}'s log-probs were backpropagated again (or after their step ended): each "
            "microbatch's gradient joins its step once. Compute them again in a new step to train on them again."
        )
    if marks and not step.cache.grads_moved(marks):
        step.close("failed")
        raise RuntimeError(
            f"the backward through microbatch {k + step.offset}'s log-probs (sp.logprobs with defer=False) did not "
            "reach the step's cached prompts, whose gradient would then be dropped: torch.autograd.grad, or "
            "loss.backward(inputs=...), accumulates into no leaf outside the ones named. Use loss.backward() without "
            "inputs, or leave defer out (deferred log-probs give autograd.grad and inputs= the parameters' "
            "gradient too). The step is closed."
        )
    step.forwarded.discard(k)
    step.done.add(k)
    step_rules.mark_grads_after(step, model)
    if len(step.done) < len(step.views):
        return
    try:
        if step.splan.shared:
            step.shared_backward(model, k, step.mode, sync=step.cp.options.sync)
    except BaseException as error:
        step.done.discard(k)
        step.fail(model, error)
        raise
    step.close("finished")


@dataclasses.dataclass(frozen=True)
class _Tail:
    """What ``_AfterBackward`` calls back: ``after_backward(step, model, k, marks)``."""

    step: Step
    model: torch.nn.Module
    k: int
    marks: list


class _AfterBackward(torch.autograd.Function):
    """The identity on a microbatch's outputs; its backward queues ``_Tail`` to run when the caller's backward ends
    (after autograd accumulated every gradient, the shared leaves' included), once per backward."""

    @staticmethod
    def forward(ctx, tail, *tensors):
        ctx.tail = tail
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors) if len(tensors) > 1 else tensors[0].view_as(tensors[0])

    @staticmethod
    def backward(ctx, *grads):
        t = ctx.tail
        torch.autograd.Variable._execution_engine.queue_callback(lambda: after_backward(t.step, t.model, t.k, t.marks))
        return (None, *grads)
