"""sharedprefix: compute each prompt once in GRPO/PPO-style training, with the same
log-probs and gradients as the plain per-row computation."""

from sharedprefix.layout.groups import Group
from sharedprefix.layout.rows import Tree
from sharedprefix.schedule.planner import Plan, plan
from sharedprefix.schedule.runner import BackwardResult, Batch, LogProbs, backward, logprobs
from sharedprefix.schedule.sharding import shard_groups

__version__ = "0.1.0"
__all__ = ["Batch", "BackwardResult", "Group", "LogProbs", "Plan", "Tree", "backward", "logprobs", "plan",
           "shard_groups"]
