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

What a step holds between its calls: the shared segments' cache (their K/V; their activations under "keep", on the
host under "offload", none under "recompute") and the gradients its microbatches accumulated on those leaves.

The rules (each refused with its reason, never silent):

- **Hooks.** A plain accumulation runs each parameter's hooks once per microbatch on that microbatch's gradient; a
  step delivers the shared prompts' share at its last microbatch, so parameter tensor hooks and post-accumulate-grad
  hooks would see other values: refused at each of the step's calls (its first, and one registered since), named.
- **Failure.** A call that raises leaves ``.grad`` as the plain accumulation of the earlier microbatches: its own
  contribution rolled back, the completed microbatches' shared share delivered (their forward run again with grad,
  their gradient pushed through it; if that raises, the call's error gets a note); the cache released, the step closed.
- **Bookkeeping.** A microbatch run twice, run after its step finished or failed, or run while another step of the
  model is under way is refused; so is a call after the parameters changed inside a step (an optimizer step before
  the last microbatch: ``step_rules.changed``), their ``requires_grad`` or the autocast changed, or ``.grad`` was
  cleared. A step whose microbatches did not all run (training stopped mid-step, a loop that skipped one) is named by
  the model's next step, and by its next call once the parameters changed; ``Step.finish`` delivers the share of the
  microbatches that ran and ``Step.release`` drops it.

Modules: ``step`` (the step), ``step_rules`` (its rules), ``step_graph`` (log-probs that keep their graph),
``step_make`` (planning, ``SplitStep``), ``step_plan`` (its passes), ``step_calls`` (the public calls).
Notation: K = microbatches of the step, n_k = rows of microbatch k, W_k = its longest row in columns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch

