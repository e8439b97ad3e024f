"""One rank of the 2-process verl test under verl's default mixed precision (torchrun, gloo): our engine and verl's,
each against a float64 plain run of the same update on this rank's groups (``verl_support.float64_step`` with the
global mini-batch's token count; gradients averaged over the ranks as FSDP2 averages them).

Usage: torchrun --standalone --nproc_per_node=2 verl_mixed_worker.py WORKDIR RESULT_JSON
The ranks' groups and cases are ``verl_worker.py``'s (whole groups per rank; micro-batches of whole and half groups;
a budget that splits rank 0's groups). Rank 0 writes {case: {engine: {what: relative error}}} (the largest over the
ranks) to RESULT_JSON.
"""

import sys

import torch.distributed as dist
import verl_cpu  # noqa: F401  (before verl's engine modules)
from verl_support import (
    FSDPEngineWithLMHead,
    Spec,
    build,
    finish_worker,
    float64_errors,
    float64_scalars,
    float64_step,
    loss_fn,
    micro_batch_rows,
    rl_batch,
    start_worker,
)

from sharedprefix.integrations.verl import SharedPrefixFSDPEngine

TEMPERATURE = 0.7


def main(workdir: str, result: str) -> None:
    rank, size, path = start_worker(workdir)
    kw = dict(mixed_precision=None)  # verl's default: bf16 parameters, float32 reduction
    ev, es, budget = (
        build(cls, path, **kw) for cls in (FSDPEngineWithLMHead, SharedPrefixFSDPEngine, SharedPrefixFSDPEngine)
    )
    budget.sp_max_tokens = 24  # rank 0's groups split (30 and 41 tokens), rank 1's fit one pass (21 and 18)
    spec = (
        Spec(prompts=[14, 20], responses=[[5, 8, 3, 6], [7, 2, 8, 4]], seed=1)
        if rank == 0
        else Spec(prompts=[9, 6], responses=[[6, 1, 2, 3], [3, 2, 4, 3]], seed=2)
    )
    lf = loss_fn("clip_kl_entropy", 8 * size)
    out = {}
    for case, engine, dynamic, micro in (
        ("static", es, False, 4),
        ("dynamic", es, True, 4),
        ("budget", budget, False, 4),
        ("split", es, False, 2),  # micro-batches of 2 rows: each group's rows in two of them, one step
    ):
        make = lambda dynamic=dynamic, micro=micro: rl_batch(  # noqa: E731
            spec, temperature=TEMPERATURE, dynamic=dynamic, micro=micro, max_tokens=128
        )
        tokens = make()["loss_mask"].sum().reshape(1)
        dist.all_reduce(tokens)
        lp64, ent64, g64, losses, metrics = float64_step(
            path,
            make(),
            lf,
            micro_batch_rows(make(), dist.group.WORLD),
            TEMPERATURE,
            batch_num_tokens=int(tokens),
            dp_size=size,
        )
        for g in g64.values():  # FSDP2's average of the ranks' shares
            dist.all_reduce(g)
            g /= size
        reference = (lp64, ent64, g64, float64_scalars(losses, metrics))
        errs = {"verl": float64_errors(ev, make, lf, reference), "ours": float64_errors(engine, make, lf, reference)}
        gathered = [None] * size
        dist.all_gather_object(gathered, errs)
        out[case] = {e: {k: max(r[e][k] for r in gathered) for k in errs[e]} for e in errs}
    finish_worker(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
