"""Run a plan: ``sp.logprobs`` (forward) and ``sp.backward`` (forward, loss, backward per pass).

Notation: N = completions in group order, T = longest completion, n = completions in one
pass, M = predicted tokens in one pass, d = hidden size.

``backward`` contract: ``loss_fn`` is called once per pass that holds completions, with a
``Batch`` of those completions, and must be *additive over completions*: the loss of a set
of completions is the sum of the losses of its parts. Every GRPO-family loss is, once its
normalisers (total tokens, total completions) are computed globally and passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sharedprefix.attention.interface import PassState, activated, pass_state
from sharedprefix.attention.kernels import select
from sharedprefix.layout.groups import Group, validate_groups
from sharedprefix.layout.packing import RowLayout, pack_row
from sharedprefix.layout.rows import Tree
from sharedprefix.layout.tree import SegmentTree
from sharedprefix.modeling import (
    check_supported,
    decoder,
    num_attention_layers,
    token_logprobs,
    unwrap,
    uses_checkpointing,
    uses_reentrant_checkpointing,
    verify_head,
)
from sharedprefix.schedule.cache import OffloadHooks, PrefixCache
from sharedprefix.schedule.grads import GradTransaction
from sharedprefix.schedule.parallel import detect
from sharedprefix.schedule.planner import Pass, Plan, PrefixBackward, plan

PREFIX_MODES = ("keep", "offload", "recompute")
REDUCTIONS = ("sum", "mean")


@dataclass
class LogProbs:
    """Per-token results, completions in group order.

    Attributes:
        logprobs: (N, T) natural-log probability of each completion token; 0 on padding.
        mask: (N, T) bool, True on real tokens.
        entropy: (N, T) entropy in nats of each predicted distribution, or None.
    """

    logprobs: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None


@dataclass
class Batch:
    """What ``loss_fn`` receives: a subset of the completions.

    Attributes:
        logprobs / mask / entropy: (n, T) as in ``LogProbs`` (T is the global longest completion).
        index: (n,) int64 positions of these completions in 0..N-1 (group order).
    """

    logprobs: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None
    index: torch.Tensor


@dataclass
class BackwardResult:
    """``loss``: total loss of this rank (float). Statistics: tokens computed (recomputation
    included), tokens a plain run computes, passes run, calls of ``loss_fn``, peak accelerator
    memory in bytes (None on CPU, where no allocator statistic exists), bytes offloaded, and
    zero-gradient rounds run only to match other FSDP2 ranks' collectives."""

    loss: float
    tokens_computed: int
    tokens_plain: int
    passes: int
    loss_calls: int
    peak_memory_bytes: int | None
    offloaded_bytes: int = 0
    dummy_rounds: int = 0


