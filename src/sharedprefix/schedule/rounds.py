"""Run ``sp.backward``'s rounds over an ``Executor``: F (record a segment), FB (a pass whose rows get a loss and
a backward), PB (a cached segment's deferred backward), REL (release it), DF / DFB (FSDP2 dummy rounds).

Notation: n = rows a pass reports.
"""

from __future__ import annotations

import torch

from sharedprefix.attention.interface import activated, pass_state
from sharedprefix.schedule.planner import Dummy, Pass, Plan, PrefixBackward
from sharedprefix.schedule.results import Batch


def rounds_of(p: Plan) -> list[tuple[str, object]]:
    """The plan's steps as rounds, in order: F (record a segment), FB (rows, loss, backward), PB (a cached segment's
    deferred backward), REL (release it), DF / DFB (dummy rounds of an FSDP2 plan, see ``Plan.for_fsdp``)."""
    out = []
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

    Under FSDP2 (several ranks) an error outside the collectives (in ``loss_fn``, a refusal after a pass's
    forward) does not leave the other ranks waiting: this rank finishes the round's collectives with a backward of
    zero, runs its remaining rounds as dummy rounds (the same collectives, nothing computed that is kept: the call's
    gradients are rolled back), and at the end every rank learns of the error from one one-element all-reduce and
    raises, with the process group intact. An error inside the collectives is ``Parallel.collectives``' case.
    """
    par = run.par
    total, calls, error = 0.0, 0, None
    with activated(run.model):
        for i, (kind, x) in enumerate(rounds):
            if kind in ("FB", "PB", "DFB"):
                par.set_sync(sync and i == last_fb)
            if error is not None:  # this rank failed earlier in the call: it only takes part in the collectives
                if kind != "REL":
                    run.dummy_round(grad=kind in ("FB", "PB", "DFB"))
                continue
            run.last = None
            try:
                loss = _round(run, kind, x, loss_fn, entropy, recompute, hooks, scale, calls)
            except Exception as e:
                if not (par.fsdp and par.world_size > 1) or par.broken:
                    raise
                error = e
                _finish_round(run, kind)
                continue
            if loss is not None:
                total += loss
                calls += 1
    if par.fsdp:
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
            sur = run.cache.surrogate(x)
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
        if res is None:  # a pass with no rows to report (its values are cached for later rows)
            return None
        batch = Batch(
            logprobs=res[0],
            mask=run.mask(layout),
            entropy=res[1] if entropy else None,
            index=torch.tensor(layout.rows, dtype=torch.int64, device=run.device),
        )
        loss = check_loss(loss_fn(batch), calls)
        with pass_state(state):
            par.backward(loss * scale if scale != 1.0 else loss)
        return float(loss.detach())
    return None


def _finish_round(run, kind: str) -> None:
    """After an error outside the collectives of a round: run the collectives the other ranks still run in it."""
    grad = kind in ("FB", "PB", "DFB")
    if run.last is None:  # the error came before the round's forward: all of it, as a dummy round
        if kind != "REL":
            run.dummy_round(grad=grad)
        return
    state, out = run.last  # the forward ran: its backward, of zero (the call's gradients are rolled back)
    out = out[0] if isinstance(out, tuple) else out
    if grad and out is not None and out.requires_grad:
        with pass_state(state):
            run.par.backward(out.sum() * 0.0)


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
