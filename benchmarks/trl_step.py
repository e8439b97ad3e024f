"""What one sharedprefix step per optimizer step (``sharedprefix_step``, the default) saves in SharedPrefixGRPOTrainer:
tokens and time of the policy passes against each microbatch on its own (``sharedprefix_step=False``), whole groups
per microbatch (``sharedprefix_group_microbatches=True``, which steps off) and TRL's own ``GRPOTrainer``.

Rows: G (``num_generations``) / rows a microbatch / ``gradient_accumulation_steps`` (= ``steps_per_generation``: one
optimizer step per generation batch), so a group of G falls across G / rows microbatches or more (TRL's shuffle).
``grad tokens``: tokens through the first decoder layer with grad enabled per optimizer step (a forward pre-hook),
against the ideal (each distinct prompt of the step once, each completion token once); ``no-grad``: the policy's
tokens without grad in ``training_step`` outside generation and scoring (a deferred call's forward: the step's and a
budget's policy passes run their microbatch's own tokens once without grad, then with grad in the backward); TRL's
rows are padded, and its padding counts. ``policy s/step``: ``training_step`` time minus generation and scoring;
``train() s/step``: the whole ``train()`` over the steps (generation included), median over rounds, the four settings
interleaved (A B C D A B C D ...), one thread. Run:

  PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/trl_step.py > benchmarks/trl_step_cpu.txt
  PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/trl_step.py --large > benchmarks/trl_step_large_cpu.txt
  PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/trl_step.py --large --completion-tokens 64 \
    > benchmarks/trl_step_large_t64_cpu.txt  # and 128: trl_step_large_t128_cpu.txt
"""

import contextlib
import io
import random
import statistics
import sys
import tempfile
import time
import warnings

import torch
import transformers as tf
from trl import GRPOConfig, GRPOTrainer

from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer
from sharedprefix.model.adapter import unwrap
from sharedprefix.model.hooks import allow_hook
from sharedprefix.recipes.grpo.tasks import KeyValueTask, build_tokenizer

T, STEPS, ROUNDS = 8, 2, 2  # completion tokens at most, optimizer steps a run, rounds
# --completion-tokens N: completions of at most N tokens (the default 8 is the step's worst case: its microbatch
# passes are small, where a pass's fixed costs weigh most; RL completions are usually far longer)
if "--completion-tokens" in sys.argv:
    T = int(sys.argv[sys.argv.index("--completion-tokens") + 1])
ROWS = [(8, 8, 2), (8, 8, 4), (16, 4, 4), (16, 8, 8)]  # G / rows a microbatch / GA (= steps_per_generation)
TASK = KeyValueTask(records=24)
# --large: a model and prompts where the policy passes' arithmetic outweighs the host work (hidden 512, 4 layers,
# prompts of ~200 tokens), at 8 / 8 / 4, to compare time with the FLOP ratio against TRL's trainer
LARGE = "--large" in sys.argv
if LARGE:
    ROWS, TASK = [(8, 8, 4)], KeyValueTask(records=64)
SETTINGS = {
    "steps (default)": dict(),
    "per microbatch": dict(sharedprefix_step=False),
    "whole groups": dict(sharedprefix_group_microbatches=True),
    "TRL GRPOTrainer": None,
}


def dataset(n=64):
    import datasets

    rng = random.Random(0)
    samples = [TASK.sample(rng) for _ in range(n)]
    return datasets.Dataset.from_dict({"prompt": [s.prompt for s in samples], "answer": [s.answer for s in samples]})


def reward(completions, answer, **kw):
    return [TASK.reward(c, a) + 0.1 * len(c.split()) for c, a in zip(completions, answer)]


