"""DeepSpeed's commonly tuned ``zero_optimization`` settings on 2 CPU processes (gloo): sharedprefix's paths against
the plain per-row run under the same engine and settings. Usage: torchrun --nproc_per_node=2
deepspeed_configs_worker.py STAGE OUT. Rank 0 writes {"CONFIG/CALL": {"grads": ..., "params": ...}} to OUT (as
``deepspeed_worker.finish``); a cell that raised has "error", a refusal "refusal", the failure paths "gathered" (the
parameters left whole after the failed call).

Each configuration (``CONFIGS``) runs ``CALLS``: the plain run, ``sp.backward`` under the splitting budget in the
``keep`` and ``recompute`` prefix modes, ``sp.logprobs`` deferred under the budget then ``engine.backward``.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
from parallel.deepspeed_worker import BUDGET, LR, finish, moe_model, plain_loss, rank_groups, weights  # noqa: E402

import sharedprefix as sp  # noqa: E402
from helpers import tiny_model  # noqa: E402
from support.torchrun import settle_gc  # noqa: E402

SMALL = 1000  # elements: buckets and prefetch budgets that split the tiny model (its largest parameter: 3104)
# name -> zero_optimization settings beside the stage; ZeRO-3's partition every parameter unless they say otherwise
# ("stage3_param_persistence_threshold": None: DeepSpeed's default, which keeps the tiny model's parameters whole)
CONFIGS = {
    2: {
        "overlap_comm": {"overlap_comm": True},
        "contiguous_gradients_false": {"contiguous_gradients": False},
        "contiguous_gradients_true": {"contiguous_gradients": True},
        "reduce_scatter_false": {"reduce_scatter": False},
        "round_robin_gradients": {"round_robin_gradients": True},
        "small_buckets": {"reduce_bucket_size": SMALL, "allgather_bucket_size": SMALL},
        "tuned": {  # all of them at once, as tuning guides set them
            "overlap_comm": True,
            "contiguous_gradients": True,
            "round_robin_gradients": True,
            "reduce_bucket_size": SMALL,
            "allgather_bucket_size": SMALL,
        },
    },
    3: {
        "overlap_comm": {"overlap_comm": True},
        "contiguous_gradients_false": {"contiguous_gradients": False},
        "contiguous_gradients_true": {"contiguous_gradients": True},
        "small_buckets": {"reduce_bucket_size": SMALL},
        "small_prefetch": {
            "stage3_prefetch_bucket_size": SMALL,
            "stage3_max_live_parameters": SMALL,
            "stage3_max_reuse_distance": SMALL,
        },
        "persistence_default": {"stage3_param_persistence_threshold": None},
        "zero_init": {},  # the model built under deepspeed.zero.Init()
        "tuned": {  # HF's ZeRO-3 example config, with the sizes scaled to the tiny model
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": SMALL,
            "reduce_bucket_size": SMALL,
            "stage3_prefetch_bucket_size": SMALL,
            "stage3_param_persistence_threshold": SMALL,
            "stage3_max_live_parameters": SMALL,
            "stage3_max_reuse_distance": SMALL,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    },
}
CALLS = ["plain", "backward_keep", "backward_recompute", "logprobs_deferred"]
# beside the configurations: gradient_accumulation_steps=2 with overlap_comm (ZeRO-2); at ZeRO-3, a deferred call
# whose backward fails (in the caller's loss, or in sharedprefix's own passes) then a good one, and defer=False with
# MoE leaf modules (refused)
EXTRA = {
    2: ["accumulated_overlap/plain", "accumulated_overlap/backward_keep", "accumulated_overlap/logprobs_deferred"],
    3: [
        "failed_in_caller/logprobs_deferred",
        "failed_in_caller_overlap/logprobs_deferred",
        "failed_in_passes/logprobs_deferred",
        "failed_after_reduction/logprobs_deferred",
        "default/plain",
        "moe_leaf/defer_false_refused",
    ],
}


def cells(stage) -> list[str]:
    """Every "CONFIG/CALL" a launch at ``stage`` runs."""
    stage = int(stage)
    return [f"{name}/{call}" for name in CONFIGS[stage] for call in CALLS] + EXTRA[stage]


def build(stage, zero, gas=1, moe=False):
    """A DeepSpeed engine over the tiny float32 Qwen3 (or the MoE model), SGD, ``zero`` added to zero_optimization;
    under ZeRO-3 every parameter partitioned unless ``zero`` sets the threshold (None: DeepSpeed's default)."""
    settings = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}), **zero}
    settings = {k: v for k, v in settings.items() if v is not None}
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": settings,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
    }
    model = moe_model() if moe else tiny_model("qwen3", dtype=torch.float32)
    return deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)[0]


def build_under_zero_init(stage):
    """The tiny Qwen3 constructed inside ``deepspeed.zero.Init()`` (each parameter partitioned as it is created),
    its weights then loaded from the same model built whole, as transformers loads a checkpoint under ZeRO-3."""
    import transformers as tf

    whole = tiny_model("qwen3", dtype=torch.float32)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
    }
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = tf.Qwen3ForCausalLM(whole.config)
    model.eval()
    state = dict(whole.named_parameters())
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if dist.get_rank() == 0:
                p.data.copy_(state[name].data)
    return deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)[0]


def finish_cell(engine, stage, cell) -> dict:
    """``deepspeed_worker.finish`` at ZeRO-3; at ZeRO-2 only the parameters after ``engine.step()`` (DeepSpeed's
    ``safe_get_full_grad`` raises under ZeRO-2 with ``overlap_comm``, on the plain run as on ours: "The size of
    tensor a (1536) must match the size of tensor b (768)"), from which the test reads the gradient SGD applied."""
    if stage == 3:
        return finish(engine, cell)
    engine.step()
    return finish(engine, "accumulated")  # ("accumulated": the parameters as they are, no gradient read)


