"""One rank of ``test_vl_step.py`` (under torchrun): an ``sp.plan_step`` step of Qwen2-VL image groups on a DDP
model, accelerate's accumulation (the first microbatch inside ``no_sync()``).

Usage: torchrun --nproc_per_node=2 vl_step_worker.py OUT
Each rank plans ``rank_microbatches(rank)`` and runs three cases on the same DDP model, the gradients zeroed between:
``keep`` (``sp.backward``), ``deferred`` (grad-enabled ``sp.logprobs``, the caller's backward) and ``recompute`` (a
budget of 16 tokens); each loss is the weighted log-probs, and the gradient the sum over ranks (sharedprefix's
default ``grad_reduction="sum"``). Rank 0 writes {case: full gradients} to OUT.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sharedprefix as sp  # noqa: E402
from support.schedule import microbatch_weights  # noqa: E402
from support.vl import mrope_model, vl_microbatches  # noqa: E402

WORLD = 2
CASES = {"keep": dict(), "deferred": dict(), "recompute": dict(max_tokens=16, prefix_activations="recompute")}


def rank_microbatches(rank):
    """Rank 0: ``vl_microbatches()``; rank 1: the same microbatches in reverse order, so the ranks' steps differ
    (another microbatch records the shared prompts, another runs their backward)."""
    mbs = vl_microbatches()
    return mbs if rank == 0 else mbs[::-1]


def weights(rank):
    """Per microbatch, (completions, longest completion) weights of this rank."""
    return microbatch_weights(rank_microbatches(rank), seed=10 + rank)


def run(model, mbs, Ws, case):
    step = sp.plan_step(model, mbs, **CASES[case])
    for k, W in enumerate(Ws):
        with model.no_sync() if k < len(mbs) - 1 else contextlib.nullcontext():
            if case == "deferred":
                out = sp.logprobs(model, step.microbatch(k))
                (out.logprobs * W[:, : out.logprobs.shape[1]]).sum().backward()
            else:
                sp.backward(model, step.microbatch(k), lambda b, W=W: (b.logprobs * W[b.index] * b.mask).sum())
    assert step.state == "finished", step.state


def main(out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(mrope_model("qwen2_vl"))
    mbs, Ws = rank_microbatches(rank), weights(rank)
    grads = {}
    for case in CASES:
        model.zero_grad(set_to_none=True)
        run(model, mbs, Ws, case)
        named = model.named_parameters()
        grads[case] = {n.removeprefix("module."): p.grad.clone() for n, p in named if p.grad is not None}
    if rank == 0:
        torch.save(grads, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1])
