"""``sp.plan_step``'s planning (``schedule.step``): the microbatches' rows as one source (``combine``: groups with the
same prompt and prompt inputs merged, a tree of every row), the engines a step cannot run on (``refuse_engine``), the
step's plan (``make_step``), and a step bounded by ``max_cached_tokens`` run in parts (``SplitStep``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sharedprefix.layout.groups import Group, validate_groups
from sharedprefix.layout.rows import Tree
from sharedprefix.model import mixers, router
from sharedprefix.model.adapter import unwrap
from sharedprefix.parallel.detect import detect
from sharedprefix.parallel.tensor import step_refusal as tensor_step_refusal
from sharedprefix.schedule.step import Microbatch, Step
from sharedprefix.schedule.step_plan import StepPlan, plan_step
from sharedprefix.schedule.step_rules import OPEN, check_index


def combine(microbatches) -> tuple[list[Group] | Tree, list[list[int]]]:
    """All rows of the step as one source (groups with the same prompt and prompt inputs merged into one group; a
    ``Tree`` of every row) and, per microbatch, its rows' indices in that source's output rows, in its own order. The
    source shares the caller's tensors: ``sp.plan_call`` plans a copy of it (``call.make_plan``)."""
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
            rows += m.rows
            trained += m.trained
        return Tree(tuple(rows), tuple(trained)), members
    merged: dict[tuple, int] = {}
    prompts: list[Group] = []
    comps: list[list[torch.Tensor]] = []
    where: list[list[tuple[int, int]]] = []
    for k, m in enumerate(microbatches):
        try:
            groups = validate_groups(m)
        except (TypeError, ValueError) as e:  # (its message names no microbatch)
            raise type(e)(f"microbatch {k} of the step: {e}") from e
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
                comps[gi].append(c)
        where.append(mine)
    groups = [Group(g.prompt, cs, prompt_inputs=g.prompt_inputs) for g, cs in zip(prompts, comps)]
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


def refuse_engine(model) -> None:
    """What a step cannot run on: refused when it is planned."""
    inner = unwrap(model)
    engine = detect(model, inner)
    why = engine.step_refusal or tensor_step_refusal(engine)
    if why is None and mixers.on_cache_path(inner):
        why = f"{type(inner).__name__}, a hybrid model on the cache path (it runs group by group, with no prefix cache)"
    if why is not None:
        raise ValueError(
            f"sp.plan_step is not available with {why}: a step holds each shared prompt's cache across several "
            "calls, which sharedprefix runs on one process, under DDP, FSDP2 and DeepSpeed ZeRO-1/2/3, for models "
            "whose calls keep a prefix cache. Run each microbatch as its own call (sp.backward(model, rows, ...)): "
            "exact, each prompt once per microbatch."
        )


def make_step(model, microbatches: Sequence, cp_of, options: dict, max_cached_tokens: int | None = None):
    """``sp.plan_step``: the step of ``microbatches`` on ``model``; ``cp_of(source)``: the ``CallPlan`` of all its rows
    (``sp.plan_call``'s). ``max_cached_tokens``: the most tokens of shared segments one step may cache; a step that
    would cache more runs as consecutive parts (``SplitStep``), each within it."""
    refuse_engine(model)
    if max_cached_tokens is not None and (
        isinstance(max_cached_tokens, bool) or not isinstance(max_cached_tokens, int) or max_cached_tokens < 0
    ):
        raise ValueError(
            f"max_cached_tokens={max_cached_tokens!r}; expected None (no bound) or a number of tokens >= 0: the most "
            "tokens of shared prompts one step holds between its calls."
        )
    inner = unwrap(model)
    other = OPEN.get(inner)
    if other is not None:
        other.refuse_unfinished("sp.plan_step")
    source, members = combine(microbatches)
    cp = cp_of(source)
    mode, device = cp.options.prefix_activations, cp.options.offload_device
    parts = _parts(cp.plan.tree, members, cp.options.max_tokens, max_cached_tokens)
    detect(model, inner).check_step(len(parts[0][1].views))  # (DeepSpeed: within its accumulation window)
    aux = _aux(model, cp)
    steps = []
    for first, splan in parts:
        step = Step(model, cp, splan, mode, device, offset=first, aux=aux)
        step.sources = list(microbatches[first : first + len(splan.views)])
        steps.append(step)
    return steps[0] if len(steps) == 1 or max_cached_tokens is None else SplitStep(steps, max_cached_tokens)


