"""How one call runs over the ranks: the ``Engine`` the schedule asks instead of branching on a kind of parallelism.

One engine per call, made by ``parallel.detect.detect`` from the model as the user passed it and dropped with the
call (nothing is set on the model); the engines are registered in ``parallel.engines``: one process, DDP, FSDP2.
Two kinds of parallelism compose with any of them as attributes: transformers' tensor parallelism as the degree
``tensor`` (``parallel.tensor``) and Ulysses sequence parallelism as the group ``sequence`` (``parallel.sequence``).

Gradient semantics: the loss of the whole global batch is the sum of every rank's ``loss_fn`` values (with
normalisers computed for the global batch), so the gradients of the ranks are *summed*, once per call (``sync=True``)
or not at all (``sync=False``, for accumulation; the last call of the optimizer step syncs what was accumulated).
How an engine sums them is its module's docstring. Failures before any collective of a call are agreed on in one
all-reduce of an error flag (``agree_on_error``); an engine's errors among its own collectives: its ``collectives``.

Adding an engine: one module under ``parallel/engines/`` with a subclass of ``Engine``, and one entry in
``parallel.engines.ENGINES``. Its abstract members are the decisions every engine states; the other members default
to one process's (no collectives, nothing refused; a step's terms: ``parallel.engine_step``), overridden as needed.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

import torch
import torch.distributed as dist

from sharedprefix.parallel.engine_step import StepTerms
from sharedprefix.parallel.grad_hooks import DeferredGradHooks
from sharedprefix.parallel.sequence import comm_device, reduce_grads
from sharedprefix.parallel.tensor import refuse_with_sequence_group

_CALLS = itertools.count()  # the n-th sharedprefix call of this process: the same n on every rank (keys errors)
R = TypeVar("R")


class Transaction(Protocol):
    """One call's gradient held aside, as an engine finishes it (``schedule.grads.GradTransaction``)."""

    held: dict[torch.Tensor, torch.Tensor]

    def deliver(self, into: dict | None = None) -> None: ...

    def collect(self) -> dict[torch.Tensor, torch.Tensor]: ...


