"""``sharedprefix train``: set up model, tokenizer and task, run the GRPO loop, report.

Everything the user gave is checked before anything is written: the model folder must exist
and hold a causal LM, the task must exist, the options must make sense, a checkpoint to resume
from must have been written with the same model and adapter. Metrics, checkpoints and the
trained model are written atomically.

Written to ``--output``: ``metrics.jsonl``, ``reward.png``, ``checkpoint/`` (see ``checkpoint``)
and ``model/``: the trained model and its tokenizer (``save_pretrained``), loadable by
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``; for a LoRA run
the adapter in PEFT's format, whose base is ``--model`` or, for the embedded default,
``base_model/`` (written at the start of the run).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import time
import warnings
from importlib import resources

import torch

from sharedprefix.recipes.grpo import checkpoint
from sharedprefix.recipes.grpo.config import TrainConfig
from sharedprefix.recipes.grpo.loop import Trainer, read_metrics, write_metrics
from sharedprefix.recipes.grpo.report import plot_metrics, speed_comparison, summarize
from sharedprefix.recipes.grpo.tasks import build_tokenizer, make_task


def load_model(cfg: TrainConfig, tokenizer):
    """The embedded default (random weights from the packaged config) or a local checkpoint folder."""
    import transformers as tf

    if cfg.model is None:
        spec = json.loads(resources.files("sharedprefix").joinpath("data/default_model.json").read_text())
        spec.pop("model_type")
        config = tf.Qwen3Config(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **spec,
        )
        config._attn_implementation = "sdpa"
        torch.manual_seed(cfg.seed)
        return tf.Qwen3ForCausalLM(config)
    load_config(cfg.model)
    with checkpoint.transformers_progress_on_terminal_only():
        return tf.AutoModelForCausalLM.from_pretrained(
            cfg.model, local_files_only=True, attn_implementation="sdpa", dtype=torch.float32
        )


def build_model(cfg: TrainConfig, base, resume_from: str | None):
    """The model to train. Full training: ``base`` (from ``load_model``), or the checkpoint's model when
    resuming. LoRA: ``base`` with a new adapter on every linear layer, or with the checkpoint's adapter."""
    import transformers as tf

    folder = None if resume_from is None else os.path.join(resume_from, checkpoint.MODEL_DIR)
    if cfg.lora_r is None:
        if folder is None:
            return base
        with checkpoint.transformers_progress_on_terminal_only():
            return tf.AutoModelForCausalLM.from_pretrained(
                folder, local_files_only=True, attn_implementation="sdpa", dtype=torch.float32
            )
    from peft import LoraConfig, PeftModel, get_peft_model

    with warnings.catch_warnings(), checkpoint.transformers_progress_on_terminal_only():
        # PEFT's constructor reads an attribute transformers 5 deprecated; the warning is not about this run
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        if folder is not None:
            return PeftModel.from_pretrained(base, folder, is_trainable=True)
        torch.manual_seed(cfg.seed)
        return get_peft_model(
            base,
            LoraConfig(
                r=cfg.lora_r,
                lora_alpha=cfg.lora_alpha,
                lora_dropout=0.0,
                target_modules="all-linear",
                task_type="CAUSAL_LM",
            ),
        )


def find_checkpoint(cfg: TrainConfig, folder: str) -> tuple[str | None, dict | None]:
    """(path, trainer state) of the newest whole checkpoint in ``folder`` (or of its replacement a kill
    interrupted), or (None, None); refuses a checkpoint this run cannot continue."""
    if not cfg.resume:
        return None, None
    path = checkpoint.latest(folder)
    if path is None:
        if os.path.exists(folder):
            raise ValueError(
                f"{folder!r} holds no whole checkpoint (no {checkpoint.MARKER!r} marker; a checkpoint "
                "written by an earlier version of sharedprefix?); it cannot be resumed. Remove it, or pass "
                "--no-resume to start over (the first new checkpoint replaces it)."
            )
        return None, None
    state = checkpoint.load_trainer_state(path)
    saved = state["config"]
    keys = ["model", "lora_r"]  # what the weights are: which base, which adapter, and (embedded default) which seed
    if cfg.lora_r is not None:
        keys += ["lora_alpha"] + (["seed"] if cfg.model is None else [])
    diff = [k for k in keys if saved.get(k) != getattr(cfg, k)]
    if diff:
        got = ", ".join(f"{k}={getattr(cfg, k)!r}" for k in diff)
        was = ", ".join(f"{k}={saved.get(k)!r}" for k in diff)
        raise ValueError(
            f"this run has {got} but the checkpoint in {path!r} was written with {was}; its weights "
            "cannot continue this run. Pass the checkpoint's options, or --no-resume to start over, or "
            "another --output."
        )
    return path, state


