"""Options of ``sharedprefix train``. Imports nothing heavy, so that ``sharedprefix train --help`` answers
without loading torch or transformers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    task: str = "kv"
    records: int = 48
    model: str | None = None  # a local transformers checkpoint folder; None: the embedded default
    lora_r: int | None = None  # LoRA rank (PEFT, on every linear layer); None: train all weights
    lora_alpha: int = 32
    group_size: int = 8
    prompts_per_step: int = 8
    steps: int = 300
    warmup_steps: int = 30
    lr: float = 1e-3
    warmup_lr: float = 3e-3
    max_new_tokens: int = 3
    temperature: float = 1.0
    max_tokens: int | None = 1024
    prefix_activations: str = "keep"
    loss_type: str = "grpo"
    epsilon: float = 0.2
    seed: int = 0
    output: str = "runs/default"
    checkpoint_every: int = 20
    resume: bool = True
    bench: bool = True
    threads: int | None = None