class Engine(StepTerms, abc.ABC):
    """How one call runs over the ranks. ``root``: the module the engine runs (the FSDP2 root, which may be a wrapper
    of the causal LM; else the causal LM); ``world_size``: every rank; ``tensor``: the tensor-parallel degree;
    ``data_size``: the ranks gradients are summed over (FSDP2's mesh, DDP's process group: not every rank where
    tensor parallelism splits the world)."""

    name: ClassVar[str]  # the engine in messages ("DDP")

    def __init__(self, root: Any, world_size: int = 1, tensor: int = 1, data_size: int = 1):
        self.root, self.world_size, self.tensor, self.data_size = root, world_size, tensor, data_size
        self.sequence: Any = None  # the call's sequence-parallel process group (``use_sequence``), or None
        self.call_id = -1  # set by ``start``
        self.broken = False  # an error left a collective-bearing region: this call's process group is closed
        self.hooks: DeferredGradHooks | None = None  # the parameters' post-accumulate-grad hooks, once per call
        self._last = False  # the round running is the call's last with a backward (``begin_backward_round``)

    # -- which engine ------------------------------------------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def match(cls, model: torch.nn.Module, root: torch.nn.Module, world: int, tensor: int) -> Engine | None:
        """This engine for ``model`` (as passed, a compile wrapper peeled) whose causal LM is ``root``, or None where
        it is not this engine's; raises ValueError for a wrapping of its kind that it cannot run exactly."""

    @classmethod
    def wrapper_syncs(cls, model: torch.nn.Module) -> bool:
        """False where the user's wrapper says this call must not synchronise gradients (DDP's ``no_sync()``)."""
        return True

    # -- the decisions every engine states ----------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def lockstep(self) -> bool:
        """Every rank must run the same collectives in the same order: the round counts are agreed before the first
        pass, a rank with fewer runs dummy rounds, the plan is reordered (``Plan.for_fsdp``), every pass runs the
        head, and the ranks agree on errors at the end of the rounds."""

    @property
    @abc.abstractmethod
    def backward_through_outputs(self) -> bool:
        """A backward must start from tensors ``call`` returned (FSDP2 registers its pre-backward hooks on them): a
        cached prompt's surrogate loss is computed inside the pass that recomputes it."""

    @property
    @abc.abstractmethod
    def default_prefix_mode(self) -> str:
        """``sp.backward``'s ``prefix_activations`` when the caller passes None."""

    @property
    @abc.abstractmethod
    def replays_tensor_hooks(self) -> bool:
        """The parameters' tensor hooks run once on the call's contribution when it is delivered (False: FSDP2,
        whose sharded parameters get no tensor hook in a plain run either)."""

    @property
    @abc.abstractmethod
    def must_defer(self) -> str | None:
        """Why a grad-enabled ``sp.logprobs`` must defer its backward into sharedprefix (the engine synchronises the
        gradient inside a call), in words ("a DDP model"); None where it need not."""

    # -- how passes run -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Number this call (the same number on every rank: same calls, same order) and set up its gradient hooks."""
        self.call_id = next(_CALLS)
        self.hooks = self.grad_hooks()

    def grad_hooks(self) -> DeferredGradHooks:
        """The call's parameter hooks, set aside during each backward and run once (``parallel.grad_hooks``)."""
        return DeferredGradHooks(self.root)

    def use_sequence(self, group: Any) -> None:
        """Run the call's rows split over the sequence group ``group`` (None: no sequence parallelism)."""
        if group is not None and self.tensor > 1:
            refuse_with_sequence_group(self.tensor)
        self.sequence = group

    def call(self, fn: Callable[[], R], guard: bool = True) -> R:
        """Run one pass, ``fn()``, as the engine runs its module's forward (here: directly). ``guard``: see
        ``collectives``; False only where every rank computes the same thing and so fails together."""
        return fn()

    def gathered(self, params: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager:
        """A block in which ``params`` hold their whole values outside any module's forward (read-only: nothing
        written inside reaches the engine's copy); here they always do. Autograd records a parameter's shape where
        a graph takes it as an input, so a graph built outside a forward is built inside this block."""
        return contextlib.nullcontext()

    def gather_until_backward_ends(self, params: Sequence[torch.Tensor]) -> None:
        """Inside a backward: ``params`` hold their whole values until it ends (autograd accumulates a gradient
        returned for them into ``.grad`` after the node that returned it); here they always do."""
        return None

    def forward_in_call(self, model: torch.nn.Module) -> Callable | None:
        """What computes ``model``'s own logits inside ``call`` (None: the model itself)."""
        return None

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` inside ``collectives``, with the parameters' hooks deferred to ``fire_hooks``."""
        with self.collectives(), self.hooks.during_backward(self._last) if self.hooks else contextlib.nullcontext():
            loss.backward()

    def fire_hooks(self) -> None:
        """Once the call's gradients are complete: each deferred post-accumulate-grad hook, once."""
        if self.hooks is not None:
            self.hooks.fire()

    @contextlib.contextmanager
    def collectives(self) -> Iterator[None]:
        """A region whose collectives the other ranks are running too (here: none)."""
        yield

    def begin_backward_round(self, sync: bool, last: bool) -> None:
        """Before a round with a backward: it reduces gradients (``sync``); it is the call's ``last`` (``backward``)."""
        self.set_sync(sync)
        self._last = last

    def set_sync(self, enabled: bool) -> None:
        """Whether the next backward reduces gradients over the ranks (here: none does)."""
        return None

    def loss_scale(self, grad_reduction: str = "sum") -> float:
        """What each rank's loss is multiplied by before its backward: 1 / S (S: the sequence group's size, 1 without
        one; its shares are summed over the group at the end of the call, ``sum_sequence_shares``)."""
        return 1.0 / self.sequence_size()

    def sequence_size(self) -> int:
        return dist.get_world_size(self.sequence) if self.sequence is not None else 1

    def layout(self) -> str:
        """The engine's kind and sizes, for a plan's fingerprint (``schedule.call_plan.Fingerprint``)."""
        return f"{type(self).__name__}(world={self.world_size}, tensor={self.tensor}, data={self.data_size})"

    def compute_device(self, fallback: torch.device) -> torch.device:
        """The device the passes run on: ``fallback`` (the head's device) unless the engine moves parameters."""
        return fallback

    def param_dtype(self, fallback: torch.dtype) -> torch.dtype:
        """The dtype the parameters are kept in (a plan's fingerprint): ``fallback``, the first registered one's."""
        return fallback

    def prefix_mode(self, requested: str) -> str:
        """The prefix mode a ``sp.backward`` runs in, given the ``requested`` one (validated)."""
        return requested

    # -- errors ---------------------------------------------------------------------------------------------------

    def recoverable(self) -> bool:
        """Whether an error outside the collectives lets this rank finish the call as dummy rounds, then agree."""
        return False

    def agree_on_error(
        self, error: BaseException | None, where: str = "before any computation of", counts: Sequence[int] = ()
    ) -> list[int]:
        """Every rank learns whether any rank failed before the next collective, and all raise together (the failing
        rank its own error, the others one naming it) instead of waiting in a collective the failed rank never
        joins. ``counts`` ride along in the same all-reduce: returns their maximum over the ranks (the round counts
        of a ``lockstep`` engine)."""
        if self.world_size == 1:
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

    # -- the call's gradient ----------------------------------------------------------------------------------------

    def before_grads(self) -> None:
        """Before the call's gradient transaction reads ``.grad`` (``schedule.grads``): here nothing."""
        return None

    def reduces_at_end(self, sync: bool) -> bool:
        """The call's gradient is reduced over the ranks after its rounds (which run no collective), so an error
        in them is agreed on first (``agree_on_error``) and ``finish_grads`` reduces."""
        return False

    def check_rounds(self) -> None:
        """After the rounds, inside the gradient transaction: refuse what they revealed (``.grad`` rolled back)."""
        return None

    def sum_sequence_shares(self, model: torch.nn.Module) -> None:
        """After the rounds: this rank's share of the call's gradient summed over the sequence group."""
        if self.sequence is not None:
            reduce_grads(model, self.sequence)

    def finish_grads(
        self, tx: Transaction, model: torch.nn.Module, sync: bool, grad_reduction: str, collect: bool
    ) -> dict | None:
        """End a successful call's gradient transaction ``tx``: delivered into ``.grad`` (None returned), or with
        ``collect`` (a deferred call's backward) returned as ``{parameter: gradient}``, ``.grad`` untouched."""
        if collect:
            return tx.collect()
        tx.deliver()
        return None

    # -- refusals -------------------------------------------------------------------------------------------------

    def check_prefix_mode(self, mode: str, splits: bool) -> None:
        """Refuse a ``sp.backward`` prefix mode it cannot run (``splits``: the plan splits a group): none here."""
        return None

    def check_sync(self, sync: bool) -> None:
        """Refuse ``sp.backward``'s ``sync`` (False: accumulate without synchronising) where not honoured: none here."""
        return None

    def check_grad_logprobs(self) -> None:
        """Refuse a grad-enabled ``sp.logprobs`` on the packed path: not here."""
        return None

    def check_undeferred(self) -> None:
        """Refuse ``defer=False`` on a grad-enabled ``sp.logprobs`` with a reason of this engine's own, more precise
        than the general refusal of ``must_defer``: not here."""
        return None

    def check_aux_term(self, name: str) -> None:
        """Refuse the MoE load-balancing loss's per-pass gradient term on ``name`` (the model's class): not here."""
        return None

    def sequence_refusals(self, model: torch.nn.Module) -> dict[str, str]:
        """{feature: reason} of what sequence parallelism does not reproduce under this engine."""
        return {}

    def check_cache_path(self, name: str, why_hybrid: str) -> None:
        """Refuse running the hybrid model ``name`` on the cache path (``why_hybrid``: the model's own reason for
        that path, appended to a refusal)."""
        if self.tensor > 1:
            raise ValueError(
                f"{name} is a hybrid model on sharedprefix's cache path, loaded with tensor "
                f"parallelism (tp_size={self.tensor}); that path runs the model's own cache-aware forward and has not "
                "been verified exact under tensor parallelism. Load it without tp_plan (DDP is supported)."
            )

    def compiled_refusal(self) -> str | None:
        """Why compiled decoder layers run eager under this engine (None: they run compiled)."""
        if self.tensor > 1:
            return "FSDP2 and tensor parallelism are not yet run through compiled layers"
        return None
