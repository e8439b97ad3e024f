"""One rank of the CallPlan settings tests under DDP (run under torchrun, 2 ranks): a call's own ``sync`` and
``grad_reduction``, passed at their defaults, win over the plan's; left out, the plan's apply.

Usage: torchrun --nproc_per_node=2 plan_worker.py OUT
Rank 0 writes {cell: (whole gradients, gradient all-reduces during the cell)} to OUT.
"""

import os
import sys
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.worker import BUDGET, groups_and_weights, loss_fn_for, my_share, whole_grads  # noqa: E402

import sharedprefix as sp  # noqa: E402
from helpers import tiny_model  # noqa: E402


def main(out):
    import faulthandler

    faulthandler.dump_traceback_later(100, exit=True)  # a hang prints where it is and fails instead of blocking CI
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mine, gidx = my_share(rank, world)
    model = torch.nn.parallel.DistributedDataParallel(tiny_model("qwen3"))
    reduces = [0]
    orig = dist.all_reduce

    def counting(*a, **k):  # gradient all-reduces (the one-element error flags agreed on per call aside)
        reduces[0] += int(a[0].numel() > 1)
        return orig(*a, **k)

    dist.all_reduce = counting
    loss_fn = loss_fn_for(mine, gidx)
    _, W = groups_and_weights()
    weights = W[gidx]
    kw = dict(max_tokens=BUDGET, prefix_activations="recompute")
    unsynced = sp.plan_call(model, mine, sync=False, **kw)
    mean = sp.plan_call(model, mine, grad_reduction="mean", **kw)

    def deferred(m, cp, **call_kw):  # grad-enabled log-probs under DDP: deferred, their backward synchronises
        lp = sp.logprobs(m, cp, **call_kw).logprobs
        (lp * weights[:, : lp.shape[1]]).sum().backward()

    cells = {
        "sync_passed": lambda m: sp.backward(m, unsynced, loss_fn, sync=True),
        "sync_left_out": lambda m: sp.backward(m, unsynced, loss_fn),
        "sum_passed": lambda m: sp.backward(m, mean, loss_fn, grad_reduction="sum"),
        "sum_left_out": lambda m: sp.backward(m, mean, loss_fn),
        "logprobs_sum_passed": lambda m: deferred(m, mean, grad_reduction="sum"),
        "logprobs_sum_left_out": lambda m: deferred(m, mean),
    }
    got = {}
    for name, fn in cells.items():
        before = reduces[0]
        got[name] = (whole_grads(model, partial(fn, model)), reduces[0] - before)
    if rank == 0:
        torch.save(got, out)
    del model
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1])