class _Runner:
    def __init__(self, model, source, max_tokens, backend, temperature, entropy, leaves):
        self.model = unwrap(model)
        self.par = detect(model, self.model)
        check_supported(self.model)
        emb = self.model.get_input_embeddings()
        vocab = min(emb.num_embeddings, self.model.get_output_embeddings().weight.shape[0])
        self.source = validate_source(source, vocab)
        if not isinstance(temperature, (int, float)) or not temperature > 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature={temperature!r}; expected a finite number > 0 (the sampling temperature).")
        self.plan: Plan = plan(self.source, max_tokens)
        if self.plan.splits and torch.is_grad_enabled() and uses_reentrant_checkpointing(self.model):
            raise ValueError(
                "gradient checkpointing with use_reentrant=True is on, and this plan splits a group across passes: "
                "reentrant checkpointing only returns gradients to a layer's explicit inputs, so the cached prompt "
                "K/V read inside each layer would get none. Enable it with "
                "gradient_checkpointing_kwargs={'use_reentrant': False} (the transformers default), or raise "
                "max_tokens so that every group fits one pass."
            )
        self.device = emb.weight.device
        select(backend, self.device)  # an unknown or unavailable backend fails before any computation
        self.backend = backend
        self.temperature = float(temperature)
        self.entropy = entropy
        self.cache = PrefixCache(leaves=leaves)
        self.T = self.plan.tree.width
        self.tokens = 0
        self.par.call(lambda: verify_head(self.model))

    def run_pass(self, step: Pass, tree: SegmentTree | None = None, surrogate: int | None = None):
        """Forward of one row (inside the root module's call under FSDP2).

        Returns (state, result, layout): result is ((n, W) log-probs, (n, W) entropies or None) of the
        output rows the pass reports, or None; with ``surrogate=seg`` it is instead that segment's
        surrogate loss (see ``PrefixCache.surrogate``), computed inside the same call.
        """
        tree = tree or self.plan.tree
        layout = pack_row(tree, list(step.segments), self.cache.segments(), step.record, step.rows)
        state = PassState(layout, self.backend, self.cache.read_kv, self.cache.write_kv)

        def fn():
            with pass_state(state):
                out = decoder(self.model)(
                    input_ids=layout.input_ids.to(self.device),
                    position_ids=layout.position_ids.to(self.device),
                    use_cache=False,
                )
            hidden = out.last_hidden_state[0]  # (L, d)
            for s in layout.record:
                self.cache.write_h(s, hidden[layout.row_end[s] - 1])
            lp = ent = None
            if layout.targets.numel():
                sources = [hidden] + [self.cache.h(s)[None] for s in layout.h_sources]
                pred = (torch.cat(sources) if len(sources) > 1 else hidden).index_select(
                    0, layout.pred_index.to(hidden.device))
                lp, ent = token_logprobs(self.model, pred, layout.targets.to(hidden.device), self.temperature,
                                         self.entropy)
                for s in layout.record:
                    if s in layout.value_slot:
                        a, b = layout.value_slot[s]
                        self.cache.write_values(s, lp[a:b], ent[a:b] if ent is not None else None)
            if surrogate is not None:
                return self.cache.surrogate(surrogate, through_outputs=self.par.fsdp)
            if not layout.rows:
                return None
            dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
            return (self._gather(layout, lp, 0, dtype, hidden),
                    self._gather(layout, ent, 1, dtype, hidden) if self.entropy else None)

        result = self.par.call(fn)
        self._check_calls(state)
        self.tokens += layout.length if tree is self.plan.tree else 0
        for s in layout.record:
            self.cache.states[s] = state
        return state, result, layout

    def _gather(self, layout: RowLayout, values, which: int, dtype, anchor) -> torch.Tensor:
        """(M,) values of this pass and the cached values of earlier ones -> (n, W) rows, zero where not reported."""
        parts = ([values] if values is not None else []) + [self.cache.values(s)[which] for s in layout.v_sources]
        n, w = layout.out_mask.shape
        if not parts:  # nothing trained in these rows: zeros, still part of the graph (exactly zero gradients)
            return torch.zeros(n, w, dtype=dtype, device=self.device) + 0.0 * anchor[:1].sum().to(dtype)
        src = torch.cat(parts) if len(parts) > 1 else parts[0]
        idx, mask = layout.out_index.to(src.device), layout.out_mask.to(src.device)
        rows = src.index_select(0, idx.reshape(-1)).view(n, w)
        return torch.where(mask, rows, torch.zeros((), dtype=src.dtype, device=src.device))

    def mask(self, layout: RowLayout) -> torch.Tensor:
        return layout.out_mask.to(self.device)

    def dummy_round(self, grad: bool) -> None:
        """A 2-token pass that takes part in FSDP2's collectives and adds exactly zero to every gradient."""
        tree = SegmentTree([Group([0], [[0]])])
        with torch.set_grad_enabled(grad):
            state, res, _ = self.run_pass(Pass((0, 1), rows=(0,)), tree=tree)
            if grad:
                with pass_state(state):
                    (res[0].sum() * 0.0).backward()

    def _check_calls(self, state: PassState) -> None:
        want = num_attention_layers(self.model)
        got = len(state.seen)
        if got != want:
            raise ValueError(
                f"{type(self.model).__name__}: the sharedprefix attention ran in {got} of {want} layers; the model's "
                "attention bypasses transformers' attention interface, so prompt sharing cannot be applied exactly. "
                "This model is not supported."
            )


