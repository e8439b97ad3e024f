"""TRL's trainers under DeepSpeed ZeRO (accelerate's DeepSpeed integration, through ``TrainingArguments.deepspeed``),
one CPU process: GRPOTrainer / RLOOTrainer and ours, 2 SGD steps each. Usage: python trl_deepspeed_worker.py STAGE
OUT. Writes {run: {parameter name: value after training}} and the initial parameters ("init") to OUT.

One process, since accelerate's DeepSpeed plugin did not start on 2 CPU processes (a gloo all-gather error before any
sharedprefix code); ZeRO-1/2 still run their reduction and partitioning hooks at world size 1, and ZeRO-3 still
partitions every parameter (empty outside its module's forward)."""

import os
import sys
import tempfile
from pathlib import Path

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu")
os.environ.setdefault("MASTER_PORT", "29533")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
import torch  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

import sharedprefix as sp  # noqa: E402
from sharedprefix.integrations.trl import (  # noqa: E402
    SharedPrefixGRPOConfig,
    SharedPrefixGRPOTrainer,
    SharedPrefixRLOOConfig,
    SharedPrefixRLOOTrainer,
)
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import qwen3_model, train_two_steps  # noqa: E402
from support.torchrun import settle_gc  # noqa: E402

GA2 = {"gradient_accumulation_steps": 2, "steps_per_generation": 2, "per_device_train_batch_size": 4}
RUNS = {
    "grpo_plain": (GRPOTrainer, GRPOConfig, {}),
    "grpo_ours": (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, {}),
    "grpo_ours_budget": (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, {"sharedprefix_max_tokens": 24}),
    "rloo_plain": (RLOOTrainer, RLOOConfig, {}),
    "rloo_ours_budget": (SharedPrefixRLOOTrainer, SharedPrefixRLOOConfig, {"sharedprefix_max_tokens": 24}),
    # DeepSpeed's gradient_accumulation_steps=2 over one generation batch: an optimizer step's two micro-steps run as
    # one sp.plan_step step (each prompt once per optimizer step), its shared prompts' backward inside the second
    "grpo_plain_ga2": (GRPOTrainer, GRPOConfig, GA2),
    "grpo_ours_ga2": (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, GA2),
    # without gradient checkpointing: deferred all the same (DeepSpeed delivers through its engine.backward)
    "grpo_ours_ga2_budget": (
        SharedPrefixGRPOTrainer,
        SharedPrefixGRPOConfig,
        {**GA2, "sharedprefix_max_tokens": 24, "gradient_checkpointing": False},
    ),
}


def main(stage, out):
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no C++ build: gloo collectives
    tmp = Path(tempfile.mkdtemp())
    tok = build_tokenizer()
    model = qwen3_model(tok)
    model.save_pretrained(tmp / "init")
    result = {"init": {n: p.detach().clone() for n, p in model.named_parameters()}}
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",  # max_grad_norm=0.0 below: no clipping in either run
        "zero_allow_untested_optimizer": True,
        # ZeRO-3 partitions every parameter (its default keeps those under 1e5 entries, all of these, whole)
        "zero_optimization": {
            "stage": int(stage),
            **({"stage3_param_persistence_threshold": 0} if stage == "3" else {}),
        },
    }
    planned = []
    plan_step = sp.plan_step

    def spy(model, microbatches, **kw):  # the steps the trainers plan, to check that they ran
        step = plan_step(model, microbatches, **kw)
        planned.append(step)
        return step

    sp.plan_step = spy
    only = os.environ.get("SP_TRL_RUNS")  # a comma-separated subset, when debugging one run
    for name, (cls, cfg, extra) in RUNS.items():
        if only and name not in only.split(","):
            continue
        planned.clear()
        settle_gc()  # (accelerate and DeepSpeed collect the garbage at each trainer's set-up)
        t = train_two_steps(
            cls, cfg, str(tmp / "init"), tok, tmp / name, deepspeed=ds, max_grad_norm=0.0, beta=0.1, **extra
        )
        assert type(t.model_wrapped).__name__ == "DeepSpeedEngine", type(t.model_wrapped)
        assert t.model_wrapped.zero_optimization_stage() == int(stage)
        assert t.model_wrapped.gradient_accumulation_steps() == extra.get("gradient_accumulation_steps", 1)
        logged = [h for h in t.state.log_history if "loss" in h]
        result[f"{name}/steps"] = [(len(s), s.state) for s in planned]
        result[f"{name}/step_tokens"] = [
            (h.get("sharedprefix/step_tokens_computed"), h.get("sharedprefix/step_tokens_plain")) for h in logged
        ]
        named = list(t.model.named_parameters())
        if stage == "3":  # partitioned (empty) outside a forward even at world size 1
            assert all(p.numel() == 0 for _, p in named), [n for n, p in named if p.numel()]
        with deepspeed.zero.GatheredParameters([p for _, p in named]):  # ZeRO-3's partitions whole; 1/2: as they are
            result[name] = {n: p.detach().clone() for n, p in named}
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
