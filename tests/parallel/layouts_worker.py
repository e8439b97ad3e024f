"""One rank of the data-parallel layout tests (run under torchrun, 2 ranks): settings of DDP and FSDP2 that users
bring, each cell's sharedprefix calls next to the plain run under the same wrapper and settings.

Usage: torchrun --nproc_per_node=2 layouts_worker.py KIND OUT   (KIND: ddp | fsdp; hsdp on 4 ranks)
Rank 0 writes {cell: whole gradients, or the error raised as a string} to OUT. Every cell's ``plain`` is the plain
per-row run (one forward of the rank's rows, right-padded, through the wrapper), scaled so that its gradient is the
sum over every rank's rows (the wrappers average over ranks); ``aux`` terms are averaged over ranks, as the wrapper's
own backward does.
"""

import os
import sys
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.worker import BUDGET, groups_and_weights, loss_fn_for, my_share, run_step, whole_grads  # noqa: E402

import sharedprefix as sp  # noqa: E402
from helpers import tiny_model  # noqa: E402


def aux_ids(rank):
    """A short row of token ids per rank for an auxiliary loss through the wrapper (an SFT term, say)."""
    return torch.tensor([[3 + rank, 17, 5, 9, 11 + 2 * rank, 2]])


def aux_loss(model, rank):
    """The auxiliary loss on ``aux_ids(rank)``: its tokens' log-likelihood (float64 model)."""
    ids = aux_ids(rank)
    logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1], -1)
    return -logp.gather(-1, ids[:, 1:, None]).sum() * 0.5


def plain_rows(model, groups, gidx, world, aux_rank=None):
    """The plain run through ``model`` (the wrapper): one forward of every row of ``groups`` right-padded (plus the
    rank's auxiliary row when ``aux_rank`` is given), loss = ``world`` * weighted log-probs (+ aux): ``world`` is
    what the wrapper divides the summed gradient by."""
    _, W = groups_and_weights()
    rows = [torch.cat([g.prompt, c]) for g in groups for c in g.completions]
    if not rows and aux_rank is None:  # a rank without groups (HSDP's 4 ranks, 3 groups): a zero loss, same collectives
        return model(input_ids=torch.tensor([[1, 2]]), use_cache=False).logits.sum() * 0.0
    if aux_rank is not None:
        rows.append(aux_ids(aux_rank)[0])
    L = max(len(r) for r in rows)
    batch = torch.stack([torch.nn.functional.pad(r, (0, L - len(r))) for r in rows])
    logp = torch.log_softmax(model(input_ids=batch, use_cache=False).logits.double(), -1)
    loss, i = 0.0, 0
    for g in groups:
        P = len(g.prompt)
        for c in g.completions:
            lp = logp[i, P - 1 : P - 1 + len(c)].gather(-1, c[:, None])[:, 0]
            loss = loss + (lp * W[gidx[i], : len(c)]).sum()
            i += 1
    loss = loss * world
    if aux_rank is not None:
        ids = batch[-1:, : len(rows[-1])]
        loss = loss - logp[-1:, : ids.shape[1] - 1].gather(-1, ids[:, 1:, None]).sum() * 0.5
    return loss


def cell(result, name, model, fn):
    """result[name] = the whole gradients after ``fn()`` from zero (names without the checkpoint wrappers' part), or
    the error it raised (as a string)."""
    try:
        grads = whole_grads(model, lambda: (fn(), resharded(model)))  # the optimizer's (sharded) parameters' .grad
        result[name] = {k.replace("._checkpoint_wrapped_", "."): v for k, v in grads.items()}  # without "module."
    except (ValueError, RuntimeError, TypeError, AssertionError) as e:
        model.zero_grad(set_to_none=True)
        result[name] = f"{type(e).__name__}: {e}"
        print(f"rank {dist.get_rank()}: {name}: {result[name][:300]}", file=sys.stderr)


def resharded(model):
    """Every FSDP2 module of ``model`` resharded: its sharded parameters registered (nothing under DDP)."""
    for m in model.modules():
        if hasattr(m, "reshard") and hasattr(m, "set_reshard_after_backward"):
            m.reshard()


