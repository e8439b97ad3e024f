"""One call's settings, built and validated once by the public functions (``api.py``) and passed whole below.

``sp.logprobs`` and ``sp.backward`` take their settings as keyword arguments; ``CallOptions.build`` checks every one
of them (value, expectation, fix) and returns a frozen object that the executor, the rounds, the deferred backward
and the hybrid path read from, instead of rows of positional arguments that change names on the way down. Nothing
below ``api.py`` checks a setting again.

A keyword the caller left out is told from one passed by its default, a ``Default`` (``default(1.0)`` in the
signature, shown as ``1.0`` by ``help()``), never by comparing values: a call on a ``CallPlan`` takes the plan's
setting where it left a keyword out and its own wherever it passed one, the default's value included
(``schedule.call``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, TypeVar, cast

import torch

from sharedprefix.attention.kernels import ALIASES, IMPLEMENTATIONS
from sharedprefix.schedule.results import PREFIX_MODES, REDUCTIONS

PrefixMode = Literal["keep", "offload", "recompute"]
Reduction = Literal["sum", "mean"]
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Default:
    """The default of a public keyword, marking it as left out: ``value`` is the documented default, and the repr is
    the value's, so that ``help(sp.logprobs)`` reads ``temperature: float = 1.0``. A call's ``given`` keywords that
    are a ``Default`` were not passed (``passed``); ``schedule.call`` resolves them, to a ``CallPlan``'s setting or to
    ``value``."""

    value: Any

    def __repr__(self) -> str:
        return repr(self.value)


def default(value: T) -> T:
    """``Default(value)``, typed as ``value`` for the signature it is the default of."""
    return cast(T, Default(value))


def passed(given: dict[str, Any]) -> dict[str, Any]:
    """The keywords of ``given`` that the caller passed (those not left at their ``Default``)."""
    return {k: v for k, v in given.items() if not isinstance(v, Default)}


@dataclasses.dataclass(frozen=True)
class CallOptions:
    """``max_tokens``: tokens one pass may hold (None: one pass). ``backend``: the attention primitive's name.
    ``temperature``: logits are divided by it. ``entropy``: also compute entropies. ``prefix_activations``: "keep",
    "offload" or "recompute" (a split prompt's activations). ``grad_reduction``: "sum" or "mean" over data-parallel
    ranks. ``sync``: synchronise gradients at the end of an ``sp.backward``. ``offload_device``: where "offload" puts
    activations. ``sequence_group``: a Ulysses process group (already checked) or None. ``defer``: ``sp.logprobs``'s
    deferral choice. ``aux_loss``: ``sp.logprobs``'s MoE load-balancing loss choice (None: as the config says)."""

    max_tokens: int | None = None
    backend: str = "auto"
    temperature: float = 1.0
    entropy: bool = False
    prefix_activations: PrefixMode = "keep"
    grad_reduction: Reduction = "sum"
    sync: bool = True
    offload_device: str | torch.device | None = "cpu"
    sequence_group: Any = None
    defer: bool | None = None
    aux_loss: bool | None = None

    @classmethod
    def build(cls, **kw) -> CallOptions:
        """The options of one call, every field checked; raises ``ValueError`` / ``TypeError`` naming the bad one.
        A public call builds them inside the ranks' error agreement (``api._options``): a value one rank alone gets
        wrong (a temperature) stops every rank, not leave the others waiting in a collective
        (``tests/parallel/sequence_worker.py``'s ``one_rank_bad``)."""
        opts = cls(**kw)
        opts._check()
        return opts

    def _check(self) -> None:
        check_budget(self.max_tokens)
        if not isinstance(self.backend, str):
            raise TypeError(f"backend={self.backend!r}; expected a backend name such as 'auto'.")
        if self.backend not in backends():
            raise ValueError(
                f"attention backend {self.backend!r} is unknown; expected one of {backends()} "
                "('auto' picks 'cuda' on CUDA tensors and 'cpu' otherwise)."
            )
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or not math.isfinite(t):
            raise ValueError(f"temperature={t!r}; expected a finite number > 0 (the sampling temperature).")
        for name in ("entropy", "sync"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r}; expected True or False.")
        if self.prefix_activations not in PREFIX_MODES:
            raise ValueError(
                f"prefix_activations={self.prefix_activations!r}; expected one of {PREFIX_MODES} or None: 'keep' holds "
                "the prompt's activations, 'offload' moves them to host memory, 'recompute' recomputes them at the end."
            )
        if self.grad_reduction not in REDUCTIONS:
            raise ValueError(f"grad_reduction={self.grad_reduction!r}; expected one of {REDUCTIONS}.")
        if not any(self.defer is v for v in (None, True, False)):
            raise TypeError(f"defer={self.defer!r}; expected None (as the model needs), True or False.")
        if not any(self.aux_loss is v for v in (None, True, False)):
            raise TypeError(f"aux_loss={self.aux_loss!r}; expected None (as the config says), True or False.")
        if self.offload_device is not None and not isinstance(self.offload_device, (str, torch.device)):
            raise TypeError(f"offload_device={self.offload_device!r}; expected a device name or torch.device.")

    def replace(self, **kw) -> CallOptions:
        """A copy with ``kw`` changed (not re-validated: only the library's own derived settings)."""
        return dataclasses.replace(self, **kw)


def backends() -> list[str]:
    """The attention primitive's names ("auto": the device's own); which of them a device runs is decided by
    ``kernels.select`` where the call's device is known."""
    return ["auto", *sorted(IMPLEMENTATIONS), *sorted(ALIASES)]


def check_budget(max_tokens) -> int | None:
    """``max_tokens`` itself: a positive int or None (``sp.plan`` checks it here too)."""
    if max_tokens is None:
        return None
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise TypeError(f"max_tokens={max_tokens!r}; expected a positive int (tokens one pass may hold) or None.")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}; expected a positive number of tokens one pass may hold, or None.")
    return max_tokens
