"""One rank of the FSDP2 tests (run under torchrun): wrappings users meet, and failures on one rank.

Usage: torchrun --nproc_per_node=2 fsdp_worker.py KIND OUT
KIND:
  wrappings  sp.backward under each wrapping of ``WRAPPINGS`` (fresh model each), a budget that splits a group;
             rank 0 writes every wrapping's full gradients, the sizes of the all-reduces per call, and whether
             any module of the user's model changed (attributes, ``forward``, class) during or after the calls.
  midfail    prefix_activations='keep' refused on the rank whose shard alone splits a group; rank 1's loss_fn
             raises on its second pass (outside the collectives); then a clean call; then a forward-only
             sp.logprobs in which rank 1 refuses after a pass, and the same call again.
  inside     rank 1 raises inside a layer's forward on its second pass (inside FSDP2's collectives).
Each rank of ``midfail`` / ``inside`` writes OUT.RANK: its error message and the seconds the call took.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.worker import BUDGET, full_grads, loss_fn_for, my_share, run_tree  # noqa: E402

import sharedprefix as sp  # noqa: E402
from helpers import tiny_model  # noqa: E402

# (name, reshard_after_forward, prefix_activations) -- the modes FSDP2 runs under a split budget: its default (None)
# and "recompute"
WRAPPINGS = [
    ("nested", True, None),  # attention and MLP inside each layer, layers, embedding, head, decoder, root
    ("nested", False, "recompute"),
    ("grouped", True, "recompute"),  # both layers as one unit, embedding + head as one unit, root
    ("grouped", False, None),
    ("mixed", None, None),  # torchtitan's choice: every layer but the last, and the units, reshard; the root does not
]


def shard(model, how, reshard):
    kw = dict(reshard_after_forward=reshard)
    dec = model.model
    if how == "nested":
        for layer in dec.layers:
            fully_shard(layer.self_attn, **kw)
            fully_shard(layer.mlp, **kw)
            fully_shard(layer, **kw)
        fully_shard(dec.embed_tokens, **kw)
        fully_shard(model.lm_head, **kw)
        fully_shard(dec, **kw)
    elif how == "grouped":
        fully_shard(list(dec.layers), **kw)
        fully_shard([dec.embed_tokens, model.lm_head], **kw)
    elif how == "mixed":
        for i, layer in enumerate(dec.layers):
            fully_shard(layer, reshard_after_forward=i < len(dec.layers) - 1)
        fully_shard(dec.embed_tokens, reshard_after_forward=True)
        fully_shard(model.lm_head, reshard_after_forward=True)
        kw = dict(reshard_after_forward=False)
    else:
        raise ValueError(how)
    fully_shard(model, **kw)
    return model


def snapshot(model):
    """What a call must leave untouched on the user's model: per module, its class, attribute names and forward."""
    return {name: (type(m), sorted(m.__dict__), m.__dict__.get("forward")) for name, m in model.named_modules()}


def my_work(rank, world):
    mine, gidx = my_share(rank, world)
    return mine, loss_fn_for(mine, gidx)


def one_wrapping(how, reshard, mode, mine, loss_fn):
    """A fresh model wrapped ``how``, one sp.backward; returns it and whether its modules stayed unchanged."""
    model = shard(tiny_model("qwen3"), how, reshard)
    during, before = [], {}
    # looks at the model from inside each pass (a layer's forward) and between passes (loss_fn)
    model.model.layers[0].register_forward_hook(sp.allow_hook(lambda *_: during.append(snapshot(model) == before)))
    before.update(snapshot(model))

    def checked(b):
        during.append(snapshot(model) == before)
        return loss_fn(b)

    sp.backward(model, mine, checked, max_tokens=BUDGET, prefix_activations=mode)
    return model, bool(during) and all(during) and snapshot(model) == before