def logprobs_then_backward(model, mine, gidx):
    """Grad-enabled sp.logprobs under the budget (deferred under DDP), then the caller's backward."""
    _, W = groups_and_weights()
    out = sp.logprobs(model, mine, max_tokens=BUDGET)
    (out.logprobs * W[gidx, : out.logprobs.shape[1]] * out.mask).sum().backward()


def checkpointed(model):
    """accelerate's FSDP ``activation_checkpointing=True``: torch's non-reentrant wrapper around each decoder layer."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    layer_cls = type(model.model.layers[0])
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, layer_cls),
    )
    return model


def ddp_cells(rank, world, result):
    from torch.nn.parallel import DistributedDataParallel as DDP

    mine, gidx = my_share(rank, world)
    loss_fn = loss_fn_for(mine, gidx)

    def run(ddp, mode):
        sp.backward(ddp, mine, loss_fn, max_tokens=BUDGET, prefix_activations=mode)

    def standard(name, ddp):
        for mode in ("keep", "recompute"):
            cell(result, f"{name}/{mode}", ddp, lambda m=mode: run(ddp, m))
            cell(result, f"{name}/plain", ddp, lambda: plain_rows(ddp, mine, gidx, world).backward())
        cell(result, f"{name}/logprobs", ddp, lambda: logprobs_then_backward(ddp, mine, gidx))

    standard("static_graph", DDP(tiny_model("qwen3"), static_graph=True))
    standard("no_broadcast_buffers", DDP(tiny_model("qwen3"), broadcast_buffers=False))
    standard("checkpoint_wrapped", DDP(checkpointed(tiny_model("qwen3"))))

    # an auxiliary loss through the DDP module and an sp.backward call before one optimizer step, in each order
    ddp = DDP(tiny_model("qwen3"))
    aux = lambda: aux_loss(ddp, rank)  # noqa: E731
    sp_call = lambda: sp.backward(ddp, mine, loss_fn, max_tokens=BUDGET)  # noqa: E731

    def aux_in_no_sync_first():
        with ddp.no_sync():
            aux().backward()
        sp_call()

    def aux_forward_around():  # refused: DDP's reducer, armed by the forward, fires in the call's backward
        a = aux()
        sp_call()
        a.backward()

    def refused_keeps_grad():  # the refusal leaves .grad as the call found it: the first auxiliary term, averaged
        aux().backward()
        a = aux()
        try:
            sp_call()
        except ValueError:
            pass
        del a

    def aux_with_deferred_logprobs():  # the auxiliary term in the same backward as a deferred call's log-probs
        _, W = groups_and_weights()
        a = aux()
        out = sp.logprobs(ddp, mine, max_tokens=BUDGET)
        ((out.logprobs * W[gidx, : out.logprobs.shape[1]] * out.mask).sum() + a).backward()

    def sp_in_no_sync_first():
        with ddp.no_sync():
            sp_call()
        aux().backward()

    orders = {
        "aux_first": lambda: (aux().backward(), sp_call()),
        "sp_first": lambda: (sp_call(), aux().backward()),
        "aux_no_sync_first": aux_in_no_sync_first,
        "sp_no_sync_first": sp_in_no_sync_first,
        "aux_forward_before_sp": aux_forward_around,
        "aux_with_deferred_logprobs": aux_with_deferred_logprobs,
    }
    for name, fn in orders.items():
        cell(result, f"mixed/{name}", ddp, fn)
        cell(result, f"mixed/{name}/plain", ddp, lambda: plain_rows(ddp, mine, gidx, world, aux_rank=rank).backward())
    cell(result, "mixed/refused_keeps_grad", ddp, refused_keeps_grad)


def fsdp_cells(rank, world, result, mesh=None):
    from torch.distributed.fsdp import fully_shard

    mine, gidx = my_share(rank, world)
    loss_fn = loss_fn_for(mine, gidx)

    def run(model, mode):
        if mine:
            sp.backward(model, mine, loss_fn, max_tokens=BUDGET, prefix_activations=mode)
        else:  # a rank without groups (HSDP: 4 ranks, 3 groups) joins with a zero loss
            zero = lambda b: (b.logprobs * 0.0).sum()  # noqa: E731
            sp.backward(model, groups_and_weights()[0][-1:], zero, max_tokens=BUDGET, prefix_activations=mode)

    def sharded(ac=None, **kw):
        model = tiny_model("qwen3")
        kw = {**kw, "mesh": mesh} if mesh is not None else kw
        if ac == "before":  # accelerate's order: checkpoint wrappers first, then fully_shard on each wrapped layer
            checkpointed(model)
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        if ac == "after":
            checkpointed(model)
        fully_shard(model, **kw)
        return model

    def standard(name, model, modes=(None, "recompute"), divide=world):
        for mode in modes:
            cell(result, f"{name}/{mode}", model, lambda m=mode: run(model, m))
        cell(result, f"{name}/plain", model, lambda: plain_rows(model, mine, gidx, divide).backward())
        cell(result, f"{name}/logprobs", model, lambda: logprobs_then_backward(model, mine, gidx))

    if mesh is not None:  # HSDP: the default wrapping on a replicate x shard mesh
        standard("hsdp", sharded())
        return
    standard("ac_before_shard", sharded(ac="before"))
    standard("ac_after_shard", sharded(ac="after"))
    for factor in (1.0, float(world), 4.0):
        model = sharded()
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_reduce_scatter_divide_factor(factor)
        standard(f"divide_factor={factor:g}", model, modes=(None,), divide=factor)
    model = sharded()
    model.model.layers[0].set_reduce_scatter_divide_factor(1.0)  # one module only: the groups disagree
    cell(result, "divide_factor_mixed", model, lambda: run(model, None))
    for r in (1, 2):
        try:
            model = sharded(reshard_after_forward=r)
        except (ValueError, RuntimeError, TypeError, AssertionError) as e:
            result[f"reshard_int={r}"] = f"{type(e).__name__}: {e}"
            continue
        standard(f"reshard_int={r}", model, modes=(None,))

    # FSDP2's own no_sync: gradient sync off for the first of two calls, then on
    model = sharded()
    first, rest = mine[:1], mine[1:]
    n1 = first[0].group_size
    w = loss_fn_for(rest, gidx[n1:]) if rest else (lambda b: (b.logprobs * 0.0).sum())

    def two_calls():
        model.set_requires_gradient_sync(False)
        sp.backward(model, first, loss_fn_for(first, gidx[:n1]), max_tokens=BUDGET)
        model.set_requires_gradient_sync(True)
        sp.backward(model, rest or first, w, max_tokens=BUDGET)

    def two_plain():
        model.set_requires_gradient_sync(False)
        plain_rows(model, first, gidx[:n1], world).backward()
        model.set_requires_gradient_sync(True)
        if rest:
            plain_rows(model, rest, gidx[n1:], world).backward()
        else:
            (plain_rows(model, first, gidx[:n1], world) * 0.0).backward()

    def run_first(m):
        sp.backward(m, first, loss_fn_for(first, gidx[:n1]), max_tokens=BUDGET)

    def run_rest(m):
        sp.backward(m, rest or first, w, max_tokens=BUDGET)

    def plain_first(m):
        plain_rows(m, first, gidx[:n1], world).backward()

    def plain_rest(m):
        (plain_rows(m, rest, gidx[n1:], world) if rest else plain_rows(m, first, gidx[:n1], world) * 0.0).backward()

    cell(result, "no_sync/two_calls", model, two_calls)
    cell(result, "no_sync/plain", model, two_plain)

    # units that stay unsharded after backward: two reducing calls, a reducing plain backward then a call, a step
    model = sharded()
    for m in model.modules():
        if hasattr(m, "set_reshard_after_backward"):
            m.set_reshard_after_backward(False)
    cell(result, "no_reshard_after_backward/two_calls", model, lambda: (run_first(model), run_rest(model)))
    cell(result, "no_reshard_after_backward/plain_then_call", model, lambda: (plain_first(model), run_rest(model)))
    cell(result, "no_reshard_after_backward/step", model, lambda: run_step("fsdp_step", model, mine, gidx))
    cell(result, "no_reshard_after_backward/plain", model, lambda: (plain_first(model), plain_rest(model)))


def main(kind, out):
    import faulthandler

    faulthandler.dump_traceback_later(250 if kind != "hsdp" else 100, exit=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    result = {}
    if kind == "hsdp":  # 4 ranks: 2 replicas of 2 shards
        from torch.distributed.device_mesh import init_device_mesh

        fsdp_cells(rank, world, result, init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    else:
        {"ddp": ddp_cells, "fsdp": fsdp_cells}[kind](rank, world, result)
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1], sys.argv[2])
