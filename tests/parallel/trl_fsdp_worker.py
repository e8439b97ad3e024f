"""One rank of the TRL-under-FSDP2 test (torchrun, 2 ranks): accelerate's FSDP plugin, version 2 (TrainingArguments
``fsdp=True, fsdp_config={"fsdp_version": 2}``), gloo on CPU, ``steps_per_generation = gradient_accumulation_steps =
2`` with groups of 4 over microbatches of 2 rows, float64. Each trainer runs 2 SGD steps from the same weights:

- TRL's GRPOTrainer and RLOOTrainer with a plain float64 per-row hook (the exact runs), under the same FSDP2 config;
- SharedPrefixGRPOTrainer with its default steps, with ``sharedprefix_step=False``, with a budget that splits groups
  and gradient checkpointing on, and SharedPrefixRLOOTrainer.

accelerate takes its FSDP plugin only on accelerator backends: on CPU processes its state stays ``MULTI_CPU`` and
the model is wrapped in DDP (accelerate 1.16, ``state.py``: only the ``MULTI_GPU``-like branch sets
``DistributedType.FSDP``). ``fsdp_on_cpu`` sets FSDP there, as that branch does, so that ``Trainer`` shards the model
with accelerate's own ``fsdp2_prepare_model`` (layers, embedding, norm and head as units, then the root); every run
checks that the model it trained is an FSDP2 module. Also built: the settings refused under FSDP2 (an MoE load-balancing
loss, prefix offloading), each must raise when the trainer is built (FSDP1's plugin refuses CPU processes itself).

Rank 0 writes {name: full parameter deltas, "sources": {name: [(type of each sp.backward source, its sync)]},
"tokens": {name: [step_tokens_computed, step_tokens_plain] per optimizer step}, "passes": {name: the most policy passes
of a logging step}, "refused": {name: message}} to OUT.

Usage: torchrun --nproc_per_node=2 trl_fsdp_worker.py OUT
"""

import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sharedprefix as sp  # noqa: E402
from sharedprefix.integrations.trl import (  # noqa: E402
    SharedPrefixGRPOConfig,
    SharedPrefixGRPOTrainer,
    SharedPrefixRLOOConfig,
    SharedPrefixRLOOTrainer,
)
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import (  # noqa: E402
    dataset,
    float64_qwen3_norms,
    moe_model,
    plain_rows,
    qwen3_model,
    reward,
    train_two_steps,
    two_step_args,
)

FSDP2 = dict(fsdp=True, fsdp_config={"fsdp_version": 2})


def fsdp_on_cpu(mp) -> None:
    """accelerate's FSDP on CPU processes: where an ``AcceleratorState`` gets an FSDP plugin and its distributed type
    is ``MULTI_CPU``, make it ``FSDP`` with that plugin (in the partial state too, which every later
    ``AcceleratorState()`` copies), as accelerate does on accelerator backends."""
    import accelerate.state as state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    mp.setattr(state.AcceleratorState, "__init__", patched)


def main(out):
    import pytest
    from torch.distributed.fsdp import FSDPModule
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    torch.set_num_threads(1)
    tok = build_tokenizer()
    mp = pytest.MonkeyPatch()
    float64_qwen3_norms(mp)
    fsdp_on_cpu(mp)
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
        model_init_kwargs={"dtype": torch.float64},
        **FSDP2,
    )
    sources: dict[str, list[str]] = {}
    backward = sp.backward

    def spy(model, source, loss_fn, **kw):
        sources.setdefault(current, []).append((type(source).__name__, kw.get("sync")))
        return backward(model, source, loss_fn, **kw)

    sp.backward = spy
    results, tokens, passes = {}, {}, {}
    runs = {
        "grpo_exact": (plain_rows(GRPOTrainer), GRPOConfig, {"beta": 0.04}),
        "grpo_steps": (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, {"beta": 0.04}),
        "grpo_no_steps": (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, {"beta": 0.04, "sharedprefix_step": False}),
        "grpo_budget_checkpointing": (  # a budget that splits groups, TRL's default gradient checkpointing
            SharedPrefixGRPOTrainer,
            SharedPrefixGRPOConfig,
            {"beta": 0.04, "sharedprefix_max_tokens": 16, "gradient_checkpointing": True},
        ),
        "rloo_exact": (plain_rows(RLOOTrainer), RLOOConfig, {}),
        "rloo_steps": (SharedPrefixRLOOTrainer, SharedPrefixRLOOConfig, {}),
    }
    for current, (cls, cfg, extra) in runs.items():
        trainer = train_two_steps(cls, cfg, init_dir, tok, tempfile.mkdtemp(), **{**settings, **extra})
        assert isinstance(trainer.model_wrapped, FSDPModule), type(trainer.model_wrapped)
        params = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
        full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in params.items()}  # every rank
        results[current] = torch.cat([(full[n].detach().double() - init[n]).flatten() for n in init])
        passes[current] = max((h.get("sharedprefix/passes", 0.0) for h in trainer.state.log_history), default=0.0)
        tokens[current] = [
            [h["sharedprefix/step_tokens_computed"], h["sharedprefix/step_tokens_plain"]]
            for h in trainer.state.log_history
            if "sharedprefix/step_tokens_computed" in h
        ]
        trainer.accelerator.wait_for_everyone()
    refused = {}
    moe_dir, _ = moe_model(Path(tempfile.mkdtemp()), tok, "qwen3_moe")
    for name, model, cfg in (
        ("offload", init_dir, dict(FSDP2, sharedprefix_prefix_activations="offload")),
        ("aux_loss", moe_dir, FSDP2),
    ):
        args = two_step_args(SharedPrefixGRPOConfig, tempfile.mkdtemp(), num_generations=4, **cfg)
        try:  # built only: the refusal must come from the constructor
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                SharedPrefixGRPOTrainer(
                    model=model, args=args, reward_funcs=reward, train_dataset=dataset(), processing_class=tok
                )
            refused[name] = None
        except ValueError as e:
            refused[name] = str(e)
    if rank == 0:
        torch.save({**results, "sources": sources, "tokens": tokens, "passes": passes, "refused": refused}, out)


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1])
