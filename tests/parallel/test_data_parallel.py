"""DDP and FSDP2 on 2 CPU processes (gloo, loopback): gradients equal a single-process plain run (float64)."""

import os
import subprocess
import sys

import pytest
import torch
from parallel.worker import BUDGET, groups_and_weights, tree_and_weights

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs, tiny_model

pytestmark = pytest.mark.slow  # torchrun, 2 processes


WORKER = os.path.join(os.path.dirname(__file__), "worker.py")


def _launch(kind, tmp_path):
    out = tmp_path / f"{kind}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, kind, str(out)]
    for attempt in range(2):  # one retry, only for a launch that timed out (a stuck rendezvous), never for a failure
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
            break
        except subprocess.TimeoutExpired as e:
            if attempt:
                raise AssertionError(f"2-process run of {kind!r} timed out twice: {str(e.stderr)[-3000:]}") from None
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def reference():
    groups, W = groups_and_weights()
    model = tiny_model("qwen3")
    return grads_of(model, lambda: (plain_logprobs(model, groups)[0] * W).sum())


def test_shards_are_unequal_and_one_group_exceeds_the_budget():
    groups, _ = groups_and_weights()
    shards = [sp.shard_groups(groups, r, 2) for r in range(2)]
    assert sorted(len(s) for s in shards) == [1, 2]
    assert sorted(g for s in shards for g in map(id, s)) == sorted(map(id, groups))  # every group once
    big = [s for s in shards if len(s) == 1][0]
    assert any(isinstance(st, sp.schedule.PrefixBackward) for st in sp.plan(big, BUDGET).steps)


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp_units", "fsdp_units_noreshard"])
def test_two_process_gradients_match_plain_float64(kind, tmp_path, reference):
    got = _launch(kind, tmp_path)
    assert_grads_close({k: v for k, v in got["grads"].items() if v is not None}, reference, 1e-9)
    (passes0, dummy0, reduce0), (passes1, dummy1, reduce1) = got["stats"]
    assert passes0 != passes1  # the ranks really had different work
    if kind == "ddp":
        assert reduce0 == reduce1 == 1  # one all-reduce of all (float64) gradients per optimizer step
    else:
        assert dummy0 + dummy1 > 0  # the rank with fewer rounds took part in the other's collectives


def test_ddp_mean_reduction(tmp_path, reference):
    got = _launch("ddp_mean", tmp_path)
    assert_grads_close({k: v * 2 for k, v in got["grads"].items() if v is not None}, reference, 1e-9)


def test_ddp_accumulation_then_one_sync(tmp_path, reference):
    got = _launch("ddp_accum", tmp_path)
    assert_grads_close({k: v for k, v in got["grads"].items() if v is not None}, reference, 1e-9)


@pytest.mark.parametrize(
    "kind", ["ddp_step", "ddp_step_recompute", "ddp_step_deferred", "fsdp_step", "fsdp_step_sync_false"]
)
def test_ddp_step_over_two_microbatches(kind, tmp_path, reference):
    """sp.plan_step under DDP, accelerate's accumulation (the first micro-step inside no_sync()): every prompt once
    for the step, its backward inside the syncing micro-step, one gradient all-reduce per rank, gradients exact;
    and under FSDP2 (its recompute mode, set_requires_gradient_sync(False) on the first micro-step). With
    ``_sync_false`` the root is sharded with FSDP2's default (not resharded after forward, as accelerate leaves it
    too) and the first micro-step's sp.backward passes sync=False after a no-grad call on its rows (the TRL
    trainers' order): FSDP2 keeps the embedding's, the norm's and the head's gradient on their unsharded parameters,
    which stay registered after a forward, until the second reduces it (before ``FSDP2.before_grads``: held aside by
    the call's gradient transaction and dropped, relative error 1.0)."""
    got = _launch(kind, tmp_path)
    assert_grads_close({k: v for k, v in got["grads"].items() if v is not None}, reference, 1e-9)
    if kind.startswith("ddp"):
        assert [reduces for _, _, reduces in got["stats"]] == [1, 1]


@pytest.mark.parametrize("kind", ["ddp_compiled", "ddp_accum_compiled"])
def test_ddp_inside_torch_compile(kind, tmp_path, reference):
    """torch.compile(DDP(model)), accelerate's order: still DDP (one gradient all-reduce per step, none inside the
    compiled wrapper's no_sync()), the decoder layers compiled with the wrapper's context, gradients exact."""
    got = _launch(kind, tmp_path)
    assert_grads_close({k: v for k, v in got["grads"].items() if v is not None}, reference, 1e-9)
    assert [reduces for _, _, reduces in got["stats"]] == [1, 1]
    assert got["graphs"] >= 1, "the layers did not run compiled"


def test_fsdp_forward_only_logprobs_and_grad_refusal(tmp_path):
    got = _launch("fsdp_logprobs", tmp_path)
    for max_err, refused in got["stats"]:
        assert max_err <= 1e-9 and refused == 1


def test_shard_groups_is_deterministic_and_validates():
    groups, _ = groups_and_weights()
    assert [id(g) for g in sp.shard_groups(groups, 0, 2)] == [id(g) for g in sp.shard_groups(groups, 0, 2)]
    assert sp.shard_groups(groups, 0, 1) == groups
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        sp.shard_groups(groups, 2, 2)
    with pytest.raises(TypeError, match="rank='0'"):
        sp.shard_groups(groups, "0", 2)


@pytest.mark.parametrize("kind", ["ddp_tree", "fsdp_tree"])
def test_two_process_tree_gradients_match_plain_rows(kind, tmp_path):
    """A tree sharded by rows (system prompt shared across prompts, second turns), budget splitting it: the
    summed gradients of the 2 ranks equal one plain forward per row, weighted per row and token."""
    from support.trees import plain_rows

    tree, rows, trained, W = tree_and_weights()
    assert any(isinstance(s, sp.schedule.PrefixBackward) for s in sp.plan(sp.shard_groups(tree, 0, 2), BUDGET).steps)
    model = tiny_model("qwen3")
    want = grads_of(model, lambda: (plain_rows(model, rows, trained) * W).sum())
    got = _launch(kind, tmp_path)
    assert_grads_close({k: v for k, v in got["grads"].items() if v is not None}, want, 1e-9)


@pytest.mark.parametrize("kind", ["ddp_refuse", "fsdp_refuse"])
def test_a_refusal_on_one_rank_stops_every_rank(kind, tmp_path):
    """Rank 1's batch holds a token id outside the vocabulary: it raises that error, rank 0 raises one naming rank 1
    and the reason, before any collective of the call (no hang: the launch would time out)."""
    msgs = _launch(kind, tmp_path)["messages"]
    assert msgs[1].startswith("ValueError") and "outside the model's vocabulary" in msgs[1]
    assert msgs[0].startswith("RuntimeError: rank 1 stopped before any computation of this sharedprefix call")
    assert "vocabulary" in msgs[0] and all(m.endswith("grads left: 0") for m in msgs)


def test_ddp_an_error_mid_call_on_one_rank_stops_every_rank(tmp_path):
    """Rank 1's loss is NaN on its second pass: under DDP (no collective during the passes) the ranks agree before
    the gradient all-reduce; both raise, and neither keeps a partial gradient."""
    msgs = _launch("ddp_midfail", tmp_path)["messages"]
    assert msgs[1].startswith("ValueError") and "expected a finite value" in msgs[1]
    assert msgs[0].startswith("RuntimeError: rank 1 stopped during this sharedprefix call") and "finite" in msgs[0]
    assert all(m.endswith("grads left: 0") for m in msgs)
