"""One optimizer step over the trainer's own microbatches (``sp.plan_step``): the seed's schedule across calls.

A trainer that accumulates gradients splits a step's rows into microbatches of its own (TRL's micro-steps, verl's
micro-batches), so the rows of one prompt fall in several of them. ``plan_step`` plans them together over one segment
tree (``planner.plan_step``): the segments that rows of two or more microbatches pass through (the prompts, a shared
system prompt, a shared conversation turn) are *shared*; each is computed once for the step, by the step's first call,
and cached as leaves (per-layer K/V, last hidden state, token values, a hybrid's mixer states: ``schedule.cache``);
each microbatch's call (``sp.backward``, or ``sp.logprobs`` with grad, deferred) computes only its own segments,
reads the cache and accumulates the shared segments' gradients on its leaves; and the step's last microbatch runs
their backward once, inside its own call (its engine's gradient synchronisation at the accumulation boundary
includes it). A budget-split ``sp.backward`` is the same schedule with one microbatch, whose passes the planner
chooses: ``planner.plan_tree``.

What a step holds between its calls: the shared segments' cache (their K/V; under ``prefix_activations="keep"``
their activations too, "offload" moves those to host memory, "recompute" keeps none and runs their forward again
at the end) and, for the microbatches that ran, the gradients accumulated on those leaves.

The rules (each refused with its reason, never silent):

- **Hooks.** A plain accumulation runs each parameter's hooks once per microbatch on that microbatch's gradient; a
  step delivers the shared prompts' share at its last microbatch, so parameter tensor hooks and post-accumulate-grad
  hooks would see other values: refused at the step's first call, naming them.
- **Failure.** A call that raises leaves ``.grad`` as the plain accumulation of the microbatches that ran before it
  would have it: its own contribution is rolled back (as for any call), and the shared prompts' share of the
  microbatches that completed is delivered (their forward run again with grad, their accumulated gradient pushed
  through it); then the cache is released and the step closed.
- **Bookkeeping.** A microbatch run twice, run after its step finished or failed, or run while another step of the
  model is under way is refused; so is a call after the parameters changed in place inside a step (an optimizer
  step before the last microbatch). A step whose microbatches did not all run (training stopped mid-step, a loop that
  skipped one) is named by the model's next step, and by its next call once the parameters changed;
  ``Step.finish`` delivers the share of the microbatches that ran and ``Step.release`` drops it.

Notation: K = microbatches of the step, n_k = rows of microbatch k, W_k = its longest row in columns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Sequence

import torch

from sharedprefix.layout.groups import Group, validate_groups
from sharedprefix.layout.rows import Tree
from sharedprefix.model import mixers, router
from sharedprefix.model.adapter import unwrap
from sharedprefix.parallel.detect import detect
from sharedprefix.schedule.cache import OffloadHooks, PrefixCache
from sharedprefix.schedule.call_plan import CallPlan
from sharedprefix.schedule.planner import Plan, StepPlan, plan_step

# the model's step under way (its first call ran, its last not yet): one per model
_OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Microbatch:
    """Microbatch ``k`` of ``step``: what ``sp.logprobs`` / ``sp.backward`` take in place of its rows. Results are
    (n_k, W_k), its rows in the order it was given them."""

    step: Step
    k: int

    def __repr__(self) -> str:
        return f"Microbatch({self.k} of {len(self.step.views)}, {len(self.step.views[self.k].rows)} rows)"


@dataclasses.dataclass(frozen=True)
class StepCall:
    """What the rounds of one microbatch call need of its step (``CallPlan.step``): the step's ``cache`` (the
    call's runner reads and writes it instead of a cache of its own), its offload ``hooks``, and ``records``: the
    shared segments' recording passes this call runs (the step's first call: all of them; later calls: none)."""

    step: Step
    k: int
    records: frozenset

    @property
    def cache(self) -> PrefixCache:
        return self.step.cache

    @property
    def hooks(self) -> OffloadHooks | None:
        return self.step.hooks

    @property
    def keep_graph(self) -> bool:
        return self.step.mode != "recompute"

    def recording(self) -> contextlib.AbstractContextManager:
        """Around a shared segment's recording pass: with grad unless recomputed, its activations offloaded."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(self.keep_graph))
        if self.hooks is not None:
            stack.enter_context(self.hooks())
        return stack


