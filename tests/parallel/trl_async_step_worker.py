"""One rank of the asynchronous-trainer-under-DDP test (torchrun, 2 ranks): TRL's AsyncGRPOTrainer (its CPU stand-ins:
the reference varlen attention for FA3, a float64 head, the stub rollout worker and weight sync) and
SharedPrefixAsyncGRPOTrainer with steps on and off, each DDP over gloo through accelerate, float64, 2 optimizer steps
of ``gradient_accumulation_steps=2`` micro-steps, groups of 4 over microbatches of 3 samples a rank (TRL's
FixedCountBatcher: 6 a micro-step, split between the ranks), so groups fall in two micro-steps. Rank 0 writes
{"trl": deltas, "on": deltas, "off": deltas, "calls": {on/off: [grad-enabled sources' kinds]},
"tokens": {on/off: per rank [its logged (computed, plain) policy tokens per optimizer step]}} to OUT.

Usage: torchrun --nproc_per_node=2 trl_async_step_worker.py OUT
"""

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sharedprefix as sp  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support import trl_async as stub  # noqa: E402


def main(out):
    import pytest
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from sharedprefix.integrations.trl_async import SharedPrefixAsyncGRPOConfig, SharedPrefixAsyncGRPOTrainer

    torch.set_num_threads(1)
    tok = build_tokenizer()
    rank = int(os.environ["RANK"])
    path = stub.save_tiny_qwen3(tempfile.mkdtemp(), len(tok))  # the same weights on every rank (seed 0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    samples = stub.rollouts(len(tok), 12, 4, 12, (2, 6))
    settings = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2)

    def delta(trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)
        return torch.cat([(p.detach().double() - init[n]).flatten() for n, p in model.named_parameters()])

    logged = []  # this rank's metrics at each logging step (TRL logs rank 0's)

    class Logged(SharedPrefixAsyncGRPOTrainer):
        def log(self, logs, start_time=None):
            if self.model.training and "sharedprefix/step_tokens_computed" in self._metrics["train"]:
                logged.append({k: list(v) for k, v in self._metrics["train"].items() if k.startswith("sharedprefix/")})
            return super().log(logs, start_time)

    def run(cls, cfg_cls, **kw):
        with pytest.MonkeyPatch.context() as m:
            if cls is AsyncGRPOTrainer:
                stub.patch_trl_kernels(m, float64_head=True, share=True)
            trainer = stub.build(cls, cfg_cls, path, tok, tempfile.mkdtemp(), samples, **settings, **kw)
            return stub.train(trainer)

    got = {"trl": delta(run(AsyncGRPOTrainer, AsyncGRPOConfig)), "calls": {}, "tokens": {}}
    logprobs = sp.logprobs
    for name, on in (("on", True), ("off", False)):
        calls = []

        def spy(model, source, calls=calls, **kw):
            if torch.is_grad_enabled():
                calls.append(type(source).__name__)
            return logprobs(model, source, **kw)

        sp.logprobs = spy
        logged.clear()
        trainer = run(Logged, SharedPrefixAsyncGRPOConfig, sharedprefix_step=on)
        sp.logprobs = logprobs
        got[name], got["calls"][name] = delta(trainer), calls
        mine = [(v["sharedprefix/step_tokens_computed"][-1], v["sharedprefix/step_tokens_plain"][-1]) for v in logged]
        got["tokens"][name] = [None] * 2
        torch.distributed.all_gather_object(got["tokens"][name], mine)
    if rank == 0:
        torch.save(got, out)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1])
