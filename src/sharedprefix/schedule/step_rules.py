"""The rules a step of ``sp.plan_step`` keeps across its calls (``schedule.step``): one step under way per model
(``OPEN``), the parameters unchanged inside a step (``stamp`` / ``check_open``: their version counters and storage,
and the engine's step clock where its optimizer leaves them unchanged, DeepSpeed's), the same trainable parameters
and autocast at every call, ``.grad`` not cleared between calls (``mark_grads``), no parameter hooks at any call (a
plain accumulation would run them per microbatch on other values), a step's microbatches delivered one way where the
engine scales a call's delivery (``check_delivery``), and a step left unfinished named by the model's next call once
its parameters changed (``check_other_step``)."""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch

from sharedprefix.model.adapter import unwrap
from sharedprefix.parallel.detect import detect

# the model's step under way (its first call ran, its last not yet): one per model
OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Stamp:
    """The model at a step's first call: (parameter, version counter, storage address or None) of each trainable one,
    the engine's step clock (``Engine.step_clock``; None where the version counters tell), the autocast state
    (device type, enabled, dtype) its forwards run under, and ``grads``: each trainable parameter's ``.grad`` after the
    step's latest backward call, as ``mark_grads`` records it."""

    versions: tuple
    clock: object = None
    autocast: tuple = ()
    grads: tuple = ()
    trainable: frozenset = frozenset()  # the trainable parameters' names (FSDP2 swaps the registered objects)


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard (FSDP2), else the tensor itself


def stamp(model) -> Stamp:
    inner = unwrap(model)
    engine = detect(model, inner)
    at = engine.data_in_place  # (else the engine moves the data itself: FSDP2, DeepSpeed ZeRO-3)
    trainable = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
    versions = tuple((p, p._version, p.data_ptr() if at else None) for _, p in trainable)
    return Stamp(versions, engine.step_clock(), _autocast(inner), trainable=frozenset(n for n, _ in trainable))


def _autocast(inner) -> tuple:
    dev = next(inner.parameters()).device.type
    on = torch.is_autocast_enabled(dev)
    return dev, on, torch.get_autocast_dtype(dev) if on else None


def _name(inner, p) -> str:
    return next((n for n, q in inner.named_parameters() if q is p), "?")


def changed(model, then: Stamp) -> str | None:
    """What changed the parameters since ``then``, in words; None where nothing did."""
    inner = unwrap(model)
    for p, v, address in then.versions:
        if p._version != v:
            return f"{_name(inner, p)!r}: version {v} then, {p._version} now"
        if address is not None and p.data_ptr() != address:
            return f"{_name(inner, p)!r}: its data replaced (p.data = ..., or the module moved by .to())"
    engine = detect(model, inner)
    clock = engine.step_clock()
    if clock != then.clock:
        return f"{engine.name}'s optimizer steps: {then.clock} then, {clock} now"
    return None


def check_open(step, model, k: int, forward: bool) -> None:
    """Before a later call (microbatch ``k``) of a step under way: the parameters, the trainable ones, ``.grad`` and,
    where the call runs a forward (``forward``), the autocast as at the step's first call; else a refusal."""
    then, inner = step.versions, unwrap(model)
    if (what := changed(model, then)) is not None:
        raise RuntimeError(
            f"microbatch {k} of a step runs after the parameters changed in place (or in the engine's own buffers) "
            f"since the step's first call ({what}), e.g. an optimizer step before the step's last microbatch. The "
            "step's cached prompts were computed at the old parameters, so its gradient would be another model's. "
            "Run every microbatch of a step before "
            "optimizer.step() (under DeepSpeed: before the accumulation boundary's engine.step()), or plan the step "
            "over the microbatches of one optimizer step only."
        )
    now = frozenset(n for n, p in inner.named_parameters() if p.requires_grad)
    if moved := sorted(now ^ then.trainable):
        raise RuntimeError(
            f"microbatch {k} of a step runs with other trainable parameters than its first call (requires_grad "
            f"changed on {moved[:3]}{' ...' if len(moved) > 3 else ''}): the step delivers its shared prompts' "
            "gradient of every microbatch at its last one, to the parameters trainable then, where a plain "
            "accumulation gives each microbatch's share to the parameters trainable at its own call. Freeze or "
            "unfreeze parameters between steps (before the step's first call), not inside one."
        )
    if forward and (now_ac := _autocast(inner)) != then.autocast:
        said = lambda a: f"autocast({a[0]!r}, dtype={a[2]})" if a[1] else "no autocast"  # noqa: E731
        raise RuntimeError(
            f"microbatch {k} of a step runs under {said(now_ac)} where the step's first call ran under "
            f"{said(then.autocast)}: the step computes its shared prompts once, at its first call, and every "
            "microbatch reads them, so all of a step's calls must run under one autocast. Put the same "
            "torch.autocast around every microbatch's call of the step (or around none)."
        )
    _check_grads(inner, then.grads, k)


def mark_grads(model) -> tuple:
    """Each trainable parameter's ``.grad`` now: (parameter, the gradient's id and version counter, or None); none
    where the engine accumulates over micro-steps of its own and clears ``.grad`` itself (DeepSpeed)."""
    inner = unwrap(model)
    if detect(model, inner).accumulates_itself:
        return ()
    grads = ((p, p.grad) for p in inner.parameters() if p.requires_grad)
    return tuple((p, None if g is None else (id(g), _local(g)._version)) for p, g in grads)


def mark_grads_after(step, model) -> None:
    """``mark_grads`` into ``step``'s stamp once the running backward call's gradient is in ``.grad``: now, or where
    the call runs inside autograd's backward (deferred log-probs, whose gradient autograd accumulates after the call
    returns; graph-kept ones), when that backward ends."""

    def mark() -> None:
        step.versions = dataclasses.replace(step.versions, grads=mark_grads(model))

    if torch._C._current_graph_task_id() == -1:
        mark()
    else:
        torch.autograd.Variable._execution_engine.queue_callback(mark)


def _check_grads(inner, marks: tuple, k: int) -> None:
    """Refuse a call after ``.grad`` was cleared since the step's latest backward call (``marks``): set to None
    (``zero_grad()``'s default, or by hand), or zeroed in place (``zero_grad(set_to_none=False)``: every gradient
    written since is all zero; a backward that accumulates into them leaves some nonzero)."""
    gone, touched = None, []
    for p, mark in marks:
        if mark is None:
            continue
        g = p.grad
        if g is None:
            gone = gone or _name(inner, p)
        elif (id(g), _local(g)._version) != mark:
            touched.append(_local(g))
    zeroed = bool(touched) and not any(bool(g.any()) for g in touched)  # (stops at the first nonzero one)
    if gone is not None or zeroed:
        what = f"the .grad of {gone!r} is None now" if gone is not None else "every .grad written since is all zero"
        raise RuntimeError(
            f"microbatch {k} of a step runs after .grad was cleared since its previous microbatch ({what}: "
            "model.zero_grad() / optimizer.zero_grad(), or p.grad = None). A step holds its shared prompts' "
            "gradient of the earlier microbatches and delivers it at its last, so it would survive the clearing "
            "where a plain accumulation loses it. Clear .grad before a step's first call or after its last, not "
            "between its microbatches."
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
