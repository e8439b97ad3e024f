"""One rank of the verl Ulysses tests (torchrun, gloo): our engine against verl's, both with
``ulysses_sequence_parallel_size=SP``, verl's Ulysses attention on a CPU varlen kernel (``verl_cpu.allow_ulysses``).

Usage: torchrun --standalone --nproc_per_node=N verl_ulysses_worker.py WORKDIR RESULT_JSON SP
Data-parallel group d = ranks d*SP .. d*SP + SP - 1 (verl's (dp, sp) mesh); its ranks get the same groups, as
verl dispatches them. Rank 0 writes {case: {what: relative error}} (ours vs verl, the largest over the ranks).
"""

import sys

import torch
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
    for case, (name, dynamic, micro, max_tokens, loss) in CASES.items():
        make = lambda d=dynamic, m=micro, t=max_tokens: rl_batch(  # noqa: E731
            spec, temperature=0.7, dynamic=d, micro=m, max_tokens=t
        )
        engine = budget if name == "budget" else es
        out[case] = case_errors(ev, engine, make, LOSSES[loss](rows), wrap_ours=_exchanged, grad_scale=True)
    finish_worker(result, out)


def _policy(rows, **policy):
    return loss_fn("clip_kl_entropy", rows, policy_loss=policy)


def _clip_cov(rows):
    """clip_cov draws its clipped tokens at random (torch's generator): the same seed before each call, the same
    draw in both engines."""
    lf = _policy(rows, loss_mode="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=-5.0)

    def fn(**kw):
        torch.manual_seed(0)
        return lf(**kw)

    return fn


def _bypass(rows):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    corr = RolloutCorrectionConfig(loss_type="reinforce", rollout_is="token", rollout_is_batch_normalize=True)
    return _policy(rows, loss_mode="bypass_mode", rollout_correction=corr)


# verl's ppo_loss (clipping, k3 KL, entropy bonus) with an additive policy loss and the four that read the rows of
# each micro-batch
LOSSES = {
    "vanilla": lambda rows: loss_fn("clip_kl_entropy", rows),
    "kl_cov": lambda rows: _policy(rows, loss_mode="kl_cov", kl_cov_ratio=0.1),
    "clip_cov": _clip_cov,
    "geo_mean": lambda rows: _policy(rows, loss_mode="geo_mean"),
    "bypass_reinforce_normalised": _bypass,
}
# case -> (engine: "es" or "budget", dynamic, micro_batch_size_per_gpu, max_token_len_per_gpu, loss): groups of 4
# rows; static micro-batches of 4 and of 2 (below rollout.n: each group split), dynamic ones of 128 and of 32 tokens
# per rank (verl's budget is per sequence group: x SP)
CASES = {
    "static": ("es", False, 4, 128, "vanilla"),
    "dynamic": ("es", True, 4, 128, "vanilla"),
    "budget": ("budget", False, 4, 128, "vanilla"),
    "split": ("es", False, 2, 128, "vanilla"),
    "split_kl_cov": ("es", False, 2, 128, "kl_cov"),
    "split_clip_cov": ("es", False, 2, 128, "clip_cov"),
    "dynamic_geo_mean": ("es", True, 4, 32, "geo_mean"),
    "dynamic_bypass": ("es", True, 4, 32, "bypass_reinforce_normalised"),
}


if __name__ == "__main__":
    main(*sys.argv[1:4])
