"""One rank of the TRL-under-DeepSpeed step test (torchrun, 2 gloo ranks, accelerate's DeepSpeed plugin through
``TrainingArguments.deepspeed``): TRL's GRPOTrainer and SharedPrefixGRPOTrainer with its default steps, at ZeRO stages
1, 2 and 3, ``steps_per_generation = gradient_accumulation_steps = 2`` with groups of 4 over microbatches of 2 rows
(every group split across the two micro-steps), float32 (DeepSpeed's buffers are float32 whatever the model's dtype).
Rank 0 writes {stage: {"init", "plain", "ours": parameters, "steps": [(microbatches, state)] planned,
"step_tokens": [(computed, plain)] logged, "calls": [(source type, defer)] of the grad-enabled log-prob calls}} to OUT.

Usage: torchrun --nproc_per_node=2 trl_deepspeed_step_worker.py OUT
"""

import os
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
import torch  # noqa: E402

import sharedprefix as sp  # noqa: E402
from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import qwen3_model, train_two_steps  # noqa: E402


def main(out):
    from trl import GRPOConfig, GRPOTrainer

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no C++ build: gloo collectives
    torch.set_num_threads(1)
    tok = build_tokenizer()
    rank = int(os.environ["RANK"])
    init_dir = tempfile.mkdtemp()
    qwen3_model(tok).save_pretrained(init_dir)  # the same weights on every rank (seed 0)
    planned, calls = [], []
    plan_step, logprobs = sp.plan_step, sp.logprobs

    def spy_plan(model, microbatches, **kw):
        step = plan_step(model, microbatches, **kw)
        planned.append(step)
        return step

    def spy_logprobs(model, source, **kw):
        if torch.is_grad_enabled():
            calls.append((type(source).__name__, kw.get("defer")))
        return logprobs(model, source, **kw)

    sp.plan_step, sp.logprobs = spy_plan, spy_logprobs
    result = {}
    for stage in (1, 2, 3):
        ds = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",  # max_grad_norm=0.0 below: no clipping in either run
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
        }
        settings = dict(
            num_generations=4,
            per_device_train_batch_size=2,
            steps_per_generation=2,
            gradient_accumulation_steps=2,
            deepspeed=ds,
            max_grad_norm=0.0,
            beta=0.1,
        )
        got = {}
        for name, cls, cfg in (
            ("plain", GRPOTrainer, GRPOConfig),
            ("ours", SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig),
        ):
            planned.clear()
            calls.clear()
            t = train_two_steps(cls, cfg, init_dir, tok, tempfile.mkdtemp(), **settings)
            engine = t.model_wrapped
            assert type(engine).__name__ == "DeepSpeedEngine" and engine.zero_optimization_stage() == stage
            assert engine.gradient_accumulation_steps() == 2 and engine.world_size == 2
            named = list(t.model.named_parameters())
            with deepspeed.zero.GatheredParameters([p for _, p in named]):  # ZeRO-3's partitions whole
                got[name] = {n: p.detach().clone() for n, p in named}
            logged = [h for h in t.state.log_history if "loss" in h]
            got[f"{name}/steps"] = [(len(s), s.state) for s in planned]
            got[f"{name}/calls"] = list(calls)
            got[f"{name}/step_tokens"] = [
                (h.get("sharedprefix/step_tokens_computed"), h.get("sharedprefix/step_tokens_plain")) for h in logged
            ]
            t.accelerator.wait_for_everyone()
        result[stage] = got
    result["init"] = {n: p.detach().clone() for n, p in qwen3_model(tok).named_parameters()}
    if rank == 0:
        torch.save(result, out)
    torch.distributed.barrier()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1])
