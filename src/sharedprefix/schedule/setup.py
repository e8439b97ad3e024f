"""The checks one call makes on its model before its first pass, and the pass runner they hand over.

``start`` is where a call meets its ranks: what the plan cannot decide (the model's state, the call's settings and
parallel engine, sequence parallelism, the MoE router, the compiled path) is checked on each rank, and every rank
learns of a refusal on any of them before any collective (``refusals.agree_setup``): a refusal on one rank stops
every rank. What they decided is one frozen ``CallSetup``; the ``PassRunner`` gets it, the plan and the engine.
"""

from __future__ import annotations

import torch

from sharedprefix.model import router
from sharedprefix.model.adapter import decoder, unwrap
from sharedprefix.model.forward_mode import uses_checkpointing
from sharedprefix.model.multimodal import Multimodal
from sharedprefix.model.support import check_supported
from sharedprefix.parallel import sequence
from sharedprefix.parallel.detect import detect
from sharedprefix.parallel.engine import Engine
from sharedprefix.parallel.sequence import refuse_features
from sharedprefix.schedule import refusals
from sharedprefix.schedule.call_plan import CallPlan, fingerprint, probed, refuse_other_model
from sharedprefix.schedule.compiled import compiled_path
from sharedprefix.schedule.executor import CallSetup, PassRunner
from sharedprefix.schedule.options import CallOptions


def start(
    model, cp: CallPlan | None, options: CallOptions, leaves: bool, aux=None, error=None
) -> tuple[PassRunner, Engine]:
    """The pass runner of one call of ``cp`` on ``model`` (as the user passed it), after the call-level checks, and
    the call's parallel engine.
    ``leaves``: an ``sp.backward``. ``aux``: the MoE load-balancing loss. True: record each pass's router logits; a
    dict ``{segment: per-layer (len, E) gradients}`` (``router.segment_grads``, scaled): add their linear term to
    what each pass backpropagates; None: as the config says. ``error``: this rank's planning failed (``cp`` is
    None), raised here on every rank."""
    inner = unwrap(model)
    engine = detect(model, inner)
    engine.use_sequence(options.sequence_group)
    engine.start()
    aux_grads = aux if isinstance(aux, dict) else None
    record = aux is True or (aux is None and router.enabled(inner))
    images = None
    if error is None:
        assert cp is not None
        try:
            images = _check(model, engine, cp, options, leaves, record, aux_grads)
        except (ValueError, TypeError) as e:  # a refusal or bad input on one rank stops every rank
            error = e
    rounds = _agree(engine, cp, options, leaves, error)
    assert cp is not None  # an error was raised above, on every rank
    # the same model on every rank: a refusal here is raised by every rank together (no guard needed)
    findings = probed(model, engine, cp.plan)
    if findings.calls > 1 and uses_checkpointing(inner):  # the same on every rank
        error = None
        try:  # this depends on each rank's groups: agreed, so that a refusal on one rank stops every rank
            refusals.check_after_probe(inner, cp.plan, findings.calls)
        except ValueError as e:
            error = e
        engine.agree_on_error(error)
    if record or aux_grads is not None:
        with torch.compiler.set_stance("force_eager"):
            engine.call(lambda: router.verify(inner, decoder(inner), cp.device), guard=False)
    cache = cp.step.cache if cp.step is not None else None  # a step's microbatch: the step's prefix cache (leaves)
    eager_because = []  # the K/V a grad-enabled call records stay in its outputs' graph unless cached as leaves
    in_graph = not (cache.leaves if cache is not None else leaves)
    if in_graph and torch.is_grad_enabled() and any(p.record for p in cp.plan.passes):
        eager_because.append(
            "a grad-enabled sp.logprobs split under max_tokens keeps the prompt's K/V in one graph with the "
            "completions' (sp.backward, or defer=True, runs compiled)"
        )
    layers, force_eager, whole = compiled_path(model, inner, engine, findings, cp.kernel, cp.frames, eager_because)
    setup = CallSetup(rounds, record, aux_grads, layers, force_eager, whole, images)
    source = cp.source if images is not None else None
    run = PassRunner(inner, engine, cp.plan, cp.rows, setup, options, leaves, cp.frames, cp.device, source, cache)
    return run, engine


def _check(model, engine: Engine, cp: CallPlan, options, leaves: bool, record: bool, aux_grads) -> Multimodal | None:
    """The refusals of this call that its plan did not run (the model's state may have changed since planning)."""
    inner = unwrap(model)
    check_supported(inner)
    if (why := cp.fingerprint.difference(fingerprint(model, engine))) is not None:
        refuse_other_model(inner, why)
    cp.check_vocab(inner)  # an embedding or head replaced by a smaller one since planning, the config unchanged
    images = Multimodal(inner, cp.source) if cp.images else None
    refusals.check_call(
        inner, cp.plan, options, engine, cp.kernel, cp.device, leaves, images is not None, record, aux_grads is not None
    )
    if engine.sequence is not None:
        found = refusals.sequence_refusals(inner, engine, images is not None, cp.frames is not None, record)
        refuse_features(type(inner).__name__, found)
    return images


def _agree(engine: Engine, cp: CallPlan | None, options: CallOptions, leaves: bool, error) -> list[int]:
    """Every rank raises together if one failed (a sequence group's ranks also check that they got the same rows)."""
    seq, o = options.sequence_group, options
    mode = o.prefix_activations if leaves else None  # (a forward-only run has no prefix mode)
    key = None
    if error is None and seq is not None and cp is not None:
        key = sequence.digest(cp.plan, o.temperature, o.entropy, leaves, mode)
    return refusals.agree_setup(engine, seq, error, key, leaves, None if error or cp is None else cp.plan)
