"""Ulysses sequence parallelism (``sequence_group``) on 2 and 4 CPU processes (gloo): every rank's log-probs,
entropies and gradients equal one plain transformers forward per row in float64 (1e-9), for GQA (Hkv/S heads per
rank), Hkv < S (replicated key/value heads), MQA and MHA, under a budget that splits a group (prompt K/V cached per
head shard, "keep" and "recompute"), for groups and a prefix tree, with attention sinks (GPT-OSS) and score
soft-capping (Gemma 2); grad-enabled logprobs (deferred) too."""

import os
import subprocess
import sys

import pytest
import torch
from parallel.sequence_worker import BUDGET, CASES, STEP_MODES, build_model, run_step, source, step_weights, weights

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs, tiny_model

WORKER = os.path.join(os.path.dirname(__file__), "sequence_worker.py")


def _launch(n, tmp_path):
    out = tmp_path / "seq"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", WORKER, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(n)]


def _plain(model, src):
    """(N, W) log-probs and entropies of one plain forward per row, aligned with sp.logprobs' output."""
    if isinstance(src, sp.Tree):
        from support.trees import plain_rows

        rows = [r.tolist() for r in src.rows]
        return plain_rows(model, rows, [[bool(x) for x in m] for m in src.trained]), None
    lp, ent = plain_logprobs(model, src, entropy=True)[:2]
    return lp, ent


@pytest.fixture(scope="module", params=[2, 4], ids=["sp2", "sp4"])
def ranks(request, tmp_path_factory):
    return request.param, _launch(request.param, tmp_path_factory.mktemp(f"sp{request.param}"))


def test_plan_splits_a_group_and_rows_need_padding():
    plan = sp.plan(source("groups"), BUDGET)
    assert any(isinstance(s, sp.schedule.PrefixBackward) for s in plan.steps)
    assert any(plan.pass_tokens(p) % 4 for p in plan.passes)  # some rows are padded to a multiple of S


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sequence_parallel_matches_plain_rows_float64(ranks, name, monkeypatch):
    n, results = ranks
    arch, over, budget, mode, kind = CASES[name]
    model = build_model(arch, over)
    if arch == "zoo:gemma2":  # the plain forward's eager softmax runs in float32: the float64 one for the reference
        from transformers.models.gemma2 import modeling_gemma2

        from support.softcap import eager64

        monkeypatch.setattr(modeling_gemma2, "eager_attention_forward", eager64)
    src = source(kind)
    ref_lp, ref_ent = _plain(model, src)
    ref_lp = ref_lp.detach()
    W, V = weights(*results[0][name]["logprobs"].shape)
    if ref_ent is not None:
        want = grads_of(model, lambda: (lambda lp, ent: (lp * W).sum() + 0.1 * (ent * V).sum())(*_plain(model, src)))
    want_lp = grads_of(model, lambda: (_plain(model, src)[0] * W).sum())
    for r, res in enumerate(results):
        got = res[name]
        assert got["passes"] > (1 if budget else 0)
        assert (got["logprobs"] - ref_lp).abs().max() <= 1e-9, (r, name)
        if ref_ent is not None:
            assert (got["entropy"] - ref_ent.detach()).abs().max() <= 1e-9, (r, name)
            assert_grads_close(got["grads"], want, 1e-9)
        assert_grads_close(got["deferred"], want_lp, 1e-9)


@pytest.mark.slow
def test_what_the_split_does_not_reproduce_is_refused(ranks):
    n, results = ranks
    for msgs in (res["refusals"] for res in results):
        want = "6 query heads, not a multiple" if n == 4 else "3 key/value heads and the sequence group 2 ranks"
        assert want in msgs["heads"]
        assert "hybrid model" in msgs["hybrid"] and "state of the slices before it" in msgs["hybrid"]
        assert "DDP data parallelism" in msgs["ddp"]
        assert "defer=False with grad enabled is not possible with sequence parallelism" in msgs["defer_false"]
        assert msgs["mismatch"].startswith(f"ValueError: the {n} ranks of sequence_group passed different inputs")
        assert f"rank(s) [{n - 1}] would compute other rows" in msgs["mismatch"]
    for r, res in enumerate(results):  # the last rank's own error; the others name it instead of waiting for it
        got = res["refusals"]["one_rank_bad"]
        if r == n - 1:
            assert got.startswith("ValueError: temperature=-1.0; expected a finite number > 0"), got
        else:
            assert got.startswith(f"RuntimeError: rank {n - 1} of the sequence group stopped before any computation")
            assert "temperature=-1.0" in got


@pytest.mark.slow
def test_fsdp2_data_parallel_times_sequence_parallel(ranks):
    """FSDP2 over all ranks, sequence groups of 2 (1 x 2 and 2 x 2): every rank's full gradient is the plain
    gradient of all groups (summed over the data-parallel groups), its log-probs its own groups' plain ones."""
    n, results = ranks
    from parallel.sequence_worker import fsdp_weights

    groups = source("groups")
    model = tiny_model("qwen3")
    W = fsdp_weights(sum(g.group_size for g in groups))
    want = grads_of(model, lambda: (lambda lp: (lp * W[:, : lp.shape[1]]).sum())(plain_logprobs(model, groups)[0]))
    assert sorted({res["fsdp"]["data_group"] for res in results}) == list(range(n // 2))
    for res in results:
        got = res["fsdp"]
        assert_grads_close(got["grads"], want, 1e-9)
        assert_grads_close(got["step_grads"], want, 1e-9)  # the same rows as a step of two microbatches
        mine = [groups[i] for i in sorted({_group_of(groups, int(c)) for c in got["gidx"]})]
        ref = plain_logprobs(model, mine)[0].detach()
        assert (got["logprobs"] - ref).abs().max() <= 1e-9


@pytest.mark.slow
def test_step_over_microbatches_with_a_sequence_group(ranks):
    """sp.plan_step with a sequence_group (every rank the same two microbatches, each prompt shared by both): each
    rank's gradient is the plain gradient of the microbatches' losses summed, and the step computes the tokens the
    same step computes on one process (each prompt once for the step), in "keep" and in "recompute" under a budget
    that splits the 30-token prompt."""
    n, results = ranks
    groups = source("groups")
    model = build_model("qwen3", {})
    W = step_weights(sum(g.group_size for g in groups))
    want = grads_of(model, lambda: (lambda lp: (lp * W[:, : lp.shape[1]]).sum())(plain_logprobs(model, groups)[0]))
    for name, (mode, budget) in STEP_MODES.items():
        model.zero_grad(set_to_none=True)
        tokens, _ = run_step(model, groups, mode, budget, None)
        for res in results:
            got = res["steps"][name]
            assert got["state"] == "finished" and got["tokens"] == tokens, name
            assert_grads_close(got["grads"], want, 1e-9)
    assert tokens < sp.plan(groups).plain_tokens


def _group_of(groups, completion):
    start = 0
    for i, g in enumerate(groups):
        if completion < start + g.group_size:
            return i
        start += g.group_size
    raise IndexError(completion)


def test_sequence_group_validated():
    import torch.distributed as dist

    model = tiny_model("qwen3")
    if dist.is_initialized():  # another test of this session left a process group
        with pytest.raises(TypeError, match="sequence_group is a object; expected a torch.distributed.ProcessGroup"):
            sp.logprobs(model, source("groups"), sequence_group=object())
    else:
        with pytest.raises(ValueError, match="torch.distributed is not initialised"):
            sp.logprobs(model, source("groups"), sequence_group=object())