def wrappings(rank, world, out):
    mine, loss_fn = my_work(rank, world)
    reduces = []
    orig = dist.all_reduce

    def counting(*a, **k):
        reduces.append(a[0].numel())
        return orig(*a, **k)

    dist.all_reduce = counting
    result = {"grads": {}, "reduces": [], "changed": []}
    for how, reshard, mode in WRAPPINGS:
        reduces.clear()
        model, unchanged = one_wrapping(how, reshard, mode, mine, loss_fn)
        result["reduces"].append(list(reduces))
        result["grads"][(how, reshard, mode)] = full_grads(model)
        if not unchanged:
            result["changed"].append((how, reshard, mode))
        if (how, reshard) == ("nested", True):  # a tree whose budget splits every depth, and forward-only values
            model.zero_grad(set_to_none=True)
            run_tree("fsdp_tree", model, rank, world)
            result["tree_grads"] = full_grads(model)
            with torch.no_grad():
                result["logprobs"] = sp.logprobs(model, mine, max_tokens=BUDGET).logprobs
    dist.all_reduce = orig
    gathered = [None] * world
    dist.all_gather_object(gathered, {k: result[k] for k in ("reduces", "changed", "logprobs")})
    if rank == 0:
        result["ranks"] = gathered
        torch.save(result, out)


def failing(rank, world, out, kind):
    """Rank 1 fails on its second pass; every rank records the error it raised and how long the call took."""
    mine, loss_fn = my_work(rank, world)
    model = shard(tiny_model("qwen3"), "nested", True)
    seen = []

    def loss(b):
        seen.append(1)
        if kind == "midfail" and rank == 1 and len(seen) == 2:
            raise ValueError("advantages missing for this batch (rank 1's loss_fn)")
        return loss_fn(b)

    def refuse(module, args):  # inside the second pass's forward: after FSDP2 all-gathered the layer
        if rank == 1 and len(seen) == 1:
            raise ValueError("layer 1 refused this batch on rank 1 (inside a pass)")

    handle = model.model.layers[1].register_forward_pre_hook(sp.allow_hook(refuse)) if kind == "inside" else None
    record = {}
    if kind == "midfail":  # a mode FSDP2 cannot run, where only rank 0's shard splits a group: refused on rank 0 only
        try:
            sp.backward(model, mine, loss_fn, max_tokens=BUDGET, prefix_activations="keep")
            record["keep_message"] = "no error"
        except (ValueError, RuntimeError) as e:
            record["keep_message"] = f"{type(e).__name__}: {e}"
    t = time.monotonic()
    try:
        sp.backward(model, mine, loss, max_tokens=BUDGET)
        msg = "no error"
    except (ValueError, RuntimeError) as e:
        msg = f"{type(e).__name__}: {e}"
    record.update(
        message=msg, seconds=time.monotonic() - t, grads_left=sum(p.grad is not None for p in model.parameters())
    )
    if handle is not None:
        handle.remove()
    if kind == "midfail":  # the process group and FSDP2's state are intact: the next call runs and is exact
        model.zero_grad(set_to_none=True)
        sp.backward(model, mine, loss_fn, max_tokens=BUDGET)
        record["grads"] = full_grads(model)
        record.update(forward_only_failure(model, mine, rank))
    record["initialized"] = dist.is_initialized()
    torch.save(record, f"{out}.{rank}")


def forward_only_failure(model, mine, rank):
    """Forward-only sp.logprobs: rank 1 refuses after its second pass's forward; then the same call succeeds."""
    from sharedprefix.schedule import refusals

    with torch.no_grad():
        before = sp.logprobs(model, mine, max_tokens=BUDGET).logprobs
        own, checks = refusals.check_calls, []

        def refusing(run, state):
            checks.append(1)
            if rank == 1 and len(checks) == 2:
                raise ValueError("rank 1 refused a pass after its forward")
            return own(run, state)

        refusals.check_calls = refusing
        try:
            sp.logprobs(model, mine, max_tokens=BUDGET)
            msg = "no error"
        except (ValueError, RuntimeError) as e:
            msg = f"{type(e).__name__}: {e}"
        finally:
            refusals.check_calls = own
        again = sp.logprobs(model, mine, max_tokens=BUDGET).logprobs
    return {"lp_message": msg, "lp_same_after": bool(torch.equal(before, again))}


def main(kind, out):
    import faulthandler

    faulthandler.dump_traceback_later(80, exit=True)  # a hang prints where it is and fails instead of blocking CI
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if kind == "wrappings":
        wrappings(rank, world, out)
    else:
        failing(rank, world, out, kind)


if __name__ == "__main__":
    from support.torchrun import run_worker

    run_worker(main, sys.argv[1], sys.argv[2])
