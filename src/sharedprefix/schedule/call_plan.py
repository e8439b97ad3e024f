"""Plan once, run many: ``CallPlan``, everything host-side a call computes before its first pass, frozen.

``make_plan`` (``sp.plan_call``) validates the source against the model, plans the passes under the budget, selects
the attention primitive, reads the probe's findings and runs the refusals that depend on these alone. A plan serves
any number of ``sp.logprobs`` / ``sp.backward`` calls, on the model it was made for and on every model with the same
``Fingerprint`` (the policy and its reference model, a PEFT adapter with it disabled): the old-policy, reference and
policy log-probs of one GRPO batch plan once. A plan is frozen when made: it holds its own copy of the groups or
tree (``call.make_plan``), so no in-place edit of the caller's tensors reaches it. The packed rows of its passes
(``RowLayout``, with the index tensors of their attention calls) are built from that copy on first use and kept with
the plan, so a reused plan packs nothing again; they are built outside inference mode (``layout.once.built_once``), so
that a plan first run under ``torch.inference_mode()`` serves calls with grad too.

Notation: L = row length of a pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import torch

from sharedprefix.attention import probe
from sharedprefix.attention.dynamic_mask import has_dynamic_mask
from sharedprefix.attention.kernels import AttentionKernel
from sharedprefix.layout.frames import Frames
from sharedprefix.layout.groups import Group, validate_groups
from sharedprefix.layout.once import built_once
from sharedprefix.layout.packing import RowLayout, pack_row
from sharedprefix.layout.rows import Tree
from sharedprefix.layout.tree import SegmentTree
from sharedprefix.model import streams
from sharedprefix.model.adapter import unwrap
from sharedprefix.model.checks import verify_head
from sharedprefix.parallel.detect import detect
from sharedprefix.parallel.engine import Engine
from sharedprefix.schedule import refusals
from sharedprefix.schedule.options import CallOptions
from sharedprefix.schedule.planner import Pass, Plan

# config entries that name a checkpoint or set what a forward returns, not the computation sharedprefix runs (it
# passes use_cache=False itself; TRL turns use_cache off on the policy only); the dtype is compared on the parameters.
# Dropped at every depth of ``config.to_dict()`` (a VL model's text_config and vision_config carry them too).
_NOT_COMPUTATION = {
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "architectures",
    "_commit_hash",
    "use_cache",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "torchscript",
    "dtype",
    "torch_dtype",
}
# the options a plan is made under: a call that passes another value of one of them is refused (``agree``)
PLAN_FIELDS = ("max_tokens", "backend", "sequence_group")


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What a model must share with the one a plan was made for: its transformers config class and the config's
    entries that define the computation (``to_dict`` without names, versions, private keys and what sets a
    forward's outputs, at every depth: ``_computation``), the parameters' dtype, the device the passes run on, and
    the parallel layout (engine kind, world, tensor and data sizes). ``config``: those entries as JSON, to name the
    first one that differs (not compared: the digest is)."""

    config_class: str
    config_digest: str
    dtype: str
    device: str
    engine: str
    config: str = dataclasses.field(default="{}", compare=False, repr=False)

    @classmethod
    def of(cls, inner: torch.nn.Module, engine: Engine, device: torch.device) -> Fingerprint:
        cfg = inner.config
        text = json.dumps(_computation(cfg.to_dict()), sort_keys=True, default=str)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        dtype = engine.param_dtype(next((p.dtype for p in inner.parameters()), torch.float32))
        return cls(type(cfg).__name__, digest, str(dtype), str(device), engine.layout(), text)

    def difference(self, other: Fingerprint) -> str | None:
        """Why a plan made for ``self`` cannot run on a model of ``other``, or None."""
        what = {
            "config_class": "its config class",
            "config_digest": "its configuration (config.to_dict())",
            "dtype": "its parameters' dtype",
            "device": "the device its passes run on",
            "engine": "its parallel layout",
        }
        for f, name in what.items():
            mine, theirs = getattr(self, f), getattr(other, f)
            if f == "config_digest" and mine != theirs:
                at = _first_difference(json.loads(self.config), json.loads(other.config), "config")
                if at is not None:
                    path, mine, theirs = at
                    return f"{name} differs at {path}: {theirs} here, {mine} where the plan was made"
            if mine != theirs:
                return f"{name} differs: {theirs} here, {mine} where the plan was made"
        return None


