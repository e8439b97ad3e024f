"""One rank of the verl Ulysses tests (torchrun, gloo): our engine against verl's, both with
``ulysses_sequence_parallel_size=SP``, verl's Ulysses attention on a CPU varlen kernel (``verl_cpu.allow_ulysses``).

Usage: torchrun --standalone --nproc_per_node=N verl_ulysses_worker.py WORKDIR RESULT_JSON SP
Data-parallel group d = ranks d*SP .. d*SP + SP - 1 (verl's (dp, sp) mesh); its ranks get the same groups, as
verl dispatches them. Rank 0 writes {case: {what: relative error}} (ours vs verl, the largest over the ranks).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import verl_cpu  # (before verl's engine modules)
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
from sharedprefix.parallel.sequence import SequenceShard

EXCHANGES = [0]  # calls of the core's sequence-parallel attention exchange, on this rank


def _counted(fn):
    def wrapped(*args, **kwargs):
        EXCHANGES[0] += 1
        return fn(*args, **kwargs)

    return wrapped


SPECS = [
    Spec(prompts=[14, 20], responses=[[5, 8, 3, 6], [7, 2, 8, 4]], seed=1),
    Spec(prompts=[9, 6], responses=[[6, 1, 2, 3], [3, 2, 4, 3]], seed=2),
]


def main(workdir: str, result: str, sp_size: str) -> None:
    sp_size = int(sp_size)
    rank, size = world()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    verl_cpu.allow_ulysses()
    SequenceShard.to_heads = _counted(SequenceShard.to_heads)
    path = os.path.join(workdir, "model")
    if rank == 0:
        save_model(path)
    dist.barrier()
    kw = dict(attn=verl_cpu.ULYSSES_ATTENTION, ulysses_sequence_parallel_size=sp_size)
    ev, es = build(FSDPEngineWithLMHead, path, **kw), build(SharedPrefixFSDPEngine, path, **kw)
    budget = build(SharedPrefixFSDPEngine, path, **kw)
    budget.sp_max_tokens = 24  # the first spec's groups split (30 and 41 tokens)
    assert es.use_ulysses_sp and es.get_data_parallel_size() == size // sp_size
    spec = SPECS[rank // sp_size]
    rows = 8 * (size // sp_size)  # the global mini-batch
    out = {}
    for case, engine, dynamic in (("static", es, False), ("dynamic", es, True), ("budget", budget, False)):
        make = lambda dynamic=dynamic: rl_batch(spec, temperature=0.7, dynamic=dynamic, micro=4, max_tokens=128)  # noqa: E731
        theirs = infer(ev, make())
        before = EXCHANGES[0]
        ours = infer(engine, make())
        assert EXCHANGES[0] > before  # our engine ran the core's sequence-parallel path
        td = make()
        resp = td["attention_mask"][:, -td["responses"].shape[1] :].bool()
        errs = {}
        for key in ("log_probs", "entropy"):
            errs[key] = masked_rel(responses_of(ours["model_output"][key], td), responses_of(theirs["model_output"][key], td), resp)
        lf = loss_fn("clip_kl_entropy", rows)
        (o_v, g_v), (o_s, g_s) = train(ev, make(), lf), train(engine, make(), lf)
        errs["grads"] = rel(g_s, g_v)
        errs["loss"] = abs(sum(o_s["loss"]) - sum(o_v["loss"])) / abs(sum(o_v["loss"]))
        errs["grad_scale"] = max(float(g.abs().max()) for g in g_v.values())  # not zero: the test checks it
        gathered = [None] * size
        dist.all_gather_object(gathered, errs)
        out[case] = {k: max(e[k] for e in gathered) for k in errs}
    if rank == 0:
        with open(result, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
