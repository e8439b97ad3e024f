"""The public calls: ``sp.logprobs`` (forward) and ``sp.backward`` (forward, loss, backward per pass).

Each prepares the call (``schedule.call``: its settings, refusals, path and plan; ``sp.plan_call`` makes the plan
alone, for many calls), then dispatches: a hybrid model to ``schedule.cache_path``, a grad-enabled call that must run
its backward inside sharedprefix to a deferred backward (``schedule.deferred``), and everything else to
``schedule.rounds``, which runs the plan's passes through a ``PassRunner`` (``schedule.setup``). Notation: N = output
rows (completions in group order, or a tree's rows), W = columns, n = rows in one pass.

Hybrid models whose mixers sharedprefix reaches (``model.mixers``) take the packed path; the others (MiniMax, Zaya)
``schedule.cache_path``. Each entry point walks the model's modules once per call (``parallel.walks``).

``backward`` contract: ``loss_fn`` is called once per pass that reports rows, with a ``Batch`` of those rows (each
whole), and must be *additive over rows*: the loss of a set of rows is the sum of the losses of its parts. Every
GRPO-family loss is, once its normalisers (total tokens, total completions) are computed globally and passed in.

Checks run before every call (``register_call_check``): ``sharedprefix.tools.verify`` registers its opt-in
first-use self-check (``SHAREDPREFIX_SELF_CHECK=1``) there, so that this module never imports ``tools``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from sharedprefix import settings
from sharedprefix.layout.groups import Group
from sharedprefix.layout.rows import Tree
from sharedprefix.model import router
from sharedprefix.model.adapter import unwrap
from sharedprefix.model.forward_mode import in_forward_autocast
from sharedprefix.parallel.detect import detect, sync_enabled
from sharedprefix.parallel.walks import once_per_call
from sharedprefix.schedule import call, rounds, step_calls
from sharedprefix.schedule.cache_path import calls as cache_path
from sharedprefix.schedule.call_plan import CallPlan
from sharedprefix.schedule.deferred import defer_logprobs
from sharedprefix.schedule.options import CallOptions, default
from sharedprefix.schedule.path import Path
from sharedprefix.schedule.results import PREFIX_MODES, REDUCTIONS, BackwardResult, Batch, LogProbs
from sharedprefix.schedule.step import Microbatch, Step
from sharedprefix.schedule.step_make import SplitStep, make_step

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "PREFIX_MODES",
    "REDUCTIONS",
    "BackwardResult",
    "Batch",
    "CallPlan",
    "LogProbs",
    "Microbatch",
    "SplitStep",
    "Step",
    "backward",
    "logprobs",
    "plan_call",
    "plan_step",
    "register_call_check",
]

_CALL_CHECKS: list[Callable] = []


def register_call_check(fn: Callable) -> None:
    """Run ``fn(model, groups)`` before every packed-path call (once per function, whatever the import order)."""
    if fn not in _CALL_CHECKS:
        _CALL_CHECKS.append(fn)


@once_per_call
def plan_call(model: torch.nn.Module, groups: Sequence[Group] | Tree, **options) -> CallPlan:
    """Plan once, run many: the host-side work of a call on ``model`` (validation, the probe's findings, the passes
    and their packed rows, the attention primitive, the refusals these decide), frozen into a ``CallPlan`` that
    ``logprobs`` and ``backward`` take in place of ``groups``, any number of times, on ``model`` or any model of the
    same configuration, dtype, device and parallel layout (a reference model; the policy with its adapter disabled).

    ``options``: any keyword of ``logprobs`` / ``backward`` (``max_tokens``, ``backend``, ``sequence_group`` shape
    the plan: a call that passes another value of one of them is refused, the documented default included; the others
    are the calls' defaults: a call that leaves one out runs under the plan's value, a call that passes one under its
    own, whatever it is). The plan keeps its own copy of ``groups`` (token ids, ``prompt_inputs``): editing them in
    place afterwards changes none of its calls. Under DDP / FSDP2 every rank calls it, and a refusal on one rank is
    raised on every rank.
    """
    with in_forward_autocast(model):  # the probe runs a forward: as the model's own would (accelerate's)
        return call.plan_agreed(model, groups, options)


@once_per_call
def plan_step(
    model: torch.nn.Module,
    microbatches: Sequence[Sequence[Group] | Tree],
    max_cached_tokens: int | None = None,
    **options,
) -> Step | SplitStep:
    """One optimizer step's microbatches, planned together: each shared prompt computed once for the step.

    ``microbatches[k]``: the rows of the trainer's microbatch k (a list of ``sp.Group`` or an ``sp.Tree``; one kind
    for all), in the order they are reported. Groups with the same prompt (and ``prompt_inputs``) in several
    microbatches share it; a tree's rows share every common prefix across microbatches. ``options``: as
    ``sp.plan_call``'s (``max_tokens`` bounds every pass; ``prefix_activations``: what the step holds between its
    calls, "keep", "offload" or "recompute"; None or left out: the engine's, "recompute" under FSDP2, else "keep").

    Then, for each k, ``sp.backward(model, step.microbatch(k), loss_fn)``, or ``sp.logprobs(model,
    step.microbatch(k))`` with grad enabled (deferred: its backward runs when the caller's loss backpropagates):
    results (n_k, W_k) for the microbatch's rows; gradients accumulated as a plain run of each microbatch would, the
    shared prompts' share delivered inside the step's last microbatch's backward (before a DDP synchronisation at the
    accumulation boundary). ``schedule.step`` gives the rules: hooks, failures, microbatches run twice or never.
    ``max_cached_tokens``: the most tokens of shared segments the step may hold between its calls (None: no bound).
    A step that would hold more runs as consecutive parts, each of as many microbatches as keep its shared tokens
    within the bound (a ``SplitStep``: the same interface, ``.parts`` its steps); each part computes its shared
    prompts once, so the bound trades memory for recomputation, and never fails.

    Available on one process, under DDP, FSDP2 (prefix_activations "recompute") and DeepSpeed ZeRO-1/2/3 (a call
    per DeepSpeed micro-step), with or without a ``sequence_group`` (Ulysses: each rank caches its heads' K/V); the
    MoE load-balancing loss on one process and under DDP (``schedule.step_aux``). Refused with the reason elsewhere
    (tensor parallelism, cache-path hybrids such as MiniMax, that loss under FSDP2, DeepSpeed or Ulysses).
    """

    if options.get("prefix_activations") is None:  # the engine's mode (FSDP2: "recompute"), as sp.backward's None
        options["prefix_activations"] = detect(model, unwrap(model)).default_prefix_mode

    def cp_of(source):
        return plan_call(model, source, **options)

    return make_step(model, microbatches, cp_of, options, max_cached_tokens)


@once_per_call
def logprobs(
    model: torch.nn.Module,
    groups: Sequence[Group] | Tree | CallPlan | Microbatch,
    temperature: float = default(1.0),
    entropy: bool = default(False),
    max_tokens: int | None = default(None),
    backend: str = default("auto"),
    defer: bool | None = default(None),
    prefix_activations: str = default("recompute"),
    grad_reduction: str = default("sum"),
    aux_loss: bool | None = default(None),
    sequence_group: ProcessGroup | None = default(None),
) -> LogProbs:
    """Log-probs of every completion token, each prompt computed once.

    Args:
        model: a transformers causal LM (PEFT / DDP / FSDP2 wrappers are handled).
        groups: list of ``sharedprefix.Group``, a ``sharedprefix.Tree``, or a ``CallPlan`` (``plan_call``), whose
            settings are this call's where it leaves them out (a keyword passed wins, at its default too).
        temperature: logits are divided by it before the log-softmax, as in TRL.
        entropy: also return the entropy of each predicted distribution.
        max_tokens: tokens one pass may hold (None: all groups in one pass). Groups larger than
            the budget run their prompt once and their completions in later passes.
        backend: implementation of the attention primitive: "auto" (the device's own: "cuda" on CUDA,
            "cpu" otherwise), "cpu", "cuda", "flash_attn", or "reference" (float64 math, for tests).
        defer: with grad enabled, compute the values without a graph and run ``sp.backward`` (with
            the incoming per-token gradients as a linear loss) when autograd reaches them. Exact by
            the chain rule; costs one more forward, but keeps the memory of the schedule under
            ``max_tokens`` and lets the backward run inside sharedprefix's attention context, which
            gradient checkpointing needs (its recomputation happens during backward), and under
            DDP, whose gradient sync it then performs. None: defer exactly when gradient
            checkpointing is active or the model is wrapped in DDP. Deferred outputs give gradients
            to the model's parameters only. (Under FSDP2, grad-enabled logprobs are refused; use
            ``sp.backward``.)
        prefix_activations / grad_reduction: the ``sp.backward`` settings a deferred backward uses.
        aux_loss: the MoE load-balancing loss of all rows (``LogProbs.aux_loss``, see ``model.router``). None: when
            the config has ``output_router_logits=True``; True: also when it has not (TRL asks for it so); False:
            never. A deferred call carries its gradient exactly (a linear term per pass).
        sequence_group: a ``torch.distributed`` process group for Ulysses sequence parallelism
            (``parallel.sequence``), or None. Every rank of it passes the same groups; each computes a slice of
            every row's tokens outside attention and a slice of the heads inside it; the result is whole on
            every rank. With grad enabled the call defers (its backward is ``sp.backward`` over the group).

    Returns:
        ``LogProbs`` with (N, W) tensors, float32 (float64 for a float64 model), with grad when
        grad is enabled.
    """
    given = dict(max_tokens=max_tokens, backend=backend, temperature=temperature, entropy=entropy, defer=defer)
    given.update(prefix_activations=prefix_activations, grad_reduction=grad_reduction, aux_loss=aux_loss)
    given["sequence_group"] = sequence_group
    if isinstance(groups, Microbatch):
        return step_calls.logprobs(model, groups, given, _call_checks(), logprobs)
    with in_forward_autocast(model):  # accelerate's mixed precision wraps the forward, not the decoder we run
        opts, path, cp, error = call.prepare(model, groups, False, given, _call_checks())
        if path is Path.HYBRID:
            return cache_path.hybrid_logprobs(model, groups, opts)
        if torch.is_grad_enabled() and (opts.aux_loss or (opts.aux_loss is None and router.enabled(unwrap(model)))):
            router.check_checkpointing(unwrap(model))  # reentrant checkpointing drops the aux loss's gradient
        if path is Path.DEFERRED:
            with torch.no_grad():
                out, records = rounds.forward(model, cp, opts, aux=opts.aux_loss, error=error)
                grads = router.segment_grads(unwrap(model), records) if records else None
            return defer_logprobs(_deferred_backward, model, cp, out, opts, grads, engine=detect(model, unwrap(model)))
        return rounds.forward(model, cp, opts, aux=opts.aux_loss, error=error)[0]


@once_per_call
def backward(
    model: torch.nn.Module,
    groups: Sequence[Group] | Tree | CallPlan | Microbatch,
    loss_fn: Callable[[Batch], torch.Tensor],
    max_tokens: int | None = default(None),
    prefix_activations: str | None = default(None),
    temperature: float = default(1.0),
    entropy: bool = default(False),
    backend: str = default("auto"),
    offload_device: str | torch.device = default("cpu"),
    sync: bool = default(True),
    grad_reduction: str = default("sum"),
    aux_loss_coef: float | None = None,
    sequence_group: ProcessGroup | None = default(None),
) -> BackwardResult:
    """Accumulate into ``.grad`` the exact gradient of ``sum over passes of loss_fn(batch)``.

    ``loss_fn(batch) -> scalar tensor`` must be additive over completions (see the module
    docstring): the total is then the loss of all completions at once, whatever the budget. ``groups``: as in
    ``logprobs`` (a ``CallPlan`` too).

    Args:
        max_tokens: tokens one pass may hold; a group larger than that computes its prompt once,
            caches the prompt's per-layer K/V and last hidden state as leaves, runs its
            completions in budget-sized passes that accumulate their gradients, and runs the
            prompt's backward once at the end.
        prefix_activations: what happens to a split prompt's activations while its completions
            run: "keep" (held), "offload" (moved to ``offload_device`` by saved-tensor hooks and
            brought back for its backward) or "recompute" (the prompt runs without a graph first
            and again with grad at the end). All three give the same gradient. None (default):
            "keep", or "recompute" on an FSDP2 model, the only mode FSDP2 can run (a prompt's
            deferred backward must run inside the root module's call).
        sync: under DDP / FSDP2, synchronise the gradients of this call over the ranks (once, at
            its end). Pass False for all but the last call of an optimizer step to accumulate. A call
            inside DDP's ``no_sync()`` context does not synchronise, as DDP's own backward would not.
        grad_reduction: "sum" (default: each rank's loss uses global normalisers, so the global
            loss is the sum over ranks) or "mean" (the average over ranks, DDP's convention).
        aux_loss_coef: an MoE model's load-balancing loss, added as ``aux_loss_coef * aux_loss`` where ``aux_loss``
            is the plain forward's over all rows (each prompt token once per completion; ``model.router``). It is
            exact under any budget: one no-grad forward of every row first gives each token's gradient d aux / d
            router logits, whose linear term joins each pass's backward. Required (a number, 0.0 to leave the loss
            out) when the config has ``output_router_logits=True``; allowed on any MoE model with the loss.
        sequence_group: Ulysses sequence parallelism (see ``logprobs``): every rank of the group passes the same
            groups and ``loss_fn``; afterwards every rank holds the full gradient (summed over the group).

    A batch whose rows hold no trained token (a ``Tree`` row with ``trained`` all False) is no error: its log-probs
    are zeros that belong to the graph, so ``loss_fn`` gets them as usual and every parameter the pass reached gets a
    zero ``.grad`` (created if it was None), as a plain backward of such a loss gives.

    Failures under DDP / FSDP2: an error on one rank ends the call on every rank within seconds, the others
    raising a RuntimeError that names the failing rank and its message, and no rank keeps the call's gradient.
    The process group stays usable, except after an error inside FSDP2's own collectives (a forward or backward
    failing part-way), where every rank closes it (see ``parallel.engines.fsdp2``).
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn is a {type(loss_fn).__name__}; expected a callable Batch -> scalar tensor.")
    if not torch.is_grad_enabled():
        raise RuntimeError("sharedprefix.backward was called under torch.no_grad(); it needs autograd enabled.")
    coef = router.check_coef(unwrap(model), aux_loss_coef)
    given = dict(max_tokens=max_tokens, backend=backend, temperature=temperature, entropy=entropy, sync=sync)
    given.update(prefix_activations=prefix_activations, grad_reduction=grad_reduction, offload_device=offload_device)
    given["sequence_group"] = sequence_group
    if isinstance(groups, Microbatch):
        return step_calls.backward(model, groups, loss_fn, given, _call_checks(), coef)
    with in_forward_autocast(model):  # accelerate's mixed precision wraps the forward, not the decoder we run
        opts, path, cp, error = call.prepare(model, groups, True, given, _call_checks(), coef)
        opts = opts.replace(sync=opts.sync and sync_enabled(model))  # inside DDP's no_sync(): accumulate, as DDP does
        if path is Path.HYBRID:
            return cache_path.hybrid_backward(model, groups, loss_fn, opts)
        aux = None
        if coef:  # one no-grad forward of every row: the aux loss and each token's gradient of it
            router.check_checkpointing(unwrap(model))
            with torch.no_grad():
                first_opts = opts.replace(entropy=False, sequence_group=None)
                _, records = rounds.forward(model, cp, first_opts, aux=True, error=error)
            aux = router.scaled_grads(unwrap(model), records, coef)
        return rounds.backward(model, cp, opts, loss_fn, aux=aux, aux_coef=coef, error=error)


@once_per_call
def _deferred_backward(model, cp: CallPlan, loss_fn, options: CallOptions, aux_grads=None, collect=False):
    """The backward of deferred log-probs on the packed path (``schedule.deferred``) under the deferred call's
    ``options``: ``sp.backward``'s path, with the aux loss's per-token gradients (already scaled by the gradient that
    reached it) from the deferred call's own forward. ``collect``: returns ``(result, {parameter: gradient})`` with
    ``.grad`` untouched (``schedule.grads``; under DDP ``.grad`` is written and the dict is empty)."""
    aux = None if aux_grads is None else (aux_grads, None)
    return rounds.backward(model, cp, options, loss_fn, aux=aux, collect=collect)


# -- validation and the deferral decision --------------------------------------------------------------------------


def _call_checks() -> list[Callable]:
    """The registered checks (run on the call's groups by ``call.prepare``), after importing the module of every
    setting that is on (``settings``: the self-check's module registers itself), whichever way the public functions
    were imported."""
    for name, setting in settings.SETTINGS.items():
        if setting.plugin is not None and settings.read(name) != setting.default:
            importlib.import_module(setting.plugin)
    return _CALL_CHECKS
