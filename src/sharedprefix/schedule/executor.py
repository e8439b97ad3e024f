"""Run a plan's passes: pack each row, run the decoder under the shared-prefix attention, read out rows.

``Executor`` owns one call's state (the plan, the prefix cache, the parallel engine ``par``) and is
dropped when the call ends; ``schedule.rounds`` runs ``sp.backward``'s rounds over it.

Notation: L = row length, M = computed tokens of a pass, n = rows a pass reports, W = columns.
"""

from __future__ import annotations

import torch

from sharedprefix.attention import compiled
from sharedprefix.attention.interface import PassState, pass_state
from sharedprefix.layout.groups import Group
from sharedprefix.layout.packing import RowLayout, pack_row
from sharedprefix.layout.tree import SegmentTree
from sharedprefix.model import mixers, router, streams
from sharedprefix.model.adapter import decoder, head_logits, unwrap, uses_checkpointing
from sharedprefix.model.checks import decoder_position_ids
from sharedprefix.model.head import token_logprobs
from sharedprefix.model.multimodal import Multimodal
from sharedprefix.model.positions import renumbered
from sharedprefix.model.support import check_supported
from sharedprefix.parallel import sequence
from sharedprefix.parallel.detect import detect
from sharedprefix.parallel.sequence import SequenceShard, refuse_features
from sharedprefix.schedule import refusals
from sharedprefix.schedule.cache import PrefixCache
from sharedprefix.schedule.call_plan import CallPlan, probed
from sharedprefix.schedule.compiled import compiled_path, removed
from sharedprefix.schedule.options import CallOptions
from sharedprefix.schedule.planner import Pass


