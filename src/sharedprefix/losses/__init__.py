"""Pure loss functions over log-probs (GRPO family), additive over completions."""

from sharedprefix.losses.grpo import LOSS_TYPES, group_advantages, kl_k3, normalizer, policy_loss

__all__ = ["LOSS_TYPES", "group_advantages", "kl_k3", "normalizer", "policy_loss"]
