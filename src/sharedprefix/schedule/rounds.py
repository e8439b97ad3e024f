"""Drive an ``Executor`` through a plan: ``forward`` (``sp.logprobs``: every pass once, rows read out) and
``backward`` (``sp.backward``'s rounds: F records a segment, FB is a pass whose rows get a loss and a backward, PB a
cached segment's deferred backward, REL releases it, DF / DFB are a ``lockstep`` engine's dummy rounds).

Notation: N = output rows, W = columns, n = rows a pass reports.
"""

from __future__ import annotations

import torch

from sharedprefix.attention.interface import pass_state
from sharedprefix.attention.switch import activated
from sharedprefix.model import mixers, router
from sharedprefix.schedule.cache import OffloadHooks
from sharedprefix.schedule.compiled import whole_compiled
from sharedprefix.schedule.grads import synced
from sharedprefix.schedule.planner import Dummy, Pass, Plan, PrefixBackward
from sharedprefix.schedule.results import BackwardResult, Batch, LogProbs


def forward(run, entropy: bool) -> LogProbs:
    """Every pass of ``run``'s plan once (a split prompt's segments sealed without a graph, released at their
    backward step); the reported rows gathered back into output order: (N, W) tensors."""
    lps, ents, masks, order = [], [], [], []
    # in lockstep (FSDP2) every rank runs as many forwards (each all-gathers the parameters): agreed before any of them
    pad = run.rounds[0] - len(run.plan.passes) if run.par.lockstep else 0
    error = None  # recoverable (FSDP2): an error outside the collectives; the rank runs the rest as dummies
    with activated(run.model), mixers.active(run.model), whole_compiled(run.whole):
        for step in run.plan.steps:
            if isinstance(step, PrefixBackward):
                for s in step.segments:
                    run.cache.release(s)
                continue
            if error is not None:
                run.dummy_round(grad=False)
                continue
            run.begin_round()
            try:
                _, res, layout = run.run_pass(step)
            except Exception as e:
                if not run.recoverable():
                    raise
                error = e
                run.finish_failed_round(grad=False)  # a forward that did not run: its collectives, as a dummy
                continue
            for s in step.record:
                run.cache.seal(s, keep_graph=False)
            if res is None:
                continue
            lps.append(res[0])
            masks.append(run.mask(layout))
            if entropy:
                ents.append(res[1])
            order += layout.rows
        for _ in range(pad):
            run.dummy_round(grad=False)
    if run.par.lockstep:
        run.par.agree_on_error(error, where="during")
    inv = torch.empty(len(order), dtype=torch.int64)
    inv[torch.tensor(order)] = torch.arange(len(order))
    inv = inv.to(run.device)
    lp = torch.cat(lps).index_select(0, inv)
    mask = torch.cat(masks).index_select(0, inv)
    ent = torch.cat(ents).index_select(0, inv) if entropy else None
    aux = router.aux_loss(run.model, run.router_logits) if run.router_logits else None
    return LogProbs(lp, mask, ent, aux)


def backward(run, loss_fn, aux_loss=None, aux_coef=0.0, collect=False):
    """``sp.backward`` over ``run``: its plan as rounds (a ``lockstep`` engine's: reordered and padded to the agreed
    counts), inside a gradient transaction the engine finishes (DDP: one synchronisation at the end); the settings are
    ``run.options``.
    ``aux_loss``: the MoE load-balancing loss's value (float) when ``run`` carries its gradient (``run.aux_grads``,
    already scaled by ``aux_coef``). ``collect``: a deferred call's backward, returns ``(result, {parameter:
    gradient})`` with ``.grad`` untouched (``schedule.grads.synced``)."""
    opts = run.options
    entropy, prefix_activations, offload_device = opts.entropy, opts.prefix_activations, opts.offload_device
    sync, grad_reduction = opts.sync, opts.grad_reduction
    par = run.par
    mode = par.prefix_mode(prefix_activations)  # FSDP2 recomputes: a deferred backward runs inside the root's call
    recompute = mode == "recompute"
    cuda = run.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(run.device)
    hooks = OffloadHooks(run.model, offload_device) if mode == "offload" else None
    steps = run.plan
    if par.lockstep:  # every rank runs the same collectives: the plan reordered and padded to the agreed counts
        steps = steps.for_fsdp(*run.rounds)
    rounds = rounds_of(steps)
    dummies = sum(k in ("DF", "DFB") for k, _ in rounds)
    last_fb = max((i for i, r in enumerate(rounds) if r[0] in ("FB", "PB", "DFB")), default=-1)
    # under "mean", scale so that FSDP2's averaging (or our own all-reduce) gives the mean / the sum
    scale = par.loss_scale(grad_reduction)
    out = synced(
        par,
        run.model,
        sync,
        grad_reduction,
        lambda: run_rounds(run, rounds, loss_fn, entropy, recompute, hooks, sync, scale, last_fb),
        collect=collect,
    )
    (total, calls), grads = out if collect else (out, None)
    peak = int(torch.cuda.max_memory_allocated(run.device)) if cuda else None
    result = BackwardResult(
        loss=total if aux_loss is None else total + aux_coef * aux_loss,
        aux_loss=aux_loss,
        tokens_computed=run.tokens,
        tokens_plain=run.plan.plain_tokens,
        passes=len(run.plan.passes),
        loss_calls=calls,
        peak_memory_bytes=peak,
        offloaded_bytes=hooks.bytes_moved if hooks else 0,
        dummy_rounds=dummies,
    )
    return (result, grads) if collect else result


