"""One rank of the TRL-under-DDP step test (torchrun, 2 ranks): TRL's GRPOTrainer with a plain float64 per-row hook
(the exact run) and SharedPrefixGRPOTrainer with its default steps, both DDP over gloo through accelerate, at
``steps_per_generation = gradient_accumulation_steps = 2`` with groups of 4 over microbatches of 2 rows (every group
split across the two micro-steps). Rank 0 writes {"exact": deltas, "ours": deltas, "calls": [...]} to OUT.
With ``moe``: a tiny float32 Qwen3-MoE with ``router_aux_loss_coef`` 0.5 against TRL's own GRPOTrainer (its aux loss
is transformers' float32 one, so there is no float64 reference), the steps carrying each microbatch's aux loss.

Usage: torchrun --nproc_per_node=2 trl_step_worker.py OUT [moe]
"""

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sharedprefix as sp  # noqa: E402
from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import float64_qwen3_norms, moe_model, plain_rows, qwen3_model, train_two_steps  # noqa: E402


def main(out, kind="dense"):
    import pytest
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    tok = build_tokenizer()
    rank = int(os.environ["RANK"])
    init_dir = tempfile.mkdtemp()
    settings = dict(
        num_generations=4,
        per_device_train_batch_size=2,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        gradient_checkpointing=False,
        beta=0.04,
    )
    if kind == "moe":  # the same weights on every rank (seed 0)
        from pathlib import Path

        init_dir, state = moe_model(Path(init_dir), tok, "qwen3_moe")
        init = {n: p.detach().double().clone() for n, p in state.items()}
        reference = GRPOTrainer
    else:
        float64_qwen3_norms(pytest.MonkeyPatch())
        qwen3_model(tok).save_pretrained(init_dir)  # the same weights on every rank (seed 0)
        init = {n: p.detach().double().clone() for n, p in qwen3_model(tok).named_parameters()}
        settings["model_init_kwargs"] = {"dtype": torch.float64}
        reference = plain_rows(GRPOTrainer)

    def delta(trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)
        return torch.cat([(p.detach().double() - init[n]).flatten() for n, p in model.named_parameters()])

    exact = delta(train_two_steps(reference, GRPOConfig, init_dir, tok, tempfile.mkdtemp(), **settings))
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
        aux = [h["aux_loss"] for h in ours_trainer.state.log_history if "aux_loss" in h]
        torch.save({"exact": exact, "ours": ours, "calls": calls, "aux": aux}, out)
    ours_trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, *sys.argv[1:])
