"""SharedPrefixGRPOTrainer (or with --rloo SharedPrefixRLOOTrainer) on the built-in kv task with a tiny model, on CPU.

Single process:      python examples/trl_grpo.py [OUTPUT_DIR] [--rloo]
Two CPU processes:   accelerate launch --multi_gpu --num_processes 2 examples/trl_grpo.py
                     or torchrun --standalone --nproc_per_node 2 examples/trl_grpo.py
                     (without GPUs, accelerate runs DDP over gloo on the CPU)
"""

import gc
import random
import sys
import tempfile

import datasets
import torch
import transformers as tf

from sharedprefix.integrations.trl import (
    SharedPrefixGRPOConfig,
    SharedPrefixGRPOTrainer,
    SharedPrefixRLOOConfig,
    SharedPrefixRLOOTrainer,
)
from sharedprefix.recipes.grpo.tasks import KeyValueTask, build_tokenizer

task = KeyValueTask(records=12)
tok = build_tokenizer()
rng = random.Random(0)
samples = [task.sample(rng) for _ in range(64)]
data = datasets.Dataset.from_dict({"prompt": [s.prompt for s in samples], "answer": [s.answer for s in samples]})


def reward(completions, answer, **kw):
    # the task's reward, plus a small bonus for answering with a value token (a random-weight model rarely
    # hits the right value in a 4-step demo, and all-zero rewards would give zero advantages)
    return [task.reward(c, a) + 0.1 * c.strip().startswith("v") for c, a in zip(completions, answer)]


cfg = tf.Qwen3Config(
    vocab_size=len(tok),
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    bos_token_id=tok.bos_token_id,
    eos_token_id=tok.eos_token_id,
    pad_token_id=tok.pad_token_id,
)
torch.manual_seed(0)
model = tf.Qwen3ForCausalLM(cfg)
rloo = "--rloo" in sys.argv[1:]
Trainer, Config = (
    (SharedPrefixRLOOTrainer, SharedPrefixRLOOConfig) if rloo else (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig)
)
out = next((a for a in sys.argv[1:] if a != "--rloo"), None) or tempfile.mkdtemp()
args = Config(
    output_dir=out,
    num_generations=4,
    per_device_train_batch_size=8,
    max_steps=4,
    max_completion_length=3,
    learning_rate=1e-3,
    logging_steps=1,
    report_to=[],
    save_strategy="no",
    use_cpu=True,
    bf16=False,
    beta=0.0,
    sharedprefix_max_tokens=48,
    sharedprefix_prefix_activations="recompute",
)
trainer = Trainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
trainer.train()
if trainer.accelerator.is_main_process:
    steps, processes = trainer.state.global_step, trainer.accelerator.num_processes
    print(f"done: {steps} steps of {type(trainer).__name__} on {processes} process(es)")
if torch.distributed.is_available() and torch.distributed.is_initialized():
    # leave the process group while the interpreter is whole: the DDP wrapper's reducer holds the process group, and
    # gloo's threads torn down with it at interpreter exit can abort a rank ("terminate called without an active
    # exception") after a run that finished. So free the wrapper first (accelerate keeps the prepared models too).
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.free_memory()
    del trainer
    gc.collect()
    torch.distributed.destroy_process_group()
