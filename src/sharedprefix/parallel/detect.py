"""Which engine a call runs under (``parallel.engines``: FSDP2 on the causal LM or on a wrapper of it as a whole,
DDP, or one process), with transformers' tensor parallelism (``parallel.tensor``) as its degree; ``detect`` returns
the call's ``parallel.engine.Engine``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sharedprefix.model.adapter import peel_compiled
from sharedprefix.parallel.engine import Engine
from sharedprefix.parallel.engines import ENGINES
from sharedprefix.parallel.tensor import tensor_parallel_size
from sharedprefix.parallel.walks import memo


def sync_enabled(model: torch.nn.Module) -> bool:
    """False where the model's wrapper says this call must not synchronise gradients (inside DDP's ``no_sync()``)."""
    return all(engine.wrapper_syncs(model) for engine in ENGINES)


def detect(model: torch.nn.Module, root: torch.nn.Module) -> Engine:
    """The engine of ``model`` (as the user passed it) and its transformers ``root``; a layout sharedprefix is not
    verified exact on raises ``ValueError`` (``parallel.tensor``, each engine's ``match``)."""
    model = peel_compiled(model)  # torch.compile around the model (accelerate's torch_compile): what is inside
    tp = memo(("tensor", id(root), id(model)), lambda: tensor_parallel_size(root, model))  # once per call

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:
        FSDP1 = ()
    m = model
    while m is not None:
        if FSDP1 and isinstance(m, FSDP1):
            raise ValueError(
                "the model is wrapped in FullyShardedDataParallel (FSDP1), whose flat sharded parameters sharedprefix "
                "cannot run; shard it with torch.distributed.fsdp.fully_shard (FSDP2) instead."
            )
        m = getattr(m, "module", None)
    for cls in ENGINES:
        if (engine := cls.match(model, root, world, tp)) is not None:
            return engine
    raise TypeError(
        f"no registered engine ({', '.join(c.__name__ for c in ENGINES)}) took {type(model).__name__}; a bug."
    )
