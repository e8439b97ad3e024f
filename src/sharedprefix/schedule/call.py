"""The call-level checks of ``sp.logprobs`` / ``sp.backward`` / ``sp.plan_call``, before anything runs: the settings
built once (``CallOptions``; against a given ``CallPlan``'s own), the model's refusals of the call, its path chosen
(``Path``), and its plan made (``make_plan``) or a given one checked against the model.

A failure on one rank reaches every rank: a bad setting through ``refusals.stop_every_rank``, a plan's failure
through the call's agreement (``setup.start(error=...)``), ``sp.plan_call``'s through ``plan_agreed``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from sharedprefix.attention.kernels import select
from sharedprefix.layout.groups import validate_groups
from sharedprefix.layout.once import outside_inference_mode
from sharedprefix.layout.rows import Tree, copied
from sharedprefix.model import mixers, router, streams
from sharedprefix.model.adapter import unwrap
from sharedprefix.model.hooks import check_module_hooks
from sharedprefix.model.multimodal import check_batchable, check_prompt_fits
from sharedprefix.model.support import check_supported
from sharedprefix.parallel.detect import detect
from sharedprefix.parallel.sequence import check_group, refuse_aux, refuse_hybrid
from sharedprefix.schedule import refusals
from sharedprefix.schedule.call_plan import PLAN_FIELDS, CallPlan, RowCache, fingerprint, probed, refuse_other_model
from sharedprefix.schedule.options import CallOptions, Default, passed
from sharedprefix.schedule.path import Path, choose_backward_path, choose_logprobs_path
from sharedprefix.schedule.planner import plan_checked
from sharedprefix.schedule.step_rules import check_other_step


def prepare(
    model, source, leaves: bool, given: dict[str, Any], checks: Sequence[Callable], coef=None
) -> tuple[CallOptions, Path, CallPlan | None, BaseException | None]:
    """(options, path, plan, error) of one public call on ``model``: ``source`` (groups, a ``Tree`` or a
    ``CallPlan``); ``leaves``: an ``sp.backward``; ``given``: its keywords, a ``Default`` where the caller left one
    out; ``checks``: the registered call checks (``api.register_call_check``); ``coef``: ``sp.backward``'s aux loss
    coefficient (checked). ``plan`` is None on the hybrid path, and where this rank's planning raised ``error``,
    which the call raises on every rank together."""
    if not (isinstance(source, CallPlan) and source.step is not None):
        check_other_step(model)  # a step of this model left unfinished before an optimizer step is named here
    opts, planned = _options(model, source, leaves, given)
    inner, seq = unwrap(model), opts.sequence_group
    if leaves:
        _check_trainable(model, seq)
    name = type(inner).__name__
    check_module_hooks(model)
    if seq is not None and (mixers.on_cache_path(inner) or mixers.on_packed_path(inner)):
        refuse_hybrid(name, seq)
    aux = bool(coef) if leaves else opts.aux_loss or (opts.aux_loss is None and router.enabled(inner))
    if seq is not None and aux:
        refuse_aux(name)
    path = choose_backward_path(model) if leaves else choose_logprobs_path(model, opts, planned)
    if path is Path.HYBRID:
        if coef if leaves else opts.aux_loss:
            router.refuse_hybrid(inner)
        if isinstance(source, CallPlan):
            refuse_plan_on_cache_path(model)
        return opts, path, None, None
    for check in checks:
        check(model, source.source if isinstance(source, CallPlan) else source)
    plan, error = _plan_or_error(model, source, opts)
    return opts, path, plan, error


def _check_trainable(model, sequence_group) -> None:
    """``sp.backward`` accumulates parameter gradients: a model none of whose parameters requires grad (frozen, or
    a reference model) is refused on every rank of the call before anything runs."""
    inner = unwrap(model)
    params = list(inner.parameters())
    if any(p.requires_grad for p in params):
        return
    error = ValueError(
        f"sp.backward got a {type(inner).__name__} none of whose {len(params)} parameters requires grad, so no "
        "gradient could be accumulated. Set requires_grad=True on the parameters you train "
        "(model.requires_grad_(True), or a PEFT adapter's), or score without gradients: sp.logprobs under "
        "torch.no_grad()."
    )
    refusals.stop_every_rank(model, error, sequence_group, True)


def _options(model, source, leaves: bool, given: dict[str, Any]) -> tuple[CallOptions, frozenset[str]]:
    """The call's ``CallOptions`` from the keywords ``given`` to it (a ``Default`` where it left one out), and the
    names of those taken from a ``CallPlan`` given as ``source`` (``_resolve``). ``prefix_activations=None``: the
    engine's default ("keep", or "recompute" under FSDP2). A bad one on one rank is raised on every rank of the call
    (``refusals.stop_every_rank``)."""
    seq = given.get("sequence_group")
    if isinstance(seq, Default):  # left out: the plan's group, whose ranks a refusal must reach
        seq = source.options.sequence_group if isinstance(source, CallPlan) else None
    else:
        seq = check_group(seq)  # a bad group cannot agree: raised at once
    kw, planned = dict(given), frozenset[str]()
    try:
        kw, planned = _resolve(source, given, seq)
        seq = kw.get("sequence_group")
        if kw.get("prefix_activations", "keep") is None:
            kw["prefix_activations"] = detect(model, unwrap(model)).default_prefix_mode
        return CallOptions.build(**kw), planned
    except (ValueError, TypeError) as e:
        refusals.stop_every_rank(model, e, seq, leaves)
        raise


def _resolve(source, given: dict[str, Any], seq) -> tuple[dict[str, Any], frozenset[str]]:
    """A call's settings from its keywords ``given``, and the names taken from ``source``'s plan: each keyword it
    passed as it passed it (``seq``: its ``sequence_group``, checked); each it left out (a ``Default``), with a
    ``CallPlan`` as ``source``, the plan's (``sp.plan_call``'s keyword, or for one of ``PLAN_FIELDS`` the plan's
    option), else its default. Raises where the call passed one of ``PLAN_FIELDS`` with another value than the plan's
    (the other settings may change from call to call)."""
    out = {k: v.value if isinstance(v, Default) else v for k, v in given.items()}
    if "sequence_group" in given and not isinstance(given["sequence_group"], Default):
        out["sequence_group"] = seq
    if not isinstance(source, CallPlan):
        return out, frozenset()
    planned, taken = dict(source.given), set()
    for name, value in given.items():
        if name not in planned and name not in PLAN_FIELDS:
            continue  # a per-call setting the plan says nothing about: the call's, or its default
        mine = getattr(source.options, name) if name in PLAN_FIELDS else planned[name]
        if isinstance(value, Default):
            out[name] = mine
            taken.add(name)
        elif name in PLAN_FIELDS and not _same(out[name], mine):
            what, remake = (
                ("step", "sp.plan_step(model, microbatches")
                if source.step
                else ("CallPlan", "sp.plan_call(model, groups")
            )
            raise ValueError(
                f"{name}={value!r} disagrees with the {what}'s {name}={mine!r}: a plan runs under the settings "
                f"it was made with. Leave {name} out of this call (or pass {mine!r}), or make another plan with "
                f"{remake}, {name}={value!r})."
            )
    return out, frozenset(taken)


def _same(a, b) -> bool:
    return a is b or (type(a) is type(b) and a == b)


def _plan_or_error(model, source, opts: CallOptions) -> tuple[CallPlan | None, BaseException | None]:
    """(the call's plan, None), or (None, the error that this rank's planning raised). A given ``CallPlan`` is
    checked against ``model`` (its ``Fingerprint``)."""
    try:
        if isinstance(source, CallPlan):
            if (why := source.fingerprint.difference(fingerprint(model))) is not None:
                refuse_other_model(unwrap(model), why)
            return source, None
        return make_plan(model, source, opts), None
    except (ValueError, TypeError) as e:
        return None, e


def make_plan(model, source, options: CallOptions, given: dict | None = None) -> CallPlan:
    """The ``CallPlan`` of ``source`` (a list of ``Group`` or a ``Tree``) on ``model`` under ``options`` (built and
    checked by the public call; ``given``: the keywords ``sp.plan_call`` got); raises ``ValueError`` / ``TypeError``
    for what no call could run.

    The plan is frozen when made: it plans a copy of ``source`` (``layout.rows.copied``), so that no later in-place
    edit of the caller's tensors reaches its calls (nor the backward of a deferred call); it is built outside
    inference mode (as are the rows packed from it at first use, ``RowCache``), so that calls with and without grad
    may use it whatever mode it was made or first run in."""
    with outside_inference_mode():
        return _make_plan(model, copied(source), options, given)


def _make_plan(model, source, options: CallOptions, given: dict | None) -> CallPlan:
    inner = unwrap(model)
    engine = detect(model, inner)
    done = ["check_supported"]
    check_supported(inner)
    frames = None
    if streams.num_streams(inner) > 1:  # K token streams per position (MusicGen): frames checked, one id per position
        source, frames = streams.encode(inner, source)
        done.append("streams.encode")
    vocab = None if frames else min(streams.embedding_size(inner), streams.head_vocab(inner))
    if isinstance(source, Tree):
        if vocab is not None:
            source.check_vocab(vocab)
    else:
        source = validate_groups(source, vocab)
    done.append("validate")
    images = not isinstance(source, Tree) and any(g.prompt_inputs for g in source)
    if images:
        check_prompt_fits(source, options.max_tokens)
        done.append("check_prompt_fits")
    plan = plan_checked(source, options.max_tokens)
    if images:
        check_batchable(source, plan)
        done.append("check_batchable")
    device = engine.compute_device(streams.head_device(inner))
    kernel = select(options.backend, device)  # an unknown or unavailable backend fails before any pass
    done.append("select")
    fp = fingerprint(model, engine)
    settings = tuple((given or {}).items())
    # the probe runs a forward, which every rank must reach: after the ranks agree (``call_plan.probed``)
    findings = None
    return CallPlan(
        source,
        frames,
        plan,
        options,
        fp,
        device,
        kernel,
        findings,
        images,
        tuple(done),
        RowCache(plan.tree),
        settings,
        vocab=vocab,
    )


def refuse_plan_on_cache_path(model) -> None:
    """A hybrid model on the cache path (``schedule.cache_path``) runs group by group and takes no ``CallPlan``."""
    raise ValueError(
        f"{type(unwrap(model)).__name__} is a hybrid model on sharedprefix's cache path, which plans each group "
        "inside the call and takes no CallPlan. Pass the list of sp.Group itself."
    )


def plan_agreed(model, source, given: dict[str, Any]) -> CallPlan:
    """``sp.plan_call``'s plan under the settings ``given`` to it, its failure on one rank raised on every rank (one
    small all-reduce when there are several)."""
    if mixers.on_cache_path(unwrap(model)):
        refuse_plan_on_cache_path(model)
    given = passed(given)  # a public signature's Default, forwarded: left out
    unknown = sorted(set(given) - {f.name for f in dataclasses.fields(CallOptions)})
    if unknown:
        raise TypeError(
            f"sp.plan_call got {unknown}; expected keywords of sp.logprobs / sp.backward that are call settings "
            f"({sorted(f.name for f in dataclasses.fields(CallOptions))})."
        )
    given = {k: v for k, v in given.items() if not (k == "prefix_activations" and v is None)}
    seq = given["sequence_group"] = check_group(given.get("sequence_group"))
    plan, error = plan_unagreed(model, source, given)
    engine = detect(model, unwrap(model))
    engine.use_sequence(seq)
    refusals.agree_setup(engine, seq, error, None, False, None)
    assert plan is not None  # an error was raised above, on every rank
    return dataclasses.replace(plan, findings=probed(model, engine, plan.plan))


def plan_unagreed(model, source, given: dict[str, Any]) -> tuple[CallPlan | None, BaseException | None]:
    """(``source``'s plan under the settings ``given``, None) or (None, the error planning raised), with no agreement
    across ranks: for a caller whose calls raise that error on every rank together (``integrations.plan_cache``)."""
    given = passed(given)
    try:
        return make_plan(model, source, CallOptions.build(**given), given), None
    except (ValueError, TypeError) as e:
        return None, e
