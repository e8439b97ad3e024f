"""Deferred log-probs (``sp.logprobs(defer=True)``): values computed without a graph now; when the caller's loss
backpropagates, its per-token gradients dL/dlogp (and dL/dentropy) drive ``sp.backward`` under the token budget with
the linear loss ``sum(dL/dlogp * logp)``, whose parameter gradient is exactly dL/dtheta.

The parameters are inputs of the deferred node, and that gradient is returned as theirs (``schedule.grads``
collects it instead of writing ``.grad``): autograd then adds it to whatever else the caller's loss gives the same
parameters (a penalty on the weights, a second call) and runs each parameter's hooks once, on the sum, and
``torch.autograd.grad`` sees it too, as for any other input. Under DDP the call synchronises the gradients itself
and writes ``.grad`` (running the hooks) at the end of its backward.

Notation: N = output rows, W = columns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sharedprefix.model.adapter import adapter_state, unwrap
from sharedprefix.schedule.options import CallOptions
from sharedprefix.schedule.results import LogProbs


@dataclass(frozen=True)
class DeferredSpec:
    """What a deferred call's backward needs: ``backward(model, source, loss_fn, options, aux_grads=..., collect=True)
    -> (result, {parameter: gradient})``, the backward of the path the call took (chosen once by the public call);
    ``params``: the model's trainable parameters (the deferred node's inputs); ``entropy``: the call computed
    entropies; ``aux_grads``: see ``defer_logprobs``; ``engine``: the call's ``Engine`` (None: one process, parameters
    always whole); ``autocast``: the autocast state of the call, restored for its backward; ``adapters``: which PEFT
    adapters took part in the call (``adapter_state``), which its backward must find again; ``versions``: each
    parameter's version counter after the call, which its backward must find unchanged; ``clock``: the engine's step
    clock then (``Engine.step_clock``: DeepSpeed's optimizer steps, which leave the version counters unchanged)."""

    backward: Callable
    model: torch.nn.Module
    source: Any
    options: CallOptions
    params: list
    entropy: bool
    aux_grads: dict | None
    engine: Any
    autocast: dict
    adapters: tuple = ()
    versions: tuple = ()
    clock: object = None


class _Deferred(torch.autograd.Function):
    """Values computed without a graph; their backward runs ``backward`` with the incoming gradients."""

    @staticmethod
    def forward(ctx, anchor, lp, ent, aux, spec, *params):
        ctx.set_materialize_grads(False)  # an output no loss uses gets None: no work for it in the backward
        ctx.spec = spec
        return lp.clone(), ent.clone(), aux.clone()

    @staticmethod
    def backward(ctx, g_lp, g_ent, g_aux):
        spec: DeferredSpec = ctx.spec
        w_ent = g_ent if spec.entropy else None
        grads = spec.aux_grads
        aux = (
            {s: [g * g_aux.to(g.dtype) for g in gs] for s, gs in grads.items()} if grads and g_aux is not None else None
        )
        none = (None,) * (5 + len(spec.params))
        _check_adapters(spec)
        _check_versions(spec)
        if g_lp is None and w_ent is None and aux is None:
            return none

        def loss_fn(b):
            loss = (
                (b.logprobs * g_lp[b.index].to(b.logprobs.dtype)).sum()
                if g_lp is not None
                else (b.logprobs * 0.0).sum()
            )
            if w_ent is not None:
                loss = loss + (b.entropy * w_ent[b.index].to(b.entropy.dtype)).sum()
            return loss

        with torch.enable_grad(), torch.autocast(**spec.autocast):
            opts = spec.options.replace(entropy=w_ent is not None)
            _, grads = spec.backward(spec.model, spec.source, loss_fn, opts, aux_grads=aux, collect=True)
        if spec.engine is not None:  # autograd accumulates the gradients into whole parameters (ZeRO-3)
            spec.engine.gather_until_backward_ends(spec.params)
        return none[:5] + tuple(grads.get(p) for p in spec.params)


def _check_adapters(spec: DeferredSpec) -> None:
    """Refuse a backward that would recompute the call's forward with other PEFT adapters taking part than the call's
    own: its gradient would be that of another model than the one the values came from."""
    now = adapter_state(spec.model)
    if now == spec.adapters:
        return
    off = lambda state: any(disabled for _, disabled, _ in state)  # noqa: E731
    raise ValueError(
        "deferred log-probs (sp.logprobs with grad enabled and defer=True, or gradient checkpointing or DDP on) are "
        "backpropagated with other PEFT adapters taking part than when they were computed (adapters disabled: "
        f"{off(spec.adapters)} then, {off(now)} now; active: {_active(spec.adapters)} then, {_active(now)} now). "
        "Their backward recomputes the forward, so it would give the gradient of another model than the values'. "
        "Run the backward inside the same model.disable_adapter() block (or with the same set_adapter), or call "
        "sp.logprobs with defer=False."
    )


def _check_versions(spec: DeferredSpec) -> None:
    """Refuse a backward after a parameter of the call was modified in place (an optimizer step, a weight sync): its
    recomputed forward would differ from the values', and plain autograd raises there too (a saved tensor's version
    changed)."""
    moved = [i for i, (p, v) in enumerate(zip(spec.params, spec.versions)) if p._version != v]
    clock = spec.engine.step_clock() if spec.engine is not None else None
    if not moved and clock != spec.clock:  # an optimizer step that writes around the parameters (DeepSpeed)
        raise RuntimeError(
            f"deferred log-probs are backpropagated after {spec.engine.name}'s optimizer steps changed the parameters "
            f"since the call ({spec.clock} then, {clock} now). Their backward recomputes the forward, so it would "
            "give the gradient at other parameters than the values'. Run the backward before engine.step() updates "
            "the parameters, or compute the log-probs again."
        )
    if not moved:
        return
    names = {id(p): n for n, p in unwrap(spec.model).named_parameters()}
    first = spec.params[moved[0]]
    raise RuntimeError(
        f"deferred log-probs are backpropagated after {len(moved)} of the model's parameters were modified in place "
        f"since the call (first {names.get(id(first), '?')!r}: version {spec.versions[moved[0]]} then, "
        f"{first._version} now). Their backward recomputes the forward, so it would give the gradient at other "
        "parameters than the values'; the plain forward's backward raises here too. Run the backward before the "
        "parameters change (optimizer.step() after loss.backward()), or compute the log-probs again."
    )


def _active(state: tuple) -> list[str]:
    """The adapter names active in some tuner layer of ``state`` (``adapter_state``)."""
    return sorted({a for _, _, active in state for a in active})


def defer_logprobs(
    backward, model, groups, out: LogProbs, options: CallOptions, aux_grads=None, engine=None
) -> LogProbs:
    """``out``'s values, computed without a graph, as outputs whose backward runs ``backward(model, groups, loss_fn,
    options, aux_grads=..., collect=True) -> (result, {parameter: gradient})`` (``sp.backward``'s path, passed in by
    the public call) under the call's ``options`` with the incoming per-token gradients as a linear loss (exact by the
    chain rule), and returns that gradient as the parameters' (see the module docstring). ``aux_grads``: with
    ``out.aux_loss``, each segment's per-layer gradient of it with respect to the router logits
    (``model.router.segment_grads``), scaled in the backward by the gradient that reaches ``aux_loss``. ``engine``:
    the call's ``Engine``: the node takes the parameters as inputs inside its ``gathered`` block (autograd records
    their shapes there, and ZeRO-3 empties them outside a forward), and its backward keeps them gathered until the
    caller's backward has accumulated the gradient into them (``gather_until_backward_ends``)."""
    dev = out.logprobs.device.type
    params = list({id(p): p for p in unwrap(model).parameters() if p.requires_grad}.values())
    spec = DeferredSpec(
        params=params,
        backward=backward,
        model=model,
        source=groups,
        options=options,
        entropy=out.entropy is not None,
        aux_grads=aux_grads,
        engine=engine,
        autocast=dict(device_type=dev, enabled=torch.is_autocast_enabled(dev), dtype=torch.get_autocast_dtype(dev)),
        adapters=adapter_state(model),
        versions=tuple(p._version for p in params),
        clock=engine.step_clock() if engine is not None else None,
    )
    ent = out.entropy if out.entropy is not None else torch.zeros_like(out.logprobs)
    aux = out.aux_loss if out.aux_loss is not None else torch.zeros((), device=out.logprobs.device)
    with engine.gathered(params) if engine is not None else contextlib.nullcontext():
        lp, ent, aux = _Deferred.apply(torch.zeros((), requires_grad=True), out.logprobs, ent, aux, spec, *params)
    return LogProbs(lp, out.mask, ent if out.entropy is not None else None, aux if out.aux_loss is not None else None)
