"""The public calls: ``sp.logprobs`` (forward) and ``sp.backward`` (forward, loss, backward per pass).

They validate, plan and hand the plan to ``schedule.executor``. Notation: N = output rows
(completions in group order, or a tree's rows), W = columns, n = rows in one pass.

Hybrid models (``modeling.HYBRID_MODEL_TYPES``: LFM2, Falcon-H1, Qwen3-Next, Zamba2, Mamba2 and others, whose layers mix tokens
outside attention) take ``schedule.hybrid`` instead: each prompt once through the model's own cache-aware
forward, each completion batch from a copy of the prompt's cache. There ``max_tokens`` bounds every forward
(prompt chunks, right-padded completion batches); a completion longer than it is refused, and so are
``sp.Tree``, ``prompt_inputs``, DDP/FSDP2 and gradient checkpointing.

``backward`` contract: ``loss_fn`` is called once per pass that reports rows, with a ``Batch``
of those rows (each whole), and must be *additive over rows*: the loss of a set of rows is the
sum of the losses of its parts. Every GRPO-family loss is, once its normalisers (total tokens,
total completions) are computed globally and passed in.
"""

from __future__ import annotations

import contextlib
import os

import torch

from sharedprefix import router
from sharedprefix.attention.interface import activated
from sharedprefix.attention.kernels import select
from sharedprefix.modeling import is_hybrid, unwrap, uses_checkpointing
from sharedprefix.schedule import hybrid
from sharedprefix.schedule.cache import OffloadHooks
from sharedprefix.schedule.deferred import defer_logprobs
from sharedprefix.schedule.executor import Executor
from sharedprefix.schedule.grads import GradTransaction
from sharedprefix.schedule.parallel import detect
from sharedprefix.schedule.planner import PrefixBackward
from sharedprefix.schedule.results import PREFIX_MODES, REDUCTIONS, BackwardResult, Batch, LogProbs
from sharedprefix.schedule.rounds import rounds_of, run_rounds

__all__ = ["PREFIX_MODES", "REDUCTIONS", "BackwardResult", "Batch", "LogProbs", "backward", "logprobs"]


