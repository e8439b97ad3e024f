"""sp.plan_step across the model zoo (``zoo.steps``): one optimizer step's microbatches, every prompt's rows shuffled
over three of them, against the plain accumulation of each microbatch's per-row transformers forward (float64: log-probs
to 1e-9, gradients to a relative 1e-9), for groups and for trees (prompts sharing a prefix, one the strict prefix of
others), under ``sp.backward`` and deferred ``sp.logprobs``, in each prefix mode and under a budget below every prompt.

The whole zoo costs several minutes (``python -m sharedprefix.tools.zoo --steps``); the suite holds one exact entry per
feature class a step could break on (``zoo.steps.representatives``: chosen by the features ``zoo.checks.features``
reports, read from the generated zoo table, and by what the entries' configs and classes say), each in the
configurations of ``zoo.steps.QUICK``."""

import functools
import os

import pytest

from sharedprefix.attention import checks
from sharedprefix.tools.zoo import readme, steps

pytestmark = pytest.mark.slow

PAGE = os.path.join(os.path.dirname(__file__), "..", "..", readme.PAGE)


@functools.cache
def _representatives() -> dict:
    return steps.representatives(PAGE)


@functools.cache
def _result(entry: str) -> steps.StepResult:
    return steps.check_step(entry, steps.QUICK)


@pytest.mark.parametrize("cls", steps.classes())
def test_a_step_is_exact_for_each_feature_class(cls):
    entry = _representatives().get(cls)
    assert entry is not None, f"no exact zoo entry has {cls!r}: the class went untested"
    r = _result(entry)
    if cls == "hybrid: cache":  # refused by plan_step, with its reason, before any gradient
        assert r.status == "refused" and r.detail.startswith("sp.plan_step: "), (entry, r.status, r.detail)
        assert r.category == steps.STEP_REFUSALS[0][0] and not r.single_refused, (entry, r.detail)
        return
    assert r.status == "exact", f"{entry} ({cls}): {r.status}: {r.detail}"
    assert r.logprob_err <= r.tolerance[0] and r.grad_err <= r.tolerance[1]


def test_the_probe_catches_a_window_dropped_on_cached_prompts(monkeypatch):
    """Control: the sliding-window entry with its window ignored fails the probe (a silent mismatch)."""
    entry = _representatives()["sliding window"]
    monkeypatch.setattr(checks, "layer_window", lambda module, passed: None)
    r = steps.check_step(entry, steps.QUICK[:1])
    assert r.status == "failed" and "silent mismatch" in r.detail, (r.status, r.detail)
