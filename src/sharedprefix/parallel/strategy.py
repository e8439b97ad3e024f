"""Data parallelism inside ``sp.backward`` / ``sp.logprobs``: DDP and FSDP2 (``fully_shard``).

Gradient semantics: the loss of the whole global batch is the sum of every rank's
``loss_fn`` values (with normalisers computed for the global batch), so the gradients of
the ranks are *summed*, once per call (``sync=True``) or not at all (``sync=False``, for
accumulation; the last call of the optimizer step syncs what was accumulated).

- DDP: passes run on the wrapped module directly (DDP's reducer stays idle), then one
  all-reduce (sum) of all gradients, flattened per dtype.
- FSDP2: every forward all-gathers parameters and every backward may reduce-scatter, so
  (1) each pass runs between the root's own FSDP2 pre- and post-forward (which unshard the
  root's parameters and hook the outputs for backward, as the root's ``__call__`` would; the
  model's ``forward`` is not replaced, nothing is set on the model), including a prompt's
  deferred backward, which is run as a recomputation whose surrogate loss ``sum(dK * K) + ...``
  is an output of that call; (2) every rank runs the same sequence of collectives, whatever
  the wrapping (nested units, grouped units, embedding and head as units of their own):
  forward-only rounds first (the prompts of split groups), then forward+backward rounds, both
  counts agreed across ranks in the all-reduce(max) that agrees on setup errors, and a rank with fewer rounds runs dummy
  rounds on a 2-token row whose loss is multiplied by zero; (3) gradient sync is disabled
  except in the last forward+backward round; (4) FSDP2 averages over ranks when it
  reduce-scatters, so the losses are scaled by the world size to keep the sum semantics.

Failures (every rank stops, with the failing rank's message, within seconds):
- before any collective of a call (bad input, a refusal): one all-reduce of an error flag;
- FSDP2, outside the collectives (``loss_fn`` raising, a refusal after a pass): the rank runs
  the rest of the call's collectives as dummy rounds, and the ranks agree at the end of the call
  (one more one-element all-reduce per call); the process group stays usable;
- FSDP2, inside a forward or backward (where agreeing is impossible): the failing rank puts
  its message in the process group's store and closes its process groups; the others'
  collectives fail at once, they read the message and raise it (``Parallel.collectives``).
  Tested with gloo; with NCCL, a rank blocked in a collective learns of it only through
  NCCL's own error handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` and the group's timeout).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sharedprefix.parallel.grad_hooks import DeferredGradHooks
from sharedprefix.parallel.sequence import comm_device, reduce_grads

_CALLS = itertools.count()  # the n-th sharedprefix call of this process: the same n on every rank (keys errors)
_ERROR_KEY = "sharedprefix/error/{call}/{rank}"
_STORES: list = []  # stores an error was published in, kept alive for the other ranks to read it


@dataclass
class Parallel:
    """How one call runs over the ranks; created for the call and dropped with it (nothing is set on the model)."""

    kind: str = "none"  # "none" | "ddp" | "fsdp"
    root: Any = None  # the FSDP2 root module (its private state is read: docs/internals.md), or the DDP module
    world_size: int = 1
    call_id: int = -1  # set by ``start``
    broken: bool = False  # an error left a collective-bearing region: this call's process group is closed
    sequence: Any = None  # the sequence-parallel process group of the call (``parallel.sequence``), or None
    hooks: DeferredGradHooks | None = None  # the parameters' post-accumulate-grad hooks, fired once per call
    tensor: int = 1  # the tensor-parallel degree (transformers' tp_plan; ``parallel.tensor``)
    data_size: int = 1  # the ranks gradients are summed over: FSDP2's mesh, DDP's process group (not every rank
    # where tensor parallelism splits the world: FSDP2 x TP on a 2-D mesh)
    data_group: Any = None  # DDP's process group (None: every rank)
    _last: bool = False  # the round running is the call's last with a backward (``begin_backward_round``)

    @property
    def fsdp(self) -> bool:
        return self.kind == "fsdp"

    @property
    def multi(self) -> bool:
        return self.kind != "none" and self.world_size > 1

    def start(self) -> None:
        """Number this call (every rank makes the same calls in the same order, so the numbers agree)."""
        self.call_id = next(_CALLS)
        self.hooks = DeferredGradHooks(self.root, fsdp=self.fsdp)

    def call(self, fn, guard: bool = True):
        """Run ``fn()`` as the FSDP2 root module's forward (directly without FSDP2).

        The root's own FSDP2 pre- and post-forward run around ``fn`` exactly as the root's ``__call__`` runs them
        around its ``forward`` (unshard the root's parameters, and register the pre-backward hooks on the tensors
        ``fn`` returns, which is why everything a backward starts from must be among them); the model's ``forward``
        is neither called nor replaced. ``guard``: see ``collectives``; False only where every rank computes the
        same thing and so fails together (the head check).
        """
        if not self.fsdp:
            return fn()
        state = self.root._get_fsdp_state()
        with self.collectives() if guard else contextlib.nullcontext():
            state._pre_forward(self.root, (), {})
            return state._post_forward(self.root, (), fn())

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` (FSDP2's backward all-gathers and reduce-scatters: a guarded region), with the
        parameters' post-accumulate-grad hooks deferred to ``fire_hooks`` (``parallel.grad_hooks``); under FSDP2 they
        run in the call's last backward instead (``begin_backward_round``), before FSDP2 reduce-scatters."""
        with self.collectives(), self.hooks.during_backward(self._last) if self.hooks else contextlib.nullcontext():
            loss.backward()

    def fire_hooks(self) -> None:
        """Once the call's gradients are complete: each deferred post-accumulate-grad hook, once."""
        if self.hooks is not None:
            self.hooks.fire()

    @contextlib.contextmanager
    def collectives(self):
        """A region whose collectives the other ranks are running too (an FSDP2 forward or backward).

        An error here cannot be agreed on: the other ranks wait in a collective this rank will not join. So the
        failing rank publishes its message in the process group's store and closes its process groups; the other
        ranks' collectives then fail at once (gloo: "connection closed by peer"), they find the message, close
        theirs too and raise an error naming the failing rank and its message.
        """
        if not (self.fsdp and self.world_size > 1):
            yield
            return
        try:
            yield
        except Exception as e:
            if self.broken:
                raise
            self.broken = True
            from torch.distributed import distributed_c10d as c10d

            store = c10d._get_default_store()
            rank = dist.get_rank()
            others = self._published(store, rank, wait=isinstance(e, RuntimeError))
            if not others:
                try:
                    store.set(_ERROR_KEY.format(call=self.call_id, rank=rank), f"{type(e).__name__}: {e}")
                    _STORES.append(store)  # where rank 0 hosts the store (tcp:// init), it outlives the group
                except RuntimeError:  # the store left with its host: this rank's own error is raised as it is
                    pass
            dist.destroy_process_group()  # every process group: the others' collectives with this rank fail now
            if not others:
                raise
            r, m = others[0]
            raise RuntimeError(
                f"rank {r} stopped during this sharedprefix call ({m}); it left in the middle of FSDP2's collectives, "
                "which a call cannot resume, so every rank closed its process group and raises. Fix the error on "
                f"rank {r}; then restart the processes (torchrun does)."
            ) from e

    def _published(self, store, rank: int, wait: bool) -> list[tuple[int, str]]:
        """(rank, message) of the other ranks that published an error in this call; with ``wait``, up to 3 s for
        one (this rank's error may be the consequence of another's: a collective it left)."""
        keys = {r: _ERROR_KEY.format(call=self.call_id, rank=r) for r in range(self.world_size) if r != rank}
        deadline = time.monotonic() + (3.0 if wait else 0.0)
        while True:
            try:
                found = [(r, store.get(k).decode()) for r, k in keys.items() if store.check([k])]
            except RuntimeError:  # the store is gone with its host: no message to find; this rank's own error stands
                return []
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def agree_on_error(
        self, error: BaseException | None, where: str = "before any computation of", counts: Sequence[int] = ()
    ) -> list[int]:
        """Under DDP / FSDP2, every rank learns whether any rank failed before the next collective (the call's first,
        or DDP's gradient all-reduce at its end), and all raise together (the failing rank its own error, the others
        one naming it) instead of waiting in a collective the failed rank never joins. ``counts`` ride along in the
        same all-reduce: returns their maximum over the ranks (FSDP2's round counts)."""
        if self.kind == "none" or self.world_size == 1:
            if error is not None:
                raise error
            return list(counts)
        flag = torch.tensor([0 if error is None else 1, *counts], dtype=torch.int64, device=comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one tiny collective when nothing failed (the common case)
        if not int(flag[0].item()):
            return [int(x) for x in flag[1:].tolist()]
        msgs = [None] * self.world_size
        dist.all_gather_object(msgs, None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = [(r, m) for r, m in enumerate(msgs) if m is not None]
        if failed:
            r, m = failed[0]
            raise RuntimeError(
                f"rank {r} stopped {where} this sharedprefix call ({m}); every rank stops with it instead of waiting "
                "in a collective that rank would never join."
            )
        raise RuntimeError(f"a rank flagged an error {where} this sharedprefix call but none reported it; a bug.")

    def begin_backward_round(self, sync: bool, last: bool) -> None:
        """Before a round with a backward: FSDP2 reduces gradients in it (``sync``); it is the call's ``last``
        backward (where FSDP2's post-accumulate-grad hooks run, ``backward``)."""
        self.set_sync(sync)
        self._last = last

    def set_sync(self, enabled: bool) -> None:
        if self.fsdp:
            self.root.set_requires_gradient_sync(enabled)

    def loss_scale(self, grad_reduction: str = "sum") -> float:
        """What each rank's loss is multiplied by before its backward. FSDP2 averages over its W ranks: "sum" scales
        by W / S (S: the sequence group's size, 1 without one; every rank of a sequence group backpropagates the
        same loss, and FSDP2 sums their shares), "mean" by 1 (the mean over the W / S data-parallel groups).
        Without FSDP2: 1 / S (the shares are summed over the group at the end of the call)."""
        size = dist.get_world_size(self.sequence) if self.sequence is not None else 1
        if self.fsdp:
            return float(self.data_size) / size if grad_reduction == "sum" else 1.0
        return 1.0 / size

    def compute_device(self, fallback: torch.device) -> torch.device:
        """The device the passes run on: FSDP2's compute device (its parameters may be offloaded to host memory,
        ``CPUOffloadPolicy``, and are brought to it for each forward), else ``fallback`` (the head's device)."""
        if self.fsdp:
            device = getattr(self.root._get_fsdp_state(), "_device", None)
            if isinstance(device, torch.device):
                return device
        return fallback

    def all_reduce_grads(self, model: torch.nn.Module) -> None:
        """DDP: sum every gradient over DDP's process group, one all-reduce per dtype."""
        if self.kind != "ddp" or self.data_size == 1:
            return
        reduce_grads(model, self.data_group)
