"""The rules a step of ``sp.plan_step`` keeps across its calls (``schedule.step``): one step under way per model
(``OPEN``), the parameters unchanged inside a step (``stamp`` / ``check_versions``: their version counters, and the
engine's step clock where its optimizer leaves them unchanged, DeepSpeed's), no parameter hooks (a plain accumulation
would run them per microbatch on other values), a step's microbatches delivered one way where the engine scales a
call's delivery (``check_delivery``), and a step left unfinished named by the model's next call once its parameters
changed (``check_other_step``)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from sharedprefix.model.adapter import unwrap
from sharedprefix.parallel.detect import detect

# the model's step under way (its first call ran, its last not yet): one per model
OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Stamp:
    """The parameters at a step's first call: (parameter, version counter) of each trainable one, and the engine's
    step clock (``Engine.step_clock``; None where the version counters tell)."""

    versions: tuple
    clock: object = None


def stamp(model) -> Stamp:
    inner = unwrap(model)
    versions = tuple((p, p._version) for p in inner.parameters() if p.requires_grad)
    return Stamp(versions, detect(model, inner).step_clock())


def changed(model, then: Stamp) -> str | None:
    """What changed the parameters since ``then``, in words; None where nothing did."""
    inner = unwrap(model)
    for p, v in then.versions:
        if p._version != v:
            name = next((n for n, q in inner.named_parameters() if q is p), "?")
            return f"{name!r}: version {v} then, {p._version} now"
    engine = detect(model, inner)
    clock = engine.step_clock()
    if clock != then.clock:
        return f"{engine.name}'s optimizer steps: {then.clock} then, {clock} now"
    return None


def check_versions(model, then: Stamp, k: int) -> None:
    if (what := changed(model, then)) is not None:
        raise RuntimeError(
            f"microbatch {k} of a step runs after the parameters changed in place (or in the engine's own buffers) "
            f"since the step's first call ({what}), e.g. an optimizer step before the step's last microbatch. The "
            "step's cached prompts were computed at the old parameters, so its gradient would be another model's. "
            "Run every microbatch of a step before "
            "optimizer.step() (under DeepSpeed: before the accumulation boundary's engine.step()), or plan the step "
            "over the microbatches of one optimizer step only."
        )


def check_delivery(step, model, deferred: bool, k: int) -> None:
    """Where the engine scales a call's gradient as it delivers it (``Engine.delivery_scale``: DeepSpeed's 1 /
    gradient_accumulation_steps), every microbatch of a step is an ``sp.backward`` or every one deferred log-probs:
    the shared prompts' gradient accumulates across them and is delivered once, so it must be in one unit."""
    if step.deferred is None or step.deferred == deferred:
        step.deferred = deferred
        return
    scale = detect(model, unwrap(model)).delivery_scale()
    if scale != 1.0:
        how = lambda d: "deferred sp.logprobs" if d else "sp.backward"  # noqa: E731
        raise ValueError(
            f"microbatch {k} of a step runs as {how(deferred)}, its earlier microbatches as {how(step.deferred)}, "
            f"under an engine that scales a call's gradient by {scale:g} as it delivers it (DeepSpeed's 1 / "
            "gradient_accumulation_steps), which deferred log-probs' gradient carries already from your "
            "engine.backward: the shared prompts' gradient, summed over the step, would mix the two. Run every "
            "microbatch of the step one way."
        )


def refuse_hooks(model, inner) -> None:
    """Parameter hooks that would see other values than in a plain accumulation (module docstring): refused, except
    the engine's own (``Engine.own_grad_hooks``)."""
    own = detect(model, inner).own_grad_hooks()
    for name, p in inner.named_parameters():
        kinds = []
        if getattr(p, "_backward_hooks", None):
            kinds.append("tensor hooks (register_hook)")
        if set(getattr(p, "_post_accumulate_grad_hooks", None) or ()) - own:
            kinds.append("post-accumulate-grad hooks")
        if kinds:
            raise ValueError(
                f"parameter {name!r} has {' and '.join(kinds)}. A plain gradient accumulation runs them once per "
                "microbatch on that microbatch's gradient, but a step of sp.plan_step delivers the shared prompts' "
                "gradient at its last microbatch, so they would see other values. Remove them for the step "
                "(handle.remove()), or run each microbatch as its own call (sp.backward(model, rows, ...))."
            )


def check_other_step(model) -> None:
    """Before a call that is not a step's: refuse it where the model's step under way can no longer finish (the
    parameters changed since it began: an optimizer step ran without its missing microbatches)."""
    step = OPEN.get(unwrap(model))
    if step is not None and changed(model, step.versions) is not None:
        step.refuse_unfinished("this call (after the parameters changed)")


def check_index(k, n: int) -> int:
    """``k``, a microbatch's index in a step of ``n``; else a ``ValueError`` naming it."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
        raise ValueError(f"microbatch {k!r} of a step of {n}; expected an int in [0, {n}).")
    return k
