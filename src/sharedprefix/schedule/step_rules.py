"""The rules a step of ``sp.plan_step`` keeps across its calls (``schedule.step``): one step under way per model
(``OPEN``), the parameters unchanged inside a step (``versions`` / ``check_versions``), no parameter hooks (a plain
accumulation would run them per microbatch on other values), and a step left unfinished named by the model's next
call once its parameters changed (``check_other_step``)."""

from __future__ import annotations

import weakref

from sharedprefix.model.adapter import unwrap

# the model's step under way (its first call ran, its last not yet): one per model
OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def versions(inner) -> tuple:
    return tuple((p, p._version) for p in inner.parameters() if p.requires_grad)


def check_versions(inner, versions: tuple, k: int) -> None:
    for p, v in versions:
        if p._version != v:
            name = next((n for n, q in inner.named_parameters() if q is p), "?")
            raise RuntimeError(
                f"microbatch {k} of a step runs after the parameters changed in place since the step's first call "
                f"({name!r}: version {v} then, {p._version} now), e.g. an optimizer step before the step's last "
                "microbatch. The step's cached prompts were computed at the old parameters, so its gradient would "
                "be another model's. Run every microbatch of a step before optimizer.step(), or plan the step over "
                "the microbatches of one optimizer step only."
            )


def refuse_hooks(inner) -> None:
    """Parameter hooks that would see other values than in a plain accumulation (module docstring): refused."""
    for name, p in inner.named_parameters():
        kinds = []
        if getattr(p, "_backward_hooks", None):
            kinds.append("tensor hooks (register_hook)")
        if getattr(p, "_post_accumulate_grad_hooks", None):
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
    inner = unwrap(model)
    step = OPEN.get(inner)
    if step is None:
        return
    if any(p._version != v for p, v in step.versions):
        step.refuse_unfinished("this call (after the parameters changed)")


def check_index(k, n: int) -> int:
    """``k``, a microbatch's index in a step of ``n``; else a ``ValueError`` naming it."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
        raise ValueError(f"microbatch {k!r} of a step of {n}; expected an int in [0, {n}).")
    return k
