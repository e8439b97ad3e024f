"""Planning passes under a token budget, the prefix K/V cache, and running forward/backward over a plan."""

from sharedprefix.schedule.planner import Pass, Plan, PrefixBackward, plan
from sharedprefix.schedule.results import BackwardResult, Batch, LogProbs

__all__ = ["Batch", "BackwardResult", "LogProbs", "Pass", "Plan", "PrefixBackward", "plan"]