def logprobs(
    model,
    groups,
    temperature: float = 1.0,
    entropy: bool = False,
    max_tokens: int | None = None,
    backend: str = "auto",
    defer: bool | None = None,
    prefix_activations: str = "recompute",
    grad_reduction: str = "sum",
) -> LogProbs:
    """Log-probs of every completion token, each prompt computed once.

    Args:
        model: a transformers causal LM (PEFT / DDP / FSDP2 wrappers are handled).
        groups: list of ``sharedprefix.Group``.
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

    Returns:
        ``LogProbs`` with (N, T) tensors, float32 (float64 for a float64 model), with grad when
        grad is enabled.
    """
    if prefix_activations not in PREFIX_MODES:
        raise ValueError(f"prefix_activations={prefix_activations!r}; expected one of {PREFIX_MODES}.")
    if grad_reduction not in REDUCTIONS:
        raise ValueError(f"grad_reduction={grad_reduction!r}; expected one of {REDUCTIONS}.")
    if is_hybrid(unwrap(model)):
        kind = _check_hybrid(model, backend)
        if torch.is_grad_enabled() and kind == "ddp" and defer is False:
            raise ValueError(
                "sharedprefix.logprobs with grad enabled and defer=False on a DDP model: the hybrid path runs the "
                "wrapped module, so only a deferred backward (defer=None or True) synchronises the gradients over "
                "the ranks. Leave defer=None."
            )
        deferred = torch.is_grad_enabled() and (defer or kind == "ddp")  # no graph now, hybrid.backward later
        error, out = None, None
        try:
            with torch.no_grad() if deferred else contextlib.nullcontext():
                out = hybrid.logprobs(unwrap(model), groups, temperature, entropy, max_tokens)
        except (ValueError, TypeError) as e:  # DDP: every rank stops, none waits in a later collective
            if kind != "ddp":
                raise
            error = e
        if kind == "ddp":
            detect(model, unwrap(model)).agree_on_error(error)
        if deferred:
            return defer_logprobs(model, groups, out, temperature, max_tokens, backend, prefix_activations, grad_reduction)
        return out
    if torch.is_grad_enabled():
        inner = unwrap(model)
        kind = detect(model, inner).kind
        if kind == "fsdp":
            raise ValueError(
                "sharedprefix.logprobs with grad enabled is not supported on an FSDP2 model: its backward would run "
                "outside FSDP2's hooks. Use sharedprefix.backward for the policy step (and logprobs under "
                "torch.no_grad() for old-policy and reference log-probs)."
            )
        needs = "a DDP model" if kind == "ddp" else "gradient checkpointing" if uses_checkpointing(inner) else None
        if defer is False and needs:
            raise ValueError(
                f"defer=False with grad enabled is not possible with {needs}: the backward must run inside "
                "sharedprefix (to recompute checkpointed layers with its attention, or to synchronise DDP "
                "gradients). Leave defer=None."
            )
        if defer or (defer is None and needs):
            router.refuse_per_pass(inner, f"logprobs defers its backward to sharedprefix.backward ({needs or 'defer=True'})")
            with torch.no_grad():
                out = logprobs(model, groups, temperature, entropy, max_tokens, backend, defer=False)
            return defer_logprobs(model, groups, out, temperature, max_tokens, backend, prefix_activations, grad_reduction)
    if os.environ.get("SHAREDPREFIX_SELF_CHECK", "0") not in ("", "0"):  # opt-in: verify this model once first
        from sharedprefix.tools.verify import self_check

        self_check(model, groups)
    run = Executor(model, groups, max_tokens, backend, temperature, entropy, leaves=False)
    lps, ents, masks, order = [], [], [], []
    # under FSDP2 every rank runs as many forwards (each all-gathers the parameters): agreed before any of them
    pad = run.rounds[0] - len(run.plan.passes) if run.par.fsdp else 0
    error = None  # under FSDP2, an error outside the collectives: the rank runs the rest as dummies, then all raise
    with activated(run.model):
        for step in run.plan.steps:
            if isinstance(step, PrefixBackward):
                for s in step.segments:
                    run.cache.release(s)
                continue
            if error is not None:
                run.dummy_round(grad=False)
                continue
            run.last = None
            try:
                _, res, layout = run.run_pass(step)
            except Exception as e:
                if not (run.par.fsdp and run.par.world_size > 1) or run.par.broken:
                    raise
                error = e
                if run.last is None:  # the pass's forward did not run: its collectives, as a dummy
                    run.dummy_round(grad=False)
                continue
            for s in step.record:
                run.cache.seal(s, keep_graph=False)
            if res is None:
                continue
            lps.append(res[0])
            masks.append(run.mask(layout))
            if entropy:
                ents.append(res[1])
            order += layout.rows
        for _ in range(pad):
            run.dummy_round(grad=False)
    if run.par.fsdp:
        run.par.agree_on_error(error, where="during")
    inv = torch.empty(len(order), dtype=torch.int64)
    inv[torch.tensor(order)] = torch.arange(len(order))
    inv = inv.to(run.device)
    lp = torch.cat(lps).index_select(0, inv)
    mask = torch.cat(masks).index_select(0, inv)
    ent = torch.cat(ents).index_select(0, inv) if entropy else None
    aux = router.aux_loss(run.model, run.router_logits) if run.router_logits else None
    return LogProbs(lp, mask, ent, aux)