class Step:
    """One optimizer step's microbatches, planned together (``sp.plan_step``); see the module docstring.

    Attributes:
        cp: the ``CallPlan`` of all the step's rows (validation, probe, fingerprint, packed rows), whose passes the
            step replaces by ``splan``'s.
        splan: the step's passes (``planner.StepPlan``).
        mode: the shared segments' ``prefix_activations``.
    """

    def __init__(self, model: torch.nn.Module, cp: CallPlan, splan: StepPlan, mode: str, offload_device):
        self.inner = weakref.ref(unwrap(model))
        self.cp, self.splan, self.mode = cp, splan, mode
        self.views = splan.views
        self.sources: list = []  # each microbatch's rows as given (a no-grad call of one runs on them)
        self.cache = PrefixCache(leaves=True)
        self.hooks = OffloadHooks(unwrap(model), offload_device) if mode == "offload" and splan.shared else None
        self.recorded = False
        self.forwarded: set[int] = set()  # deferred log-probs computed, backward not yet run
        self.done: set[int] = set()
        self.state = "planned"  # -> "open" (first call) -> "finished" | "failed" | "released"
        self.versions: tuple = ()
        self._held: list | None = None  # the shared leaves' gradients held aside by the running backward call
        self._merged = False

    def microbatch(self, k: int) -> Microbatch:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < len(self.views):
            raise ValueError(
                f"microbatch {k!r} of a step of {len(self.views)}; expected an int in [0, {len(self.views)})."
            )
        return Microbatch(self, k)

    def __len__(self) -> int:
        return len(self.views)

    @property
    def missing(self) -> list[int]:
        """The microbatches whose backward has not run."""
        return [k for k in range(len(self.views)) if k not in self.done]

    def describe(self) -> str:
        return self.splan.describe()

    # -- the calls ------------------------------------------------------------------------------------------------

    def begin(self, model: torch.nn.Module, k: int, backward: bool) -> CallPlan:
        """The ``CallPlan`` of microbatch ``k``'s call on ``model`` now (``backward``: its gradient is accumulated:
        ``sp.backward``, a deferred call's backward; else a deferred call's forward), after the step's checks."""
        inner = unwrap(model)
        self._check_call(inner, k, backward)
        if self.state == "planned":
            _refuse_hooks(inner)
            other = _OPEN.get(inner)
            if other is not None and other is not self:
                other.refuse_unfinished("a new step's first call")
            _OPEN[inner] = self
            self.state = "open"
            self.versions = _versions(inner)
        steps: list = []
        records: frozenset = frozenset()
        if not self.recorded:
            steps += self.splan.record
            records = frozenset(self.splan.record)
        steps += list(self.splan.microbatches[k])
        if backward and self.done | {k} == set(range(len(self.views))):
            steps += self.splan.backward
        plan = Plan(self.splan.tree, steps, self.splan.max_tokens, self.views[k])
        return dataclasses.replace(self.cp, plan=plan, step=StepCall(self, k, records))

    def run(self, model, sc: StepCall, backward: bool, fn):
        """``fn()`` (the call's rounds) as microbatch ``sc.k``'s call: on success the step's bookkeeping (its shared
        segments recorded, the microbatch done, the step finished at its last); on failure the step closed as the
        module docstring says, and the error raised. A backward's gradients on the shared leaves are a transaction
        of their own: held aside at the start, added back at the end or before the step's prefix backward
        (``merge_held``), restored on failure."""
        self._held = self.cache.hold_grads() if backward else None
        self._merged = False
        try:
            out = fn()
            self.merge_held()
        except BaseException:
            if self._held is not None:
                self.cache.restore_grads(self._held)
            self._held, self._merged = None, False
            self._fail(model)
            raise
        if sc.records:
            self.recorded = True
        if not backward:
            self.forwarded.add(sc.k)
            return out
        self.forwarded.discard(sc.k)
        self.done.add(sc.k)
        if len(self.done) == len(self.views):
            self._close("finished")
        return out

    def merge_held(self) -> None:
        """The gradients the earlier microbatches accumulated on the shared leaves, added to this call's (out of
        place: the held tensors stay as they were, for a failure's restore); once per call."""
        if self._held is not None and not getattr(self, "_merged", False):
            self.cache.merge_grads(self._held)
            self._merged = True

    # -- ending a step early ----------------------------------------------------------------------------------

    def finish(self, model: torch.nn.Module) -> None:
        """End the step now: the shared prompts' gradient of the microbatches that ran is delivered into ``.grad``
        (their forward run again with grad), so that ``.grad`` is the plain accumulation of those microbatches; the
        cache is released. For a loop that stops mid-step on purpose."""
        if self.state in ("finished", "failed", "released"):
            return
        self._deliver_partial(model)
        self._close("finished")

    def release(self) -> None:
        """End the step now and drop its cache: the shared prompts' gradient of the microbatches that ran is *not*
        delivered (``.grad`` then holds only their own segments' share)."""
        if self.state not in ("finished", "failed"):
            self._close("released")

    def refuse_unfinished(self, where: str) -> None:
        """Raise: this step was left with microbatches that never ran."""
        raise RuntimeError(
            f"{where} found an earlier sp.plan_step step of this model unfinished: microbatch(es) {self.missing} of "
            f"{len(self.views)} never ran their backward, so the shared prompts' gradient of the ones that ran "
            f"({sorted(self.done)}) was never delivered and an optimizer step since would have missed it. Run every "
            "microbatch of a step (sp.backward(model, step.microbatch(k), ...) for each k), or end it explicitly: "
            "step.finish(model) delivers the share of the microbatches that ran, step.release() drops it."
        )

    # -- internals ---------------------------------------------------------------------------------------------

    def _check_call(self, inner, k: int, backward: bool) -> None:
        own = self.inner()
        if own is not inner:
            raise ValueError(
                f"microbatch {k} of a step planned for another model than this {type(inner).__name__}: a step caches "
                "its model's prompts and accumulates into its parameters. Plan a step for this model with "
                "sp.plan_step(model, microbatches)."
            )
        if self.state in ("finished", "failed", "released"):
            raise RuntimeError(
                f"microbatch {k} run after its step {self.state}: a step's shared prompts are backpropagated once, at "
                "its last microbatch (or at a failure), and then released. Plan the next step with sp.plan_step."
            )
        other = _OPEN.get(inner)
        if other is not None and other is not self:
            raise RuntimeError(
                f"microbatch {k} belongs to a step other than the one under way on this model (its microbatches "
                f"{sorted(other.done)} ran, {other.missing} missing): the rows of two steps cannot mix. Finish that "
                "step first (or step.finish(model) / step.release() it)."
            )
        if k in self.done or (not backward and k in self.forwarded):
            raise RuntimeError(
                f"microbatch {k} of this step already ran{'' if backward else ' its log-probs'}: each microbatch runs "
                "once per step (a plain accumulation would add its gradient twice). Plan a new step to train on it "
                "again."
            )
        if self.state == "open":
            _check_versions(inner, self.versions, k)

    def _fail(self, model) -> None:
        """After a call of the step raised: deliver the completed microbatches' shared share, release, close."""
        try:
            self._deliver_partial(model)
        finally:
            self._close("failed")

    def _deliver_partial(self, model) -> None:
        """The shared segments' backward with the gradients the completed microbatches accumulated, their forward
        run again with grad (whatever the mode: a failed call may have consumed a kept graph). A lockstep engine's
        ranks (FSDP2: an error in a call is raised on every rank) all run it, with nothing to compute where a rank
        has nothing to deliver, so that their collectives match."""
        lockstep = detect(model, unwrap(model)).lockstep
        if not self.done or not (lockstep or (self.recorded and self.splan.shared)):
            return
        from sharedprefix.schedule import rounds  # (rounds imports this module's types only)

        steps = list(self.splan.backward) if self.recorded else []
        plan = Plan(self.splan.tree, steps, self.splan.max_tokens, self.views[0])
        cp = dataclasses.replace(self.cp, plan=plan, step=StepCall(self, -1, frozenset()))
        opts = self.cp.options.replace(prefix_activations="recompute", sync=False, entropy=False)
        with torch.enable_grad():
            rounds.backward(model, cp, opts, _no_rows)

    def _close(self, state: str) -> None:
        for s in list(self.cache.segments()):
            self.cache.release(s)
        self.state = state
        inner = self.inner()
        if inner is not None and _OPEN.get(inner) is self:
            del _OPEN[inner]


