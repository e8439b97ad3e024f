"""DeepSpeed ZeRO-1/2/3 on 2 CPU processes (gloo): each path of sharedprefix against the plain per-row run under the
same engine. Usage: torchrun --nproc_per_node=2 deepspeed_worker.py STAGE OUT. Rank 0 writes {path: {"grads": full
gradients before the step, "params": parameters after ``engine.step()``}} to OUT; a path that raised has "error"."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402

import sharedprefix as sp  # noqa: E402
from helpers import random_groups, refused_on_second_call, tiny_model  # noqa: E402
from support.torchrun import settle_gc  # noqa: E402

BUDGET = 8  # splits the first group: a chain of cached prompt segments, then one completion per pass


def rank_groups(rank):
    """Each rank's own groups (the data-parallel shard)."""
    return random_groups(11 + rank, 2, [30, 5], [[6, 6, 6], [2, 3]])


def weights(rank):
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(5 + rank))


def plain_loss(model, groups, w):
    """The plain run: one forward of each [prompt, completion] row, log-probs weighted by ``w``."""
    rows = []
    for g in groups:
        for c in g.completions:
            logits = model(input_ids=torch.cat([g.prompt, c])[None], use_cache=False).logits[0]
            lp = logits[g.prompt.shape[0] - 1 : -1].float().log_softmax(-1).gather(-1, c[:, None])[:, 0]
            rows.append(torch.nn.functional.pad(lp, (0, w.shape[1] - c.shape[0])))
    return (torch.stack(rows) * w).sum()


LR = 0.5  # SGD's, in every engine's config: the parameters after engine.step() are init - LR * gradient


def reference(model=None):
    """The float64 gradient DeepSpeed should hold: the mean over the two ranks of each rank's plain loss's."""
    model = model if model is not None else tiny_model("qwen3", dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    for rank in range(2):
        (plain_loss(model, rank_groups(rank), weights(rank).double()) / 2).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return grads, init


def err(got, want):
    """The largest error over all parameters, relative to the largest entry of the whole gradient."""
    scale = max(float(w.abs().max()) for w in want.values())
    return max(float((got[n].double() - want[n]).abs().max()) for n in want) / scale


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)


def lora_model(dtype=torch.float32):
    """A PEFT LoRA model on the tiny Qwen3 (random adapters, seed 1), in ``dtype``."""
    import peft

    model = tiny_model("qwen3", dtype=torch.float32)
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(**LORA)).to(dtype)


COEF = 0.3  # the MoE paths' aux_loss_coef


def moe_model(dtype=torch.float32):
    """A tiny Mixtral whose forward returns its load-balancing loss (``output_router_logits=True``), with eager
    experts (``grouped_mm`` has no float64 kernel for the reference)."""
    model = tiny_model("mixtral", dtype=dtype, output_router_logits=True)
    model.config._experts_implementation = "eager"
    return model


def moe_loss(model, groups, w):
    """The MoE plain run: one forward of every [prompt, completion] row, right-padded and masked (as
    ``tools.zoo.checks.plain_aux_loss`` pads them), its weighted log-probs plus COEF times its aux loss."""
    rows = [(torch.cat([g.prompt, c]), g.prompt.shape[0], c) for g in groups for c in g.completions]
    width = max(r.shape[0] for r, _, _ in rows)
    ids = torch.stack([torch.cat([r, r[:1].expand(width - r.shape[0])]) for r, _, _ in rows])
    mask = (torch.arange(width)[None] < torch.tensor([r.shape[0] for r, _, _ in rows])[:, None]).long()
    out = model(input_ids=ids, attention_mask=mask, use_cache=False)
    lps = []
    for i, (r, p, c) in enumerate(rows):
        lp = out.logits[i, p - 1 : r.shape[0] - 1].float().log_softmax(-1).gather(-1, c[:, None])[:, 0]
        lps.append(torch.nn.functional.pad(lp, (0, w.shape[1] - c.shape[0])))
    return (torch.stack(lps) * w).sum() + COEF * out.aux_loss


HYBRIDS = ("qwen3_next", "zaya")  # the packed path (gated delta rule, convolutions, MoE) and the cache path


def hybrid_groups(rank):
    """Each rank's own hybrid groups (``support.hybrid.groups_of``: prompts of 9, 1 and 5 tokens, 7 completions) and
    their weights (7, 6)."""
    from support.hybrid import groups_of

    return groups_of(seed=rank), torch.randn(7, 6, generator=torch.Generator().manual_seed(50 + rank))


