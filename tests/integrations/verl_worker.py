"""One rank of the 2-process verl test (torchrun, gloo): our engine against verl's on this rank's whole groups.

Usage: torchrun --standalone --nproc_per_node=2 verl_worker.py WORKDIR RESULT_JSON
Each rank gets different groups (as verl's uid-level balancing hands them out) of different lengths, so that
the ranks run different numbers of sharedprefix passes; gradients are FSDP2-averaged across the ranks.
Rank 0 writes {case: {what: relative error}} (ours vs verl) to RESULT_JSON.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import verl_cpu  # noqa: F401  (before verl's engine modules)
from verl_support import (
    FSDPEngineWithLMHead,
    Spec,
    build,
    infer,
    loss_fn,
    masked_rel,
    rel,
    responses_of,
    rl_batch,
    save_model,
    train,
    world,
)

from sharedprefix.integrations.verl import SharedPrefixFSDPEngine


def main(workdir: str, result: str) -> None:
    rank, size = world()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    path = os.path.join(workdir, "model")
    if rank == 0:
        save_model(path)
    dist.barrier()
    ev, es = build(FSDPEngineWithLMHead, path), build(SharedPrefixFSDPEngine, path)
    budget = build(SharedPrefixFSDPEngine, path)
    budget.sp_max_tokens = 24  # rank 0's groups split (30 and 41 tokens), rank 1's fit one pass (21 and 18)
    spec = (
        Spec(prompts=[14, 20], responses=[[5, 8, 3, 6], [7, 2, 8, 4]], seed=1)
        if rank == 0
        else Spec(prompts=[9, 6], responses=[[6, 1, 2, 3], [3, 2, 4, 3]], seed=2)
    )
    rows = 8 * size  # the global mini-batch
    out = {}
    for case, engine, dynamic in (("static", es, False), ("dynamic", es, True), ("budget", budget, False)):
        make = lambda dynamic=dynamic: rl_batch(spec, temperature=0.7, dynamic=dynamic, micro=4, max_tokens=128)  # noqa: E731
        theirs, ours = infer(ev, make()), infer(engine, make())
        td = make()
        resp = td["attention_mask"][:, -td["responses"].shape[1] :].bool()
        errs = {}
        for key in ("log_probs", "entropy"):
            errs[key] = masked_rel(responses_of(ours["model_output"][key], td), responses_of(theirs["model_output"][key], td), resp)
        lf = loss_fn("clip_kl_entropy", rows)
        (o_v, g_v), (o_s, g_s) = train(ev, make(), lf), train(engine, make(), lf)
        errs["grads"] = rel(g_s, g_v)
        errs["loss"] = abs(sum(o_s["loss"]) - sum(o_v["loss"])) / abs(sum(o_v["loss"]))
        gathered = [None] * size
        dist.all_gather_object(gathered, errs)
        out[case] = {k: max(e[k] for e in gathered) for k in errs}
    if rank == 0:
        with open(result, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
