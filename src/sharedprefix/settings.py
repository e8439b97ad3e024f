"""Environment settings: every ``SHAREDPREFIX_*`` variable in one table, read when used (not at import), and a
value outside its allowed ones refused at that use, naming the variable, what it got and what it takes.

The table is ``SETTINGS``; docs/troubleshooting.md shows it to users. A setting implemented outside the core (the
self-check lives in ``tools/verify.py``) names its module in ``plugin``: the core imports it by name when the setting
is on, and the module registers itself (``api.register_call_check``), so that ``from sharedprefix.api import
logprobs`` runs the self-check as ``sp.logprobs`` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    allowed: tuple[str, ...] | None  # None: any value (the reader checks it)
    default: str
    what: str
    plugin: str | None = None  # the module that implements the setting, imported when it is on


SETTINGS = {
    "SHAREDPREFIX_DENSE": Setting(
        ("0", "1"),
        "1",
        "1: run equal-shape cascade calls on the device's dense kernel (cuDNN on Hopper); 0: varlen only",
    ),
    "SHAREDPREFIX_KEEP_LOGITS": Setting(
        ("auto", "always", "never"),
        "auto",
        "whether the head keeps the completion tokens' logits for the backward (auto: when they fit under its cap)",
    ),
    "SHAREDPREFIX_SELF_CHECK": Setting(
        ("0", "1"),
        "0",
        "1: verify each model on its first call's groups against the plain forward, and refuse on a mismatch",
        plugin="sharedprefix.tools.verify",
    ),
    "SHAREDPREFIX_MAX_TOKENS": Setting(
        None, "", "verl: the token budget of one pass (a positive int; read when the engine is built)"
    ),
}


def read(name: str) -> str:
    """The value of setting ``name`` in the environment now (its default when unset or empty)."""
    setting = SETTINGS[name]
    value = os.environ.get(name, "")
    if value == "":
        return setting.default
    if setting.allowed is not None and value not in setting.allowed:
        raise ValueError(
            f"{name}={value!r} in the environment; expected one of {list(setting.allowed)} ({setting.what}). Set one "
            f"of those, or unset it for the default {setting.default!r}."
        )
    return value