def hybrid_model(family, dtype=torch.float32):
    """A copy of the tiny float64 hybrid of ``family`` (``support.hybrid.model_of``) in ``dtype``."""
    import copy

    from support.hybrid import model_of

    return copy.deepcopy(model_of(family)).to(dtype)


def run_hybrid(stage, path, rank):
    """A hybrid path, FAMILY_CALL (``HYBRID_CALLS``): the plain run, ``sp.backward`` whole and under the budget (which
    splits the 9-token prompt into a chain), ``sp.logprobs`` whole, and under the budget deferred, then
    ``engine.backward``."""
    family = next(f for f in HYBRIDS if path.startswith(f + "_"))
    what = path[len(family) + 1 :]
    groups, w = hybrid_groups(rank)
    model = hybrid_model(family)
    if what == "leaf_refused":  # a cache-path hybrid with its MoE block a ZeRO-3 leaf: refused before any pass
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, [type(model.model.layers[0].mlp)])
    engine = engine_of(stage, model=model)

    def loss_fn(b):
        return (b.logprobs * w[b.index, : b.logprobs.shape[1]]).sum()

    if what == "plain":
        engine.backward(plain_loss(engine, groups, w))
    elif what == "backward":
        sp.backward(engine, groups, loss_fn)
    elif what == "backward_split":
        sp.backward(engine, groups, loss_fn, max_tokens=BUDGET)
    elif what == "logprobs":
        engine.backward((sp.logprobs(engine, groups).logprobs * w).sum())
    elif what == "logprobs_deferred":
        engine.backward((sp.logprobs(engine, groups, max_tokens=BUDGET, defer=True).logprobs * w).sum())
    elif what == "leaf_refused":
        try:
            sp.backward(engine, groups, loss_fn, max_tokens=BUDGET)
        except ValueError as e:
            return {"refusal": str(e)}
    return finish(engine, path)