def rounds_of(p: Plan) -> list[tuple[str, object]]:
    """The plan's steps as rounds, in order: F (record a segment), FB (rows, loss, backward), PB (a cached segment's
    deferred backward), REL (release it), DF / DFB (dummy rounds of a ``lockstep`` plan, see ``Plan.for_fsdp``)."""
    out: list[tuple[str, object]] = []
    for step in p.steps:
        if isinstance(step, PrefixBackward):
            out += [("PB", s) for s in reversed(step.segments)] + [("REL", step.segments)]
        elif isinstance(step, Dummy):
            out.append(("DFB" if step.backward else "DF", None))
        else:
            out.append(("F" if step.record else "FB", step))
    return out


def run_rounds(run, rounds, loss_fn, entropy, recompute, hooks, sync, scale, last_fb):
    """Run ``rounds``; returns (total loss, loss_fn calls).

    Under a ``recoverable`` engine (FSDP2, several ranks) an error outside the collectives (in ``loss_fn``, a refusal
    after a pass's forward) does not leave the other ranks waiting: this rank finishes the round's collectives with a
    backward of zero, runs its remaining rounds as dummy rounds (the same collectives, nothing computed that is kept:
    the call's gradients are rolled back), and at the end every rank learns of the error from one one-element
    all-reduce and raises, with the process group intact. An error inside the collectives is
    ``Engine.collectives``' case.
    """
    par = run.par
    total, calls, error = 0.0, 0, None
    with activated(run.model), mixers.active(run.model), whole_compiled(run.whole):
        for i, (kind, x) in enumerate(rounds):
            if kind in ("FB", "PB", "DFB"):
                par.begin_backward_round(sync=sync and i == last_fb, last=i == last_fb)
            if error is not None:  # this rank failed earlier in the call: it only takes part in the collectives
                if kind != "REL":
                    run.dummy_round(grad=kind in ("FB", "PB", "DFB"))
                continue
            run.begin_round()
            try:
                loss = _round(run, kind, x, loss_fn, entropy, recompute, hooks, scale, calls)
            except Exception as e:
                if not run.recoverable():
                    raise
                error = e
                run.finish_failed_round(grad=kind in ("FB", "PB", "DFB"), dummy=kind != "REL")
                continue
            if loss is not None:
                total += loss
                calls += 1
    if par.lockstep:
        par.agree_on_error(error, where="during")
    return total, calls


def _round(run, kind, x, loss_fn, entropy, recompute, hooks, scale, calls) -> float | None:
    """One round (see ``rounds_of``); returns the loss of an FB round that called ``loss_fn``, else None."""
    par = run.par
    if kind in ("DF", "DFB"):
        run.dummy_round(grad=kind == "DFB")
    elif kind == "REL":
        for s in x:
            run.cache.release(s)
    elif kind == "PB":
        if recompute:
            state, sur, _ = run.run_pass(Pass((x,), record=(x,)), surrogate=x)
        else:
            state = run.cache.states[x]
            sur = run.cache.surrogate(x, through_outputs=run.layers is not None)  # compiled: dK, dV join at the layers
            if hooks is not None:  # start bringing the offloaded activations back before the backward needs them
                hooks.prefetch()
        if sur is not None:
            with pass_state(state):
                par.backward(sur)
    elif kind == "F":
        with torch.set_grad_enabled(not recompute):
            if hooks is not None:
                with hooks():
                    run.run_pass(x)
            else:
                run.run_pass(x)
        for s in x.record:
            run.cache.seal(s, keep_graph=not recompute)
    else:  # FB
        state, res, layout = run.run_pass(x)
        aux = run.aux_term  # the MoE aux loss's linear term of this pass's tokens, or None
        if res is None:  # a pass with no rows to report (its values are cached for later rows)
            if aux is not None:
                with pass_state(state):
                    par.backward(aux)
            return None
        batch = Batch(
            logprobs=res[0],
            mask=run.mask(layout),
            entropy=res[1] if entropy else None,
            index=torch.tensor(layout.rows, dtype=torch.int64, device=run.device),
        )
        loss = check_loss(loss_fn(batch), calls)
        total = loss if aux is None else loss + aux
        with pass_state(state):
            par.backward(total * scale if scale != 1.0 else total)
        return float(loss.detach())
    return None


def check_loss(loss, call: int) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn returned a {type(loss).__name__} on call {call}; expected a scalar torch.Tensor.")
    if loss.numel() != 1:
        raise ValueError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)} on call {call}; expected a scalar. Reduce it "
            "with sums over completions (and global normalisers) so that it stays additive over completions."
        )
    if not loss.requires_grad:
        raise ValueError(
            f"loss_fn returned a tensor without grad on call {call}; it must be computed from batch.logprobs "
            "(or batch.entropy). Did you detach it or compute it under torch.no_grad()?"
        )
    if not torch.isfinite(loss.detach()).all():
        raise ValueError(
            f"loss_fn returned {float(loss.detach())} on call {call}; expected a finite value. Check the advantages "
            "and normalisers passed in (a zero normaliser gives NaN)."
        )
    return loss.reshape(())
