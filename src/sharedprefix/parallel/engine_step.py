"""What a step of ``sp.plan_step`` (``schedule.step``) asks of a call's engine: whether steps run on it at all, and
what an engine that accumulates over micro-steps of its own (DeepSpeed) adds to the step's rules. Mixed into
``parallel.engine.Engine``; the defaults are every engine's that runs steps without further rules (one process, DDP,
FSDP2)."""

from __future__ import annotations

from typing import ClassVar


class StepTerms:
    step_refusal: ClassVar[str | None] = None  # why ``sp.plan_step``'s steps cannot run on it, in words (None: can)
    # why a step's microbatch cannot keep its log-probs' graph (``sp.logprobs(..., defer=False)``), in words
    step_graph_refusal: ClassVar[str | None] = None
    # why a step cannot carry the MoE load-balancing loss (``schedule.step_aux``), in words (None: it can)
    step_aux_refusal: ClassVar[str | None] = None
    # the engine accumulates over micro-steps of its own and reduces as it pleases (DeepSpeed): a failed step's
    # partial share is delivered as a call of its own (sync=True), not added unsynchronised
    accumulates_itself: ClassVar[bool] = False
    # the parameters' data stay where they are between a step's calls, so that a step can tell ``p.data = ...`` (which
    # leaves the version counter) by its address; not where the engine moves them itself (FSDP2's reshard and unshard,
    # DeepSpeed ZeRO-3's partitions)
    data_in_place: ClassVar[bool] = True

    def step_clock(self) -> object:
        """A value that changes where the engine updates the parameters without their version counters changing
        (DeepSpeed writes its partitions, not the parameters): a step's later calls must find it unchanged (None:
        the version counters tell)."""
        return None

    def check_step(self, count: int) -> None:
        """Refuse a step of ``count`` microbatches whose first call runs now where the engine would update the
        parameters before the step's last microbatch (an accumulation boundary inside the step): none here."""
        return None

    def own_grad_hooks(self) -> frozenset[int]:
        """The ids of the post-accumulate-grad hooks the engine set on the parameters itself, which a step leaves to
        it (DeepSpeed's reduction into its partitions: linear in the gradient it is given, so a step that delivers
        the shared prompts' share at its last microbatch gets the same sum); other hooks a step refuses."""
        return frozenset()

    def delivery_scale(self) -> float:
        """The factor a call's gradient is multiplied by where ``finish_grads`` delivers it (1 here; DeepSpeed:
        ``engine.backward``'s 1 / gradient_accumulation_steps). A deferred call's gradient carries the caller's own
        scaling already, so a step's shared prompts must be delivered in one of the two units, not a mix."""
        return 1.0
