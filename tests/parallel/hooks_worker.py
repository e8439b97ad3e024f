"""One rank of the gradient-counting tests (run under torchrun, 2 ranks): each data-parallel wrapper's way of
reducing gradients, with sp.backward under a budget that splits a group, and a control run that reduces the
gradient not at all (``sync=False``) or twice.

Usage: torchrun --nproc_per_node=2 hooks_worker.py KIND OUT
(KIND: ddp_unused | ddp_no_sync | ddp_bucket_view | fsdp_noreshard | fsdp_mixed | fsdp_lora)
Rank 0 writes {"grads": whole gradients, "control": the control's, ...} to OUT.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.worker import BUDGET, groups_and_weights, loss_fn_for, my_share, run_step, whole_grads  # noqa: E402

import sharedprefix as sp  # noqa: E402
from helpers import tiny_model  # noqa: E402
from sharedprefix.tools.reference import Float64Inside  # noqa: E402

LORA = dict(
    r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0, init_lora_weights=False
)


def lora_model():
    import peft

    return peft.get_peft_model(tiny_model("qwen3"), peft.LoraConfig(**LORA))


def fsdp(model, reshard=True, mp=None):
    from torch.distributed.fsdp import fully_shard

    kw = {"reshard_after_forward": reshard} if mp is None else {"reshard_after_forward": reshard, "mp_policy": mp}
    from sharedprefix.model.adapter import decoder, unwrap

    for layer in decoder(unwrap(model)).layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def plain_sum(lp, w, world):
    """The plain run's loss on this rank: its rows' log-probs (N, T) weighted by ``w`` (N, >= T), times the world
    size (FSDP2 averages over ranks; the global loss is the sum)."""
    return (lp.float() * w[:, : lp.shape[1]].float()).sum() * world


def main(kind, out):
    import faulthandler

    faulthandler.dump_traceback_later(200, exit=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    groups, W = groups_and_weights()
    mine, gidx = my_share(rank, world)
    loss_fn = loss_fn_for(mine, gidx)
    result = {}
    reduces = {"n": 0}
    orig = dist.all_reduce

    def counting(*a, **k):  # gradient all-reduces (one-element error flags aside)
        reduces["n"] += int(a[0].numel() > 1)
        return orig(*a, **k)

    dist.all_reduce = counting
    if kind == "ddp_unused":  # Qwen3-MoE: experts no token of a rank's shard routes to get no gradient there
        from sharedprefix.tools.zoo.configs import build, float64_norms

        with Float64Inside():  # its router's float32 softmax kept float64, as in the test's reference
            model, _ = build("qwen3_moe")
            float64_norms(model)
            for unused in (True, False):
                ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)
                result[f"find_unused={unused}"] = whole_grads(
                    ddp, lambda m=ddp: sp.backward(m, mine, loss_fn, max_tokens=BUDGET)
                )
            result["control"] = whole_grads(ddp, lambda: sp.backward(ddp, mine, loss_fn, max_tokens=BUDGET, sync=False))
    elif kind == "ddp_no_sync":  # two calls, the first inside DDP's no_sync(): one all-reduce, the plain sum
        ddp = torch.nn.parallel.DistributedDataParallel(tiny_model("qwen3"))
        first, rest = mine[:1], mine[1:]
        n1 = first[0].group_size

        def accumulate(control=False):
            with ddp.no_sync():
                sp.backward(ddp, first, loss_fn_for(first, gidx[:n1]), max_tokens=BUDGET)
            result.setdefault("reduces_in_no_sync", reduces["n"])
            rest_or_zero = rest if rest else first  # a rank with one group syncs a zero contribution
            w = (lambda b: loss_fn_for(rest, gidx[n1:])(b)) if rest else (lambda b: (b.logprobs * 0.0).sum())
            with ddp.no_sync() if control else torch.enable_grad():
                sp.backward(ddp, rest_or_zero, w, max_tokens=BUDGET)

        result["grads"] = whole_grads(ddp, accumulate)
        result["reduces"] = reduces["n"]
        result["control"] = whole_grads(ddp, lambda: accumulate(control=True))
    elif kind == "ddp_bucket_view":  # .grad as views into DDP's buckets: each call adds into them in place
        ddp = torch.nn.parallel.DistributedDataParallel(tiny_model("qwen3"), gradient_as_bucket_view=True)
        ddp(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()  # DDP's own step makes .grad bucket views
        named = list(ddp.module.named_parameters())
        views = {n: p.grad for n, p in named}
        result["views_before"] = all(g is not None and g._base is not None for g in views.values())
        first, rest = mine[:1], mine[1:]
        n1 = first[0].group_size
        for name, calls in (
            ("one_call", [(mine, loss_fn, False)]),
            (
                "accumulated",
                [
                    (first, loss_fn_for(first, gidx[:n1]), True),
                    (
                        rest or first,
                        loss_fn_for(rest, gidx[n1:]) if rest else (lambda b: (b.logprobs * 0.0).sum()),
                        False,
                    ),
                ],
            ),
        ):
            ddp.zero_grad(set_to_none=False)  # zeros in the buckets, as optimizers leave them
            for groups_, fn, in_no_sync in calls:
                with ddp.no_sync() if in_no_sync else torch.enable_grad():
                    sp.backward(ddp, groups_, fn, max_tokens=BUDGET)
            result[f"{name}_same_tensors"] = all(p.grad is views[n] for n, p in named)
            result[name] = {n: p.grad.detach().clone() for n, p in named}
    elif kind == "fsdp_noreshard":
        model = fsdp(tiny_model("qwen3"), reshard=False)
        result["grads"] = whole_grads(model, lambda: sp.backward(model, mine, loss_fn, max_tokens=BUDGET))
        result["control"] = whole_grads(model, lambda: sp.backward(model, mine, loss_fn, max_tokens=BUDGET, sync=False))
    elif kind == "fsdp_lora":
        model = fsdp(lora_model())
        result["grads"] = whole_grads(model, lambda: sp.backward(model, mine, loss_fn, max_tokens=BUDGET))
        result["control"] = whole_grads(model, lambda: sp.backward(model, mine, loss_fn, max_tokens=BUDGET, sync=False))
    if kind == "fsdp_mixed":  # bf16 parameters, float32 reduction: ours and the plain run under the same policy
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from helpers import plain_logprobs

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = fsdp(tiny_model("qwen3", dtype=torch.float32), mp=mp)
        result["grads"] = whole_grads(model, lambda: sp.backward(model, mine, loss_fn, max_tokens=BUDGET))
        # the plain run: each rank's rows, scaled by the world size (FSDP2 averages; the global loss is the sum)
        mw = W[gidx]
        result["plain"] = whole_grads(model, lambda: plain_sum(plain_logprobs(model, mine)[0], mw, world).backward())
        result["control"] = whole_grads(
            model, lambda: sp.backward(model, mine, loss_fn, max_tokens=BUDGET, grad_reduction="mean")
        )
        # a step, the root (embedding, norm, head) sharded at FSDP2's default (as accelerate leaves it): unsharded
        # after a forward, its registered parameters in bf16
        model = tiny_model("qwen3", dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        try:
            result["step"] = whole_grads(model, lambda: run_step("fsdp_step", model, mine, gidx))
        except ValueError as e:
            result["step"] = f"ValueError: {e}"
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1], sys.argv[2])
