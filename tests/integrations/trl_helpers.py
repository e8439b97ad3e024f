"""Shared by the TRL ``train()`` comparisons: the config both trainers run under, and one ``train()`` call."""

import warnings


def two_step_args(cfg_cls, out, **settings):
    """``cfg_cls`` (``GRPOConfig`` or ``SharedPrefixGRPOConfig``) for 2 plain-SGD steps at a constant rate of 0.5, on
    CPU in float32, seed 0, logging every step, no saving or reporting; ``settings`` add to or override these."""
    base = dict(
        output_dir=str(out),
        max_steps=2,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=True,
        bf16=False,
    )
    return cfg_cls(**{**base, **settings})


def train(cls, args, **trainer_kwargs):
    """``cls(args=args, **trainer_kwargs)`` built and trained with warnings silenced; returns the trainer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(args=args, **trainer_kwargs)
        trainer.train()
    return trainer