from sharedprefix.model.adapter import unwrap
from sharedprefix.parallel.detect import detect
from sharedprefix.schedule import rounds, step_rules
from sharedprefix.schedule.cache import PrefixCache
from sharedprefix.schedule.call_plan import CallPlan
from sharedprefix.schedule.offload import OffloadHooks
from sharedprefix.schedule.planner import Plan
from sharedprefix.schedule.step_plan import StepPlan
from sharedprefix.schedule.step_rules import OPEN, check_index, check_open, refuse_hooks


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

    def recording(self) -> contextlib.AbstractContextManager:
        """Around a shared segment's recording pass: with grad unless recomputed, its activations offloaded."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(self.step.mode != "recompute"))
        stack.enter_context(self.hooks() if self.hooks is not None else contextlib.nullcontext())
        return stack


class Step:
    """One optimizer step's microbatches, planned together (``sp.plan_step``; the module docstring). ``cp``: the
    ``CallPlan`` of all its rows (validation, probe, fingerprint, packed rows), whose passes the step replaces by
    ``splan``'s (``planner.StepPlan``); ``mode``: the shared segments' ``prefix_activations``; ``aux``: their router
    logits are cached, for the MoE load-balancing loss of its microbatches."""

    def __init__(self, model, cp: CallPlan, splan: StepPlan, mode: str, offload_device, offset=0, aux=False):
        self.inner = weakref.ref(unwrap(model))
        self.offset = offset  # its first microbatch's index in a ``SplitStep`` (0 otherwise), for messages
        self.cp, self.splan, self.mode = cp, splan, mode
        self.views = splan.views
        self.sources: list = []  # each microbatch's rows as given (a no-grad call of one runs on them)
        self.cache = PrefixCache(leaves=True)
        self.aux, self.cache.routed = aux, frozenset(splan.shared if aux else ())  # (MoE aux loss: ``step_aux``)
        self.hooks = OffloadHooks(unwrap(model), offload_device) if mode == "offload" and splan.shared else None
        self.recorded = False
        self.forwarded: set[int] = set()  # deferred log-probs computed, backward not yet run
        self.done: set[int] = set()
        self.state = "planned"  # -> "open" (first call) -> "finished" | "failed" | "released"
        self.versions = step_rules.Stamp(())  # the parameters at the first call (``step_rules.stamp``)
        self.deferred: bool | None = None  # its microbatches' backward: deferred log-probs' (or sp.backward's)
        self._held: list | None = None  # the shared leaves' gradients held aside by the running backward call
        self._merged = False  # (``merge_held``)

    def microbatch(self, k: int) -> Microbatch:
        return Microbatch(self, check_index(k, len(self.views)))

    def __len__(self) -> int:
        return len(self.views)

    def part_of(self, k: int) -> tuple[Step, int]:
        """The ``Step`` that runs microbatch ``k`` and its index there (a ``SplitStep``'s part; here: itself)."""
        return self, k

    @property
    def missing(self) -> list[int]:  # the microbatches whose backward has not run
        return [self.offset + k for k in range(len(self.views)) if k not in self.done]

    @property
    def ran(self) -> list[int]:  # the microbatches whose backward ran
        return sorted(self.offset + k for k in self.done)

    def describe(self) -> str:
        return self.splan.describe()

    def begin(self, model: torch.nn.Module, k: int, backward: bool, deferred: bool = False) -> CallPlan:
        """The ``CallPlan`` of microbatch ``k``'s call on ``model`` now (``backward``: its gradient is accumulated:
        ``sp.backward``, a ``deferred`` call's backward; else a deferred call's forward), after the step's checks."""
        inner = unwrap(model)
        self._check_call(model, inner, k, backward, forward=not (backward and deferred))
        refuse_hooks(model, inner)  # (at every call: a hook registered after the first sees other values too)
        if self.state == "planned":
            other = OPEN.get(inner)
            if other is not None and other is not self:
                other.refuse_unfinished("a new step's first call")
            detect(model, inner).check_step(len(self.views))  # (DeepSpeed: within its accumulation window)
            OPEN[inner] = self
            self.state = "open"
            self.versions = step_rules.stamp(model)
        step_rules.check_delivery(self, model, deferred or not backward, k + self.offset)  # (a forward: deferred)
        records: frozenset = frozenset() if self.recorded else frozenset(self.splan.record)
        steps: list = ([] if self.recorded else list(self.splan.record)) + list(self.splan.microbatches[k])
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
        except BaseException as error:
            if self._held is not None:
                self.cache.restore_grads(self._held)
            self._held, self._merged = None, False
            self.fail(model, error)
            raise
        if sc.records:
            self.recorded = True
        if not backward:
            self.forwarded.add(sc.k)
            return out
        self.forwarded.discard(sc.k)
        self.done.add(sc.k)
        step_rules.mark_grads_after(self, model)
        if len(self.done) == len(self.views):
            self.close("finished")
        return out

    def merge_held(self) -> None:
        """The gradients the earlier microbatches accumulated on the shared leaves, added to this call's (out of
        place: the held tensors stay as they were, for a failure's restore); once per call."""
        if self._held is not None and not self._merged:
            self.cache.merge_grads(self._held)
            self._merged = True

    def finish(self, model: torch.nn.Module) -> None:
        """End the step now: the shared prompts' gradient of the microbatches that ran is delivered into ``.grad``
        (their forward run again with grad), so that ``.grad`` is the plain accumulation of those microbatches; the
        cache is released. For a loop that stops mid-step on purpose."""
        if self.state in ("finished", "failed", "released"):
            return
        self._deliver_partial(model)
        self.close("finished")

    def release(self) -> None:
        """End the step now and drop its cache: the shared prompts' gradient of the microbatches that ran is *not*
        delivered (``.grad`` then holds only their own segments' share)."""
        if self.state not in ("finished", "failed"):
            self.close("released")

    def refuse_unfinished(self, where: str) -> None:
        """Raise: this step was left with microbatches that never ran."""
        raise RuntimeError(
            f"{where} found an earlier sp.plan_step step of this model unfinished: microbatch(es) {self.missing} of "
            f"{len(self.views)} never ran their backward, so the shared prompts' gradient of the ones that ran "
            f"({self.ran}) was never delivered and an optimizer step since would have missed it. Run every "
            "microbatch of a step (sp.backward(model, step.microbatch(k), ...) for each k), or end it explicitly: "
            "step.finish(model) delivers the share of the microbatches that ran, step.release() drops it."
        )

    def _check_call(self, model, inner, k: int, backward: bool, forward: bool) -> None:
        g = k + self.offset  # its index in the user's list
        own = self.inner()
        if own is not inner:
            raise ValueError(
                f"microbatch {g} of a step planned for another model than this {type(inner).__name__}: a step caches "
                "its model's prompts and accumulates into its parameters. Plan a step for this model with "
                "sp.plan_step(model, microbatches)."
            )
        if self.state in ("finished", "failed", "released"):
            raise RuntimeError(
                f"microbatch {g} run after its step {self.state}: a step's shared prompts are backpropagated once, at "
                "its last microbatch (or at a failure), and then released. Plan the next step with sp.plan_step."
            )
        other = OPEN.get(inner)
        if other is not None and other is not self:
            raise RuntimeError(
                f"microbatch {g} belongs to a step other than the one under way on this model (its microbatches "
                f"{other.ran} ran, {other.missing} missing): the rows of two steps cannot mix. Finish that "
                "step first (or step.finish(model) / step.release() it)."
            )
        if k in self.done or (not backward and k in self.forwarded):
            raise RuntimeError(
                f"microbatch {g} of this step already ran{'' if backward else ' its log-probs'}: each microbatch runs "
                "once per step (a plain accumulation would add its gradient twice). Plan a new step to train on it "
                "again."
            )
        if self.state == "open":
            check_open(self, model, g, forward)

    def fail(self, model, error: BaseException) -> None:
        """After a call raised ``error``: the completed microbatches' shared share delivered (else noted on it; Python
        3.10 has no notes: the delivery's error raised, ``error`` its context); the caller raises ``error``."""
        try:
            self._deliver_partial(model)
        except Exception as e:
            if not hasattr(error, "add_note"):
                raise
            error.add_note(
                f"sharedprefix: .grad lacks the completed microbatches' shared share ({e!r}); skip this step"
            )
        finally:
            self.close("failed")

    def _deliver_partial(self, model) -> None:
        """The shared segments' backward with the gradients the completed microbatches accumulated, their forward
        run again with grad (whatever the mode: a failed call may have consumed a kept graph). A lockstep engine's
        ranks (FSDP2: an error in a call is raised on every rank) all run it, with nothing to compute where a rank
        has nothing to deliver, so that their collectives match."""
        engine = detect(model, unwrap(model))
        if not self.done or not (engine.lockstep or (self.recorded and self.splan.shared)):
            return
        if self.deferred and engine.delivery_scale() != 1.0:  # the leaves hold the caller's scaled gradient already
            self.cache.scale_grads(1.0 / engine.delivery_scale())
        self.shared_backward(model, 0, "recompute", sync=engine.accumulates_itself)

    def shared_backward(self, model, k: int, mode: str, sync: bool) -> None:
        """The shared segments' backward (one round per recording pass, ``StepPlan.backward``) with the gradients on
        their leaves, delivered into ``.grad`` as a call of microbatch ``k`` under prefix ``mode`` (nothing to compute
        before they were recorded: a lockstep engine's rank then only takes part in the collectives)."""
        steps = list(self.splan.backward) if self.recorded else []
        plan = Plan(self.splan.tree, steps, self.splan.max_tokens, self.views[k])
        cp = dataclasses.replace(self.cp, plan=plan, step=StepCall(self, k, frozenset()))
        opts = self.cp.options.replace(prefix_activations=mode, sync=sync, entropy=False)
        with torch.enable_grad():
            rounds.backward(model, cp, opts, no_rows)

    def close(self, state: str) -> None:
        """Release the cache; the step is ``state`` and no longer the model's step under way."""
        for s in list(self.cache.segments()):
            self.cache.release(s)
        self.state = state
        inner = self.inner()
        if inner is not None and OPEN.get(inner) is self:
            del OPEN[inner]


def no_rows(batch):
    raise RuntimeError("a step's prefix backward reports no rows; this is a bug.")
