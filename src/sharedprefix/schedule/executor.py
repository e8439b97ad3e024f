"""Run a plan's passes: pack each row, run the decoder under the shared-prefix attention, read out rows.

``PassRunner`` owns one call's state (the prefix cache, the router's records, the statistics) and is dropped when the
call ends. It is handed the plan's passes and packed rows (``schedule.call_plan``), the parallel engine
(``parallel.engine``) and what the call-level checks decided (``schedule.setup``), never the groups themselves;
``schedule.rounds`` drives it through its methods.

Notation: L = row length, M = computed tokens of a pass, n = rows a pass reports, W = columns.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from sharedprefix.attention import compiled
from sharedprefix.attention.interface import PassState, pass_state
from sharedprefix.layout.frames import Frames
from sharedprefix.layout.groups import Group
from sharedprefix.layout.packing import RowLayout, pack_row
from sharedprefix.layout.tree import SegmentTree
from sharedprefix.model import mixers, router, streams
from sharedprefix.model.adapter import decoder, head_logits
from sharedprefix.model.checks import decoder_position_ids
from sharedprefix.model.head import token_logprobs
from sharedprefix.model.multimodal import Multimodal
from sharedprefix.model.positions import renumbered
from sharedprefix.parallel.engine import Engine
from sharedprefix.parallel.sequence import SequenceShard
from sharedprefix.schedule import refusals
from sharedprefix.schedule.cache import PrefixCache
from sharedprefix.schedule.call_plan import RowCache
from sharedprefix.schedule.compiled import removed
from sharedprefix.schedule.options import CallOptions
from sharedprefix.schedule.planner import Pass, Plan, Segments


@dataclasses.dataclass(frozen=True)
class CallSetup:
    """What a call decided before its first pass: ``rounds``: the round counts a lockstep engine (FSDP2) agreed;
    ``record``: record each pass's router logits; ``aux_grads``: the MoE aux loss's per-segment gradients whose
    linear term joins each pass, or None; ``layers`` / ``force_eager`` / ``whole``: the compiled path
    (``schedule.compiled.compiled_path``); ``images``: the vision tower's view of the groups, or None."""

    rounds: list[int]
    record: bool
    aux_grads: dict | None
    layers: list | None
    force_eager: bool
    whole: tuple | None
    images: Multimodal | None


