"""One rank of the verl Ulysses tests (torchrun, gloo): our engine against verl's, both with
``ulysses_sequence_parallel_size=SP``, verl's Ulysses attention on a CPU varlen kernel (``verl_cpu.allow_ulysses``).

Usage: torchrun --standalone --nproc_per_node=N verl_ulysses_worker.py WORKDIR RESULT_JSON SP
Data-parallel group d = ranks d*SP .. d*SP + SP - 1 (verl's (dp, sp) mesh); its ranks get the same groups, as
verl dispatches them. Rank 0 writes {case: {what: relative error}} (ours vs verl, the largest over the ranks).
"""

import sys

import verl_cpu  # (before verl's engine modules)
from verl_support import FSDPEngineWithLMHead, Spec, build, case_errors, finish_worker, loss_fn, rl_batch, start_worker

from sharedprefix.integrations.verl import SharedPrefixFSDPEngine
from sharedprefix.parallel.sequence import SequenceShard

EXCHANGES = [0]  # calls of the core's sequence-parallel attention exchange, on this rank


def _counted(fn):
    def wrapped(*args, **kwargs):
        EXCHANGES[0] += 1
        return fn(*args, **kwargs)

    return wrapped


def _exchanged(run):
    """Our inference call, which must run the core's sequence-parallel path."""
    before = EXCHANGES[0]
    ours = run()
    assert EXCHANGES[0] > before
    return ours


SPECS = [
    Spec(prompts=[14, 20], responses=[[5, 8, 3, 6], [7, 2, 8, 4]], seed=1),
    Spec(prompts=[9, 6], responses=[[6, 1, 2, 3], [3, 2, 4, 3]], seed=2),
]


def main(workdir: str, result: str, sp_size: str) -> None:
    sp_size = int(sp_size)
    rank, size, path = start_worker(workdir, before_model=verl_cpu.allow_ulysses)
    SequenceShard.to_heads = _counted(SequenceShard.to_heads)
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
        lf = loss_fn("clip_kl_entropy", rows)
        out[case] = case_errors(ev, engine, make, lf, wrap_ours=_exchanged, grad_scale=True)
    finish_worker(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
