"""Planning passes under a token budget, the prefix K/V cache, and running forward/backward."""

from sharedprefix.schedule.planner import Pass, Plan, PrefixBackward, plan
from sharedprefix.schedule.runner import BackwardResult, Batch, LogProbs, backward, logprobs
from sharedprefix.schedule.sharding import shard_groups

__all__ = ["Batch", "BackwardResult", "LogProbs", "Pass", "Plan", "PrefixBackward", "backward", "logprobs", "plan", "shard_groups"]
