"""Drive a call's ``PassRunner`` (``schedule.setup.start``) through its plan: ``forward`` (``sp.logprobs``: every pass
once, rows read out) and ``backward`` (``sp.backward``'s rounds, ``Round``: a pass that records segments, a pass whose
rows get a loss and a backward, a cached segment's deferred backward, its release, and a ``lockstep`` engine's dummy
rounds).

Notation: N = output rows, W = columns, n = rows a pass reports.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sharedprefix.attention.switch import activated
from sharedprefix.model import mixers, router
from sharedprefix.model.adapter import unwrap
from sharedprefix.schedule.compiled import whole_compiled
from sharedprefix.schedule.grads import synced
from sharedprefix.schedule.offload import OffloadHooks
from sharedprefix.schedule.options import CallOptions
from sharedprefix.schedule.planner import Dummy, Plan, PrefixBackward
from sharedprefix.schedule.results import BackwardResult, Batch, LogProbs
from sharedprefix.schedule.setup import start
from sharedprefix.schedule.step_plan import RowView


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
    the last round with a backward (-1: none); ``view``: a step's microbatch rows (``planner.RowView``), whose
    batches give the microbatch's row indices and width; ``step``: its ``schedule.step.StepCall``, or None."""

    loss_fn: Callable
    entropy: bool
    recompute: bool
    hooks: OffloadHooks | None
    sync: bool
    scale: float
    last_backward: int
    view: RowView | None = None
    step: Any = None


def forward(model, cp, options: CallOptions, aux=None, error=None) -> tuple[LogProbs, list | None]:
    """``sp.logprobs`` of ``cp`` (a ``CallPlan``; None where this rank's planning raised ``error``) on ``model``:
    every pass once (a split prompt's segments sealed without a graph, released at their backward step), the reported
    rows gathered back into output order: (N, W) tensors; and the router's records (``PassRunner.router_records``).
    ``aux``: see ``setup.start``."""
    run, engine = start(model, cp, options, leaves=False, aux=aux, error=error)
    plan, entropy, inner = cp.plan, options.entropy, unwrap(model)
    sc = cp.step  # a step's microbatch: its shared segments recorded as sp.backward records them, once per step
    lps, ents, masks, order = [], [], [], []
    # in lockstep (FSDP2) every rank runs as many forwards (each all-gathers the parameters): agreed before any of them
    pad = run.agreed_rounds()[0] - len(plan.passes) if engine.lockstep else 0
    error = None  # recoverable (FSDP2): an error outside the collectives; the rank runs the rest as dummies
    with activated(inner), mixers.active(inner), whole_compiled(run.compile_context()):
        for step in plan.steps:
            if isinstance(step, PrefixBackward):
                run.release(step.segments)
                continue
            if error is not None:
                run.dummy_round(grad=False)
                continue
            run.begin_round()
            if sc is not None and step in sc.records:
                with sc.recording():
                    run.run_pass(step)
                run.seal(step.record, keep_graph=sc.step.mode != "recompute")
                continue
            try:
                _, res, layout = run.run_pass(step)
            except Exception as e:
                if not engine.recoverable():
                    raise
                error = e
                run.finish_failed_round(grad=False)  # a forward that did not run: its collectives, as a dummy
                continue
            run.seal(step.record, keep_graph=False)
            if res is None:
                continue
            lps.append(res[0])
            masks.append(run.mask(layout))
            if entropy:
                ents.append(res[1])
            order += layout.rows
        for _ in range(pad):
            run.dummy_round(grad=False)
    if engine.lockstep:
        engine.agree_on_error(error, where="during")
    order, width = _local(plan.view, order, plan.tree.width)
    inv = torch.empty(len(order), dtype=torch.int64)
    inv[torch.tensor(order)] = torch.arange(len(order))
    inv = inv.to(cp.device)
    lp = torch.cat(lps).index_select(0, inv)[:, :width]
    mask = torch.cat(masks).index_select(0, inv)[:, :width]
    ent = torch.cat(ents).index_select(0, inv)[:, :width] if entropy else None
    records = run.router_records()
    aux_loss = router.aux_loss(inner, records) if records else None
    return LogProbs(lp, mask, ent, aux_loss), records


