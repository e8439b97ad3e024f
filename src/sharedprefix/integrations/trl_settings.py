"""The settings sharedprefix adds to a TRL config (``SharedPrefixSettings``) and their check (``checked_settings``),
shared by the synchronous trainers (``integrations.trl``) and the asynchronous one (``integrations.trl_async``),
which import them from here so that neither imports the other.

A trainer may be given TRL's own config (``GRPOConfig``, ``RLOOConfig``, ``AsyncGRPOConfig``), as a user swapping
only the trainer class writes: every setting is read through ``setting``, which gives the field's default where the
config does not have it.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from sharedprefix.schedule.results import PREFIX_MODES

__all__ = ["SharedPrefixSettings", "checked_settings", "setting"]


@dataclass
class SharedPrefixSettings:
    """The settings of sharedprefix that ``SharedPrefixGRPOConfig`` and ``SharedPrefixRLOOConfig`` add to TRL's.

    Args:
        sharedprefix_max_tokens: tokens one pass may hold. None: every microbatch runs as one packed
            pass. Set it to bound memory: groups larger than the budget compute their prompt once and
            their completions in several passes (exact; the policy pass then costs one extra
            no-grad forward of the packed layout).
        sharedprefix_prefix_activations: "keep" | "offload" | "recompute", see ``sp.backward``.
        sharedprefix_group_microbatches: False (default): the microbatches are TRL's (its row shuffle across the
            generation batch), so the parameters follow TRL's trainer's for every setting. True: each microbatch
            holds whole groups (all ``num_generations`` rows of a prompt, as far as the microbatch size allows), so
            the policy pass computes each prompt once per step instead of once per microbatch it falls in. The
            same rows in another order: an equally valid sampling of GRPO/RLOO, but NOT TRL's trainer's result
            wherever microbatch membership matters (``membership_matters``: more than one microbatch per generation
            batch, and either an optimizer step inside a generation batch or a loss normalised per microbatch);
            the trainer warns when built with it on in that case.
        sharedprefix_step: True (default): the micro-steps of one optimizer step that come from one generation batch
            (the asynchronous trainer: all of them) run their policy passes as one ``sp.plan_step`` step
            (``integrations.trl_step``): each prompt computed once per optimizer step, TRL's microbatches kept, the
            same parameters. False: each microbatch's policy pass on its own (each prompt once per microbatch it has
            rows in).
        sharedprefix_step_cached_tokens: the most tokens of shared prompts one step holds between its micro-steps
            (``sp.plan_step``'s ``max_cached_tokens``). None (default): no bound. A step that would hold more runs as
            consecutive parts within the bound (each part computes its shared prompts once), which the logged
            ``sharedprefix/step_tokens_computed`` shows; never an error.
    """

    sharedprefix_max_tokens: int | None = field(
        default=None, metadata={"help": "tokens one sharedprefix pass may hold"}
    )
    sharedprefix_prefix_activations: str = field(default="keep", metadata={"help": "keep | offload | recompute"})
    sharedprefix_group_microbatches: bool = field(
        default=False,
        metadata={
            "help": "keep whole groups inside one microbatch (not TRL's microbatches: other parameters than TRL's "
            "trainer wherever microbatch membership matters)"
        },
    )
    sharedprefix_step: bool = field(
        default=True,
        metadata={"help": "run an optimizer step's microbatches as one sharedprefix step (each prompt once per step)"},
    )
    sharedprefix_step_cached_tokens: int | None = field(
        default=None,
        metadata={"help": "the most tokens of shared prompts one sharedprefix step holds (None: no bound)"},
    )


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(SharedPrefixSettings) if f.default is not MISSING}


def setting(args: Any, name: str) -> Any:
    """The sharedprefix setting ``name`` (a field of ``SharedPrefixSettings``) of a trainer's config ``args``: its
    value, or the field's default where ``args`` is TRL's own config, which has no such field."""
    return getattr(args, name, _DEFAULTS[name])


def checked_settings(trainer) -> tuple[int | None, str]:
    """(budget, prefix mode) of a sharedprefix TRL ``trainer``'s config, validated; fp16 loss scaling refused."""
    a = trainer.args
    budget = setting(a, "sharedprefix_max_tokens")
    mode = setting(a, "sharedprefix_prefix_activations")
    if mode not in PREFIX_MODES:
        raise ValueError(f"sharedprefix_prefix_activations={mode!r}; expected one of {PREFIX_MODES}.")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"sharedprefix_max_tokens={budget!r}; expected a positive int or None.")
    grouped = setting(a, "sharedprefix_group_microbatches")
    if not isinstance(grouped, bool):
        raise ValueError(
            f"sharedprefix_group_microbatches={grouped!r}; expected True (whole groups per microbatch) or False "
            "(TRL's own microbatches, the default)."
        )
    cap = setting(a, "sharedprefix_step_cached_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise ValueError(
            f"sharedprefix_step_cached_tokens={cap!r}; expected None (no bound) or a number of tokens >= 0: the most "
            "tokens of shared prompts one step holds between its micro-steps."
        )
    step = setting(a, "sharedprefix_step")
    if not isinstance(step, bool):
        raise ValueError(
            f"sharedprefix_step={step!r}; expected True (an optimizer step's microbatches as one sharedprefix step, "
            "the default) or False (each microbatch on its own)."
        )
    if getattr(a, "fp16", False):
        raise ValueError(
            f"fp16=True (float16 mixed precision with loss scaling) is not supported by {type(trainer).__name__}: "
            "its deferred backward runs inside sharedprefix, outside the gradient scaler. Use bf16=True (or "
            "float32) instead."
        )
    return budget, mode
