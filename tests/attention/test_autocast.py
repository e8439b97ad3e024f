"""Mixed precision: float32 weights under ``torch.autocast`` (TRL's and accelerate's ``bf16=True`` over a float32
model). Autocast runs the plain forward's SDPA in bfloat16; the shared-prefix attention casts query, key and value
the same way and keeps its log-sum-exp merges in float32. Judged by the 2x rule against a float64 copy: sharedprefix's
error at most twice the plain autocast run's own, for log-probs and for parameter gradients, in one pass and with a
budget that splits groups (cached prompt K/V in bfloat16).
"""

import copy

import pytest
import torch

import sharedprefix as sp
from helpers import grads_of, plain_logprobs, random_groups, tiny_model
from sharedprefix.attention import checks

GROUPS = random_groups(0, 2, [24, 7], [[5, 9, 1], [6, 6]])


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _grad_error(got: dict, want: dict) -> float:
    """The largest gradient error relative to that parameter's largest exact gradient."""
    return max(float((got[n].double() - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)) for n in want)


@pytest.mark.parametrize(
    "budget, arch",
    [
        pytest.param(None, "llama", marks=pytest.mark.slow),
        (12, "llama"),
        pytest.param(None, "phi3", marks=pytest.mark.slow),
        pytest.param(12, "phi3", marks=pytest.mark.slow),
    ],
)
def test_logprobs_and_gradients_under_autocast_by_the_2x_rule(arch, budget):
    exact = tiny_model(arch)  # float64
    model = copy.deepcopy(exact).float()
    w = torch.randn(5, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = plain_logprobs(exact, GROUPS)[0].detach()
    want = grads_of(exact, lambda: (plain_logprobs(exact, GROUPS)[0] * w).sum())
    with _autocast():
        with torch.no_grad():
            plain = plain_logprobs(model, GROUPS)[0].double()
            ours = sp.logprobs(model, GROUPS, max_tokens=budget).logprobs.double()
        g_plain = grads_of(model, lambda: (plain_logprobs(model, GROUPS)[0].double() * w).sum())
        g_ours = grads_of(
            model,
            lambda: (
                sp.backward(model, GROUPS, lambda b: (b.logprobs.double() * w[b.index]).sum(), max_tokens=budget)
                and None
            ),
        )
    plain_err, our_err = float((plain - ref).abs().max()), float((ours - ref).abs().max())
    assert 1e-5 < plain_err  # autocast really ran in bfloat16
    assert our_err <= 2 * plain_err, (our_err, plain_err)
    assert set(g_ours) == set(want)
    assert _grad_error(g_ours, want) <= 2 * _grad_error(g_plain, want)


def test_without_the_cast_the_kernels_get_mixed_dtypes(monkeypatch):
    """Control: autocast hands the attention float32 queries and keys (after the float32 rotary) with bfloat16 values;
    without the cast the kernels refuse the mix (it failed so before the cast was added)."""
    model = tiny_model("llama").float()
    monkeypatch.setattr(checks, "autocast_device", lambda t: None)
    with _autocast(), torch.no_grad(), pytest.raises(RuntimeError):
        sp.logprobs(model, GROUPS)


@pytest.mark.parametrize("budget", [pytest.param(None, marks=pytest.mark.slow), 12])
def test_a_float64_model_under_autocast_stays_float64(budget):
    """Autocast casts no float64 tensor (a float64 model, or sp.verify's float64 copy, run inside a bf16=True training
    step runs in float64): neither does the shared-prefix attention (it cast them and crashed in o_proj)."""
    model = tiny_model("llama")  # float64
    w = torch.randn(5, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = plain_logprobs(model, GROUPS)[0].detach()
    want = grads_of(model, lambda: (plain_logprobs(model, GROUPS)[0] * w).sum())
    with _autocast():
        with torch.no_grad():
            assert (plain_logprobs(model, GROUPS)[0] - ref).abs().max() == 0  # autocast leaves the plain run alone
            out = sp.logprobs(model, GROUPS, max_tokens=budget).logprobs
        got = grads_of(
            model,
            lambda: sp.backward(model, GROUPS, lambda b: (b.logprobs * w[b.index]).sum(), max_tokens=budget) and None,
        )
    assert (out - ref).abs().max() <= 1e-9
    assert _grad_error(got, want) <= 1e-9