def load_config(path: str):
    """The checkpoint's config; refuses folders without one and models that are not causal LMs."""
    import transformers as tf

    check_model_folder(path)
    try:
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {path!r} holds no readable transformers config ({str(e)[:200]}).") from None
    if type(config) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"--model {path!r} is a {config.model_type!r} model, which is not a causal LM; sharedprefix trains causal "
            "language models."
        )
    return config


def check_model_folder(path: str) -> None:
    if not os.path.isdir(path):
        raise ValueError(
            f"--model {path!r} is not a folder; expected a local transformers checkpoint folder "
            "(with config.json and weights). Models are not downloaded."
        )


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
    if cfg.lora_r is not None and (cfg.lora_r < 1 or cfg.lora_alpha < 1):
        raise ValueError(
            f"lora_r={cfg.lora_r}, lora_alpha={cfg.lora_alpha}; expected positive integers (or no lora_r, to train all "
            "weights)."
        )
    needed = [("matplotlib", "plot", "the reward plot")] + ([("peft", "trl", "LoRA")] if cfg.lora_r is not None else [])
    for module, extra, what in needed:
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"{what} needs {module}, which is not installed: pip install 'sharedprefix[{extra}]'.")


def train(cfg: TrainConfig) -> int:
    from tqdm import tqdm

    from sharedprefix.recipes.grpo import distributed as dist

    check_config(cfg)
    if cfg.model is not None:
        cfg = dataclasses.replace(cfg, model=os.path.abspath(cfg.model))  # the same in every checkpoint
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    task = make_task(cfg.task, records=cfg.records)
    if cfg.model is not None:
        check_model_folder(cfg.model)
        load_config(cfg.model)
    tokenizer = load_tokenizer(cfg)
    ckpt = os.path.join(cfg.output, "checkpoint")
    found, state = find_checkpoint(cfg, ckpt)
    ctx = dist.setup()
    if cfg.prompts_per_step < ctx.world_size:
        ctx.close()
        raise ValueError(
            f"prompts_per_step={cfg.prompts_per_step} is smaller than the {ctx.world_size} ranks; every "
            "rank needs at least one prompt (whole groups per rank). Raise prompts_per_step."
        )
    if ctx.is_main:
        os.makedirs(cfg.output, exist_ok=True)
    base = load_model(cfg, tokenizer) if cfg.lora_r is not None or found is None else None
    base_dir = None
    if cfg.lora_r is not None:
        base_dir = cfg.model or os.path.join(cfg.output, "base_model")
        if cfg.model is None and ctx.is_main:  # the random base of the embedded default, for the adapter to name
            checkpoint.replace(base_dir, lambda path: checkpoint.save_model(base, tokenizer, path))
    model = ctx.prepare(build_model(cfg, base, found))
    trainer = Trainer(cfg, model, tokenizer, task, ctx=ctx)
    metrics_path = os.path.join(cfg.output, "metrics.jsonl")
    if state is not None:
        trainer.load_state(state)
        if ctx.is_main:
            print(f"resumed from {found} at step {trainer.step}")
    rows = [r for r in read_metrics(metrics_path) if r["step"] < trainer.step] if cfg.resume else []
    if not trainer.warm_done:
        t0 = time.perf_counter()
        trainer.warmup()
        if ctx.is_main:
            print(
                f"warm-up: {cfg.warmup_steps} supervised steps on the answer format in {time.perf_counter() - t0:.1f}s"
            )
    # progress on stderr, only on a terminal (tqdm's disable=None) and only on rank 0
    bar = tqdm(
        total=cfg.steps, initial=trainer.step, disable=None if ctx.is_main else True, desc="GRPO", dynamic_ncols=True
    )
    while trainer.step < cfg.steps:
        row = trainer.train_step()
        if ctx.is_main:
            rows.append(row)
            write_metrics(metrics_path, rows)
            bar.set_postfix(
                reward=f"{row['reward']:.2f}", loss=f"{row['loss']:+.3f}", tok_s=f"{row['tokens_per_s']:.0f}"
            )
            bar.update(1)
        if trainer.step % cfg.checkpoint_every == 0 or trainer.step == cfg.steps:
            if ctx.is_main:
                trainer.save(ckpt, base_dir)
            ctx.barrier()
    bar.close()
    if ctx.is_main:
        checkpoint.finish(ckpt)  # a resume from checkpoint.tmp at the last step leaves it to be renamed in
        out = os.path.join(cfg.output, "model")
        checkpoint.replace(out, lambda path: checkpoint.save_model(trainer.model, tokenizer, path, base_dir))
        plot_metrics(rows, os.path.join(cfg.output, "reward.png"))
        print(summarize(rows))
        kind = f"LoRA adapter (PEFT) of {base_dir}" if base_dir else "model and tokenizer (save_pretrained)"
        print(f"trained {kind}: {out}")
        if cfg.bench:
            print(speed_comparison(trainer))
    ctx.close()
    return 0
