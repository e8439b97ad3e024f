"""sharedprefix: compute each prompt once in GRPO/PPO-style training, with the same
log-probs and gradients as the plain per-row computation.

The public names are imported on first use (PEP 562 module ``__getattr__``), so that a
submodule that needs no torch, the command line's argument parsing, loads without it:
``sharedprefix --help`` answers at once. ``import sharedprefix as sp; sp.backward`` works as
before, and so does ``sp.schedule`` (a subpackage is imported on first access too). Loading a name does nothing
else: the opt-in self-check (``SHAREDPREFIX_SELF_CHECK``) is loaded by the calls themselves (``settings``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_PUBLIC = {
    "Batch": "sharedprefix.api",
    "BackwardResult": "sharedprefix.api",
    "CallPlan": "sharedprefix.api",
    "Group": "sharedprefix.layout.groups",
    "Tree": "sharedprefix.layout.rows",
    "LogProbs": "sharedprefix.api",
    "Plan": "sharedprefix.schedule.planner",
    "allow_hook": "sharedprefix.model.hooks",
    "backward": "sharedprefix.api",
    "logprobs": "sharedprefix.api",
    "plan": "sharedprefix.schedule.planner",
    "plan_call": "sharedprefix.api",
    "plan_step": "sharedprefix.api",
    "Step": "sharedprefix.api",
    "SplitStep": "sharedprefix.api",
    "Microbatch": "sharedprefix.api",
    "shard_groups": "sharedprefix.parallel.sharding",
    "verify": "sharedprefix.tools.verify",
    "VerifyReport": "sharedprefix.tools.verify",
}
__all__ = [
    "Batch",
    "BackwardResult",
    "CallPlan",
    "Group",
    "LogProbs",
    "Microbatch",
    "Plan",
    "SplitStep",
    "Step",
    "Tree",
    "VerifyReport",
    "allow_hook",
    "backward",
    "logprobs",
    "plan",
    "plan_call",
    "plan_step",
    "shard_groups",
    "verify",
]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_PUBLIC})


if TYPE_CHECKING:
    from sharedprefix.api import (
        BackwardResult,
        Batch,
        CallPlan,
        LogProbs,
        Microbatch,
        SplitStep,
        Step,
        backward,
        logprobs,
        plan_call,
        plan_step,
    )
    from sharedprefix.layout.groups import Group
    from sharedprefix.layout.rows import Tree
    from sharedprefix.model.hooks import allow_hook
    from sharedprefix.parallel.sharding import shard_groups
    from sharedprefix.schedule.planner import Plan, plan
    from sharedprefix.tools.verify import VerifyReport, verify