def engine_of(
    stage, gas=1, checkpointing=False, lora=False, bf16=False, float32_head=False, zero=None, moe=False, model=None
):
    if model is None:
        model = lora_model() if lora else moe_model() if moe else tiny_model("qwen3", dtype=torch.float32)
    if float32_head:  # sharedprefix's float32 head (TRL's cast_lm_head_to_fp32): F.linear on the head's weight
        from sharedprefix.model.adapter import mark_float32_head

        mark_float32_head(model)
    if checkpointing:
        model.train()  # (no dropout in the tiny model: training mode changes nothing else)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,  # DeepSpeed clips by default otherwise
        "zero_allow_untested_optimizer": True,
        # ZeRO-3 keeps parameters under 1e5 entries whole (every one of the tiny model's): 0 partitions them all
        "zero_optimization": {
            "stage": stage,
            **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}),
            **(zero or {}),
        },
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "bf16": {"enabled": bf16},
    }
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def run(stage, path, rank):
    if path.startswith(HYBRIDS):
        return run_hybrid(stage, path, rank)
    groups, w = rank_groups(rank), weights(rank)

    def loss_fn(b):
        return (b.logprobs * w[b.index, : b.logprobs.shape[1]]).sum()

    gas = 2 if path.startswith("accumulated") else 1
    lora, bf16 = path.startswith("lora"), path.startswith("bf16")
    zero = ZERO_SETTINGS.get(path)
    flags = dict(float32_head=path == "float32_head", zero=zero, moe=path.startswith("moe"))
    engine = engine_of(stage, gas, path in ("checkpointed", "moe_checkpointed"), lora, bf16, **flags)
    if path == "plain":
        engine.backward(plain_loss(engine, groups, w))
    elif path == "logprobs":
        engine.backward((sp.logprobs(engine, groups).logprobs * w).sum())
    elif path == "logprobs_split":
        engine.backward((sp.logprobs(engine, groups, max_tokens=BUDGET).logprobs * w).sum())
    elif path == "logprobs_deferred":
        engine.backward((sp.logprobs(engine, groups, max_tokens=BUDGET, defer=True).logprobs * w).sum())
    elif path in ("backward", "bf16_backward"):
        sp.backward(engine, groups, loss_fn, max_tokens=None if path == "backward" else BUDGET)
    elif path in ("lora_plain", "bf16_plain"):
        engine.backward(plain_loss(engine, groups, w))
    elif path == "lora_backward":
        sp.backward(engine, groups, loss_fn, max_tokens=BUDGET)
    elif path == "sync_false":  # refused before any pass, with the DeepSpeed setting to use instead
        try:
            sp.backward(engine, groups, loss_fn, sync=False)
        except ValueError as e:
            return {"refusal": str(e)}
    elif path.startswith("backward_"):
        sp.backward(engine, groups, loss_fn, max_tokens=BUDGET, prefix_activations=path.split("_")[1])
    elif path == "moe_plain":
        if stage == 3:  # DeepSpeed made the MoE blocks ZeRO-3 leaf modules, as by default
            from deepspeed.utils import get_z3_leaf_modules

            assert {type(m).__name__ for m in get_z3_leaf_modules(engine.module)} == {"MixtralSparseMoeBlock"}
        engine.backward(moe_loss(engine, groups, w))
    elif path == "moe_backward":  # the aux term's per-pass gradient under a splitting budget
        sp.backward(engine, groups, loss_fn, max_tokens=BUDGET, aux_loss_coef=COEF)
    elif path == "moe_backward_whole":
        sp.backward(engine, groups, loss_fn, aux_loss_coef=COEF)
    elif path in ("moe_backward_offload", "moe_backward_recompute", "moe_checkpointed"):
        mode = "keep" if path == "moe_checkpointed" else path.split("_")[2]
        sp.backward(engine, groups, loss_fn, max_tokens=BUDGET, aux_loss_coef=COEF, prefix_activations=mode)
    elif path == "moe_logprobs_deferred":
        out = sp.logprobs(engine, groups, max_tokens=BUDGET, defer=True)
        engine.backward((out.logprobs * w).sum() + COEF * out.aux_loss)
    elif path == "moe_logprobs":
        out = sp.logprobs(engine, groups, max_tokens=BUDGET)
        engine.backward((out.logprobs * w).sum() + COEF * out.aux_loss)
    elif path == "zeropp_refused":  # refused before any pass, naming the setting
        try:
            sp.backward(engine, groups, loss_fn, max_tokens=BUDGET)
        except ValueError as e:
            return {"refusal": str(e)}
    elif path == "moe_leaf_control":  # ZeRO-3's leaf-module reductions never fired: the control of their firing
        from sharedprefix.parallel.engines.deepspeed import DeepSpeed

        fire, DeepSpeed._fire_leaf_hooks = DeepSpeed._fire_leaf_hooks, lambda self: None
        try:
            sp.backward(engine, groups, loss_fn, max_tokens=BUDGET, aux_loss_coef=COEF)
        finally:
            DeepSpeed._fire_leaf_hooks = fire
        named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        full = {n: safe_get_full_grad(p) for n, p in named}  # no step: DeepSpeed's own step raises on this state
        return {"grads": {n: torch.zeros(p.ds_shape) if full[n] is None else full[n].float() for n, p in named}}
    elif path in ("float32_head", "offload_param"):
        sp.backward(engine, groups, loss_fn, max_tokens=BUDGET)
    elif path == "checkpointed":  # non-reentrant gradient checkpointing, recomputed inside sharedprefix's backward
        sp.backward(engine, groups, loss_fn, max_tokens=BUDGET)
    elif path == "tree":  # the rows as a token trie, completion tokens trained; the same loss
        rows = [torch.cat([g.prompt, c]) for g in groups for c in g.completions]
        starts = [g.prompt.shape[0] for g in groups for _ in g.completions]
        trained = [torch.arange(r.shape[0]) >= p for r, p in zip(rows, starts)]
        wt = torch.zeros(len(rows), max(r.shape[0] for r in rows))
        for i, (r, p) in enumerate(zip(rows, starts)):
            wt[i, p : r.shape[0]] = w[i, : r.shape[0] - p]
        tree = sp.Tree.from_rows(rows, trained=trained)
        sp.backward(engine, tree, lambda b: (b.logprobs * wt[b.index, : b.logprobs.shape[1]]).sum(), max_tokens=BUDGET)
    elif path == "failed_control":  # the same with the failed call's partial gradient left for the next call
        from sharedprefix.schedule import grads as grads_module

        rollback, collect, left = grads_module.GradTransaction.rollback, grads_module.GradTransaction.collect, {}

        def leave(tx):  # as a rollback that leaves the first pass's share in .grad (ZeRO-3 holds no .grad)
            left.update(tx.contribution())
            rollback(tx)

        def collect_with_left(tx):  # the next call's gradient with the left share added, as .grad would sum it
            grads = collect(tx)
            return {p: g + left[p] if p in left else g for p, g in grads.items()}

        grads_module.GradTransaction.rollback = leave
        try:
            sp.backward(engine, groups, refused_on_second_call(loss_fn), max_tokens=BUDGET)
        except ValueError:
            pass
        finally:
            grads_module.GradTransaction.rollback = rollback
        assert left, "the failed call left no share: the control tests nothing"
        grads_module.GradTransaction.collect = collect_with_left
        try:
            sp.backward(engine, groups, loss_fn, max_tokens=BUDGET)
        finally:
            grads_module.GradTransaction.collect = collect
    elif path == "failed_then_backward":  # a call that raises on its second pass leaves no gradient behind
        try:
            sp.backward(engine, groups, refused_on_second_call(loss_fn), max_tokens=BUDGET)
        except ValueError:
            pass
        sp.backward(engine, groups, loss_fn, max_tokens=BUDGET)
    elif path == "accumulated_plain":  # DeepSpeed's gradient_accumulation_steps=2: two micro-steps, one update
        for half, rows in ((groups[:1], slice(0, 3)), (groups[1:], slice(3, 5))):
            engine.backward(plain_loss(engine, half, w[rows]))
            engine.step()
    elif path == "accumulated":
        first = groups[:1]
        for half, rows in ((first, slice(0, 3)), (groups[1:], slice(3, 5))):
            ws = w[rows]
            sp.backward(
                engine,
                half,
                lambda b, ws=ws: (b.logprobs * ws[b.index, : b.logprobs.shape[1]]).sum(),
                max_tokens=BUDGET,
            )
            engine.step()
    return finish(engine, path)