def backward(
    model,
    groups,
    loss_fn,
    max_tokens: int | None = None,
    prefix_activations: str | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    backend: str = "auto",
    offload_device: str | torch.device = "cpu",
    sync: bool = True,
    grad_reduction: str = "sum",
) -> BackwardResult:
    """Accumulate into ``.grad`` the exact gradient of ``sum over passes of loss_fn(batch)``.

    ``loss_fn(batch) -> scalar tensor`` must be additive over completions (see the module
    docstring): the total is then the loss of all completions at once, whatever the budget.

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
            its end). Pass False for all but the last call of an optimizer step to accumulate.
        grad_reduction: "sum" (default: each rank's loss uses global normalisers, so the global
            loss is the sum over ranks) or "mean" (the average over ranks, DDP's convention).

    Failures under DDP / FSDP2: an error on one rank ends the call on every rank within seconds, the others
    raising a RuntimeError that names the failing rank and its message, and no rank keeps the call's gradient.
    The process group stays usable, except after an error inside FSDP2's own collectives (a forward or backward
    failing part-way), where every rank closes it (see ``schedule.parallel``).
    """
    if prefix_activations is None:  # the default: "keep", or the mode FSDP2 needs
        prefix_activations = "recompute" if detect(model, unwrap(model)).fsdp else "keep"
    if prefix_activations not in PREFIX_MODES:
        raise ValueError(
            f"prefix_activations={prefix_activations!r}; expected one of {PREFIX_MODES} or None: 'keep' holds the prompt's "
            "activations, 'offload' moves them to host memory, 'recompute' recomputes them at the end."
        )
    if grad_reduction not in REDUCTIONS:
        raise ValueError(f"grad_reduction={grad_reduction!r}; expected one of {REDUCTIONS}.")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn is a {type(loss_fn).__name__}; expected a callable Batch -> scalar tensor.")
    if not torch.is_grad_enabled():
        raise RuntimeError("sharedprefix.backward was called under torch.no_grad(); it needs autograd enabled.")
    router.refuse_per_pass(unwrap(model), "sharedprefix.backward takes its loss per pass")
    if is_hybrid(unwrap(model)):
        inner = unwrap(model)

        def run_hybrid():
            return hybrid.backward(inner, groups, loss_fn, max_tokens, prefix_activations, temperature, entropy,
                                   offload_device)

        if _check_hybrid(model, backend) != "ddp":
            return run_hybrid()
        return _synced(detect(model, inner), inner, sync, grad_reduction, run_hybrid)  # the module, then one sync
    if os.environ.get("SHAREDPREFIX_SELF_CHECK", "0") not in ("", "0"):  # opt-in: verify this model once first
        from sharedprefix.tools.verify import self_check

        self_check(model, groups)
    # (a refusal on one rank, e.g. a mode FSDP2 cannot run where only its shard splits a group, stops every rank)
    run = Executor(model, groups, max_tokens, backend, temperature, entropy, leaves=True,
                   prefix_activations=prefix_activations)
    par = run.par
    recompute = prefix_activations == "recompute" or par.fsdp
    cuda = run.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(run.device)
    hooks = OffloadHooks(run.model, offload_device) if prefix_activations == "offload" and not par.fsdp else None
    steps = run.plan
    if par.fsdp:  # every rank runs the same collectives: the plan reordered and padded to the agreed counts
        steps = steps.for_fsdp(*run.rounds)
    rounds = rounds_of(steps)
    dummies = sum(k in ("DF", "DFB") for k, _ in rounds)
    last_fb = max((i for i, r in enumerate(rounds) if r[0] in ("FB", "PB", "DFB")), default=-1)
    # under "mean", scale so that FSDP2's averaging (or our own all-reduce) gives the mean / the sum
    scale = par.loss_scale() if grad_reduction == "sum" else 1.0
    total, calls = _synced(par, run.model, sync, grad_reduction,
                           lambda: run_rounds(run, rounds, loss_fn, entropy, recompute, hooks, sync, scale, last_fb))
    peak = int(torch.cuda.max_memory_allocated(run.device)) if cuda else None
    return BackwardResult(
        loss=total,
        tokens_computed=run.tokens,
        tokens_plain=run.plan.plain_tokens,
        passes=len(run.plan.passes),
        loss_calls=calls,
        peak_memory_bytes=peak,
        offloaded_bytes=hooks.bytes_moved if hooks else 0,
        dummy_rounds=dummies,
    )


def _check_hybrid(model, backend: str) -> str:
    """A hybrid model runs its own attention (``schedule.hybrid``): the backend name is checked, not used; FSDP2 is
    refused. Returns the data-parallel kind ("none" or "ddp")."""
    select(backend, unwrap(model).get_input_embeddings().weight.device)
    kind = detect(model, unwrap(model)).kind
    if kind == "fsdp":
        raise ValueError(
            f"{type(unwrap(model)).__name__} is a hybrid model (layers that mix tokens outside attention) sharded with "
            "FSDP2; sharedprefix's hybrid path runs the model's own cache-aware forward, which it does not run inside "
            "FSDP2's unshard and reshard hooks. Use DDP (supported) or a single process."
        )
    return kind


def _synced(par, model, sync: bool, grad_reduction: str, fn):
    """``fn()`` inside a gradient transaction (a failure leaves ``.grad`` as it was); under DDP with ``sync``, whose
    passes run no collective, the ranks agree on any error first (every rank raises, none waits), then one
    all-reduce of the gradients (sum, or mean)."""
    tx = GradTransaction(model, ddp=par.kind == "ddp")
    ddp = par.kind == "ddp" and sync
    try:
        error, out = None, None
        try:
            out = fn()
        except Exception as e:  # agreed on below, before the all-reduce the other ranks will join
            if not ddp:
                raise
            error = e
        if ddp:
            par.agree_on_error(error, where="during")
            par.all_reduce_grads(model)
            if grad_reduction == "mean":
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.div_(par.world_size)
    except BaseException:
        tx.rollback()  # no partial gradient is left behind
        raise
    finally:
        par.set_sync(True)  # FSDP2's default, whatever happened
    tx.commit(synced=sync)
    return out
