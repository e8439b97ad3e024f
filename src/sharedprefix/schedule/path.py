"""The route of one public call (``Path``), chosen once by ``api.py`` before anything runs; everything below follows
it (a deferred call's backward is the backward of its path, ``schedule.deferred``)."""

from __future__ import annotations

import enum

import torch

from sharedprefix.model import mixers
from sharedprefix.model.adapter import unwrap
from sharedprefix.model.forward_mode import uses_checkpointing
from sharedprefix.parallel.detect import detect
from sharedprefix.schedule.options import CallOptions


class Path(enum.Enum):
    """How one public call runs, chosen once by ``api.py``: ``PACKED`` (the executor over the plan's passes, with or
    without a graph), ``DEFERRED`` (a grad-enabled ``sp.logprobs`` whose values are computed without a graph now and
    whose backward is ``sp.backward``'s, see ``schedule.deferred``), ``HYBRID`` (a model on ``schedule.cache_path``)."""

    PACKED = "packed"
    DEFERRED = "deferred"
    HYBRID = "hybrid"


def choose_backward_path(model) -> Path:
    """``sp.backward``'s path: the cache path of a hybrid model, else the packed one."""
    return Path.HYBRID if mixers.on_cache_path(unwrap(model)) else Path.PACKED


def choose_logprobs_path(model, options: CallOptions, planned: frozenset[str] = frozenset()) -> Path:
    """``sp.logprobs``' path, chosen once: the cache path of a hybrid model (which defers on its own terms,
    ``cache_path.calls``); with grad enabled, deferred when asked for (``defer=True``) or needed (gradient
    checkpointing, DDP, sequence parallelism); else packed. Refuses what cannot be exact either way (FSDP2;
    ``defer=False`` where deferral is needed, named as the call's or, in ``planned``, its ``CallPlan``'s)."""
    if mixers.on_cache_path(unwrap(model)):
        return Path.HYBRID
    if not torch.is_grad_enabled():
        return Path.PACKED
    defer, seq = options.defer, options.sequence_group
    inner = unwrap(model)
    engine = detect(model, inner)
    engine.check_grad_logprobs()  # FSDP2: neither a kept graph nor a deferred backward runs FSDP2 as plain does
    if defer is False:
        engine.check_undeferred()  # DeepSpeed ZeRO-3's leaf modules: their reduction, in words of their own
    needs = engine.must_defer or ("gradient checkpointing" if uses_checkpointing(inner) else None)
    needs = needs or ("sequence parallelism" if seq is not None else None)
    if defer is False and needs:
        whose, fix = (
            ("the CallPlan's defer=False (from sp.plan_call)", "Pass defer=None to this call, or plan without defer")
            if "defer" in planned
            else ("defer=False", "Pass defer=None, or leave defer out")
        )
        raise ValueError(
            f"{whose} with grad enabled is not possible with {needs}: the backward must run inside "
            "sharedprefix (to recompute checkpointed layers with its attention, to synchronise DDP "
            f"gradients, or to sum a sequence group's gradient shares). {fix}."
        )
    return Path.DEFERRED if defer or (defer is None and needs) else Path.PACKED