def left_gathered(engine) -> list[str]:
    """The ZeRO-3 parameters that are not partitioned (status or storage), but those DeepSpeed keeps whole
    (``ds_persist``: under its persistence threshold)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [
        n
        for n, p in engine.module.named_parameters()
        if not p.ds_persist and (p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.numel() != 0)
    ]


class _FailLater(torch.autograd.Function):
    """A term of the caller's loss whose backward raises; made before the deferred node, so it runs after it."""

    @staticmethod
    def forward(ctx, x):
        return x * 0

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("injected: the caller's loss backward fails")


def deferred(engine, groups, w, fail=None):
    """``sp.logprobs`` deferred under the budget, then ``engine.backward`` of the weighted sum. ``fail``: "hook": a
    gradient hook of the caller's on every parameter raises (after the deferred node, before any of DeepSpeed's
    hooks: the first parameter's accumulation fails); "later": a term of the loss raises after every parameter's
    gradient reached DeepSpeed's hooks."""
    bad = _FailLater.apply(torch.zeros((), requires_grad=True)) if fail == "later" else None
    lp = sp.logprobs(engine, groups, max_tokens=BUDGET, defer=True).logprobs
    loss = (lp * w[:, : lp.shape[1]]).sum()
    handles = []
    if fail == "hook":

        def check(g):
            raise RuntimeError("injected: the caller's gradient hook fails")

        handles = [p.register_hook(check) for p in engine.module.parameters()]
    try:
        engine.backward(loss + bad if bad is not None else loss)
    finally:
        for h in handles:
            h.remove()


def failing_passes():
    """sharedprefix's passes raise from the third on (inside the deferred node's backward): restores on exit."""
    from sharedprefix.parallel.engines.deepspeed import DeepSpeed

    call, seen = DeepSpeed.call, []

    def failing(self, fn, guard=True):
        seen.append(1)
        if len(seen) == 3:
            raise RuntimeError("injected: a pass of the deferred backward fails")
        return call(self, fn, guard)

    class Patch:
        def __enter__(self):
            DeepSpeed.call = failing

        def __exit__(self, *exc):
            DeepSpeed.call = call

    return Patch()


def run(stage, cell, rank):
    name, what = cell.split("/")
    groups, w = rank_groups(rank), weights(rank)

    def loss_fn(b):
        return (b.logprobs * w[b.index, : b.logprobs.shape[1]]).sum()

    if name == "moe_leaf":  # defer=False with grad enabled under ZeRO-3 leaf modules: refused, naming them
        engine = build(stage, {}, moe=True)
        try:
            sp.logprobs(engine, groups, max_tokens=BUDGET, defer=False)
        except ValueError as e:
            return {"refusal": str(e)}
        return {"error": "not refused"}
    if name.startswith("accumulated"):  # gradient_accumulation_steps=2: two micro-steps, one update
        engine = build(stage, {"overlap_comm": True}, gas=2)
        for half, rows in ((groups[:1], slice(0, 3)), (groups[1:], slice(3, 5))):
            ws = w[rows]
            if what == "plain":
                engine.backward(plain_loss(engine, half, ws))
            elif what == "backward_keep":
                sp.backward(
                    engine,
                    half,
                    lambda b, ws=ws: (b.logprobs * ws[b.index, : b.logprobs.shape[1]]).sum(),
                    max_tokens=BUDGET,
                )
            else:
                deferred(engine, half, ws)
            engine.step()
        return finish(engine, "accumulated")  # the parameters after the second step
    if name.startswith("failed"):  # a deferred call whose backward fails, then a good one
        engine = build(stage, {"overlap_comm": True} if name.endswith("overlap") else {})
        try:
            if name == "failed_in_passes":
                with failing_passes():
                    deferred(engine, groups, w)
            else:
                deferred(engine, groups, w, fail="later" if name == "failed_after_reduction" else "hook")
        except RuntimeError as e:
            assert "injected" in str(e), e
        else:
            raise AssertionError("the injected failure did not fail the call")
        gathered = left_gathered(engine)
        if name == "failed_after_reduction":  # DeepSpeed's own state cannot go on: its epilogue never ran (the same
            return {"gathered": gathered}  # after a failed plain backward), so only the parameters are checked
        deferred(engine, groups, w)
        return {**finish_cell(engine, stage, cell), "gathered": gathered}
    if name == "zero_init":
        engine = build_under_zero_init(stage)
    else:
        engine = build(stage, CONFIGS[stage].get(name, {}))  # "default": the stage's settings alone
    if what == "plain":
        engine.backward(plain_loss(engine, groups, w))
    elif what.startswith("backward_"):
        sp.backward(engine, groups, loss_fn, max_tokens=BUDGET, prefix_activations=what.split("_")[1])
    elif what == "logprobs_deferred":
        deferred(engine, groups, w)
    gathered = left_gathered(engine) if stage == 3 else []
    return {**finish_cell(engine, stage, cell), "gathered": gathered}


def main(stage, out):
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo collectives (see deepspeed_worker.main)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    result = {}
    only = os.environ.get("SP_DS_PATHS")  # a comma-separated subset of cells, when debugging one
    for cell in only.split(",") if only else cells(stage):
        settle_gc()
        try:
            start = time.perf_counter()
            result[cell] = run(int(stage), cell, rank)
            result[cell]["seconds"] = time.perf_counter() - start
        except Exception as e:  # reported, so that the test names the cell
            import traceback

            traceback.print_exc()
            result[cell] = {"error": f"{type(e).__name__}: {e}"}
    if rank == 0:
        torch.save(result, out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
