"""The smallest `sharedprefix train` run the CLI tests share: 8 records, 2 prompts of 4 completions a step."""

from __future__ import annotations

SMALL = ["--records", "8", "--prompts-per-step", "2", "--group-size", "4", "--warmup-steps", "2", "--no-bench"]


def train_args(steps: int = 2, *extra: str) -> list[str]:
    """argv for a small one-thread run of ``steps`` steps; ``extra`` comes last, so it overrides what precedes it."""
    return ["train", "--steps", str(steps), *SMALL, "--threads", "1", *extra]
