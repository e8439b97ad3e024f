"""FSDP2 on 2 CPU processes (gloo): the wrappings users meet, the model left untouched, failures on one rank.

Float64 gradients are compared with one plain transformers forward per row (a single process), to 1e-9.
"""

import os

import pytest
import torch
from parallel.fsdp_worker import WRAPPINGS
from parallel.worker import groups_and_weights, tree_and_weights

import sharedprefix as sp
from helpers import assert_grads_close, grads_of, plain_logprobs, tiny_model
from support.torchrun import torchrun

pytestmark = pytest.mark.slow  # torchrun, 2 processes


WORKER = os.path.join(os.path.dirname(__file__), "fsdp_worker.py")


def _launch(kind, tmp_path, timeout=120):
    """Run 2 ranks; a hang fails the test after ``timeout`` seconds (never retried: a hang is what is tested)."""
    out = tmp_path / f"{kind}.pt"
    torchrun(WORKER, [kind, str(out)], timeout=timeout)
    return out


@pytest.fixture(scope="module")
def reference():
    groups, W = groups_and_weights()
    model = tiny_model("qwen3")
    return grads_of(model, lambda: (plain_logprobs(model, groups)[0] * W).sum())


def test_every_wrapping_matches_plain_and_leaves_the_model_untouched(tmp_path, reference):
    """Nested units (attention and MLP inside layers, layers, embedding, head, decoder, root), grouped units
    (all layers as one; embedding + head as one) and per-unit settings, reshard_after_forward True and False, FSDP2's
    default mode and 'recompute', a budget that splits a group on one rank only: every rank runs the same collectives
    and the summed gradients are the plain run's. No module of the user's model gains or loses an attribute, a
    ``forward`` or a class during or after a call; and an FSDP2 call costs 2 small all-reduces besides FSDP2's own
    collectives (setup errors with the round counts; errors during the call), as many as before failures ended
    cleanly."""
    from support.trees import plain_rows

    got = torch.load(_launch("wrappings", tmp_path), weights_only=False)
    assert sorted(got["grads"]) == sorted(WRAPPINGS)
    for wrapping, grads in got["grads"].items():
        try:
            assert_grads_close({k: v for k, v in grads.items() if v is not None}, reference, 1e-9)
        except AssertionError as e:
            raise AssertionError(f"{wrapping}: {e}") from None
    tree, rows, trained, W = tree_and_weights()
    model = tiny_model("qwen3")
    want = grads_of(model, lambda: (plain_rows(model, rows, trained) * W).sum())
    assert_grads_close({k: v for k, v in got["tree_grads"].items() if v is not None}, want, 1e-9)
    groups, _ = groups_and_weights()
    for rank, r in enumerate(got["ranks"]):
        assert r["changed"] == [], f"the user's model changed under {r['changed']}"
        with torch.no_grad():
            ref = plain_logprobs(model, sp.shard_groups(groups, rank, 2))[0]
        assert float((r["logprobs"] - ref).abs().max()) <= 1e-9
        assert r["reduces"] == [[3, 1]] * len(WRAPPINGS)  # (setup error, forward rounds, backward rounds), errors


def _records(tmp_path, kind):
    out = _launch(kind, tmp_path, timeout=90)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]


def test_an_error_in_loss_fn_on_one_rank_stops_every_rank(tmp_path, reference):
    """A refusal of prefix_activations='keep' on the one rank whose shard splits a group stops both at setup.
    Rank 1's loss_fn raises on its second pass, outside FSDP2's collectives while rank 0 is about to run a
    backward: rank 1 finishes the call's collectives as dummy rounds, both ranks raise at its end (rank 0 naming
    rank 1 and its message) within seconds, neither keeps a gradient, and the next call runs exactly. The same for
    a forward-only sp.logprobs in which rank 1 refuses after a pass."""
    msg = "advantages missing for this batch (rank 1's loss_fn)"
    r0, r1 = _records(tmp_path, "midfail")
    assert r1["message"] == f"ValueError: {msg}"
    assert (
        r0["message"].startswith("RuntimeError: rank 1 stopped during this sharedprefix call") and msg in r0["message"]
    )
    for r in (r0, r1):
        assert r["seconds"] < 10 and r["grads_left"] == 0 and r["initialized"]
    assert_grads_close({k: v for k, v in r0["grads"].items() if v is not None}, reference, 1e-9)
    # a mode FSDP2 cannot run, refused only on the rank whose shard splits a group: every rank raises, at setup
    keep = [r["keep_message"] for r in (r0, r1)]
    assert sum(m.startswith("ValueError: prefix_activations='keep' with an FSDP2 model") for m in keep) == 1
    assert (
        sum(
            m.startswith("RuntimeError: rank ")
            and "stopped before any computation" in m
            and "prefix_activations='recompute'" in m
            for m in keep
        )
        == 1
    )
    # forward-only sp.logprobs: rank 1 refuses after a pass's forward; both raise, and the next call is unchanged
    msg = "rank 1 refused a pass after its forward"
    assert r1["lp_message"] == f"ValueError: {msg}"
    assert r0["lp_message"].startswith("RuntimeError: rank 1 stopped during this sharedprefix call")
    assert msg in r0["lp_message"] and r0["lp_same_after"] and r1["lp_same_after"]


def test_an_error_inside_a_pass_on_one_rank_stops_every_rank(tmp_path):
    """Rank 1 raises inside a layer's forward, in the middle of FSDP2's all-gathers: it publishes its message in
    the store and closes its process group; rank 0's collective fails at once and it raises naming rank 1 and its
    message (not a bare "connection closed"); both within seconds, no gradient left."""
    msg = "layer 1 refused this batch on rank 1 (inside a pass)"
    r0, r1 = _records(tmp_path, "inside")
    assert r1["message"] == f"ValueError: {msg}"
    assert (
        r0["message"].startswith("RuntimeError: rank 1 stopped during this sharedprefix call") and msg in r0["message"]
    )
    assert "FSDP2's collectives" in r0["message"]
    for r in (r0, r1):
        assert r["seconds"] < 10 and r["grads_left"] == 0 and not r["initialized"]
