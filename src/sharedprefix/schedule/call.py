"""The call-level checks of ``sp.logprobs`` / ``sp.backward`` / ``sp.plan_call``, before anything runs: the settings
built once (``CallOptions``; against a given ``CallPlan``'s own), and the plan made (or a given one checked against
the model). A failure on one rank reaches every rank: a bad setting through ``refusals.stop_every_rank``, a plan's
failure through the executor's agreement (``Executor(error=...)``), ``sp.plan_call``'s through ``plan_agreed``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sharedprefix.layout.rows import Tree
from sharedprefix.model import mixers
from sharedprefix.model.adapter import unwrap
from sharedprefix.parallel.detect import detect
from sharedprefix.parallel.sequence import check_group
from sharedprefix.schedule import refusals
from sharedprefix.schedule.call_plan import CallPlan, make_plan, probed
from sharedprefix.schedule.options import CallOptions


def options(model, source, leaves: bool, given: dict[str, Any], defaults: dict[str, Any]) -> CallOptions:
    """The call's ``CallOptions`` from the keywords ``given`` to it (``defaults``: the public function's): with a
    ``CallPlan`` as ``source``, the settings left at their default are the plan's and one set otherwise is refused
    (``CallPlan.agree``). ``prefix_activations=None``: the engine's default ("keep", or "recompute" under FSDP2). A
    bad one on one rank is raised on every rank of the call (``refusals.stop_every_rank``); ``leaves``: an
    ``sp.backward``."""
    kw = dict(given)
    if isinstance(source, CallPlan) and given.get("sequence_group") is None:
        kw["sequence_group"] = source.options.sequence_group
    kw["sequence_group"] = seq = check_group(kw.get("sequence_group"))  # a bad group cannot agree: raised at once
    try:
        if isinstance(source, CallPlan):
            kw = source.agree(kw, defaults)
        if kw.get("prefix_activations", "keep") is None:
            kw["prefix_activations"] = detect(model, unwrap(model)).default_prefix_mode
        return CallOptions.build(**kw)
    except (ValueError, TypeError) as e:
        refusals.stop_every_rank(model, e, seq, leaves)
        raise


def plan_or_error(model, source, opts: CallOptions) -> tuple[CallPlan | None, BaseException | None]:
    """(the call's plan, None), or (None, the error that this rank's planning raised), which the executor raises on
    every rank together. A given ``CallPlan`` is checked against ``model`` (``CallPlan.check_model``)."""
    try:
        if isinstance(source, CallPlan):
            source.check_model(model)
            return source, None
        return make_plan(model, source, opts), None
    except (ValueError, TypeError) as e:
        return None, e


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
    try:
        return make_plan(model, source, CallOptions.build(**given), given), None
    except (ValueError, TypeError) as e:
        return None, e


def source_of(source) -> list | Tree:
    """The groups or tree behind ``source`` (a ``CallPlan``'s validated source)."""
    return source.source if isinstance(source, CallPlan) else source