def backward(model, cp, options: CallOptions, loss_fn, aux=None, aux_coef=0.0, collect=False, error=None):
    """``sp.backward`` of ``cp`` (a ``CallPlan``; None where this rank's planning raised ``error``) on ``model``
    under ``options``: its plan as rounds (a ``lockstep`` engine's: reordered and padded to the agreed counts),
    inside a gradient transaction the engine finishes (DDP: one synchronisation at the end). ``aux``: (per-segment
    aux gradients already scaled by ``aux_coef``, the MoE load-balancing loss's value) or None. ``collect``: a
    deferred call's backward, returns ``(result, {parameter: gradient})`` with ``.grad`` untouched
    (``schedule.grads.synced``)."""
    grads, aux_loss = aux if aux is not None else (False, None)
    # (a refusal on one rank, e.g. a mode FSDP2 cannot run where only its shard splits a group, stops every rank)
    run, par = start(model, cp, options, leaves=True, aux=grads, error=error)
    inner, device, o = unwrap(model), cp.device, options
    mode = par.prefix_mode(o.prefix_activations)  # FSDP2 recomputes: a deferred backward runs inside the root's call
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if cp.step is not None:  # a step's microbatch: the step's offload hooks hold its shared segments' activations
        hooks = cp.step.hooks
    else:
        hooks = OffloadHooks(inner, o.offload_device) if mode == "offload" else None
    steps = cp.plan
    if par.lockstep:  # every rank runs the same collectives: the plan reordered and padded to the agreed counts
        steps = steps.for_fsdp(*run.agreed_rounds())
    rounds = rounds_of(steps)
    dummies = sum(k.dummy for k, _ in rounds)
    last_fb = max((i for i, r in enumerate(rounds) if r[0].has_backward), default=-1)
    # under "mean", scale so that FSDP2's averaging (or our own all-reduce) gives the mean / the sum
    scale = par.loss_scale(o.grad_reduction)
    settings = RoundSettings(
        loss_fn, o.entropy, mode == "recompute", hooks, o.sync, scale, last_fb, cp.plan.view, cp.step
    )

    def run_all() -> tuple[float, int]:
        return run_rounds(run, par, inner, rounds, settings)

    out = synced(par, inner, o.sync, o.grad_reduction, run_all, collect=collect)
    (total, calls), grads = out if collect else (out, None)
    peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    result = BackwardResult(
        loss=total if aux_loss is None else total + aux_coef * aux_loss,
        aux_loss=aux_loss,
        tokens_computed=run.tokens_computed(),
        tokens_plain=cp.plan.plain_tokens,
        passes=len(cp.plan.passes),
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
            backs = [step.segments] if step.together else list(reversed(step.segments))
            out += [(Round.PREFIX_BACKWARD, s) for s in backs] + [(Round.RELEASE, step.segments)]
        elif isinstance(step, Dummy):
            out.append((Round.DUMMY_BACKWARD if step.backward else Round.DUMMY_FORWARD, None))
        else:
            out.append((Round.RECORD if step.record else Round.ROWS, step))
    return out


def run_rounds(run, par, model, rounds: list[tuple[Round, object]], settings: RoundSettings) -> tuple[float, int]:
    """Run ``rounds``; returns (total loss, loss_fn calls).

    Under a ``recoverable`` engine (FSDP2, several ranks) an error outside the collectives (in ``loss_fn``, a refusal
    after a pass's forward) does not leave the other ranks waiting: this rank finishes the round's collectives with a
    backward of zero, runs its remaining rounds as dummy rounds (the same collectives, nothing computed that is kept:
    the call's gradients are rolled back), and at the end every rank learns of the error from one one-element
    all-reduce and raises, with the process group intact. An error inside the collectives is
    ``Engine.collectives``' case.
    """
    total, calls, error = 0.0, 0, None
    with activated(model), mixers.active(model), whole_compiled(run.compile_context()):
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
                if not par.recoverable():
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
    hooks = settings.hooks
    if kind.dummy:
        run.dummy_round(grad=kind is Round.DUMMY_BACKWARD)
    elif kind is Round.RELEASE:
        run.release(x)
    elif kind is Round.PREFIX_BACKWARD:
        if settings.step is not None:  # the step's earlier microbatches' gradients join before the backward
            settings.step.step.merge_held()
        run.prefix_backward(x, settings.recompute, hooks)
    elif kind is Round.RECORD:
        with torch.set_grad_enabled(not settings.recompute):
            if hooks is not None:
                with hooks():
                    run.run_pass(x)
            else:
                run.run_pass(x)
        run.seal(x.record, keep_graph=not settings.recompute)
    else:  # ROWS
        state, res, layout = run.run_pass(x)
        aux = run.take_aux_term()  # the MoE aux loss's linear term of this pass's tokens, or None
        if res is None:  # a pass with no rows to report (its values are cached for later rows)
            if aux is not None:
                run.backward(state, aux)
            return None
        rows, width = _local(settings.view, layout.rows, layout.out_mask.shape[1])
        mask = run.mask(layout)[:, :width]
        batch = Batch(
            logprobs=res[0][:, :width],
            mask=mask,
            entropy=res[1][:, :width] if settings.entropy else None,
            index=torch.tensor(rows, dtype=torch.int64, device=mask.device),
        )
        loss = check_loss(settings.loss_fn(batch), calls)
        total = loss if aux is None else loss + aux
        run.backward(state, total * settings.scale if settings.scale != 1.0 else total)
        return float(loss.detach())
    return None


def _local(view: RowView | None, rows, width: int) -> tuple[list[int], int]:
    """The tree rows ``rows`` a pass reported as the call's row indices, and the call's width in columns (``width``:
    the tree's): a step's microbatch (``view``) numbers its own rows from 0 and is as wide as its longest row."""
    if view is None:
        return list(rows), width
    local = view.local
    return [local[r] for r in rows], view.width


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
