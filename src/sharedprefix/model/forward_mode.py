"""How the user's set-up runs the model's forward beyond the model's own code: activation checkpointing
(transformers' own, or torch's checkpoint wrappers around layers), which recomputes layers in the backward, and the
autocast a wrapper puts around the forward (accelerate's mixed precision). sharedprefix runs the decoder itself, so it
asks here what the plain forward would run under."""

from __future__ import annotations

import contextlib

import torch
from transformers import PreTrainedModel

from sharedprefix.model.adapter import wrappers


def uses_checkpointing(model: PreTrainedModel) -> bool:
    """True when activation checkpointing is active, reentrant or not: transformers' gradient checkpointing (in
    training mode), or torch's checkpoint wrappers around modules (``checkpoint_wrappers``, in any mode)."""
    hf = model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    return hf or bool(checkpoint_wrappers(model))


def uses_reentrant_checkpointing(model: PreTrainedModel) -> bool:
    """True when checkpointing with ``use_reentrant=True`` is active: transformers' in training mode, or a torch
    checkpoint wrapper's."""
    if any(_reentrant(fn) for fn in checkpoint_wrappers(model).values()):
        return True
    if not model.training:
        return False
    for mod in model.modules():
        if getattr(mod, "gradient_checkpointing", False):
            if _reentrant(getattr(mod, "_gradient_checkpointing_func", None)):
                return True
    return False


def checkpoint_wrappers(model: torch.nn.Module) -> dict:
    """{module: its checkpoint function} of torch's activation-checkpointing wrappers inside ``model``
    (``CheckpointWrapper``, put around layers by ``apply_activation_checkpointing``: accelerate's FSDP
    ``activation_checkpointing``, torchtitan). They recompute their module in the backward whatever the mode, outside
    any context of sharedprefix's unless the call defers, as transformers' own checkpointing does."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # a torch built without distributed
        return {}
    return {m: getattr(m, "checkpoint_fn", None) for m in model.modules() if isinstance(m, CheckpointWrapper)}


def _reentrant(fn) -> bool:
    """Whether a checkpoint function (a ``functools.partial`` of ``torch.utils.checkpoint.checkpoint``) runs
    reentrant: torch.utils.checkpoint defaults to ``use_reentrant=True`` when it is not given."""
    return fn is not None and getattr(fn, "keywords", {}).get("use_reentrant", True)


def forward_autocast(model: torch.nn.Module) -> torch.autocast | None:
    """The ``torch.autocast`` that a wrapper put around the forward of ``model`` or of a wrapper inside it
    (accelerate's mixed precision: ``Accelerator.prepare`` replaces the model's ``forward`` with one that runs the
    original under autocast and converts the outputs to float32), found in that instance-level ``forward``'s
    closures; None where there is none. sharedprefix runs the decoder itself, not that ``forward``, so a call
    applies this autocast itself (``api``), as the plain run would."""
    for m in wrappers(model):
        forward = vars(m).get("forward") if isinstance(m, torch.nn.Module) else None
        if forward is not None and (found := _autocast_in(forward, 6)) is not None:
            return found
    return None


def _autocast_in(fn, depth: int) -> torch.autocast | None:
    """A ``torch.autocast`` among the closure cells (and ``model_forward`` / ``__wrapped__``) of the callable
    ``fn`` and of the callables there, ``depth`` levels down."""
    if fn is None or depth == 0:
        return None
    if isinstance(fn, torch.autocast):
        return fn
    fn = getattr(fn, "__func__", fn)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(v, torch.autocast) or callable(v):
            if (found := _autocast_in(v, depth - 1)) is not None:
                return found
    for attr in ("model_forward", "__wrapped__"):  # accelerate's ConvertOutputsToFp32, functools.wraps
        if (found := _autocast_in(getattr(fn, attr, None), depth - 1)) is not None:
            return found
    return None


def in_forward_autocast(model: torch.nn.Module):
    """A context that enables the autocast around ``model``'s forward (``forward_autocast``) where the caller has
    not enabled autocast on its device already; a null context otherwise."""
    found = forward_autocast(model)
    if found is None or not found._enabled or torch.is_autocast_enabled(found.device):
        return contextlib.nullcontext()
    return torch.autocast(found.device, dtype=found.fast_dtype, cache_enabled=found._cache_enabled)
