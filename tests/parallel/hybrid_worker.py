"""One rank of the hybrid DDP / FSDP2 test (run under torchrun): a tiny hybrid wrapped in DDP, or sharded with FSDP2
(kinds ``fsdp*``: every layer, the embedding and head as one unit, and the root), each rank with its share of the
groups. FAMILIES (default lfm2; several, comma-separated, run one after another in one launch) picks the hybrids:
``support.hybrid``'s ``model_of`` (lfm2: short convolutions beside attention; falcon_h1: Mamba2 mixers; qwen3_next:
gated delta-nets) or its ``linear_model``, 3-layer cuts of the zoo's configs (lfm3: convolutions; lara_mini: gated
delta-nets; kimi_linear: Kimi delta attention). The delta rules and the Mamba2 scan compute in float32 inside a
float64 model, so those families run ``sp.backward`` under ``Float64Inside``, as the reference does (kinds backward
and fsdp only).

Usage: torchrun --nproc_per_node=2 hybrid_worker.py KIND OUT [FAMILIES]
KIND: backward | mean | deferred | fsdp   the groups under a budget that splits one (DDP; FSDP2 for fsdp); for LFM2
                                          and Kimi Linear (``TREE_FAMILIES``) backward and fsdp then run a tree
                                          (worker.py's: a shared system prompt, branches, second turns) sharded by
                                          rows, and for LFM2 fsdp the groups again with non-reentrant gradient
                                          checkpointing on (training mode)
      midfail | refuse_logprobs           a failure on rank 1 (DDP): what every rank raised
Rank 0 writes to OUT {"results": {(family, run): [each rank's value]}} (``run``'s), or the messages.
"""

import contextlib
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.worker import full_grads, nan_on_second_pass, report_outcome, run_tree, shard_of  # noqa: E402

import sharedprefix as sp  # noqa: E402
from sharedprefix.tools.reference import Float64Inside  # noqa: E402
from support.hybrid import COMMON, SMALL, groups_of, linear_model, model_of  # noqa: E402

BUDGET = 8  # splits the first group (prompt 9: two chunks; four completions in several batches)
VOCAB = COMMON["vocab_size"]  # of every family here (the tree's token ids stay below it)
# families whose scans cast to float32: run under Float64Inside
FLOAT32_INSIDE = {"falcon_h1", "qwen3_next", "lara_mini", "kimi_linear"}
# kinds backward and fsdp then run the tree too (fsdp also checkpointing, for those without float32 scans) in the same
# launch: those recompute inside autograd's backward, where Float64Inside does not reach
TREE_FAMILIES = {"lfm2", "kimi_linear"}


def build(family):
    """The tiny float64 model of ``family`` (one per process: wrapping it changes it)."""
    return linear_model(family) if family in SMALL else model_of(family)


def inside(family):
    return Float64Inside() if family in FLOAT32_INSIDE else contextlib.nullcontext()


def weights(groups):
    n = sum(g.group_size for g in groups)
    return torch.randn(n, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(7))


def wrap(kind, model):
    if not kind.startswith("fsdp"):
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard([model.model.embed_tokens, model.lm_head])  # (tied weights, where they are: one unit)
    return fully_shard(model)


def run(kind, family, model, rank, world):
    """The sharedprefix calls of ``kind`` on this rank's share: {run: this rank's full gradients after it}. For a
    family of ``TREE_FAMILIES``, kinds backward and fsdp then run the tree ("tree"), and fsdp the groups again with
    checkpointing ("groups_checkpointed"; "layer0_forwards" and "layer0_forwards_checkpointed": how many forwards the
    first layer ran in the groups' call without and with it)."""
    mine, gidx = shard_of(groups_of(), rank, world)
    W = weights(groups_of())

    def loss_fn(b):
        return (b.logprobs * W[gidx[b.index], : b.logprobs.shape[1]] * b.mask).sum()

    calls = []  # the first layer's forwards under FSDP2: a checkpointed call runs them again in autograd's backward
    if kind == "fsdp":
        model.model.layers[0].register_forward_pre_hook(sp.allow_hook(lambda *_: calls.append(1)))
    out = {}
    if kind == "deferred":  # grad-enabled log-probs: deferred by default under DDP, synced by their backward
        out_lp = sp.logprobs(model, mine, max_tokens=BUDGET)
        (out_lp.logprobs * W[gidx, : out_lp.logprobs.shape[1]] * out_lp.mask).sum().backward()
    else:  # (FSDP2: "recompute", the mode it runs, chosen by default)
        mode = None if kind == "fsdp" else "recompute"
        with inside(family):
            sp.backward(
                model,
                mine,
                loss_fn,
                max_tokens=BUDGET,
                prefix_activations=mode,
                grad_reduction="mean" if kind == "mean" else "sum",
            )
    out["groups"], out["layer0_forwards"] = full_grads(model), len(calls)
    if family not in TREE_FAMILIES or kind not in ("backward", "fsdp"):
        return out
    model.zero_grad(set_to_none=True)
    with inside(family):  # rows sharded; a budget of 16 chains the 20-token system prompt
        run_tree(kind, model, rank, world, vocab=VOCAB)
    out["tree"] = full_grads(model)
    if kind == "fsdp" and family not in FLOAT32_INSIDE:
        model.zero_grad(set_to_none=True)
        model.train()  # (HF checkpoints only in training mode; the tiny configs have no dropout)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        calls.clear()
        sp.backward(model, mine, loss_fn, max_tokens=BUDGET)  # FSDP2's default mode
        out["groups_checkpointed"], out["layer0_forwards_checkpointed"] = full_grads(model), len(calls)
    return out


def failure(kind, model, rank, world, out):
    mine, gidx = shard_of(groups_of(), rank, world)
    W = weights(groups_of())

    def loss_fn(b):
        return (b.logprobs * W[gidx[b.index], : b.logprobs.shape[1]] * b.mask).sum()

    if kind == "refuse_logprobs":  # rank 1's groups are refused (a completion longer than the budget)
        bad = [sp.Group([3, 4, 5], [[6] * 12])] if rank == 1 else mine

        def deferred(m):
            sp.logprobs(m, bad, max_tokens=BUDGET).logprobs.sum().backward()  # grad-enabled: deferred under DDP

        report_outcome(deferred, model, rank, world, out)
    else:  # midfail: rank 1's loss is NaN on its second batch: every rank stops, no .grad is left behind
        report_outcome(
            lambda m: sp.backward(m, mine, nan_on_second_pass(loss_fn, rank), max_tokens=BUDGET),
            model,
            rank,
            world,
            out,
        )


def main(kind, out, families="lfm2"):
    import faulthandler

    faulthandler.dump_traceback_later(150, exit=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    result = {}
    for family in families.split(","):
        model = wrap(kind, build(family))
        if kind in ("midfail", "refuse_logprobs"):
            failure(kind, model, rank, world, out)
        else:
            for name, value in run(kind, family, model, rank, world).items():
                everyone = [None] * world
                dist.all_gather_object(everyone, value)
                result[family, name] = everyone
        del model  # before the process group goes (the caught error's traceback may hold it in a cycle: collected)
        gc.collect()
    if rank == 0 and result:
        torch.save({"results": result}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, *sys.argv[1:])
