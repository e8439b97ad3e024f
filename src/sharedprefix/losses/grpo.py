"""GRPO-family losses as pure functions over per-token log-probs.

Notation: N = completions of the whole batch, n = completions of one call (a microbatch or a
pass of ``sp.backward``), T = longest completion, G = group size. All tensors are float32
or float64 natural-log probabilities; masks are bool or {0, 1}.

Every loss here is *additive over completions*: the normaliser (completions, tokens, or
completions x max length) is a number computed once for the whole batch and passed in, so
the sum of the losses of any partition of the batch equals the loss of the batch, which is
what ``sp.backward`` needs. ``normalizer(loss_type, mask, ...)`` computes it from the full mask.

``loss_type`` (TRL's names):
- ``grpo``: mean over each completion's tokens, then mean over completions;
- ``dapo`` / ``bnpo``: sum over all tokens / all tokens of the batch;
- ``dr_grpo``: sum over all tokens / (completions x ``max_completion_length``);
- ``gspo``: sequence-level importance ratio exp(mean_t log(pi/pi_old)), clipped per completion,
  then as ``grpo``.
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo", "gspo")


def group_advantages(rewards: torch.Tensor, group_size: int, scale_std: bool = True, eps: float = 1e-4):
    """(N,) rewards of consecutive groups of ``group_size`` -> (N,) group-relative advantages.

    ``A_i = r_i - mean_group(r)``, divided by ``std_group(r) + eps`` (unbiased std, as TRL) when
    ``scale_std``; Dr. GRPO sets ``scale_std=False``.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)}; expected (N,) with N a multiple of group_size={group_size} "
            "(completions of one prompt stored consecutively)."
        )
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if scale_std:
        std = r.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(adv)
        adv = adv / (std + eps)
    return adv.reshape(-1)


def normalizer(loss_type: str, mask: torch.Tensor, max_completion_length: int | None = None) -> float:
    """The batch-wide constant the summed per-token (or per-sequence) loss is divided by."""
    _check_type(loss_type)
    n = mask.shape[0]
    if loss_type in ("grpo", "gspo"):
        return float(n)
    if loss_type in ("dapo", "bnpo"):
        return float(max(1, int(mask.sum())))
    if max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length (its constant normaliser is N x max length).")
    return float(n * max_completion_length)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): exp(ref - lp) - (ref - lp) - 1 >= 0."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    norm: float,
    loss_type: str = "grpo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
):
    """Clipped policy loss (+ ``beta`` x k3 KL) of n completions, additive over completions.

    Args:
        logprobs: (n, T) log-probs under the policy being trained (with grad).
        old_logprobs: (n, T) log-probs under the sampling policy (no grad).
        advantages: (n,) group-relative advantages.
        mask: (n, T) True on completion tokens.
        norm: batch-wide normaliser from ``normalizer``.
        epsilon / epsilon_high: clip range [1 - epsilon, 1 + epsilon_high] (epsilon_high defaults to epsilon).
        beta: KL coefficient; needs ``ref_logprobs`` (n, T) when > 0.
        entropy: (n, T) entropies in nats, only reported as a metric.

    Returns:
        (loss, metrics): loss a scalar tensor; metrics a dict of *sums* (``tokens``, ``clipped``,
        ``kl``, ``entropy``) so that they too add up over microbatches.
    """
    _check_type(loss_type)
    if beta and ref_logprobs is None:
        raise ValueError(f"beta={beta} needs ref_logprobs (n, T); pass the reference model's log-probs or set beta=0.")
    eps_hi = epsilon if epsilon_high is None else epsilon_high
    m = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)[:, None]
    log_ratio = logprobs - old_logprobs
    if loss_type == "gspo":
        log_ratio = (log_ratio * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp_min(1.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_hi)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if per_token.shape[1] == 1:
        per_token = per_token.expand_as(logprobs)
    kl = None
    if beta:
        kl = kl_k3(logprobs, ref_logprobs)
        per_token = per_token + beta * kl
    if loss_type in ("grpo", "gspo"):
        loss = ((per_token * m).sum(1) / m.sum(1).clamp_min(1.0)).sum() / norm
    else:
        loss = (per_token * m).sum() / norm
    with torch.no_grad():
        is_clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + eps_hi) & (adv > 0))
        metrics = {
            "tokens": float(m.sum()),
            "clipped": float((is_clipped.to(m.dtype).expand_as(m) * m).sum()),
            "kl": float((kl * m).sum()) if kl is not None else 0.0,
            "entropy": float((entropy * m).sum()) if entropy is not None else 0.0,
        }
    return loss, metrics


def _check_type(loss_type: str) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; expected one of {LOSS_TYPES}.")
