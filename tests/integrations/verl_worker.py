"""One rank of the 2-process verl test (torchrun, gloo): our engine against verl's on this rank's groups.

Usage: torchrun --standalone --nproc_per_node=2 verl_worker.py WORKDIR RESULT_JSON
Each rank gets different groups (as verl's uid-level balancing hands them out) of different lengths, so that
the ranks run different numbers of sharedprefix passes; gradients are FSDP2-averaged across the ranks. Micro-batches
of 4 rows hold one group each, of 2 rows half of one: each rank's mini-batch is one step whose prompts are shared by
two micro-batches.
Rank 0 writes {case: {what: relative error}} (ours vs verl) to RESULT_JSON.
"""

import sys

import verl_cpu  # noqa: F401  (before verl's engine modules)
from verl_support import FSDPEngineWithLMHead, Spec, build, case_errors, finish_worker, loss_fn, rl_batch, start_worker

from sharedprefix.integrations.verl import SharedPrefixFSDPEngine


def main(workdir: str, result: str) -> None:
    rank, size, path = start_worker(workdir)
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
    geo_mean = {"policy_loss": {"loss_mode": "geo_mean"}}
    cases = (
        ("static", es, False, 4, {}),
        ("dynamic", es, True, 4, {}),
        ("budget", budget, False, 4, {}),
        ("split", es, False, 2, {}),  # micro-batches of 2 rows: each group's rows in two of them, one step
        ("split_geo_mean", budget, False, 2, geo_mean),  # a loss that reads each micro-batch's rows, under a budget
    )
    for case, engine, dynamic, micro, loss in cases:
        make = lambda dynamic=dynamic, micro=micro: rl_batch(  # noqa: E731
            spec, temperature=0.7, dynamic=dynamic, micro=micro, max_tokens=128
        )
        out[case] = case_errors(ev, engine, make, loss_fn("clip_kl_entropy", rows, **loss))
    finish_worker(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