def finish(engine, path):
    """{"grads": the full gradients before ``engine.step()``, "params": the parameters after it}."""
    grads = None
    if not path.startswith("accumulated"):
        named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        grads = {n: safe_get_full_grad(p).detach().float().clone() for n, p in named}
        engine.step()
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in named]):  # ZeRO-3's partitions, whole (1/2: as they are)
        params = {n: p.detach().float().clone() for n, p in named}
    return {"grads": grads, "params": params}


# DeepSpeed settings of a path, beside the stage: ZeRO-3's parameters and optimizer state kept on the CPU (on these
# CPU processes that runs DeepSpeed's offload code, not a transfer), ZeRO++'s quantised gradients (refused)
ZERO_SETTINGS = {
    "offload_param": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
    "zeropp_refused": {"zero_quantized_gradients": True},
}
# the leaf modules' hooks through the recomputed forwards too (prefix modes, checkpointing), and their control
STAGE3_PATHS = [
    "offload_param",
    "zeropp_refused",
    "moe_backward_offload",
    "moe_backward_recompute",
    "moe_checkpointed",
    "moe_leaf_control",
]
# at ZeRO-3 the MoE block is a leaf module (DeepSpeed's default): its hooks run once, in the delivering backward
MOE_PATHS = ["moe_plain", "moe_backward", "moe_backward_whole", "moe_logprobs", "moe_logprobs_deferred"]
HYBRID_CALLS = ["plain", "backward", "backward_split", "logprobs", "logprobs_deferred"]
HYBRID_PATHS = [f"{f}_{c}" for f in HYBRIDS for c in HYBRID_CALLS]
# DeepSpeed's own ZeRO-3 run of a hybrid stops at a later forward's start on these 2 ranks (its prefetch trace check,
# "Detected a disagreement on list length between rank0 and rank1: 63 / 65", then a hang): not run at stage 3
HYBRID_STAGE3 = [p for p in HYBRID_PATHS if not p.endswith("_plain")] + ["zaya_leaf_refused"]

PATHS = [
    "plain",
    "logprobs",
    "logprobs_split",
    "logprobs_deferred",
    "backward",
    "backward_keep",
    "backward_offload",
    "backward_recompute",
    "checkpointed",
    "float32_head",
    "tree",
    "failed_then_backward",
    "failed_control",
    "accumulated_plain",
    "accumulated",
    "lora_plain",
    "lora_backward",
    "bf16_plain",
    "bf16_backward",
    "sync_false",
]


def paths_of(stage):
    """The paths a launch at ``stage`` ("1", "2" or "3") runs."""
    return PATHS + MOE_PATHS + (STAGE3_PATHS + HYBRID_STAGE3 if str(stage) == "3" else HYBRID_PATHS)


def main(stage, out):
    # DeepSpeed's shared-memory all-reduce is a C++ op it compiles on first use (minutes): skipped, so its
    # collectives go through torch.distributed (gloo), as every other test's
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    result = {}
    only = os.environ.get("SP_DS_PATHS")  # a comma-separated subset, when debugging one path
    for path in only.split(",") if only else paths_of(stage):
        settle_gc()
        try:
            result[path] = run(int(stage), path, rank)
        except Exception as e:  # reported, so that the test names the path
            import traceback

            traceback.print_exc()
            result[path] = {"error": f"{type(e).__name__}: {e}"}
    if rank == 0:
        torch.save(result, out)
    dist.barrier()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1], sys.argv[2])
