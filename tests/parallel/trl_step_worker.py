"""One rank of the TRL-under-DDP step test (torchrun, 2 ranks): TRL's GRPOTrainer with a plain float64 per-row hook
(the exact run) and SharedPrefixGRPOTrainer with its default steps, both DDP over gloo through accelerate, at
``steps_per_generation = gradient_accumulation_steps = 2`` with groups of 4 over microbatches of 2 rows (every group
split across the two micro-steps). Rank 0 writes {"exact": deltas, "ours": deltas, "microbatch_calls": n} to OUT.

Usage: torchrun --nproc_per_node=2 trl_step_worker.py OUT
"""

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sharedprefix as sp  # noqa: E402
from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import float64_qwen3_norms, plain_rows, qwen3_model, train_two_steps  # noqa: E402


def main(out):
    import pytest
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    tok = build_tokenizer()
    mp = pytest.MonkeyPatch()
    float64_qwen3_norms(mp)
    rank = int(os.environ["RANK"])
    init_dir = tempfile.mkdtemp()
    qwen3_model(tok).save_pretrained(init_dir)  # the same weights on every rank (seed 0)
    init = {n: p.detach().double().clone() for n, p in qwen3_model(tok).named_parameters()}
    settings = dict(
        num_generations=4,
        per_device_train_batch_size=2,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        gradient_checkpointing=False,
        beta=0.04,
        model_init_kwargs={"dtype": torch.float64},
    )

    def delta(trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)
        return torch.cat([(p.detach().double() - init[n]).flatten() for n, p in model.named_parameters()])

    exact = delta(train_two_steps(plain_rows(GRPOTrainer), GRPOConfig, init_dir, tok, tempfile.mkdtemp(), **settings))
    calls = []
    logprobs = sp.logprobs

    def spy(model, source, **kw):
        if torch.is_grad_enabled():
            calls.append((type(source).__name__, kw.get("defer")))
        return logprobs(model, source, **kw)

    sp.logprobs = spy
    ours_trainer = train_two_steps(
        SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, init_dir, tok, tempfile.mkdtemp(), **settings
    )
    ours = delta(ours_trainer)
    if rank == 0:
        torch.save({"exact": exact, "ours": ours, "calls": calls}, out)
    ours_trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1])
