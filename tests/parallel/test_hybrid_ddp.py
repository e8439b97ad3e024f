"""Hybrid models under DDP and FSDP2 (2 CPU processes, gloo): the float64 gradients of a single-process plain run
(relative 1e-9), on every rank. LFM2 (short convolutions, on the packed path) under DDP ("recompute", mean reduction,
deferred log-probs) and FSDP2; an ``sp.Tree`` sharded by rows under both, and non-reentrant gradient checkpointing
under FSDP2; Falcon-H1's Mamba2 mixers under DDP and FSDP2; Qwen3-Next's gated delta-nets, Kimi Linear's Kimi delta
attention (the tree too), LFM3's convolutions and Lara-mini's gated delta-nets under FSDP2. The float32 scans are
kept float64 by ``Float64Inside`` on every rank and in the reference. Every budget splits a group (or the tree)."""

import os
import subprocess
import sys

import pytest
import torch
from parallel.hybrid_worker import BUDGET, VOCAB, build, inside, weights
from parallel.worker import BUDGET as TREE_BUDGET
from parallel.worker import tree_and_weights

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs
from support.hybrid import groups_of

pytestmark = pytest.mark.slow  # torchrun, 2 processes


WORKER = os.path.join(os.path.dirname(__file__), "hybrid_worker.py")


def _launch(kind, tmp_path, families="lfm2", timeout=200):
    out = tmp_path / f"{kind}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        WORKER,
        kind,
        str(out),
        families,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(kind, families)``: the results of one launch, shared by the tests that read it (each launch costs
    10-20 s)."""
    done = {}

    def get(kind, families="lfm2"):
        if (kind, families) not in done:
            done[kind, families] = _launch(kind, tmp_path_factory.mktemp(kind), families)["results"]
        return done[kind, families]

    return get


def _reference(family):
    groups, model = groups_of(), build(family)
    W = weights(groups)[:, : max(c.numel() for g in groups for c in g.completions)]
    with inside(family):
        return grads_of(model, lambda: (plain_logprobs(model, groups)[0] * W).sum())


def _assert_every_rank(got, want, scale=1.0):
    """Both ranks hold the summed (or averaged: ``scale``) gradient of every parameter that has one."""
    assert len(got) == 2
    for grads in got:
        assert_grads_close({k: v / scale for k, v in grads.items() if v is not None}, want, 1e-9)


@pytest.fixture(scope="module")
def reference():
    return _reference("lfm2")


def test_the_shards_differ_and_the_budgets_split_a_group_and_the_tree():
    shards = [sp.shard_groups(groups_of(), r, 2) for r in range(2)]
    assert sorted(len(s) for s in shards) == [1, 2]
    assert any(sp.plan(s, BUDGET).splits for s in shards)
    tree = tree_and_weights(VOCAB)[0]
    for r in range(2):  # each rank's rows: a system prompt chunked into a chain, some segments cached for later passes
        assert any(
            isinstance(s, sp.schedule.PrefixBackward) for s in sp.plan(sp.shard_groups(tree, r, 2), TREE_BUDGET).steps
        )


@pytest.mark.parametrize("kind, scale", [("backward", 1.0), ("mean", 0.5), ("deferred", 1.0), ("fsdp", 1.0)])
def test_two_process_hybrid_gradients_match_plain_float64(kind, scale, launched, reference):
    _assert_every_rank(launched(kind)["lfm2", "groups"], reference, scale)


def _tree_reference(family):
    """The gradient of one plain forward per row of worker.py's tree, weighted per row and token."""
    from support.trees import plain_rows

    _, rows, trained, W = tree_and_weights(VOCAB)
    model = build(family)
    with inside(family):
        return grads_of(model, lambda: (plain_rows(model, rows, trained) * W).sum())


@pytest.mark.parametrize("kind", ["backward", "fsdp"])
def test_two_process_hybrid_tree_and_checkpointing_match_plain_float64(kind, launched, reference):
    """LFM2 on a tree (a system prompt shared by three prompts, their completions, second turns) whose rows are
    sharded across the ranks, under a budget that chains the system prompt and caches segments: the gradient of one
    plain forward per row weighted per row and token, under DDP and FSDP2 (in the launches of the groups' test).
    Under FSDP2 the groups then run in training mode with non-reentrant gradient checkpointing (the layers run again
    inside autograd's backward, FSDP2 gathering them there): the plain gradient too."""
    got = launched(kind)
    _assert_every_rank(got["lfm2", "tree"], _tree_reference("lfm2"))
    if kind == "fsdp":
        _assert_every_rank(got["lfm2", "groups_checkpointed"], reference)
        for plain, checkpointed in zip(got["lfm2", "layer0_forwards"], got["lfm2", "layer0_forwards_checkpointed"]):
            assert checkpointed > plain > 0  # checkpointing was on: the layer ran again in the backward


@pytest.mark.parametrize("families, kind", [("falcon_h1", "backward"), ("falcon_h1,qwen3_next", "fsdp")])
def test_two_process_mamba2_and_delta_net_gradients_match_plain_float64(families, kind, launched):
    """A Mamba2 family (Falcon-H1: attention and Mamba2 in every layer) under DDP ("recompute") and FSDP2 (its default
    mode), and a gated delta-net family (Qwen3-Next) under FSDP2, with a budget that splits a group: the plain
    gradient on both ranks."""
    got = launched(kind, families)
    for family in families.split(","):
        _assert_every_rank(got[family, "groups"], _reference(family))


def test_two_process_kda_conv_and_delta_net_families_under_fsdp2(tmp_path):
    """Kimi Linear (Kimi delta attention beside attention, dense and MoE MLPs), LFM3 (convolutions beside sliding
    attention) and Lara-mini (gated delta-nets beside sliding attention), one after another in one FSDP2 launch, a
    budget that splits a group: the plain gradient on both ranks; and Kimi Linear on the tree sharded by rows."""
    families = ("kimi_linear", "lfm3", "lara_mini")
    got = _launch("fsdp", tmp_path, ",".join(families), timeout=300)["results"]
    for family in families:
        _assert_every_rank(got[family, "groups"], _reference(family))
    _assert_every_rank(got["kimi_linear", "tree"], _tree_reference("kimi_linear"))  # KDA states along the tree's paths


def test_a_failure_on_one_rank_stops_both_and_leaves_no_gradient(tmp_path):
    msgs = _launch("midfail", tmp_path)["messages"]
    assert "rank 1 stopped during this sharedprefix call" in msgs[0], msgs
    assert "non-finite" in msgs[1].lower() or "nan" in msgs[1].lower(), msgs
    assert all(m.endswith("grads left: 0") for m in msgs), msgs


def test_a_logprobs_refusal_on_one_rank_stops_both(tmp_path):
    """Grad-enabled log-probs under DDP are deferred; a refusal on one rank must not leave the other waiting in the
    deferred backward's all-reduce."""
    msgs = _launch("refuse_logprobs", tmp_path)["messages"]
    assert "rank 1 stopped" in msgs[0], msgs
    assert "max_tokens" in msgs[1], msgs