def _aux(model, cp) -> bool:
    """Whether the step's calls may take the MoE load-balancing loss (``aux_loss=True``, or left out with
    ``output_router_logits=True``): its shared segments' router logits are then cached (``schedule.step_aux``);
    refused where a step cannot carry it."""
    inner, opts = unwrap(model), cp.options
    if not (opts.aux_loss is True or (opts.aux_loss is None and router.enabled(inner))):
        return False
    engine = detect(model, inner)
    engine.check_aux_term(type(inner).__name__)  # (FSDP2 refuses the loss's per-pass term)
    why = engine.step_aux_refusal or ("a sequence_group" if opts.sequence_group is not None else None)
    if why is not None:
        raise ValueError(
            f"sp.plan_step with an MoE load-balancing loss (aux_loss={opts.aux_loss!r}, output_router_logits="
            f"{router.enabled(inner)}) under {why}: a step carries that loss on one process only. Plan the step "
            "with aux_loss=False (config.output_router_logits=False) to leave the loss out, or run each microbatch "
            "as its own call (sp.backward(model, rows, ..., aux_loss_coef=...)): exact, each prompt once per "
            "microbatch."
        )
    router.check_available(inner)
    return True


def _parts(tree, members, max_tokens, cap) -> list[tuple[int, StepPlan]]:
    """(first microbatch, plan) of each part: all microbatches in one plan, or, where its shared segments would hold
    more than ``cap`` tokens, consecutive runs of microbatches each as long as its shared tokens stay within ``cap``
    (one microbatch shares nothing)."""
    whole = plan_step(tree, members, max_tokens)
    if cap is None or whole.shared_tokens <= cap:
        return [(0, whole)]
    parts, first = [], 0
    while first < len(members):
        last = first + 1
        best = plan_step(tree, members[first:last], max_tokens)
        while last < len(members):
            more = plan_step(tree, members[first : last + 1], max_tokens)
            if more.shared_tokens > cap:
                break
            best, last = more, last + 1
        parts.append((first, best))
        first = last
    return parts


class SplitStep:
    """A step whose shared segments would cache more than ``max_cached_tokens``, run as consecutive parts, each a
    ``Step`` of its own (its shared prompts computed once for the part): the same interface as a ``Step``.
    ``parts``: the ``Step`` of each part, in order."""

    def __init__(self, parts: list[Step], max_cached_tokens: int):
        self.parts, self.max_cached_tokens = parts, max_cached_tokens
        self._at = [(p.offset, p) for p in parts]

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def microbatch(self, k: int) -> Microbatch:
        part, local = self.part_of(check_index(k, len(self)))
        return part.microbatch(local)

    def part_of(self, k: int) -> tuple[Step, int]:
        first, part = next((f, p) for f, p in reversed(self._at) if f <= k)
        return part, k - first

    @property
    def inner(self):
        return self.parts[0].inner

    @property
    def missing(self) -> list[int]:
        return [k for p in self.parts for k in p.missing]

    @property
    def state(self) -> str:
        states = {p.state for p in self.parts}
        return states.pop() if len(states) == 1 else "open"

    @property
    def tokens_cached(self) -> int:
        return max(p.splan.shared_tokens for p in self.parts)

    def describe(self) -> str:
        head = (
            f"step of {len(self)} microbatches in {len(self.parts)} parts (max_cached_tokens={self.max_cached_tokens})"
        )
        return "\n".join([head] + [f"part from microbatch {p.offset}: " + p.describe() for p in self.parts])

    def finish(self, model) -> None:
        for p in self.parts:
            p.finish(model) if p.state == "open" else p.release()

    def release(self) -> None:
        for p in self.parts:
            p.release()
