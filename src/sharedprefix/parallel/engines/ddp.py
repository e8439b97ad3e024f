"""DDP (``DistributedDataParallel``): passes run on the wrapped module directly (DDP's reducer stays idle), then one
all-reduce of all gradients over DDP's process group, flattened per dtype, at the end of the syncing call.

The call keeps DDP's own accumulation rule, so that it composes with the user's plain DDP backwards in any order
before one optimizer step: the call adds its contribution into ``.grad`` as a plain DDP backward of the loss times
the number of ranks would (DDP averages; ``grad_reduction="mean"``: the loss itself), and a syncing call replaces every
``.grad`` by its mean over the ranks, which is what DDP's reducer does at a syncing backward (everything accumulated
since the last sync is averaged; what was synchronised already is the same on every rank and stays). A call with
``sync=False`` or inside DDP's ``no_sync()`` only adds, as DDP's backward does there; whichever syncing backward comes
next, the call's or DDP's own, averages it. Reads DDP's ``require_backward_grad_sync``, ``process_group`` and
``static_graph`` (docs/internals.md).

A forward through the DDP model whose backward has not run when a call starts (``aux = ddp(...); sp.backward(...);
aux.backward()``, or ``aux`` in the same backward as a grad-enabled ``sp.logprobs``' loss) arms DDP's reducer for
that backward; the reducer's hooks sit on the parameters' gradient accumulators, so the call's own first backward
fires them instead, and the auxiliary gradient reaches ``.grad`` unreduced (measured: 0.26 relative error). Whether
the reducer is armed cannot be read (its ``expect_autograd_hooks_`` is not exposed), but an armed reducer that fires
records each parameter's readiness time in ``reducer.get_backward_stats()``, which nothing else writes: the call
reads them at its start and after its rounds, and refuses (``.grad`` rolled back) when they moved.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sharedprefix.model.adapter import peel_compiled
from sharedprefix.parallel.engine import Engine, Transaction
from sharedprefix.parallel.sequence import reduce_grads


class DDP(Engine):
    name = "DDP"
    lockstep = False
    backward_through_outputs = False
    default_prefix_mode = "keep"
    replays_tensor_hooks = True
    must_defer = "a DDP model"

    def __init__(self, root: Any, world_size: int, tensor: int, data_size: int, data_group: Any, ddp: Any = None):
        super().__init__(root, world_size, tensor=tensor, data_size=data_size)
        self.data_group = data_group  # DDP's process group (None: every rank)
        self.ddp = ddp  # the DistributedDataParallel wrapper (its reducer is read, never driven)
        self._reducer_stats: list[int] | None = None  # the reducer's backward stats at the call's start

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
        _refuse_static_graph(model)
        group = getattr(model, "process_group", None)
        return cls(root, world, tensor, dist.get_world_size(group) if world > 1 else 1, group, model)

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

    def start(self) -> None:
        super().start()
        self._reducer_stats = _reducer_stats(self.ddp)

    def check_rounds(self) -> None:
        """Refuse the call when DDP's reducer fired in its backwards: a forward through the DDP model had armed it
        for a backward still to come (the module's docstring)."""
        if self._reducer_stats is None or _reducer_stats(self.ddp) == self._reducer_stats:
            return
        raise ValueError(
            "DistributedDataParallel's reducer fired during this sharedprefix call's backward: a forward through the "
            "DDP model with gradient sync (an auxiliary loss, aux = ddp(...)) ran before the call and its backward "
            "had not (it was still to come, or is the same backward as a grad-enabled sp.logprobs' loss), so DDP's "
            "reducer, armed for that backward, ran on this call's, and the auxiliary gradient would reach .grad "
            "without being averaged over the ranks. The call's gradient was rolled back. Expected the auxiliary "
            "term's own backward to run before the call (aux = ddp(...); aux.backward(); sp.backward(...)) or its "
            "forward after it (sp.backward(...); ddp(...).backward()), each order exact; with sp.logprobs, call "
            "aux.backward() before building the call's loss, or compute aux after that loss's backward."
        )

    def finish_grads(
        self, tx: Transaction, model: torch.nn.Module, sync: bool, grad_reduction: str, collect: bool
    ) -> dict | None:
        """Add this call's contribution into ``.grad``, scaled as a plain DDP backward's would be (the loss times the
        number of ranks for "sum", DDP averaging), and at a syncing call average every ``.grad`` over the ranks, as
        DDP's reducer does. ``.grad`` is written even for a deferred call's backward (``collect``), which under DDP
        synchronises inside the call."""
        tx.deliver(into={})  # .grad: the call's contribution alone; tx.held: what was there before
        scale = float(self.data_size) if grad_reduction == "sum" else 1.0
        with torch.no_grad():
            for p in model.parameters():
                old = tx.held.get(p)
                if p.grad is None or p.grad is old:
                    continue
                if scale != 1.0:
                    p.grad.mul_(scale)
                if old is not None:
                    old.add_(p.grad)
                    p.grad = old
            for p, old in tx.held.items():  # held tensors the call did not reach stay where they were
                if p.grad is None:
                    p.grad = old
        if sync and self.data_size > 1:
            self.all_reduce_grads(model)
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.div_(self.data_size)
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


def _reducer_stats(ddp: Any) -> list[int] | None:
    """DDP's reducer's per-parameter readiness times of its last reduced backward (``Reducer.get_backward_stats``,
    docs/internals.md), written only when an armed reducer's hook fires; None where DDP keeps no such reducer."""
    reducer = getattr(ddp, "reducer", None)
    stats = getattr(reducer, "get_backward_stats", None)
    return list(stats()) if callable(stats) else None


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


def _refuse_static_graph(ddp) -> None:
    """Refuse ``static_graph=True``: until DDP's first iteration ends, its reducer counts every gradient of the model,
    sharedprefix's backwards (which run on the wrapped module) included, as its first iteration's, and learns from
    that count how many times a parameter's gradient arrives per iteration; the user's later plain DDP backwards then
    reduce wrong gradients (measured: 1.55 relative error), silently."""
    if getattr(ddp, "static_graph", False):
        raise ValueError(
            "the DistributedDataParallel model was built with static_graph=True; DDP's reducer then counts every "
            "backward through the model before its own first iteration ends, sharedprefix's passes included, as that "
            "iteration's, and later plain DDP backwards through the model (an auxiliary loss, an SFT step) reduce "
            "wrong gradients. Wrap the model without static_graph (sharedprefix does not use DDP's reducer, so the "
            "setting brings nothing to its calls)."
        )
