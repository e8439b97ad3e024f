"""One call's settings, built and validated once by the public functions (``api.py``) and passed whole below.

``sp.logprobs`` and ``sp.backward`` take their settings as keyword arguments; ``CallOptions.build`` checks each
(value, expectation, fix) and returns a frozen object that the executor, the rounds, the deferred backward and the
hybrid path read from, instead of rows of positional arguments that change names on the way down.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from sharedprefix.schedule.results import PREFIX_MODES, REDUCTIONS


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
    prefix_activations: str = "keep"
    grad_reduction: str = "sum"
    sync: bool = True
    offload_device: Any = "cpu"
    sequence_group: Any = None
    defer: bool | None = None
    aux_loss: bool | None = None

    @classmethod
    def build(cls, **kw) -> CallOptions:
        """The options of one call, each checked; raises ``ValueError`` / ``TypeError`` naming the bad one. The
        temperature is checked by the executor instead, inside the error agreement of the ranks: a value one rank
        alone gets wrong must stop every rank, not leave the others waiting in a collective
        (``tests/parallel/sequence_worker.py``'s ``one_rank_bad``)."""
        opts = cls(**kw)
        if opts.prefix_activations not in PREFIX_MODES:
            raise ValueError(
                f"prefix_activations={opts.prefix_activations!r}; expected one of {PREFIX_MODES} or None: 'keep' holds "
                "the prompt's activations, 'offload' moves them to host memory, 'recompute' recomputes them at the end."
            )
        if opts.grad_reduction not in REDUCTIONS:
            raise ValueError(f"grad_reduction={opts.grad_reduction!r}; expected one of {REDUCTIONS}.")
        if opts.aux_loss not in (None, True, False):
            raise TypeError(f"aux_loss={opts.aux_loss!r}; expected None (as the config says), True or False.")
        if not isinstance(opts.backend, str):
            raise TypeError(f"backend={opts.backend!r}; expected a backend name such as 'auto'.")
        if opts.offload_device is not None and not isinstance(opts.offload_device, (str, torch.device)):
            raise TypeError(f"offload_device={opts.offload_device!r}; expected a device name or torch.device.")
        return opts

    def replace(self, **kw) -> CallOptions:
        """A copy with ``kw`` changed (not re-validated: only the library's own derived settings)."""
        return dataclasses.replace(self, **kw)
