"""Drive an ``Executor`` through a plan: ``forward`` (``sp.logprobs``: every pass once, rows read out) and
``backward`` (``sp.backward``'s rounds, ``Round``: a pass that records segments, a pass whose rows get a loss and a
backward, a cached segment's deferred backward, its release, and a ``lockstep`` engine's dummy rounds).

Notation: N = output rows, W = columns, n = rows a pass reports.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sharedprefix.attention.interface import pass_state
from sharedprefix.attention.switch import activated
from sharedprefix.model import mixers, router
from sharedprefix.schedule.cache import OffloadHooks
from sharedprefix.schedule.compiled import whole_compiled
from sharedprefix.schedule.grads import synced
from sharedprefix.schedule.planner import Dummy, Pass, Plan, PrefixBackward
from sharedprefix.schedule.results import BackwardResult, Batch, LogProbs


class Round(enum.Enum):
    """The kinds of ``sp.backward``'s rounds (``rounds_of``)."""

    RECORD = "F"  # a pass that records segments for later passes (its rows, if any, come later)
    ROWS = "FB"  # a pass whose rows get a loss and a backward
    PREFIX_BACKWARD = "PB"  # a cached segment's deferred backward
    RELEASE = "REL"  # release cached segments after their backward
    DUMMY_FORWARD = "DF"  # a ``lockstep`` engine's dummy forward round
    DUMMY_BACKWARD = "DFB"  # a ``lockstep`` engine's dummy forward + backward round

    @property
    def has_backward(self) -> bool:
        return self in (Round.ROWS, Round.PREFIX_BACKWARD, Round.DUMMY_BACKWARD)

    @property
    def dummy(self) -> bool:
        return self in (Round.DUMMY_FORWARD, Round.DUMMY_BACKWARD)


@dataclass(frozen=True)
class RoundSettings:
    """What every round of one ``sp.backward`` needs besides the executor: ``loss_fn``; ``recompute``: the prefix
    mode recomputes split prompts; ``hooks``: the offload hooks, or None; ``sync``: synchronise at the last backward
    round; ``scale``: the factor of every backpropagated loss (``Engine.loss_scale``); ``last_backward``: the index of
    the last round with a backward (-1: none)."""

    loss_fn: Callable
    entropy: bool
    recompute: bool
    hooks: OffloadHooks | None
    sync: bool
    scale: float
    last_backward: int


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
    dummies = sum(k.dummy for k, _ in rounds)
    last_fb = max((i for i, r in enumerate(rounds) if r[0].has_backward), default=-1)
    # under "mean", scale so that FSDP2's averaging (or our own all-reduce) gives the mean / the sum
    scale = par.loss_scale(grad_reduction)
    settings = RoundSettings(loss_fn, entropy, recompute, hooks, sync, scale, last_fb)
    out = synced(par, run.model, sync, grad_reduction, lambda: run_rounds(run, rounds, settings), collect=collect)
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


def rounds_of(p: Plan) -> list[tuple[Round, object]]:
    """The plan's steps as rounds, in order: RECORD (record a segment), ROWS (rows, loss, backward), PREFIX_BACKWARD
    (a cached segment's deferred backward), RELEASE (release it), DUMMY_* (dummy rounds of a ``lockstep`` plan, see
    ``Plan.for_fsdp``)."""
    out: list[tuple[Round, object]] = []
    for step in p.steps:
        if isinstance(step, PrefixBackward):
            out += [(Round.PREFIX_BACKWARD, s) for s in reversed(step.segments)] + [(Round.RELEASE, step.segments)]
        elif isinstance(step, Dummy):
            out.append((Round.DUMMY_BACKWARD if step.backward else Round.DUMMY_FORWARD, None))
        else:
            out.append((Round.RECORD if step.record else Round.ROWS, step))
    return out


def run_rounds(run, rounds: list[tuple[Round, object]], settings: RoundSettings) -> tuple[float, int]:
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
            last = i == settings.last_backward
            if kind.has_backward:
                par.begin_backward_round(sync=settings.sync and last, last=last)
            if error is not None:  # this rank failed earlier in the call: it only takes part in the collectives
                if kind is not Round.RELEASE:
                    run.dummy_round(grad=kind.has_backward)
                continue
            run.begin_round()
            try:
                loss = _round(run, kind, x, settings, calls)
            except Exception as e:
                if not run.recoverable():
                    raise
                error = e
                run.finish_failed_round(grad=kind.has_backward, dummy=kind is not Round.RELEASE)
                continue
            if loss is not None:
                total += loss
                calls += 1
    if par.lockstep:
        par.agree_on_error(error, where="during")
    return total, calls


def _round(run, kind: Round, x, settings: RoundSettings, calls: int) -> float | None:
    """One round (see ``rounds_of``); returns the loss of a ROWS round that called ``loss_fn``, else None."""
    par, hooks = run.par, settings.hooks
    if kind.dummy:
        run.dummy_round(grad=kind is Round.DUMMY_BACKWARD)
    elif kind is Round.RELEASE:
        for s in x:
            run.cache.release(s)
    elif kind is Round.PREFIX_BACKWARD:
        if settings.recompute:
            state, sur, _ = run.run_pass(Pass((x,), record=(x,)), surrogate=x)
        else:
            state = run.cache.states[x]
            sur = run.cache.surrogate(x, through_outputs=run.layers is not None)  # compiled: dK, dV join at the layers
            if hooks is not None:  # start bringing the offloaded activations back before the backward needs them
                hooks.prefetch()
        if sur is not None:
            with pass_state(state):
                par.backward(sur)
    elif kind is Round.RECORD:
        with torch.set_grad_enabled(not settings.recompute):
            if hooks is not None:
                with hooks():
                    run.run_pass(x)
            else:
                run.run_pass(x)
        for s in x.record:
            run.cache.seal(s, keep_graph=not settings.recompute)
    else:  # ROWS
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
            entropy=res[1] if settings.entropy else None,
            index=torch.tensor(layout.rows, dtype=torch.int64, device=run.device),
        )
        loss = check_loss(settings.loss_fn(batch), calls)
        total = loss if aux is None else loss + aux
        with pass_state(state):
            par.backward(total * settings.scale if settings.scale != 1.0 else total)
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