def _computation(entries: Any) -> Any:
    """``entries`` (a ``config.to_dict()``) without the keys that do not define the computation, at every depth:
    private keys and ``_NOT_COMPUTATION`` (names, versions, dtype, use_cache, ...), in sub-configs and lists too."""
    if isinstance(entries, dict):
        return {
            k: _computation(v)
            for k, v in entries.items()
            if not (isinstance(k, str) and (k.startswith("_") or k in _NOT_COMPUTATION))
        }
    if isinstance(entries, (list, tuple)):
        return [_computation(v) for v in entries]
    return entries


_ABSENT = "(absent)"


def _first_difference(mine: Any, theirs: Any, path: str) -> tuple[str, str, str] | None:
    """(the path of the first entry, in key order, where two ``_computation`` trees differ, its value in ``mine``,
    its value in ``theirs``), values as JSON; None where they are equal."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for k in sorted(set(mine) | set(theirs), key=str):
            a, b = mine.get(k, _ABSENT), theirs.get(k, _ABSENT)
            if (at := _first_difference(a, b, f"{path}.{k}")) is not None:
                return at
        return None
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if (at := _first_difference(a, b, f"{path}[{i}]")) is not None:
                return at
        return None
    if mine == theirs and type(mine) is type(theirs):
        return None
    show = lambda v: v if v is _ABSENT else json.dumps(v, sort_keys=True)  # noqa: E731
    return path, show(mine), show(theirs)


@dataclasses.dataclass(frozen=True)
class Findings:
    """What the probe of the layers found, for the refusals and the compiled path: ``calls``: the most attention
    calls of one module per forward; ``keep``: the smallest ``keep_window_size`` of a dynamic-mask (Doge) layer, or
    None; ``indexed``: a layer passes indexer-selected keys; ``nope_rescale``: a Llama 4 NoPE layer rescales its
    queries by their row index."""

    calls: int
    keep: int | None
    indexed: bool
    nope_rescale: bool

    @classmethod
    def of(cls, inner: torch.nn.Module) -> Findings:
        pats = {m: p for m in inner.modules() if (p := probe.pattern(m)) is not None}
        return cls(
            calls=max((p.calls for p in pats.values()), default=1),
            keep=min((m.keep_window_size for m in pats if has_dynamic_mask(m)), default=None),
            indexed=any(p.indexed for p in pats.values()),
            nope_rescale=any(
                getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True) for m in pats
            ),
        )


class RowCache:
    """The packed rows (``RowLayout``) of a plan's passes, each built on first use (with the index tensors of its
    attention calls, ``RowLayout.cascade``) and the same object for every later call of the plan."""

    def __init__(self, tree: SegmentTree):
        self.tree = tree
        self.built: dict[tuple[Pass, frozenset[int]], RowLayout] = {}

    def layout(self, step: Pass, cached: set[int]) -> RowLayout:
        """The packed row of ``step`` when ``cached`` segments are in the prefix cache."""
        build = lambda: pack_row(self.tree, list(step.segments), cached, step.record, step.rows)  # noqa: E731
        return built_once(self.built, (step, frozenset(cached)), build)  # no inference tensor, in any mode

    def __len__(self) -> int:
        return len(self.built)


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """One call's host-side work, done once (``sp.plan_call``).

    Attributes:
        source: the validated groups (``list[Group]``, frames as 1-D ids for a multi-stream model) or ``Tree``.
        frames: a multi-stream (MusicGen) model's frames, or None.
        plan: the passes and their order (``schedule.planner.Plan``); ``plan.tree`` the segment tree.
        options: the settings it was planned under (``PLAN_FIELDS`` must agree in every call that runs it).
        given: the settings given to ``sp.plan_call``, as (name, value) pairs: a call's default for each.
        fingerprint: what a model must share with the one it was made for (``check_model``).
        device: where the passes run; kernel: the attention primitive selected for it.
        findings: the probe's findings (``Findings``), once the model was probed (``sp.plan_call`` probes it;
            a plan made inside a call leaves them to the call, which probes first).
        images: the groups carry ``prompt_inputs``.
        refusals: the checks already run, by name, in order.
        vocab: the vocabulary the token ids were checked against (None: frames, checked by ``streams.encode``).
        step: for a call of one microbatch of ``sp.plan_step``'s step, what its rounds need of the step
            (``schedule.step.StepCall``: its cache, its offload hooks, the shared segments this call records); else
            None.
    """

    source: list[Group] | Tree
    frames: Frames | None
    plan: Plan
    options: CallOptions
    fingerprint: Fingerprint
    device: torch.device
    kernel: type[AttentionKernel]
    findings: Findings | None
    images: bool
    refusals: tuple[str, ...]
    rows: RowCache = dataclasses.field(repr=False, compare=False)
    given: tuple[tuple[str, Any], ...] = ()
    vocab: int | None = None
    step: Any = dataclasses.field(default=None, repr=False, compare=False)  # a step's microbatch call (StepCall)

    @property
    def passes(self) -> list[Pass]:
        return self.plan.passes

    @property
    def splits(self) -> bool:
        """Some group is split across passes (its prompt cached and backpropagated at the end)."""
        return self.plan.splits

    def check_vocab(self, inner: torch.nn.Module) -> None:
        """Refuse, as planning does (naming the token id and the vocabulary), to run on ``inner`` when its input
        embedding or output head holds fewer entries than the plan's ids were checked against (one replaced by a
        smaller one since, the config unchanged) and an id is outside them; a few attribute reads otherwise."""
        if self.vocab is None:
            return
        vocab = min(streams.embedding_size(inner), streams.head_vocab(inner))
        if vocab < self.vocab:
            if isinstance(self.source, Tree):
                self.source.check_vocab(vocab)
            else:
                validate_groups(self.source, vocab)


def refuse_other_model(inner: torch.nn.Module, why: str) -> None:
    """Refuse a model a plan was not made for (``why``: ``Fingerprint.difference``)."""
    raise ValueError(
        f"this CallPlan was made for another model than {type(inner).__name__}: {why}. A plan runs on the model it "
        "was made for and on models of the same configuration (a reference model, the policy with its adapter "
        "disabled); make one for this model with sp.plan_call(model, groups, ...)."
    )


def fingerprint(model: torch.nn.Module, engine: Engine | None = None) -> Fingerprint:
    """The ``Fingerprint`` of ``model`` (as the user passed it; ``engine``: its parallel engine, when known)."""
    inner = unwrap(model)
    engine = engine or detect(model, inner)
    return Fingerprint.of(inner, engine, engine.compute_device(streams.head_device(inner)))


def probed(model: torch.nn.Module, engine: Engine, plan: Plan) -> Findings:
    """The probe's ``Findings`` of ``model`` (its head verified and its layers probed, once per model, by a forward
    inside ``engine``'s call), and the refusals they decide for ``plan``, agreed across the ranks. Every rank calls
    it, after the ranks agreed that none failed before."""
    inner = unwrap(model)
    own = engine.forward_in_call(inner)
    with torch.compiler.set_stance("force_eager"):  # checks of the model's own forward: compiled layers run eager
        engine.call(lambda: verify_head(inner, own), guard=False)
    findings = Findings.of(inner)
    if findings.keep is not None:  # the same on every rank
        error = None
        try:  # this depends on each rank's groups: agreed, so that a refusal on one rank stops every rank
            refusals.check_window(type(inner).__name__, plan, findings.keep)
        except ValueError as e:
            error = e
        engine.agree_on_error(error)
    return findings
