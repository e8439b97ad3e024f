"""One rank of ``test_aux_step.py`` (under torchrun): an ``sp.plan_step`` step carrying the MoE load-balancing loss on
a DDP model, accelerate's accumulation (every microbatch but the last inside ``no_sync()``), against the same
microbatches each as its own ``sp.backward`` call (one call's exact mechanism) through the same DDP model.

Usage: torchrun --nproc_per_node=2 aux_step_worker.py OUT
Rank 0: ``support.moe_step.microbatches()``; rank 1: the same in reverse order (another microbatch records the shared
prompts, another runs their backward). Cases: ``backward`` (``sp.backward(aux_loss_coef=...)``) and ``deferred``
(grad-enabled ``sp.logprobs`` with ``.aux_loss`` in the caller's loss), each under a budget of 12 tokens. Rank 0 writes
{case: (step's gradients, the per-microbatch calls' gradients)} to OUT.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sharedprefix as sp  # noqa: E402
from support.moe_step import COEF, loss, microbatches, mixtral_float64_outside_the_loss  # noqa: E402
from support.schedule import microbatch_weights  # noqa: E402


def run(model, sources, Ws, deferred):
    """Each of ``sources`` (a step's microbatches, or groups) as accelerate accumulates; the full gradients after."""
    model.zero_grad(set_to_none=True)
    for k, (src, W) in enumerate(zip(sources, Ws)):
        with model.no_sync() if k < len(Ws) - 1 else contextlib.nullcontext():
            if deferred:
                out = sp.logprobs(model, src, max_tokens=12)
                ((out.logprobs * W).sum() + COEF * out.aux_loss).backward()
            else:
                sp.backward(model, src, loss(W), aux_loss_coef=COEF, max_tokens=12)
    return {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main(out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    mbs = microbatches() if rank == 0 else microbatches()[::-1]
    Ws = microbatch_weights(microbatches(), seed=1)
    Ws = Ws if rank == 0 else Ws[::-1]
    got = {}
    with mixtral_float64_outside_the_loss() as m:
        model = torch.nn.parallel.DistributedDataParallel(m)
        for case in ("backward", "deferred"):
            step = sp.plan_step(model, mbs, max_tokens=12, aux_loss=True)
            mine = run(model, [step.microbatch(k) for k in range(len(mbs))], Ws, case == "deferred")
            assert step.state == "finished", step.state
            got[case] = (mine, run(model, mbs, Ws, case == "deferred"))
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1])
