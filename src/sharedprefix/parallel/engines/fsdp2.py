"""FSDP2 (``fully_shard``, on the causal LM or on a wrapper of it as a whole), alone or over a second mesh dimension
with transformers' tensor parallelism.

Every forward all-gathers parameters and every backward may reduce-scatter, so
(1) each pass runs between the root's own FSDP2 pre- and post-forward (which unshard the root's parameters and hook
the outputs for backward, as the root's ``__call__`` would; the model's ``forward`` is not replaced, nothing is set
on the model), including a prompt's deferred backward, which is run as a recomputation whose surrogate loss
``sum(dK * K) + ...`` is an output of that call; (2) every rank runs the same sequence of collectives, whatever the
wrapping (nested units, grouped units, embedding and head as units of their own): forward-only rounds first (the
prompts of split groups), then forward+backward rounds, both counts agreed across ranks in the all-reduce(max) that
agrees on setup errors, and a rank with fewer rounds runs dummy rounds on a 2-token row whose loss is multiplied by
zero; (3) gradient sync is disabled except in the last forward+backward round; (4) FSDP2 averages over ranks when it
reduce-scatters, so the losses are scaled by the world size to keep the sum semantics.

Failures (every rank stops, with the failing rank's message, within seconds):
- outside the collectives (``loss_fn`` raising, a refusal after a pass): the rank runs the rest of the call's
  collectives as dummy rounds, and the ranks agree at the end of the call (one more one-element all-reduce per
  call); the process group stays usable;
- inside a forward or backward (where agreeing is impossible): the failing rank puts its message in the process
  group's store and closes its process groups; the others' collectives fail at once, they read the message and raise
  it (``collectives``). Tested with gloo; with NCCL, a rank blocked in a collective learns of it only through NCCL's
  own error handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` and the group's timeout).

Reads FSDP2's private root state (``_get_fsdp_state``, ``_pre_forward``, ``_post_forward``, ``_device``) and
``_fsdp_param_group.mesh_info`` (the ranks it averages over): docs/internals.md.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from sharedprefix.parallel.engine import Engine
from sharedprefix.parallel.engines.fsdp2_state import (
    fsdp_data_size,
    fsdp_module_cls,
    fsdp_modules,
    gradient_divide_factor,
    outer_fsdp,
    sharded_dtype,
)
from sharedprefix.parallel.grad_hooks import DeferredGradHooks
from sharedprefix.parallel.sequence import fsdp_mesh_refusal

_ERROR_KEY = "sharedprefix/error/{call}/{rank}"
_STORES: list = []  # stores an error was published in, kept alive for the other ranks to read it
R = TypeVar("R")


class FSDP2(Engine):
    name = "FSDP2"
    lockstep = True
    backward_through_outputs = True
    default_prefix_mode = "recompute"
    replays_tensor_hooks = False
    must_defer = None
    data_in_place = False  # (reshard / unshard re-point and free the parameters' data)
    divide_factor: float | None = None  # what FSDP2 divides the summed gradient by (``gradient_divide_factor``)

    @classmethod
    def match(cls, model: torch.nn.Module, root: torch.nn.Module, world: int, tensor: int) -> Engine | None:
        fsdp_cls = fsdp_module_cls()
        outer = outer_fsdp(model, root, fsdp_cls)
        if outer is not None:  # FSDP2 applied to a wrapper of the causal LM as a whole (a PEFT model): the root
            root = outer
        if fsdp_cls is not None and isinstance(root, fsdp_cls):
            state = root._get_fsdp_state() if hasattr(root, "_get_fsdp_state") else None
            if not (hasattr(state, "_pre_forward") and hasattr(state, "_post_forward")):
                raise ValueError(
                    f"torch {torch.__version__}'s FSDP2 root state has no _pre_forward / _post_forward, which "
                    "sharedprefix runs around each pass (the FSDP2 root's own hooks); use a torch version that has "
                    "them (torch 2.13, which this was tested with, does)."
                )
            engine = cls(root, world, tensor=tensor, data_size=fsdp_data_size(root, world))
            engine.divide_factor = gradient_divide_factor(root, engine.data_size)
            return engine
        if fsdp_modules(root):
            raise ValueError(
                "the model has fully_shard (FSDP2) submodules but its root is not sharded; apply fully_shard to the "
                "causal LM itself too (after its layers), so that its embedding and LM head are managed by FSDP2."
            )
        return None

    # -- how passes run -----------------------------------------------------------------------------------------

    def grad_hooks(self) -> DeferredGradHooks:
        """Hooks on FSDP2's unsharded parameters too, run in the call's last backward (``parallel.grad_hooks``)."""
        return DeferredGradHooks(self.root, fsdp=True)

    def call(self, fn: Callable[[], R], guard: bool = True) -> R:
        """Run ``fn()`` as the FSDP2 root module's forward.

        The root's own FSDP2 pre- and post-forward run around ``fn`` exactly as the root's ``__call__`` runs them
        around its ``forward`` (unshard the root's parameters, and register the pre-backward hooks on the tensors
        ``fn`` returns, which is why everything a backward starts from must be among them); the model's ``forward``
        is neither called nor replaced. ``guard``: see ``collectives``; False only where every rank computes the
        same thing and so fails together (the head check).
        """
        state = self.root._get_fsdp_state()
        with self.collectives() if guard else contextlib.nullcontext():
            state._pre_forward(self.root, (), {})
            return state._post_forward(self.root, (), fn())

    def forward_in_call(self, model: torch.nn.Module) -> Callable | None:
        """Inside the root call the root's hooks already ran: its bound ``model.forward``."""
        return model.forward

    def set_sync(self, enabled: bool) -> None:
        self.root.set_requires_gradient_sync(enabled)

    def loss_scale(self, grad_reduction: str = "sum") -> float:
        """FSDP2 divides the sum over its W ranks by F (W, or the user's ``set_gradient_divide_factor``): "sum" scales
        by F / S (S: the sequence group's size, 1 without one; every rank of a sequence group backpropagates the same
        loss, and FSDP2 sums their shares), "mean" by F / W (the mean over the W / S data-parallel groups)."""
        factor = self.divide_factor or float(self.data_size)
        return factor / self.sequence_size() if grad_reduction == "sum" else factor / self.data_size

    def compute_device(self, fallback: torch.device) -> torch.device:
        """FSDP2's compute device (its parameters may be offloaded to host memory, ``CPUOffloadPolicy``, and are
        brought to it for each forward), else ``fallback``."""
        device = getattr(self.root._get_fsdp_state(), "_device", None)
        return device if isinstance(device, torch.device) else fallback

    def param_dtype(self, fallback: torch.dtype) -> torch.dtype:
        """FSDP2's sharded parameters' (``fsdp2_state.sharded_dtype``), not the ``MixedPrecisionPolicy``'s of the
        unsharded ones a unit registers until it reshards: a plan made before a unit stayed unsharded was refused."""
        return sharded_dtype(self.root, fallback)

    def prefix_mode(self, requested: str) -> str:
        """Always "recompute": a prompt's deferred backward must run inside the root module's call."""
        return "recompute"

    def before_grads(self) -> None:
        """Every FSDP2 module resharded (``FSDPModule.reshard``), at the start of the call's gradient transaction and
        after its rounds, so that it reads the sharded parameters. A module that does not reshard after forward (the
        root by default; accelerate's norm and head) keeps its unsharded ones registered, whose ``.grad`` is FSDP2's
        own accumulation of backwards that did not reduce (``sync=False``, ``set_requires_gradient_sync(False)``):
        held aside, it missed the next reduction (relative error 1.0 on the embedding). One that does not reshard
        after backward (``set_reshard_after_backward(False)``) keeps them registered after the rounds, the reduced
        ``.grad`` on the sharded ones out of sight: the gradient held before the call was dropped (1.08 after two
        reducing calls, 1.21 after a step). Costs those modules' next forward one all-gather."""
        for _, m in fsdp_modules(self.root):
            m.reshard()

    def sum_sequence_shares(self, model: torch.nn.Module) -> None:
        """Nothing: FSDP2's reduce-scatter sums the sequence group's shares (``loss_scale``)."""

    # -- errors ---------------------------------------------------------------------------------------------------

    def recoverable(self) -> bool:
        return self.world_size > 1 and not self.broken

    @contextlib.contextmanager
    def collectives(self) -> Iterator[None]:
        """A region whose collectives the other ranks are running too (an FSDP2 forward or backward).

        An error here cannot be agreed on: the other ranks wait in a collective this rank will not join. So the
        failing rank publishes its message in the process group's store and closes its process groups; the other
        ranks' collectives then fail at once (gloo: "connection closed by peer"), they find the message, close
        theirs too and raise an error naming the failing rank and its message.
        """
        if self.world_size == 1:
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

    def _published(self, store: Any, rank: int, wait: bool) -> list[tuple[int, str]]:
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

    # -- refusals -------------------------------------------------------------------------------------------------

    def check_prefix_mode(self, mode: str, splits: bool) -> None:
        if splits and mode != "recompute":
            raise ValueError(
                f"prefix_activations={mode!r} with an FSDP2 model and a budget that splits a group: a "
                "prompt's deferred backward must run inside the root module's call under FSDP2, which only "
                "'recompute' does. Use prefix_activations='recompute' (or None, which picks it under FSDP2)."
            )

    def check_grad_logprobs(self) -> None:
        raise ValueError(
            "sharedprefix.logprobs with grad enabled is not supported on an FSDP2 model: its backward would run "
            "outside sharedprefix's rounds (a kept graph: FSDP2's gradient sync and the ranks' agreed collectives are "
            "set per round), or inside the caller's backward (deferred), where FSDP2 takes every forward for an "
            "activation-checkpointing recomputation and reshards no unit after it, gathering the whole model at once. "
            "Use sharedprefix.backward for the policy step (and logprobs under torch.no_grad() for old-policy and "
            "reference log-probs); the sharedprefix TRL trainers do."
        )

    def check_aux_term(self, name: str) -> None:
        raise ValueError(
            f"{name}'s MoE load-balancing loss with an FSDP2 model: sharedprefix adds its "
            "per-pass linear term to a tensor that is not among the outputs FSDP2 registers its pre-backward hooks "
            "on, which it does not support. Use DDP or one process, or leave the loss out (aux_loss_coef=0.0; TRL: "
            "router_aux_loss_coef=0.0)."
        )

    def sequence_refusals(self, model: torch.nn.Module) -> dict[str, str]:
        why = fsdp_mesh_refusal(model, self.sequence)
        return {"FSDP2": why} if why else {}

    def check_cache_path(self, name: str, why_hybrid: str) -> None:
        super().check_cache_path(name, why_hybrid)
        raise ValueError(
            f"{name} is a hybrid model (layers that mix tokens outside attention) sharded with "
            "FSDP2; sharedprefix's hybrid path runs the model's own cache-aware forward, which it does not run inside "
            "FSDP2's unshard and reshard hooks (its cache path). Use DDP (supported) or a single process." + why_hybrid
        )

    def compiled_refusal(self) -> str | None:
        return "FSDP2 and tensor parallelism are not yet run through compiled layers"
