"""DDP (``DistributedDataParallel``): passes run on the wrapped module directly (DDP's reducer stays idle), then one
all-reduce (sum) of all gradients over DDP's process group, flattened per dtype, at the end of the syncing call.

Accumulation (``sync=False``, or a call inside DDP's ``no_sync()``): the ``.grad`` held at the start of an
accumulation (already synchronised) is kept aside across its ``sync=False`` calls, which accumulate into tensors of
their own; the syncing call all-reduces their sum with its own contribution and adds the result into the tensors
held at the start, so those are the ``.grad`` afterwards. The state kept between calls lives here, keyed weakly by
the model. Reads DDP's ``require_backward_grad_sync`` and ``process_group`` (docs/internals.md).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from sharedprefix.model.adapter import peel_compiled
from sharedprefix.parallel.engine import Engine, Transaction
from sharedprefix.parallel.sequence import reduce_grads

_SYNCED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {param: grad held at its start}


class DDP(Engine):
    name = "DDP"
    lockstep = False
    backward_through_outputs = False
    default_prefix_mode = "keep"
    replays_tensor_hooks = True
    must_defer = "a DDP model"

    def __init__(self, root: Any, world_size: int, tensor: int, data_size: int, data_group: Any):
        super().__init__(root, world_size, tensor=tensor, data_size=data_size)
        self.data_group = data_group  # DDP's process group (None: every rank)

    @classmethod
    def match(cls, model: torch.nn.Module, root: torch.nn.Module, world: int, tensor: int) -> Engine | None:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            return None
        if tensor > 1:
            raise ValueError(
                f"the model is wrapped in DistributedDataParallel and tensor-parallel (tp_size={tensor}); sharedprefix "
                "is verified exact with tensor parallelism alone or under FSDP2 over a second mesh dimension "
                "(fully_shard, or transformers' DistributedConfig(tp_size=..., fsdp_size=...)), not under DDP. Shard "
                "the data dimension with FSDP2 instead."
            )
        _refuse_comm_hook(model)
        group = getattr(model, "process_group", None)
        return cls(root, world, tensor, dist.get_world_size(group) if world > 1 else 1, group)

    @classmethod
    def wrapper_syncs(cls, model: torch.nn.Module) -> bool:
        """False inside a DDP model's ``no_sync()`` context (DDP's public flag ``require_backward_grad_sync``)."""
        from torch.nn.parallel import DistributedDataParallel

        model = peel_compiled(model)
        return not isinstance(model, DistributedDataParallel) or bool(
            getattr(model, "require_backward_grad_sync", True)
        )

    def reduces_at_end(self, sync: bool) -> bool:
        return sync

    def finish_grads(
        self, tx: Transaction, model: torch.nn.Module, sync: bool, grad_reduction: str, collect: bool
    ) -> dict | None:
        """Deliver this call's contribution into the accumulation's own tensors; at the syncing call, all-reduce them
        and add the result into the ``.grad`` held at the accumulation's start. ``.grad`` is written even for a
        deferred call's backward (``collect``), which under DDP synchronises inside the call."""
        start = _SYNCED.get(model)
        if start is None:  # this call starts an accumulation: what it holds was synchronised before
            tx.deliver(into={})
            start = tx.held
        else:  # what it holds is the accumulation so far (earlier sync=False calls)
            tx.deliver()
        if not sync:
            _SYNCED[model] = start
            return None
        _SYNCED.pop(model, None)
        self.all_reduce_grads(model)
        with torch.no_grad():
            if grad_reduction == "mean":
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.div_(self.data_size)
            for p, old in start.items():
                if p.grad is None:
                    p.grad = old
                elif old is not p.grad:
                    old.add_(p.grad)
                    p.grad = old
        return None

    def all_reduce_grads(self, model: torch.nn.Module) -> None:
        """Sum every gradient over DDP's process group, one all-reduce per dtype."""
        if self.data_size == 1:
            return
        reduce_grads(model, self.data_group)

    def sequence_refusals(self, model: torch.nn.Module) -> dict[str, str]:
        return {
            "DDP data parallelism": "DDP's all-reduce is not combined with the sum over the sequence group (use FSDP2)"
        }


def _refuse_comm_hook(ddp) -> None:
    """Refuse a DDP model with a communication hook (``register_comm_hook``: fp16 / bf16 compression, PowerSGD, a
    hook of the user's; or a built-in one): the call's gradient is reduced by sharedprefix's own all-reduce, so the
    hook would never run and the result would not be the plain DDP run's. Read from DDP's logging data, where both
    kinds of registration name their hook (private: ``_get_ddp_logging_data``; docs/internals.md)."""
    hook = ddp._get_ddp_logging_data().get("comm_hook") if hasattr(ddp, "_get_ddp_logging_data") else None
    if hook:
        raise ValueError(
            f"the DistributedDataParallel model has a communication hook ({hook}); sharedprefix runs its passes on "
            "the wrapped module and reduces the call's gradient with one all-reduce of its own, so the hook would "
            "never run and the gradients would not be the plain DDP run's (uncompressed, where the hook compresses). "
            "Wrap the model in DistributedDataParallel without register_comm_hook."
        )
