"""What ``sp.logprobs`` returns, what ``loss_fn`` receives, and what ``sp.backward`` reports.

Notation: N = output rows (completions in group order, or the rows of a ``Tree``), W = columns
(the longest completion, or the longest row), n = rows of one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PREFIX_MODES = ("keep", "offload", "recompute")
REDUCTIONS = ("sum", "mean")


@dataclass
class LogProbs:
    """Per-token results: completions in group order (N, T), or a tree's rows aligned with them (N, L).

    Attributes:
        logprobs: (N, W) natural-log probability of each reported token; 0 elsewhere.
        mask: (N, W) bool, True on reported tokens (a completion's tokens; a row's trained tokens, t >= 1).
        entropy: (N, W) entropy in nats of each predicted distribution, or None.
        aux_loss: () float32, the MoE load-balancing loss the plain forward of all N rows as one batch returns
            (``output_router_logits=True``; see ``sharedprefix.model.router``), with grad when grad is enabled;
            else None.
    """

    logprobs: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None
    aux_loss: torch.Tensor | None = None


@dataclass
class Batch:
    """What ``loss_fn`` receives: a subset of the output rows, each whole.

    Attributes:
        logprobs / mask / entropy: (n, W) as in ``LogProbs`` (W is the global width).
        index: (n,) int64 positions of these rows in 0..N-1.
    """

    logprobs: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None
    index: torch.Tensor


@dataclass
class BackwardResult:
    """``loss``: total loss of this rank (float; with ``aux_loss_coef``, ``coef * aux_loss`` included). Statistics:
    tokens computed (recomputation included), tokens a plain run computes, passes run, calls of ``loss_fn``, peak
    accelerator memory in bytes (None on CPU, where no allocator statistic exists), bytes offloaded, and
    zero-gradient rounds run only to match other FSDP2 ranks' collectives. ``aux_loss``: the MoE load-balancing
    loss of all rows (the plain forward's ``aux_loss``, float) when ``aux_loss_coef`` was given, else None."""

    loss: float
    tokens_computed: int
    tokens_plain: int
    passes: int
    loss_calls: int
    peak_memory_bytes: int | None
    offloaded_bytes: int = 0
    dummy_rounds: int = 0
    aux_loss: float | None = None