def model(tok):
    size = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8, head_dim=64)
    if not LARGE:
        size = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, head_dim=32)
    cfg = tf.Qwen3Config(
        vocab_size=len(tok),
        **size,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.Qwen3ForCausalLM(cfg)


def measured(base):
    """``base`` counting tokens per optimizer step and timing its policy passes."""

    class Measured(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.step_s, self.gen_s, self.in_gen, self.in_step = [], 0.0, False, False
            self.grad, self.nograd, self.prompts, self.completions = {}, {}, {}, {}
            unwrap(self.model).model.layers[0].register_forward_pre_hook(allow_hook(self._count), with_kwargs=True)

        def _count(self, module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            n, s = h.shape[0] * h.shape[1], self.state.global_step
            if torch.is_grad_enabled():
                self.grad[s] = self.grad.get(s, 0) + n
            elif self.in_step and not self.in_gen:
                self.nograd[s] = self.nograd.get(s, 0) + n

        def _generate_and_score_completions(self, batch):
            t0, self.in_gen = time.perf_counter(), True
            try:
                return super()._generate_and_score_completions(batch)
            finally:
                self.in_gen = False
                self.gen_s += time.perf_counter() - t0

        def _prepare_inputs(self, batch):
            inputs = super()._prepare_inputs(batch)
            s = self.state.global_step
            for ids, mask in zip(inputs["prompt_ids"], inputs["prompt_mask"]):
                self.prompts.setdefault(s, set()).add(tuple(ids[mask.bool()].tolist()))
            self.completions[s] = self.completions.get(s, 0) + int(inputs["completion_mask"].sum())
            return inputs

        def training_step(self, *a, **kw):
            gen0, t0, self.in_step = self.gen_s, time.perf_counter(), True
            try:
                return super().training_step(*a, **kw)
            finally:
                self.in_step = False
                self.step_s.append(time.perf_counter() - t0 - (self.gen_s - gen0))

        def ideal(self, s):
            return sum(len(p) for p in self.prompts[s]) + self.completions[s]

    return Measured


def run(init, tok, out, g, rows, ga, settings):
    base = dict(
        output_dir=out,
        max_steps=STEPS,
        learning_rate=1e-3,
        optim="sgd",
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=True,
        bf16=False,
        num_generations=g,
        per_device_train_batch_size=rows,
        steps_per_generation=ga,
        gradient_accumulation_steps=ga,
        max_completion_length=T,
        beta=0.0,
        gradient_checkpointing=False,
        logging_steps=STEPS,
    )
    cls, cfg = (GRPOTrainer, GRPOConfig) if settings is None else (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig)
    args = cfg(**base, **(settings or {}))
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its logs
        warnings.simplefilter("ignore")
        trainer = measured(cls)(
            model=init, reward_funcs=reward, args=args, train_dataset=dataset(), processing_class=tok
        )
        t0 = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - t0
    steps = sorted(trainer.grad)
    ratio = statistics.mean(trainer.grad[s] / trainer.ideal(s) for s in steps)
    nograd = statistics.mean(trainer.nograd.get(s, 0) / trainer.ideal(s) for s in steps)
    per_step = sum(trainer.step_s) / STEPS
    return ratio, nograd, per_step, total / STEPS


def main():
    torch.set_num_threads(1)
    tok = build_tokenizer()
    plen = statistics.mean(len(tok(TASK.sample(random.Random(i)).prompt).input_ids) for i in range(8))
    shape = "hidden 512, 4 layers" if LARGE else "hidden 128, 2 layers"
    print(
        f"small Qwen3 ({shape}), float32, CPU, 1 thread; kv task prompts of ~{plen:.0f} tokens, "
        f"completions <= {T} tokens, {STEPS} optimizer steps a run, {ROUNDS} rounds; torch {torch.__version__}"
    )
    print("| G / rows / GA | setting | grad tokens / ideal | no-grad tokens / ideal | policy s/step | train() s/step |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        model(tok).save_pretrained(f"{d}/init")
        for g, rows, ga in ROWS:
            res: dict = {name: [] for name in SETTINGS}
            for r in range(ROUNDS):
                for name, settings in SETTINGS.items():
                    res[name].append(run(f"{d}/init", tok, f"{d}/o{g}{rows}{ga}{r}", g, rows, ga, settings))
            for name, runs in res.items():
                ratio, nograd = runs[-1][0], runs[-1][1]
                policy = statistics.median(x[2] for x in runs)
                total = statistics.median(x[3] for x in runs)
                print(f"| {g} / {rows} / {ga} | {name} | {ratio:.2f} | {nograd:.2f} | {policy:.3f} | {total:.3f} |")
            # the policy passes' FLOP ratio against TRL's trainer (a token's forward 1, its backward 2, attention's
            # quadratic part left out) and their time ratio
            flops = {n: 3 * r[-1][0] + r[-1][1] for n, r in res.items()}
            times = {n: statistics.median(x[2] for x in r) for n, r in res.items()}
            trl, ours = "TRL GRPOTrainer", "steps (default)"
            print(
                f"{g} / {rows} / {ga}: policy FLOP ratio TRL / steps {flops[trl] / flops[ours]:.2f}, time ratio "
                f"{times[trl] / times[ours]:.2f} ({times[trl] / times[ours] / (flops[trl] / flops[ours]):.2f} of it)"
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