def _no_rows(batch):
    raise RuntimeError("a step's prefix backward reports no rows; this is a bug.")


def _versions(inner) -> tuple:
    return tuple((p, p._version) for p in inner.parameters() if p.requires_grad)


def _check_versions(inner, versions: tuple, k: int) -> None:
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


def _refuse_hooks(inner) -> None:
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
    step = _OPEN.get(inner)
    if step is None:
        return
    if any(p._version != v for p, v in step.versions):
        step.refuse_unfinished("this call (after the parameters changed)")


# -- planning ---------------------------------------------------------------------------------------------------


def combine(microbatches) -> tuple[list[Group] | Tree, list[list[int]]]:
    """All rows of the step as one source (groups with the same prompt and prompt inputs merged into one group; a
    ``Tree`` of every row) and, per microbatch, its rows' indices in that source's output rows, in its own order."""
    if isinstance(microbatches, (Tree, Group)) or not isinstance(microbatches, Sequence) or not microbatches:
        raise TypeError(
            f"microbatches is a {type(microbatches).__name__}; expected a non-empty list with one entry per microbatch "
            "of the step, each a list of sp.Group or an sp.Tree."
        )
    trees = [isinstance(m, Tree) for m in microbatches]
    if any(trees) and not all(trees):
        raise TypeError(
            f"microbatches mixes sp.Tree ({trees.count(True)}) and lists of groups ({trees.count(False)}); expected "
            "one kind for the whole step (Tree.from_rows turns groups' rows into a tree)."
        )
    if all(trees):
        rows: list[torch.Tensor] = []
        trained: list[torch.Tensor] = []
        members: list[list[int]] = []
        for m in microbatches:
            members.append(list(range(len(rows), len(rows) + len(m.rows))))
            rows += [r.clone() for r in m.rows]
            trained += [t.clone() for t in m.trained]
        return Tree(tuple(rows), tuple(trained)), members
    merged: dict[tuple, int] = {}
    prompts: list[Group] = []
    comps: list[list[torch.Tensor]] = []
    where: list[list[tuple[int, int]]] = []
    for m in microbatches:
        groups = validate_groups(m)
        mine = []
        for g in groups:
            key = _group_key(g)
            if key not in merged:
                merged[key] = len(prompts)
                prompts.append(g)
                comps.append([])
            gi = merged[key]
            for c in g.completions:
                mine.append((gi, len(comps[gi])))
                comps[gi].append(c.clone())
        where.append(mine)
    groups = [Group(g.prompt.clone(), cs, prompt_inputs=_copied(g.prompt_inputs)) for g, cs in zip(prompts, comps)]
    offset = [0]
    for cs in comps:
        offset.append(offset[-1] + len(cs))
    return groups, [[offset[gi] + j for gi, j in mine] for mine in where]


