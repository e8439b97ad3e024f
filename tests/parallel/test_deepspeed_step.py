"""``sp.plan_step`` under DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3 on 2 CPU processes (``deepspeed_step_worker.py``): a step
over 3 microbatches with every prompt split across them, ``gradient_accumulation_steps=3`` (each microbatch's call one
DeepSpeed micro-step, ``engine.step()`` after each), in the prefix modes keep / offload / recompute, under a budget, as
deferred ``sp.logprobs`` with ``engine.backward``, and an MoE model (at ZeRO-3 its MoE blocks leaf modules, reduced in
a module hook), against DeepSpeed's own plain run of the same micro-steps by the 2x rule: the model computes in
float64, but DeepSpeed accumulates, reduces and updates in float32 at every stage (its master weights and gradient
partitions are float32, and ``communication_data_type`` has no fp64), so each run's gradient before the boundary's
``engine.step()`` and its update after it are within twice the plain DeepSpeed run's error against the float64
reference. A failure mid-step (microbatch 1 on its first pass, microbatch 2 on its second pass, deferred microbatch 2
inside the caller's ``engine.backward``) leaves DeepSpeed's buffers as the plain accumulation of the microbatches that
completed: the user reruns the rest plainly and gets the plain update. Refused, naming why: a step that straddles
DeepSpeed's accumulation boundary (at plan_step), a step whose parameters DeepSpeed updated mid-step under a
caller-set boundary (the version counters do not move: the engine's step count tells), and a step mixing
``sp.backward`` with deferred log-probs (two units of 1/GA)."""

import os

import pytest
import torch

pytest.importorskip("deepspeed")

from parallel.deepspeed_step_worker import CASES, PROMPTS, microbatches, reference  # noqa: E402
from parallel.deepspeed_worker import LR  # noqa: E402

from support.torchrun import torchrun  # noqa: E402

pytestmark = pytest.mark.slow  # torchrun, 2 processes

WORKER = os.path.join(os.path.dirname(__file__), "deepspeed_step_worker.py")
EXACT = ["keep", "offload", "recompute", "budget_keep", "budget_offload", "budget_recompute", "deferred"]
EXACT += ["deferred_budget", "failed", "failed_last", "failed_deferred"]


def rel(got, want):
    """The largest error over all parameters, relative to the largest entry of ``want`` over all of them."""
    scale = max(float(w.abs().max()) for w in want.values())
    return max(float((got[n].double() - want[n].double()).abs().max()) for n in want) / scale


def update(got, init):
    return {n: got["params"][n].double() - init[n] for n in init}


@pytest.fixture(scope="module")
def references():
    return {moe: reference(moe) for moe in (False, True)}


def rule(got, want, init, plain):
    """(gradient error, update error) of the run ``got`` against the float64 ``want`` gradient, and the bar of each:
    twice the plain DeepSpeed run's."""
    step = {n: -LR * g for n, g in want.items()}
    errs = (rel(got["grads"], want), rel(update(got, init), step))
    bars = (2 * rel(plain["grads"], want), 2 * rel(update(plain, init), step))
    return errs, bars


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_steps_under_deepspeed_equal_its_plain_micro_steps(stage, tmp_path, references):
    out = tmp_path / f"zero{stage}.pt"
    os.environ["DS_ACCELERATOR"] = "cpu"
    torchrun(WORKER, [str(stage), str(out)], timeout=600)
    got = torch.load(out, weights_only=False)
    assert set(got) == set(CASES)
    failed = {c: r["error"] for c, r in got.items() if "error" in r}
    assert not failed, failed
    want, init = references[False]
    plain = got["plain"]
    assert 0 < rel(plain["grads"], want) < 1e-6  # float32 rounding of DeepSpeed's buffers, not another loss
    assert max(float(d.abs().max()) for d in update(plain, init).values()) > 1e-3  # the parameters moved
    for case in EXACT:
        (g, u), (gbar, ubar) = rule(got[case], want, init, plain)
        assert g <= gbar and u <= ubar, (case, g, gbar, u, ubar)
    # each prompt once for the step (recompute runs the shared prompts' forward again inside the last microbatch)
    prompts, completions = sum(PROMPTS), sum(len(c) for mb in microbatches(0) for g in mb for c in g.completions)
    assert got["keep"]["tokens"] == got["offload"]["tokens"] == prompts + completions
    assert got["recompute"]["tokens"] == 2 * prompts + completions
    for case in ("failed", "failed_last"):
        assert "refused" in got[case]["error_seen"], got[case]["error_seen"]
    assert "expected a finite value" in got["failed_deferred"]["error_seen"], got["failed_deferred"]["error_seen"]
    # the control: the completed microbatches' shared share never delivered fails the same rule
    (g, u), (gbar, ubar) = rule(got["failed_control"], want, init, plain)
    assert g > gbar and u > ubar
    # ZeRO-3's leaf modules (the MoE blocks): the step against DeepSpeed's own run of the same MoE model
    moe_want, moe_init = references[True]
    (g, u), (gbar, ubar) = rule(got["moe_step"], moe_want, moe_init, got["moe_plain"])
    assert 0 < gbar < 1e-6 and g <= gbar and u <= ubar, (g, gbar, u, ubar)

    straddle = got["straddle_refused"]["refusals"]
    assert len(straddle) == 2 and all("straddle the accumulation boundary" in r for r in straddle), straddle
    assert "a step of 3 microbatches beginning at DeepSpeed micro-step 0" in straddle[0]
    assert "micro-step 1 of its gradient_accumulation_steps=2" in straddle[1]
    clock = got["clock_refused"]
    assert clock["versions_moved"] == 0  # DeepSpeed's update leaves the version counters: only its step count tells
    assert "DeepSpeed ZeRO's optimizer steps: 0 then, 1 now" in clock["refusal"], clock["refusal"]
    assert "this call (after the parameters changed) found an earlier sp.plan_step step" in clock["outside"]
    # deferred log-probs outside a step, backpropagated after an update: refused as a changed parameter is (their
    # backward recomputes the forward at the new parameters; before, nothing saw DeepSpeed's update)
    after = got["update_then_deferred_backward"].get("refusal", "")
    assert "after DeepSpeed ZeRO's optimizer steps changed the parameters since the call (0 then, 1 now)" in after, got
    mixed = got["mixed_refused"]["refusal"]
    assert "runs as deferred sp.logprobs, its earlier microbatches as sp.backward" in mixed, mixed
