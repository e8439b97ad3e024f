"""Hybrid models under DDP and FSDP2 (2 CPU processes, gloo): the gradients of a single-process plain run, on every
rank (LFM2, on the packed path; Falcon-H1's Mamba2 mixers under DDP and FSDP2, Qwen3-Next's gated delta-nets under
FSDP2, both with their float32 scans kept float64 by ``Float64Inside`` on every rank and in the reference)."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from distributed.hybrid_worker import BUDGET, FLOAT32_INSIDE, weights
from models.test_hybrid import groups_of, model_of

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs
from sharedprefix.tools.reference import Float64Inside

pytestmark = pytest.mark.slow  # torchrun, 2 processes


WORKER = os.path.join(os.path.dirname(__file__), "hybrid_worker.py")


def _launch(kind, tmp_path, family="lfm2"):
    out = tmp_path / f"{kind}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, kind, str(out), family]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _reference(family):
    groups, model = groups_of(), model_of(family)
    W = weights(groups)[:, : max(c.numel() for g in groups for c in g.completions)]
    with Float64Inside() if family in FLOAT32_INSIDE else contextlib.nullcontext():
        return grads_of(model, lambda: (plain_logprobs(model, groups)[0] * W).sum())


@pytest.fixture(scope="module")
def reference():
    return _reference("lfm2")


def test_the_shards_differ_and_the_budget_splits_a_group():
    shards = [sp.shard_groups(groups_of(), r, 2) for r in range(2)]
    assert sorted(len(s) for s in shards) == [1, 2]
    assert any(sp.plan(s, BUDGET).splits for s in shards)


@pytest.mark.parametrize("kind, scale", [("backward", 1.0), ("mean", 0.5), ("deferred", 1.0), ("fsdp", 1.0)])
def test_two_process_hybrid_gradients_match_plain_float64(kind, scale, tmp_path, reference):
    got = _launch(kind, tmp_path)
    for grads in got["grads"]:  # both ranks hold the summed (or averaged) gradient
        assert_grads_close({k: v / scale for k, v in grads.items() if v is not None}, reference, 1e-9)


@pytest.mark.parametrize("family, kind", [("falcon_h1", "backward"), ("falcon_h1", "fsdp"), ("qwen3_next", "fsdp")])
def test_two_process_mamba2_and_delta_net_gradients_match_plain_float64(family, kind, tmp_path):
    """A Mamba2 family (Falcon-H1: attention and Mamba2 in every layer) under DDP ("recompute") and FSDP2 (its default
    mode), and a gated delta-net family (Qwen3-Next) under FSDP2, with a budget that splits a group: the plain
    gradient on both ranks."""
    got = _launch(kind, tmp_path, family)
    want = _reference(family)
    for grads in got["grads"]:
        assert_grads_close({k: v for k, v in grads.items() if v is not None}, want, 1e-9)


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