def _group_key(g: Group) -> tuple:
    def digest(t):
        t = t.detach().cpu().contiguous()
        return (
            str(t.dtype),
            tuple(t.shape),
            t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes(),
        )

    inputs = tuple(
        sorted((k, digest(v) if isinstance(v, torch.Tensor) else repr(v)) for k, v in (g.prompt_inputs or {}).items())
    )
    return digest(g.prompt), inputs


def _copied(inputs):
    if not inputs:
        return inputs
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def refuse_engine(model) -> None:
    """What a step cannot run on: refused when it is planned."""
    inner = unwrap(model)
    engine = detect(model, inner)
    why = engine.step_refusal()
    if why is None and engine.tensor > 1:
        why = f"tensor parallelism (tp_size={engine.tensor}), whose gradient all-reduce is a post-accumulate hook"
    if why is None and mixers.on_cache_path(inner):
        why = f"{type(inner).__name__}, a hybrid model on the cache path (it runs group by group, with no prefix cache)"
    if why is None and router.enabled(inner):
        why = "an MoE load-balancing loss (output_router_logits=True), which is each microbatch's own"
    if why is not None:
        raise ValueError(
            f"sp.plan_step is not available with {why}: a step runs each shared prompt once across several calls, "
            "which sharedprefix has verified on one process, under DDP and under FSDP2. Run each microbatch as its own "
            "call (sp.backward(model, rows, ...)): exact, each prompt once per microbatch."
        )


def make_step(model, microbatches: Sequence, cp_of, options: dict) -> Step:
    """``sp.plan_step``: the step of ``microbatches`` on ``model``; ``cp_of(source)``: the ``CallPlan`` of all its rows
    (``sp.plan_call``'s)."""
    refuse_engine(model)
    if options.get("sequence_group") is not None:
        raise ValueError(
            "sp.plan_step got a sequence_group: a step is not available with Ulysses sequence parallelism. Run each "
            "microbatch as its own call with sequence_group."
        )
    inner = unwrap(model)
    other = _OPEN.get(inner)
    if other is not None:
        other.refuse_unfinished("sp.plan_step")
    source, members = combine(microbatches)
    cp = cp_of(source)
    splan = plan_step(cp.plan.tree, members, cp.options.max_tokens)
    mode = cp.options.prefix_activations
    step = Step(model, cp, splan, mode, cp.options.offload_device)
    step.sources = list(microbatches)
    return step