def validate_source(source, vocab_size: int | None = None):
    """A ``Tree`` (token ids checked) or a validated list of groups."""
    if isinstance(source, Tree):
        if vocab_size is not None:
            source.check_vocab(vocab_size)
        return source
    return validate_groups(source, vocab_size)


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
            with torch.no_grad():
                out = logprobs(model, groups, temperature, entropy, max_tokens, backend, defer=False)
            return _defer(model, groups, out, temperature, max_tokens, backend, prefix_activations, grad_reduction)
    run = _Runner(model, groups, max_tokens, backend, temperature, entropy, leaves=False)
    lps, ents, masks, order = [], [], [], []
    # under FSDP2 every rank runs as many forwards (each all-gathers the parameters): agree before any of them
    pad = run.par.agree_max([len(run.plan.passes)])[0] - len(run.plan.passes) if run.par.fsdp else 0
    with activated(run.model):
        for step in run.plan.steps:
            if isinstance(step, PrefixBackward):
                for s in step.segments:
                    run.cache.release(s)
                continue
            _, res, layout = run.run_pass(step)
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
    inv = torch.empty(len(order), dtype=torch.int64)
    inv[torch.tensor(order)] = torch.arange(len(order))
    inv = inv.to(run.device)
    lp = torch.cat(lps).index_select(0, inv)
    mask = torch.cat(masks).index_select(0, inv)
    ent = torch.cat(ents).index_select(0, inv) if entropy else None
    return LogProbs(lp, mask, ent)


def _rounds(p: Plan, fsdp: bool) -> list[tuple[str, object]]:
    """The plan as rounds: F (record a prompt segment), FB (completions, loss, backward), PB (a prompt segment's
    deferred backward), REL (release a chain). Under FSDP2 all F rounds come first (see ``parallel``)."""
    out = []
    for step in p.steps:
        if isinstance(step, PrefixBackward):
            out += [("PB", s) for s in reversed(step.segments)] + [("REL", step.segments)]
        else:
            out.append(("F" if step.record else "FB", step))
    if fsdp:
        out = [r for r in out if r[0] == "F"] + [r for r in out if r[0] != "F"]
    return out