class PassRunner:
    """Runs the passes of one call: handed the plan's passes and packed rows (``CallPlan.plan``, ``CallPlan.rows``),
    the parallel ``engine`` and what the call-level checks decided (``setup.CallSetup``); it holds the prefix cache
    and the call's statistics, not the groups. ``leaves``: an ``sp.backward`` (cached prompt K/V are leaves whose
    gradient is accumulated). ``source``: the groups, for a call whose groups carry ``prompt_inputs`` only (the
    vision tower reads them), else None."""

    def __init__(
        self,
        model,
        engine: Engine,
        plan: Plan,
        rows: RowCache,
        setup: CallSetup,
        options: CallOptions,
        leaves: bool,
        frames: Frames | None,
        device: torch.device,
        source=None,
        cache: PrefixCache | None = None,
    ):
        self.model, self.par, self.plan, self.rows, self.setup = (model, engine, plan, rows, setup)
        self.frames, self.device, self.source, self.mm = (frames, device, source, setup.images)
        self.backend, self.force_eager, self.layers = (options.backend, setup.force_eager, setup.layers)
        self.temperature, self.entropy = float(options.temperature), options.entropy
        self.cache = cache if cache is not None else PrefixCache(leaves=leaves)  # a step's, shared by its calls
        self.tokens = 0
        self.aux_grads = setup.aux_grads
        self.aux_term = None  # the aux loss's linear term of the latest pass that computed one under grad
        self.router_logits: list | None = [] if setup.record else None  # per pass: (logits, multiplicities, spans)
        self.last: tuple | None = None  # (state, result) of the latest pass whose forward ran (``finish_failed_round``)

    def run_pass(self, step: Pass, tree: SegmentTree | None = None, surrogate: Segments | None = None):
        """Forward of one row (inside the root module's call under FSDP2).

        Returns (state, result, layout): result is ((n, W) log-probs, (n, W) entropies or None) of the
        output rows the pass reports, or None; with ``surrogate=seg`` it is instead that segment's
        surrogate loss (see ``PrefixCache.surrogate``), computed inside the same call.
        """
        tree = tree or self.plan.tree
        own = tree is self.plan.tree  # a pass of the plan (not a lockstep engine's dummy pass)
        mixers.check_active(self.model)
        self.last = None
        cached = self.cache.segments()
        layout = self.rows.layout(step, cached) if own else pack_row(tree, list(step.segments), cached, (), step.rows)
        if not step.segments:  # a step's rows whose every value is cached (``planner.plan_step``): nothing to run
            return None, self._cached_rows(layout), layout
        if self.mm is not None and own:
            layout.blocks = self.mm.row_blocks(layout)
        seq = SequenceShard(self.par.sequence, layout.length) if self.par.sequence is not None else None
        state = PassState(layout, self.backend, self.cache, force_eager=self.force_eager, sequence=seq)

        def fn():
            hidden = self._hidden(self._decode(state, layout, own), state, layout, own, surrogate)
            lp, ent, hidden = self._predict(hidden, layout)
            return self._result(hidden, layout, lp, ent, surrogate)

        result = self.par.call(fn)
        self.last = (state, result)
        refusals.check_calls(self.model, state)
        self.tokens += layout.length if own else 0
        for s in layout.record:
            self.cache.states[s] = state
        return state, result, layout

    def _cached_rows(self, layout: RowLayout):
        """The reported rows of a pass with no token, read from the cached values: ((n, W), (n, W) or None)."""
        self.aux_term, anchor = None, self.cache.h(next(iter(self.cache.segments())))
        dtype = torch.float64 if anchor.dtype == torch.float64 else torch.float32
        ent = self._gather(layout, None, 1, dtype, anchor) if self.entropy else None
        return self._gather(layout, None, 0, dtype, anchor), ent

    def _decode(self, state: PassState, layout: RowLayout, own: bool):
        """The decoder over the packed row under the pass's attention state: its output (``last_hidden_state``)."""
        hook = None
        if self.layers is not None:  # compiled decoder layers: the pass's handle, and the cached K/V's gradients
            compiled.register(state, self.layers)
            if (bridge := compiled.bridge(state, self.layers, self.cache.read_kv)) is not None:
                hook = self.model.get_input_embeddings().register_forward_hook(bridge)
        with pass_state(state), removed(hook):
            if self.mm is not None and own:  # the vision tower runs for this row's prompts
                extra = {k: v.to(self.device) for k, v in self.mm.inputs(layout, self.source).items()}
                ids, pos = (layout.input_ids.to(self.device), self.mm.positions(layout).to(self.device))
                return self.mm.module(input_ids=ids, position_ids=pos, use_cache=False, **extra)
            shard = state.sequence.shard if state.sequence is not None else (lambda t: t)  # (..., L) -> this rank's
            dec = decoder(self.model)
            positions = shard(decoder_position_ids(self.model, layout)).to(self.device)
            routed = self.router_logits is not None or self.aux_grads is not None
            routed = routed or bool(self.cache.routed.intersection(layout.segments))  # a step's shared segments
            with (
                renumbered(self.model, dec, positions) as kw,
                streams.framed(self.model, dec, self.frames),
                router.recording(self.model, routed),
            ):
                return dec(input_ids=shard(layout.input_ids).to(self.device), use_cache=False, **kw)

    def _hidden(self, out, state: PassState, layout: RowLayout, own: bool, surrogate: Segments | None) -> torch.Tensor:
        """(L, d) hidden states of the whole row; the router's records and the recorded segments' last states kept."""
        hidden = out.last_hidden_state[0]  # (L, d), or (Ls, d) of this rank's tokens
        if state.sequence is not None:
            hidden = state.sequence.gather(hidden)
        self.aux_term = None
        if own and (shared := self.cache.routed.intersection(layout.segments)):  # a step's, each microbatch's term
            self.cache.write_router(out.router_logits, [sp for sp in router.spans(layout) if sp[0] in shared])
            own = False  # (``schedule.step_aux``)
        if self.router_logits is not None and own:
            self.router_logits.append((out.router_logits, router.multiplicity(layout), router.spans(layout)))
        if self.aux_grads is not None and own and torch.is_grad_enabled():
            self.aux_term = router.linear_term(out.router_logits, router.spans(layout), self.aux_grads, 1.0)
            if surrogate is None and layout.record:  # a recorded prompt: its term joins its deferred backward
                self.cache.add_term(layout.record[0], self.aux_term)
                self.aux_term = None
        for s in layout.record:
            self.cache.write_h(s, hidden[layout.row_end[s] - 1])
        return hidden

    def _predict(self, hidden: torch.Tensor, layout: RowLayout):
        """(M,) log-probs and entropies (or None) of the row's computed tokens, the recorded segments' kept; and the
        hidden states (tied to the head by a zero under a lockstep engine when the row predicts nothing)."""
        if not layout.targets.numel():
            if self.par.lockstep:
                # FSDP2 may shard the output head as a unit of its own (verl does): every rank's pass must run it,
                # forward and backward, whatever this rank's pass predicts, or the ranks' collectives differ.
                # One row of logits, times zero: adds exactly nothing.
                hidden = hidden + (head_logits(self.model, hidden[-1:]).sum() * 0.0).to(hidden.dtype)
            return None, None, hidden
        sources = [hidden] + [self.cache.h(s)[None] for s in layout.h_sources]
        pred = (torch.cat(sources) if len(sources) > 1 else hidden).index_select(0, layout.pred_index.to(hidden.device))
        targets = layout.targets.to(hidden.device)
        if self.frames is not None:  # (M,) frame ids -> (M, K) codes, one per head; pads add nothing
            targets = self.frames.codes(targets)
        ignore = streams.pad_id(self.model) if self.frames else None
        lp, ent = token_logprobs(self.model, pred, targets, self.temperature, self.entropy, ignore=ignore)
        for s in layout.record:
            if s in layout.value_slot:
                a, b = layout.value_slot[s]
                self.cache.write_values(s, lp[a:b], ent[a:b] if ent is not None else None)
        return lp, ent, hidden

    def _result(self, hidden, layout: RowLayout, lp, ent, surrogate: Segments | None):
        """What the pass returns: a segment's surrogate loss, or the reported rows' (n, W) values, or None."""
        if surrogate is not None:
            through = self.par.backward_through_outputs or self.layers is not None
            sur = self.cache.surrogates(surrogate, through)
            if self.aux_term is not None:
                sur, self.aux_term = ((self.aux_term if sur is None else sur + self.aux_term), None)
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

    def seal(self, segments, keep_graph: bool) -> None:
        """The recorded ``segments``' cache entries complete (``keep_graph``: their forward's graph is kept)."""
        for s in segments:
            self.cache.seal(s, keep_graph=keep_graph)

    def release(self, segments) -> None:
        for s in segments:
            self.cache.release(s)

    def prefix_backward(self, seg: Segments, recompute: bool, hooks) -> None:
        """A cached segment's deferred backward: its forward again with grad (``recompute``), or its kept graph
        (its offloaded activations brought back first by ``hooks``), given the gradients its readers accumulated.
        ``seg`` a tuple: segments one pass recorded together, one backward for all (``PrefixBackward.together``)."""
        segs = seg if isinstance(seg, tuple) else (seg,)
        if recompute:
            state, sur, _ = self.run_pass(Pass(segs, record=segs), surrogate=segs)
        else:
            state = self.cache.states[segs[0]]
            sur = self.cache.surrogates(segs, through=self.layers is not None)  # compiled: dK, dV at the layers
            if hooks is not None:  # start bringing the offloaded activations back before the backward needs them
                hooks.prefetch()
        if sur is not None:
            with pass_state(state):
                self.par.backward(sur)

    def backward(self, state: PassState, loss: torch.Tensor) -> None:
        """The backward of ``loss`` inside pass ``state``'s attention context (None: a pass that ran no token)."""
        with pass_state(state) if state is not None else contextlib.nullcontext():
            self.par.backward(loss)

    def take_aux_term(self):  # the MoE aux loss's linear term of the latest pass (or None), handed over once
        term, self.aux_term = self.aux_term, None
        return term

    def router_records(self) -> list | None:  # per pass: (router logits, multiplicities, spans), or None
        return self.router_logits

    def tokens_computed(self) -> int:
        return self.tokens

    def agreed_rounds(self) -> list[int]:
        """The round counts a lockstep engine's ranks agreed on (``CallSetup.rounds``)."""
        return self.setup.rounds

    def compile_context(self) -> tuple | None:
        """A model compiled as a whole: what ``compiled.whole_compiled`` needs for the call (``CallSetup.whole``)."""
        return self.setup.whole

    def dummy_round(self, grad: bool) -> None:
        """A 2-token pass that takes part in a lockstep engine's (FSDP2's) collectives and adds exactly zero to every
        gradient."""
        tree = SegmentTree([Group([0], [[0]])])
        with torch.set_grad_enabled(grad):
            state, res, _ = self.run_pass(Pass((0, 1), rows=(0,)), tree=tree)
            if grad:
                with pass_state(state):
                    self.par.backward(res[0].sum() * 0.0)
