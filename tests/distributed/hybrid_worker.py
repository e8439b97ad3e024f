"""One rank of the hybrid DDP / FSDP2 test (run under torchrun): a tiny LFM2 (short convolutions beside attention, on
the packed path) wrapped in DDP, or sharded with FSDP2 (``fsdp``: every layer, the tied embedding and head as one unit, and the root),
each rank with its share of the groups. FAMILY (default lfm2) picks another packed hybrid of ``models.test_hybrid``
(falcon_h1: Mamba2 mixers; qwen3_next: gated delta-nets); those compute their scans in float32 inside a float64 model,
so their ranks run ``sp.backward`` under ``Float64Inside``, as the reference does (kinds backward and fsdp only).

Usage: torchrun --nproc_per_node=2 hybrid_worker.py KIND OUT [FAMILY]
(KIND: backward | mean | deferred | midfail | refuse_logprobs | fsdp) Rank 0 writes the gradients (or the messages)
to OUT.
"""

import contextlib
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distributed.worker import full_grads, nan_on_second_pass, report_outcome, shard_of  # noqa: E402
from models.test_hybrid import groups_of, model_of  # noqa: E402

import sharedprefix as sp  # noqa: E402
from sharedprefix.tools.reference import Float64Inside  # noqa: E402

BUDGET = 8  # splits the first group (prompt 9: two chunks; four completions in several batches)
FLOAT32_INSIDE = {"falcon_h1", "qwen3_next"}  # families whose scans cast to float32: run under Float64Inside


def weights(groups):
    n = sum(g.group_size for g in groups)
    return torch.randn(n, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(7))


def main(kind, out, family="lfm2"):
    import faulthandler

    faulthandler.dump_traceback_later(100, exit=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mine, gidx = shard_of(groups_of(), rank, world)
    W = weights(groups_of())
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        model = model_of(family)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard([model.model.embed_tokens, model.lm_head])  # (tied weights: one unit)
        model = fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model_of(family))

    def loss_fn(b):
        return (b.logprobs * W[gidx[b.index], : b.logprobs.shape[1]] * b.mask).sum()

    if kind == "refuse_logprobs":  # rank 1's groups are refused (a completion longer than the budget)
        bad = [sp.Group([3, 4, 5], [[6] * 12])] if rank == 1 else mine

        def deferred(m):
            sp.logprobs(m, bad, max_tokens=BUDGET).logprobs.sum().backward()  # grad-enabled: deferred under DDP

        report_outcome(deferred, model, rank, world, out)
    elif kind == "midfail":  # rank 1's loss is NaN on its second batch: every rank stops, no .grad is left behind
        report_outcome(lambda m: sp.backward(m, mine, nan_on_second_pass(loss_fn, rank), max_tokens=BUDGET), model, rank, world, out)
    else:
        if kind == "deferred":  # grad-enabled log-probs: deferred by default under DDP, synced by their backward
            out_lp = sp.logprobs(model, mine, max_tokens=BUDGET)
            (out_lp.logprobs * W[gidx, : out_lp.logprobs.shape[1]] * out_lp.mask).sum().backward()
        else:  # (FSDP2: "recompute", the mode it runs, chosen by default)
            mode = None if kind == "fsdp" else "recompute"
            with Float64Inside() if family in FLOAT32_INSIDE else contextlib.nullcontext():
                sp.backward(
                    model, mine, loss_fn, max_tokens=BUDGET, prefix_activations=mode, grad_reduction="mean" if kind == "mean" else "sum"
                )
        grads = full_grads(model)
        everyone = [None] * world
        dist.all_gather_object(everyone, grads)
        if rank == 0:
            torch.save({"grads": everyone, "shards": [len(sp.shard_groups(groups_of(), r, world)) for r in range(world)]}, out)
    del model  # before the process group goes (the caught error's traceback may hold it in a cycle: collected)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
