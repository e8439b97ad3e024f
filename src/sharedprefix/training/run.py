"""``sharedprefix train``: set up model, tokenizer and task, run the GRPO loop, report.

Everything the user gave is checked before anything is written: the model folder must exist
and hold a causal LM, the task must exist, the options must make sense. Metrics and
checkpoints are written atomically.
"""

from __future__ import annotations

import json
import os
import time
from importlib import resources

import torch

from sharedprefix.training.loop import TrainConfig, Trainer, read_metrics, write_metrics
from sharedprefix.training.report import plot_metrics, speed_comparison, summarize
from sharedprefix.training.tasks import build_tokenizer, make_task


def load_model(cfg: TrainConfig, tokenizer):
    """The embedded default (random weights from the packaged config) or a local checkpoint folder."""
    import transformers as tf

    if cfg.model is None:
        spec = json.loads(resources.files("sharedprefix").joinpath("data/default_model.json").read_text())
        spec.pop("model_type")
        config = tf.Qwen3Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **spec)
        config._attn_implementation = "sdpa"
        torch.manual_seed(cfg.seed)
        return tf.Qwen3ForCausalLM(config)
    load_config(cfg.model)
    return tf.AutoModelForCausalLM.from_pretrained(cfg.model, local_files_only=True, attn_implementation="sdpa",
                                                   dtype=torch.float32)


def load_config(path: str):
    """The checkpoint's config; refuses folders without one and models that are not causal LMs."""
    import transformers as tf

    check_model_folder(path)
    try:
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {path!r} holds no readable transformers config ({str(e)[:200]}).") from None
    if type(config) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"--model {path!r} is a {config.model_type!r} model, which is not a causal LM; "
                         "sharedprefix trains causal language models.")
    return config


def check_model_folder(path: str) -> None:
    if not os.path.isdir(path):
        raise ValueError(f"--model {path!r} is not a folder; expected a local transformers checkpoint folder "
                         "(with config.json and weights). Models are not downloaded.")


def load_tokenizer(cfg: TrainConfig):
    import transformers as tf

    if cfg.model is None:
        return build_tokenizer()
    check_model_folder(cfg.model)
    try:
        tok = tf.AutoTokenizer.from_pretrained(cfg.model, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {cfg.model!r} holds no usable tokenizer ({str(e)[:200]}).") from None
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer in {cfg.model!r} has no EOS token; completions need one to stop.")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def check_config(cfg: TrainConfig):
    for name in ("group_size", "prompts_per_step", "steps", "max_new_tokens", "checkpoint_every"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}={getattr(cfg, name)}; expected a positive integer.")
    if cfg.group_size < 2:
        raise ValueError(f"group_size={cfg.group_size}; GRPO needs at least 2 completions per prompt.")
    if cfg.warmup_steps < 0:
        raise ValueError(f"warmup_steps={cfg.warmup_steps}; expected >= 0.")
    if not cfg.temperature > 0:
        raise ValueError(f"temperature={cfg.temperature}; expected > 0.")


def train(cfg: TrainConfig) -> int:
    from tqdm import tqdm

    from sharedprefix.training import distributed as dist

    check_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    task = make_task(cfg.task, records=cfg.records)
    if cfg.model is not None:
        check_model_folder(cfg.model)
        load_config(cfg.model)
    tokenizer = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer)
    ctx = dist.setup(model)
    if cfg.prompts_per_step < ctx.world_size:
        ctx.close()
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} is smaller than the {ctx.world_size} ranks; every "
                         "rank needs at least one prompt (whole groups per rank). Raise prompts_per_step.")
    trainer = Trainer(cfg, ctx.model, tokenizer, task, ctx=ctx)
    ckpt = os.path.join(cfg.output, "checkpoint")
    metrics_path = os.path.join(cfg.output, "metrics.jsonl")
    if ctx.is_main:
        os.makedirs(cfg.output, exist_ok=True)
    if cfg.resume and os.path.isdir(ckpt):
        trainer.load(ckpt)
        print(f"resumed from {ckpt} at step {trainer.step}")
    rows = [r for r in read_metrics(metrics_path) if r["step"] < trainer.step] if cfg.resume else []
    if not trainer.warm_done:
        t0 = time.perf_counter()
        trainer.warmup()
        if ctx.is_main:
            print(f"warm-up: {cfg.warmup_steps} supervised steps on the answer format in {time.perf_counter() - t0:.1f}s")
    bar = tqdm(total=cfg.steps, initial=trainer.step, disable=not ctx.is_main, desc="GRPO", dynamic_ncols=True)
    while trainer.step < cfg.steps:
        row = trainer.train_step()
        if ctx.is_main:
            rows.append(row)
            write_metrics(metrics_path, rows)
            bar.set_postfix(reward=f"{row['reward']:.2f}", loss=f"{row['loss']:+.3f}",
                            tok_s=f"{row['tokens_per_s']:.0f}")
            bar.update(1)
        if trainer.step % cfg.checkpoint_every == 0 or trainer.step == cfg.steps:
            if ctx.is_main:
                trainer.save(ckpt)
            ctx.barrier()
    bar.close()
    if ctx.is_main:
        plot_metrics(rows, os.path.join(cfg.output, "reward.png"))
        print(summarize(rows))
        if cfg.bench:
            print(speed_comparison(trainer))
    ctx.close()
    return 0
