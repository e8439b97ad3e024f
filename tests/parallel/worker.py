"""One rank of the distributed tests (run under torchrun): sp.backward on a DDP or FSDP2 model.

Usage: torchrun --nproc_per_node=2 worker.py KIND OUT
(KIND: ddp | fsdp | ddp_mean | ddp_accum | fsdp_logprobs | ddp_tree | fsdp_tree)
Rank 0 writes the full gradients (and statistics) to OUT.
"""

import contextlib
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sharedprefix as sp  # noqa: E402
from helpers import random_groups, tiny_model  # noqa: E402

# one group larger than the budget (prompt 30 -> chunks of 16 + 14, completions in 2 passes) and two small ones
SPEC = ([30, 4, 5], [[6, 6, 6, 6], [2, 2], [3, 3]])
BUDGET = 16


def groups_and_weights():
    groups = random_groups(11, 3, *SPEC)
    n = sum(g.group_size for g in groups)
    W = torch.randn(n, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    return groups, W


def tree_and_weights(vocab=97):
    """Rows sharing a system prompt, with second turns on top of first ones, and per-row per-token weights (token ids
    below ``vocab``)."""
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    system = rand(20)
    rows = []
    for p in range(3):
        prompt = system + rand(4 + p)
        for c in range(2 + p % 2):
            first = prompt + rand(3 + c)
            rows.append(first)
            if c == 0:
                rows.append(first + rand(2) + rand(3))  # a second turn on top of the first
    trained = [[t >= 20 for t in range(len(r))] for r in rows]
    W = torch.randn(len(rows), max(map(len, rows)), dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    return sp.Tree.from_rows(rows, trained), rows, trained, W


def run_tree(kind, model, rank, world, vocab=97):
    """This rank's rows of ``tree_and_weights(vocab)`` (sharded by rows), under a budget that splits the tree."""
    tree, _, _, W = tree_and_weights(vocab)
    mine = sp.shard_groups(tree, rank, world)
    glob = torch.tensor(mine.index)
    loss_fn = lambda b: (b.logprobs * W[glob[b.index], : b.logprobs.shape[1]]).sum()  # noqa: E731
    return sp.backward(model, mine, loss_fn, max_tokens=BUDGET, prefix_activations="recompute")


def step_microbatches(mine, gidx):
    """This rank's groups as two microbatches that split every group's completions (each prompt in both), and each
    microbatch's global completion indices."""
    mbs, idx = [[], []], [[], []]
    at = 0
    for g in mine:
        half = (g.group_size + 1) // 2
        for k, part in enumerate((range(half), range(half, g.group_size))):
            if len(part):
                mbs[k].append(sp.Group(g.prompt, [g.completions[i] for i in part]))
                idx[k] += [int(gidx[at + i]) for i in part]
        at += g.group_size
    return mbs, [torch.tensor(i) for i in idx]


def run_step(kind, model, mine, gidx):
    """A step of two microbatches as accelerate accumulates: the first inside DDP's no_sync(), the second syncing
    (``sp.backward``, or with ``_deferred``: grad-enabled log-probs and the caller's backward)."""
    mbs, idx = step_microbatches(mine, gidx)
    _, W = groups_and_weights()
    # FSDP2: "recompute" passed (_sync_false) or left to the engine (fsdp_step; it was "keep", every call refused)
    mode = "recompute" if "recompute" in kind or kind.endswith("_sync_false") else "keep"
    step = sp.plan_step(model, mbs, max_tokens=BUDGET, **({} if kind == "fsdp_step" else {"prefix_activations": mode}))
    res = None
    for k in range(2):
        if kind.startswith("fsdp"):  # FSDP2's accumulation: no reduce-scatter before the last micro-step
            model.set_requires_gradient_sync(k == 1)
            ctx = contextlib.nullcontext()
        else:
            ctx = model.no_sync() if k == 0 else contextlib.nullcontext()
        with ctx:
            if kind.endswith("_deferred"):
                out = sp.logprobs(model, step.microbatch(k))
                (out.logprobs * W[idx[k], : out.logprobs.shape[1]]).sum().backward()
            elif kind.endswith("_sync_false"):  # as the TRL trainers under FSDP2: values without grad, then
                with torch.no_grad():  # sp.backward, reducing at the last micro-step only (FSDP2 keeps the first's)
                    sp.logprobs(model, step.microbatch(k))
                res = sp.backward(model, step.microbatch(k), loss_fn_for(mbs[k], idx[k]), sync=k == 1)
            else:
                res = sp.backward(model, step.microbatch(k), loss_fn_for(mbs[k], idx[k]))
    assert step.state == "finished", step.state
    return res


def loss_fn_for(groups, gidx):
    _, W = groups_and_weights()
    return lambda b: (b.logprobs * W[gidx[b.index], : b.logprobs.shape[1]] * b.mask).sum()


def my_share(rank, world):
    """This rank's groups and the global completion index of each of their completions."""
    return shard_of(groups_and_weights()[0], rank, world)


def shard_of(groups, rank, world):
    """This rank's share of ``groups`` and the global completion index of each of their completions."""
    mine = sp.shard_groups(groups, rank, world)
    starts, n = {}, 0
    for g in groups:
        starts[id(g)] = n
        n += g.group_size
    return mine, torch.tensor([starts[id(g)] + i for g in mine for i in range(g.group_size)])


def full_grads(model):
    """{parameter name without DDP's ``module.``: its whole gradient (FSDP2 shards gathered), or None}."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name.replace("_orig_mod.", "").replace("module.", "")] = None if g is None else g.detach().clone()
    return out


def present(grads):
    """``grads`` without the parameters that got no gradient (None)."""
    return {k: v for k, v in grads.items() if v is not None}


def whole_grads(model, fn):
    """Run ``fn()`` from zero gradients; returns ``full_grads`` after it, and leaves no gradient behind."""
    model.zero_grad(set_to_none=True)
    fn()
    g = full_grads(model)
    model.zero_grad(set_to_none=True)
    return g


def nan_on_second_pass(loss_fn, rank):
    """``loss_fn`` whose value on rank 1 is NaN on its second call, after a first call accumulated gradients."""
    seen = []

    def failing(b):
        seen.append(1)
        return loss_fn(b) * (float("nan") if rank == 1 and len(seen) == 2 else 1.0)

    return failing


def report_outcome(fn, model, rank, world, out):
    """Run ``fn(model)``; rank 0 writes every rank's outcome ("no error" or the error, then how many ``.grad`` are left)
    to OUT as {"messages": [...]}."""
    try:
        fn(model)
        msg = "no error"
    except (ValueError, RuntimeError) as e:
        msg = f"{type(e).__name__}: {e}"
    msg += f" | grads left: {sum(p.grad is not None for p in model.parameters())}"
    msgs = [None] * world
    dist.all_gather_object(msgs, msg)
    if rank == 0:
        torch.save({"messages": msgs}, out)


def main(kind, out):
    import faulthandler

    from torch._dynamo.utils import counters

    faulthandler.dump_traceback_later(100, exit=True)  # a hang prints where it is and fails instead of blocking CI
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    groups, W = groups_and_weights()
    mine, gidx = my_share(rank, world)
    model = tiny_model("qwen3")
    calls = {"all_reduce": 0}
    if kind.startswith("ddp"):
        model = torch.nn.parallel.DistributedDataParallel(model)
        orig = dist.all_reduce

        def counting(*a, **k):  # gradient all-reduces (the one-element error flags agreed on per call aside)
            calls["all_reduce"] += int(a[0].numel() > 1)
            return orig(*a, **k)

        dist.all_reduce = counting
        if kind.endswith("_compiled"):  # accelerate's order: DDP, then torch.compile around it
            model = torch.compile(model, backend="aot_eager")
    else:
        from torch.distributed.fsdp import fully_shard

        reshard = not kind.endswith("_noreshard")
        if "_units" in kind:  # embedding and LM head as FSDP2 units of their own, as verl and auto-wrap do
            fully_shard(model.model.embed_tokens, reshard_after_forward=reshard)
            fully_shard(model.lm_head, reshard_after_forward=reshard)
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=reshard)
        if kind.endswith("_sync_false"):  # the root as FSDP2 and accelerate leave it: not resharded after forward
            fully_shard(model)
        else:
            fully_shard(model, reshard_after_forward=reshard)
    loss_fn = loss_fn_for(mine, gidx)
    if kind.endswith("_refuse") or kind == "ddp_midfail":  # rank 1 fails: every rank must stop, none hang
        failing = nan_on_second_pass(loss_fn, rank)
        bad = [sp.Group([1, 2, 500], [[3]])] if rank == 1 and kind.endswith("_refuse") else mine
        report_outcome(
            lambda m: sp.backward(m, bad, failing, max_tokens=BUDGET, prefix_activations="recompute"),
            model,
            rank,
            world,
            out,
        )
        # before its process group goes: a DDP reducer destroyed after it can block on gloo or abort the process at
        # exit; the caught error's traceback may still hold the model in a reference cycle, hence the collection
        del model
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        return
    if kind.endswith("_tree"):
        res = run_tree(kind, model, rank, world)
    elif kind == "fsdp_logprobs":
        from helpers import plain_logprobs

        with torch.no_grad():  # forward-only under FSDP2, unequal shards: the short rank runs dummy forwards
            lp = sp.logprobs(model, mine, max_tokens=BUDGET).logprobs
            ref = plain_logprobs(tiny_model("qwen3"), mine)[0]
        refused = 0
        try:
            sp.logprobs(model, mine, max_tokens=BUDGET)
        except ValueError as e:
            refused = int("not supported on an FSDP2 model" in str(e))
        stats = torch.tensor([float((lp - ref).abs().max()), refused])
        gathered = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        if rank == 0:
            torch.save({"stats": [t.tolist() for t in gathered]}, out)
        dist.destroy_process_group()
        return
    elif kind.startswith("ddp_step") or kind.startswith(
        "fsdp_step"
    ):  # one sp.plan_step step over two microbatches, the first inside no_sync()
        res = run_step(kind, model, mine, gidx)
    elif kind.startswith("ddp_accum"):  # accumulate without sync, then sync once: same as one call
        if kind == "ddp_accum_compiled":  # DDP's no_sync(), reached through the compiled wrapper
            with model.no_sync():
                sp.backward(model, mine[:1], loss_fn_for(mine[:1], gidx), max_tokens=BUDGET)
        else:
            sp.backward(model, mine[:1], loss_fn_for(mine[:1], gidx), max_tokens=BUDGET, sync=False)
        res = (
            sp.backward(
                model, mine[1:], loss_fn_for(mine[1:], gidx[sum(g.group_size for g in mine[:1]) :]), max_tokens=BUDGET
            )
            if len(mine) > 1
            else None
        )
        if res is None:  # this rank had one group: its sync call has no groups, so sync an empty contribution
            res = sp.backward(model, mine[:1], lambda b: (b.logprobs * 0.0).sum(), max_tokens=BUDGET)
    else:
        mode = {} if kind == "fsdp_units" else {"prefix_activations": "recompute"}  # FSDP2's default: its mode
        res = sp.backward(
            model, mine, loss_fn, max_tokens=BUDGET, grad_reduction="mean" if kind.endswith("mean") else "sum", **mode
        )
    grads = full_grads(model)
    stats = torch.tensor([res.passes if res else 0, res.dummy_rounds if res else 0, calls["all_reduce"]])
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    if rank == 0:
        torch.save(
            {
                "grads": grads,
                "stats": [t.tolist() for t in gathered],
                "shards": [len(sp.shard_groups(groups, r, world)) for r in range(world)],
                "graphs": counters["stats"]["unique_graphs"],  # this rank's compiled graphs
            },
            out,
        )
    del model
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1], sys.argv[2])
