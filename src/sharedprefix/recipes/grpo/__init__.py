"""The GRPO recipe behind ``sharedprefix train``: tasks and tokenizer, config, loop, checkpoints, report."""