class Executor:
    """``options``: the call's settings (validated by the public call; the temperature here, where the ranks agree on
    errors). ``leaves``: an ``sp.backward`` (cached prompt
    K/V are leaves whose gradient is accumulated). ``aux``: the MoE load-balancing loss. True: record each pass's
    router logits (``router.aux_loss``); a dict ``{segment: per-layer (len, E) gradients}`` (``router.segment_grads``,
    scaled): add their linear term to what each pass backpropagates; None: as the config says
    (``output_router_logits``)."""

    def __init__(
        self,
        model,
        call_plan: CallPlan | None,
        options: CallOptions,
        leaves: bool,
        aux=None,
        error: BaseException | None = None,
    ):
        prefix_activations = options.prefix_activations if leaves else None  # (a forward-only run has no prefix mode)
        sequence_group = options.sequence_group
        self.options = options
        self.model = unwrap(model)
        self.par = detect(model, self.model)
        self.par.use_sequence(sequence_group)
        self.par.start()
        self.last: tuple | None = None  # (state, result) of the latest pass whose forward ran (``finish_failed_round``)
        if error is None:  # ``error``: this rank's plan failed (``make_plan``); agreed below like any refusal
            assert call_plan is not None
            try:
                self._setup(call_plan, leaves, aux)
            except (ValueError, TypeError) as e:  # a refusal or bad input on one rank stops every rank
                error = e
        o = options
        key = (
            None
            if error is not None or sequence_group is None
            else sequence.digest(self.plan, o.temperature, o.entropy, leaves, prefix_activations)
        )
        self.rounds = refusals.agree_setup(self.par, sequence_group, error, key, leaves, None if error else self.plan)
        # the same model on every rank: a refusal here is raised by every rank together (no guard needed)
        findings = probed(self.model, self.par, self.plan)
        calls = findings.calls
        if calls > 1 and uses_checkpointing(self.model):  # the same on every rank
            error = None
            try:  # this depends on each rank's groups: agreed, so that a refusal on one rank stops every rank
                refusals.check_after_probe(self, calls)
            except ValueError as e:
                error = e
            self.par.agree_on_error(error)
        if self.router_logits is not None or self.aux_grads is not None:
            with torch.compiler.set_stance("force_eager"):
                self.par.call(lambda: router.verify(self.model, decoder(self.model), self.device), guard=False)
        self.layers, self.force_eager, self.whole = compiled_path(self, findings, model)

    def _setup(self, call_plan: CallPlan, leaves, aux):
        self.call_plan = call_plan
        check_supported(self.model)  # the model's state (training mode with dropout) may have changed since planning
        call_plan.check_model(self.model, self.par)
        self.frames, self.source, self.plan = call_plan.frames, call_plan.source, call_plan.plan
        self.mm: Multimodal | None = Multimodal(self.model, self.source) if call_plan.images else None
        self.device, impl = call_plan.device, call_plan.kernel
        self.impl = impl
        self.aux_grads = aux if isinstance(aux, dict) else None
        record = aux is True or (aux is None and router.enabled(self.model))
        refusals.check_call(
            self.model,
            self.plan,
            self.options,
            self.par,
            impl,
            self.device,
            leaves,
            self.mm is not None,
            record,
            self.aux_grads is not None,
        )
        self.backend = self.options.backend
        self.temperature = float(self.options.temperature)
        self.entropy = self.options.entropy
        self.cache = PrefixCache(leaves=leaves)
        self.tokens = 0
        self.aux_term = None  # the aux loss's linear term of the latest pass that computed one under grad
        self.router_logits: list | None = [] if record else None  # per pass: (router logits, multiplicities, spans)
        if self.par.sequence is not None:
            refuse_features(type(self.model).__name__, refusals.sequence_refusals(self))

    def run_pass(self, step: Pass, tree: SegmentTree | None = None, surrogate: int | None = None):
        """Forward of one row (inside the root module's call under FSDP2).

        Returns (state, result, layout): result is ((n, W) log-probs, (n, W) entropies or None) of the
        output rows the pass reports, or None; with ``surrogate=seg`` it is instead that segment's
        surrogate loss (see ``PrefixCache.surrogate``), computed inside the same call.
        """
        tree = tree or self.plan.tree
        mixers.check_active(self.model)
        self.last = None
        if tree is self.plan.tree:  # the plan's rows are packed once per plan, whatever the calls
            layout = self.call_plan.layout(step, self.cache.segments())
        else:
            layout = pack_row(tree, list(step.segments), self.cache.segments(), step.record, step.rows)
        if self.mm is not None and tree is self.plan.tree:
            layout.blocks = self.mm.row_blocks(layout)
        state = PassState(
            layout,
            self.backend,
            self.cache,
            force_eager=self.force_eager,
            sequence=SequenceShard(self.par.sequence, layout.length) if self.par.sequence is not None else None,
        )
        shard = state.sequence.shard if state.sequence is not None else (lambda t: t)  # (..., L) -> this rank's

        def fn():
            hook = None
            if self.layers is not None:  # compiled decoder layers: the pass's handle, and the cached K/V's gradients
                compiled.register(state, self.layers)
                if (bridge := compiled.bridge(state, self.layers, self.cache.read_kv)) is not None:
                    hook = self.model.get_input_embeddings().register_forward_hook(bridge)
            with pass_state(state), removed(hook):
                if self.mm is not None and tree is self.plan.tree:  # the vision tower runs for this row's prompts
                    extra = {k: v.to(self.device) for k, v in self.mm.inputs(layout, self.source).items()}
                    out = self.mm.module(
                        input_ids=layout.input_ids.to(self.device),
                        position_ids=self.mm.positions(layout).to(self.device),
                        use_cache=False,
                        **extra,
                    )
                else:
                    dec = decoder(self.model)
                    with (
                        renumbered(
                            self.model, dec, shard(decoder_position_ids(self.model, layout)).to(self.device)
                        ) as kw,
                        streams.framed(self.model, dec, self.frames),
                        router.recording(self.model, self.router_logits is not None or self.aux_grads is not None),
                    ):
                        out = dec(input_ids=shard(layout.input_ids).to(self.device), use_cache=False, **kw)
            hidden = out.last_hidden_state[0]  # (L, d), or (Ls, d) of this rank's tokens
            if state.sequence is not None:
                hidden = state.sequence.gather(hidden)
            self.aux_term = None
            if self.router_logits is not None and tree is self.plan.tree:
                self.router_logits.append((out.router_logits, router.multiplicity(layout), router.spans(layout)))
            if self.aux_grads is not None and tree is self.plan.tree and torch.is_grad_enabled():
                self.aux_term = router.linear_term(out.router_logits, router.spans(layout), self.aux_grads, 1.0)
                if surrogate is None and layout.record:  # a recorded prompt: its term joins its deferred backward
                    self.cache.add_term(layout.record[0], self.aux_term)
                    self.aux_term = None
            for s in layout.record:
                self.cache.write_h(s, hidden[layout.row_end[s] - 1])
            lp = ent = None
            if layout.targets.numel():
                sources = [hidden] + [self.cache.h(s)[None] for s in layout.h_sources]
                pred = (torch.cat(sources) if len(sources) > 1 else hidden).index_select(
                    0, layout.pred_index.to(hidden.device)
                )
                targets = layout.targets.to(hidden.device)
                if self.frames is not None:  # (M,) frame ids -> (M, K) codes, one per head; pads add nothing
                    targets = self.frames.codes(targets)
                lp, ent = token_logprobs(
                    self.model,
                    pred,
                    targets,
                    self.temperature,
                    self.entropy,
                    ignore=streams.pad_id(self.model) if self.frames else None,
                )
                for s in layout.record:
                    if s in layout.value_slot:
                        a, b = layout.value_slot[s]
                        self.cache.write_values(s, lp[a:b], ent[a:b] if ent is not None else None)
            elif self.par.lockstep:
                # FSDP2 may shard the output head as a unit of its own (verl does): every rank's pass must run it,
                # forward and backward, whatever this rank's pass predicts, or the ranks' collectives differ.
                # One row of logits, times zero: adds exactly nothing.
                hidden = hidden + (head_logits(self.model, hidden[-1:]).sum() * 0.0).to(hidden.dtype)
            if surrogate is not None:
                sur = self.cache.surrogate(
                    surrogate, through_outputs=self.par.backward_through_outputs or self.layers is not None
                )
                if self.aux_term is not None:
                    sur, self.aux_term = (self.aux_term if sur is None else sur + self.aux_term), None
                if self.par.backward_through_outputs and not layout.targets.numel() and torch.is_grad_enabled():
                    sur = (hidden[-1].sum() * 0.0) + (sur if sur is not None else 0.0)
                return sur
            if not layout.rows:
                return None
            dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
            return (
                self._gather(layout, lp, 0, dtype, hidden),
                self._gather(layout, ent, 1, dtype, hidden) if self.entropy else None,
            )

        result = self.par.call(fn)
        self.last = (state, result)
        refusals.check_calls(self, state)
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

    def begin_round(self) -> None:
        """Forget the latest pass: ``finish_failed_round`` then knows whether the next round's forward ran."""
        self.last = None

    def recoverable(self) -> bool:
        """Whether an error outside the collectives lets this rank finish the call as dummy rounds (FSDP2 with
        several ranks and an intact process group) instead of raising at once."""
        return self.par.recoverable()

    def finish_failed_round(self, grad: bool, dummy: bool = True) -> None:
        """After an error outside the collectives of a round: run the collectives the other ranks still run in it.
        ``grad``: the round has a backward; ``dummy``: a round whose forward did not run is replaced by a dummy."""
        if self.last is None:  # the error came before the round's forward: all of it, as a dummy round
            if dummy:
                self.dummy_round(grad=grad)
            return
        state, out = self.last  # the forward ran: its backward, of zero (the call's gradients are rolled back)
        out = out[0] if isinstance(out, tuple) else out
        if grad and out is not None and out.requires_grad:
            with pass_state(state):
                self.par.backward(out.sum() * 0.0)

    def mask(self, layout: RowLayout) -> torch.Tensor:
        return layout.out_mask.to(self.device)

    def dummy_round(self, grad: bool) -> None:
        """A 2-token pass that takes part in a lockstep engine's (FSDP2's) collectives and adds exactly zero to every
        gradient."""
        tree = SegmentTree([Group([0], [[0]])])
        with torch.set_grad_enabled(grad):
            state, res, _ = self.run_pass(Pass((0, 1), rows=(0,)), tree=tree)
            if grad:
                with pass_state(state):
                    self.par.backward(res[0].sum() * 0.0)