def backward(
    model,
    groups,
    loss_fn,
    max_tokens: int | None = None,
    prefix_activations: str = "keep",
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
            and again with grad at the end). All three give the same gradient. FSDP2 needs
            "recompute" (its deferred backward must run inside the root module's call).
        sync: under DDP / FSDP2, synchronise the gradients of this call over the ranks (once, at
            its end). Pass False for all but the last call of an optimizer step to accumulate.
        grad_reduction: "sum" (default: each rank's loss uses global normalisers, so the global
            loss is the sum over ranks) or "mean" (the average over ranks, DDP's convention).
    """
    if prefix_activations not in PREFIX_MODES:
        raise ValueError(
            f"prefix_activations={prefix_activations!r}; expected one of {PREFIX_MODES}: 'keep' holds the prompt's "
            "activations, 'offload' moves them to host memory, 'recompute' recomputes them at the end."
        )
    if grad_reduction not in REDUCTIONS:
        raise ValueError(f"grad_reduction={grad_reduction!r}; expected one of {REDUCTIONS}.")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn is a {type(loss_fn).__name__}; expected a callable Batch -> scalar tensor.")
    if not torch.is_grad_enabled():
        raise RuntimeError("sharedprefix.backward was called under torch.no_grad(); it needs autograd enabled.")
    run = _Runner(model, groups, max_tokens, backend, temperature, entropy, leaves=True)
    par = run.par
    if par.fsdp and run.plan.splits and prefix_activations != "recompute":
        raise ValueError(
            f"prefix_activations={prefix_activations!r} with an FSDP2 model and a budget that splits a group: a "
            "prompt's deferred backward must run inside the root module's call under FSDP2, which only "
            "'recompute' does. Use prefix_activations='recompute'."
        )
    recompute = prefix_activations == "recompute" or par.fsdp
    cuda = run.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(run.device)
    hooks = OffloadHooks(run.model, offload_device) if prefix_activations == "offload" and not par.fsdp else None
    rounds = _rounds(run.plan, par.fsdp)
    n_f = sum(k == "F" for k, _ in rounds)
    n_fb = sum(k in ("FB", "PB") for k, _ in rounds)
    pad_f = pad_fb = 0
    if par.fsdp:
        most_f, most_fb = par.agree_max([n_f, n_fb])
        pad_f, pad_fb = most_f - n_f, most_fb - n_fb
        rounds = [r for r in rounds if r[0] == "F"] + [("DF", None)] * pad_f + \
            [r for r in rounds if r[0] != "F"] + [("DFB", None)] * pad_fb
    last_fb = max((i for i, r in enumerate(rounds) if r[0] in ("FB", "PB", "DFB")), default=-1)
    # under "mean", scale so that FSDP2's averaging (or our own all-reduce) gives the mean / the sum
    scale = par.loss_scale() if grad_reduction == "sum" else 1.0
    tx = GradTransaction(run.model, ddp=par.kind == "ddp")
    total, calls = 0.0, 0
    try:
        total, calls = _run_rounds(run, rounds, loss_fn, entropy, recompute, hooks, sync, scale, last_fb)
        if par.kind == "ddp" and sync:
            par.all_reduce_grads(run.model)
            if grad_reduction == "mean":
                for p in run.model.parameters():
                    if p.grad is not None:
                        p.grad.div_(par.world_size)
    except BaseException:
        tx.rollback()  # no partial gradient is left behind
        raise
    finally:
        par.set_sync(True)  # FSDP2's default, whatever happened
    tx.commit(synced=sync)
    peak = int(torch.cuda.max_memory_allocated(run.device)) if cuda else None
    return BackwardResult(
        loss=total,
        tokens_computed=run.tokens,
        tokens_plain=run.plan.plain_tokens,
        passes=len(run.plan.passes),
        loss_calls=calls,
        peak_memory_bytes=peak,
        offloaded_bytes=hooks.bytes_moved if hooks else 0,
        dummy_rounds=pad_f + pad_fb,
    )


def _run_rounds(run, rounds, loss_fn, entropy, recompute, hooks, sync, scale, last_fb):
    par = run.par
    total, calls = 0.0, 0
    with activated(run.model):
        for i, (kind, x) in enumerate(rounds):
            if kind in ("FB", "PB", "DFB"):
                par.set_sync(sync and i == last_fb)
            if kind == "DF":
                run.dummy_round(grad=False)
            elif kind == "DFB":
                run.dummy_round(grad=True)
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
                        sur.backward()
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
                    continue
                batch = Batch(
                    logprobs=res[0],
                    mask=run.mask(layout),
                    entropy=res[1] if entropy else None,
                    index=torch.tensor(layout.rows, dtype=torch.int64, device=run.device),
                )
                loss = _check_loss(loss_fn(batch), calls)
                calls += 1
                with pass_state(state):
                    (loss * scale if scale != 1.0 else loss).backward()
                total += float(loss.detach())
    return total, calls


class _Deferred(torch.autograd.Function):
    """Values computed without a graph; their backward runs ``backward`` with the incoming gradients."""

    @staticmethod
    def forward(ctx, anchor, lp, ent, spec):
        ctx.spec = spec
        return lp.clone(), ent.clone()

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        spec = ctx.spec
        w_ent = g_ent if spec["entropy"] else None

        def loss_fn(b):
            loss = (b.logprobs * g_lp[b.index].to(b.logprobs.dtype)).sum()
            if w_ent is not None:
                loss = loss + (b.entropy * w_ent[b.index].to(b.entropy.dtype)).sum()
            return loss

        with torch.enable_grad(), torch.autocast(**spec["autocast"]):
            backward(spec["model"], spec["groups"], loss_fn, max_tokens=spec["max_tokens"], temperature=spec["temperature"],
                     entropy=w_ent is not None, backend=spec["backend"], prefix_activations=spec["mode"],
                     grad_reduction=spec["reduction"])
        return None, None, None, None


def _defer(model, groups, out: LogProbs, temperature, max_tokens, backend, mode, reduction) -> LogProbs:
    if mode not in PREFIX_MODES:
        raise ValueError(f"prefix_activations={mode!r}; expected one of {PREFIX_MODES}.")
    dev = out.logprobs.device.type
    spec = dict(model=model, groups=groups, temperature=temperature, max_tokens=max_tokens, backend=backend, mode=mode,
                reduction=reduction,
                entropy=out.entropy is not None,
                autocast=dict(device_type=dev, enabled=torch.is_autocast_enabled(dev), dtype=torch.get_autocast_dtype(dev)))
    ent = out.entropy if out.entropy is not None else torch.zeros_like(out.logprobs)
    lp, ent = _Deferred.apply(torch.zeros((), requires_grad=True), out.logprobs, ent, spec)
    return LogProbs(lp, out.mask, ent if out.entropy is not None else None)


def _check_loss(loss, call: int) -> torch.Tensor:
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
