"""What TRL's own microbatches (the default) cost against whole groups per microbatch
(``sharedprefix_group_microbatches=True``) in SharedPrefixGRPOTrainer: time and tokens of the policy passes.

With ``steps_per_generation`` > 1, TRL shuffles the rows of a generation batch and splits them into microbatches, so
a microbatch holds parts of several groups and the policy pass computes each of their prompts; whole groups compute
each prompt once per step. The old-policy and reference passes are over the whole generation batch in both (the same
cost), and at ``steps_per_generation=1`` the one microbatch is the generation batch, so the two settings hold the
same rows.

Measured: a few ``train()`` steps of a small Qwen3 on the kv task (long prompts, short completions), the two
settings interleaved (A B A B ...), one thread. ``policy s/step``: time in ``training_step`` minus generation and
scoring (which holds the no-grad passes), i.e. the policy forward and backward and TRL's loss; ``tokens``: tokens the
policy passes compute (``sp.plan(...).tokens_computed``; a plain per-row run's in brackets); ``train() s/step``:
the whole ``train()`` time over the steps, generation included (median of the rounds). Run:

  PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/trl_order.py > benchmarks/trl_order_cpu.txt
"""

import contextlib
import io
import statistics
import sys
import tempfile
import time
import warnings

import torch
import transformers as tf

import sharedprefix as sp
from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer
from sharedprefix.recipes.grpo.tasks import KeyValueTask, build_tokenizer

G, ROWS, T, ROUNDS = 8, 8, 16, 3  # num_generations, rows a microbatch, completion tokens at most, A/B rounds
TASK = KeyValueTask(records=40)


def dataset(n=64):
    import random

    import datasets

    rng = random.Random(0)
    samples = [TASK.sample(rng) for _ in range(n)]
    return datasets.Dataset.from_dict({"prompt": [s.prompt for s in samples], "answer": [s.answer for s in samples]})


def reward(completions, answer, **kw):
    return [TASK.reward(c, a) + 0.1 * len(c.split()) for c, a in zip(completions, answer)]


def model(tok):
    cfg = tf.Qwen3Config(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.Qwen3ForCausalLM(cfg)


class Timed(SharedPrefixGRPOTrainer):
    """Accumulates the time of training steps and of generation and scoring, and the policy passes' tokens."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.step_s, self.gen_s, self.tokens, self.plain = [], 0.0, 0, 0

    def _generate_and_score_completions(self, batch):
        t0 = time.perf_counter()
        out = super()._generate_and_score_completions(batch)
        self.gen_s += time.perf_counter() - t0
        return out

    def training_step(self, *a, **kw):
        gen0, t0 = self.gen_s, time.perf_counter()
        out = super().training_step(*a, **kw)
        self.step_s.append(time.perf_counter() - t0 - (self.gen_s - gen0))
        return out


def run(init, tok, out, spg, grouped, steps):
    args = SharedPrefixGRPOConfig(
        output_dir=out,
        max_steps=steps,
        learning_rate=1e-3,
        optim="sgd",
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=True,
        bf16=False,
        num_generations=G,
        per_device_train_batch_size=ROWS,
        steps_per_generation=spg,
        max_completion_length=T,
        beta=0.0,
        gradient_checkpointing=False,
        logging_steps=steps,
        sharedprefix_group_microbatches=grouped,
    )
    logprobs = sp.logprobs
    counts = [0, 0]

    def spy(m, source, **kw):
        if torch.is_grad_enabled():
            plan = sp.plan(source, kw.get("max_tokens"))
            counts[0] += plan.tokens_computed
            counts[1] += plan.plain_tokens
        return logprobs(m, source, **kw)

    sp.logprobs = spy
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its logs
            warnings.simplefilter("ignore")
            trainer = Timed(model=init, reward_funcs=reward, args=args, train_dataset=dataset(), processing_class=tok)
            t0 = time.perf_counter()
            trainer.train()
            total = time.perf_counter() - t0
    finally:
        sp.logprobs = logprobs
    return trainer.step_s, total / steps, counts


def main():
    torch.set_num_threads(1)
    tok = build_tokenizer()
    plen = statistics.mean(len(tok(TASK.sample(__import__("random").Random(i)).prompt).input_ids) for i in range(8))
    print(
        f"small Qwen3 (hidden 256, 4 layers), float32, CPU, 1 thread; kv task prompts of ~{plen:.0f} tokens, "
        f"groups of {G}, {ROWS} rows a microbatch, completions <= {T} tokens; torch {torch.__version__}"
    )
    with tempfile.TemporaryDirectory() as d:
        model(tok).save_pretrained(f"{d}/init")
        print("| steps_per_generation | microbatches | policy s/step | train() s/step | policy tokens (plain) |")
        print("|---|---|---|---|---|")
        for spg in (1, 4):
            steps = 2 * spg
            times = {False: [], True: []}
            totals = {False: [], True: []}
            tokens = {}
            for r in range(ROUNDS):
                for grouped in (False, True):
                    s, total, c = run(f"{d}/init", tok, f"{d}/o{spg}{grouped}{r}", spg, grouped, steps)
                    times[grouped] += s[1:] if r == 0 else s  # the first step of the first round warms up
                    totals[grouped].append(total)
                    tokens[grouped] = c
            med = {k: statistics.median(v) for k, v in times.items()}
            tot = {k: statistics.median(v) for k, v in totals.items()}
            for grouped in (False, True):
                name = "whole groups" if grouped else "TRL's (default)"
                c = tokens[grouped]
                print(f"| {spg} | {name} | {med[grouped]:.3f} | {tot[grouped]:.3f} | {c[0]} ({c[1]}) |")
            print(
                f"steps_per_generation={spg}: TRL's / whole groups: policy time {med[False] / med[True]:.2f}x, "
                f"train() time {tot[False] / tot[True]:.2f}x, policy tokens {tokens[False][0] / tokens[True][0]:.2f}x"
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
