import math

import pytest
import torch

import sharedprefix as sp
from helpers import random_groups, tiny_model
from sharedprefix import losses


def _data(seed=0, n=6, T=5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, T, dtype=torch.float64, generator=g) * 3
    old = lp + 0.3 * torch.randn(n, T, dtype=torch.float64, generator=g)
    ref = lp + 0.2 * torch.randn(n, T, dtype=torch.float64, generator=g)
    lens = torch.tensor([5, 3, 1, 4, 5, 2])[:n]
    mask = torch.arange(T)[None] < lens[:, None]
    adv = torch.randn(n, dtype=torch.float64, generator=g)
    return lp, old, ref, mask, adv


def test_group_advantages_formula():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 3.0, 3.0])
    a = losses.group_advantages(r, 3)
    expected = torch.tensor([(1 - 1 / 3) / (torch.tensor([1.0, 0, 0]).std() + 1e-4), 0, 0, 0, 0, 0])
    expected[1] = expected[2] = (0 - 1 / 3) / (torch.tensor([1.0, 0, 0]).std() + 1e-4)
    assert torch.allclose(a, expected)
    assert torch.allclose(
        losses.group_advantages(r, 3, scale_std=False), torch.tensor([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])
    )
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        losses.group_advantages(r, 4)


def _direct(lp, old, ref, mask, adv, loss_type, eps_lo, eps_hi, beta, max_len=None):
    """Straight-line formulas, one completion and token at a time."""
    n, T = lp.shape
    total = 0.0
    tokens = int(mask.sum())
    for i in range(n):
        idx = [t for t in range(T) if mask[i, t]]
        seq_ratio = math.exp(sum(float(lp[i, t] - old[i, t]) for t in idx) / len(idx))
        per = []
        for t in idx:
            r = seq_ratio if loss_type == "gspo" else math.exp(float(lp[i, t] - old[i, t]))
            a = float(adv[i])
            v = -min(r * a, min(max(r, 1 - eps_lo), 1 + eps_hi) * a)
            if beta:
                d = float(ref[i, t] - lp[i, t])
                v += beta * (math.exp(d) - d - 1)
            per.append(v)
        if loss_type in ("grpo", "gspo"):
            total += sum(per) / len(per) / n
        elif loss_type in ("dapo", "bnpo"):
            total += sum(per) / tokens
        else:
            total += sum(per) / (n * max_len)
    return total


@pytest.mark.parametrize("loss_type", losses.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_policy_loss_matches_direct_formula(loss_type, beta):
    lp, old, ref, mask, adv = _data()
    norm = losses.normalizer(loss_type, mask, max_completion_length=7)
    loss, metrics = losses.policy_loss(
        lp, old, adv, mask, norm, loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, beta=beta, ref_logprobs=ref
    )
    want = _direct(lp, old, ref, mask, adv, loss_type, 0.2, 0.28, beta, max_len=7)
    assert abs(float(loss) - want) <= 1e-12 * max(1.0, abs(want))
    assert metrics["tokens"] == float(mask.sum())


@pytest.mark.parametrize("loss_type", losses.LOSS_TYPES)
def test_losses_are_additive_over_completions(loss_type):
    lp, old, ref, mask, adv = _data(1)
    norm = losses.normalizer(loss_type, mask, max_completion_length=5)
    kw = dict(norm=norm, loss_type=loss_type, beta=0.1)
    whole, _ = losses.policy_loss(lp, old, adv, mask, ref_logprobs=ref, **kw)
    parts = sum(
        float(losses.policy_loss(lp[s], old[s], adv[s], mask[s], ref_logprobs=ref[s], **kw)[0])
        for s in (slice(0, 2), slice(2, 3), slice(3, 6))
    )
    assert abs(float(whole) - parts) <= 1e-12


def test_unknown_loss_type_and_missing_inputs_are_refused():
    lp, old, ref, mask, adv = _data()
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        losses.policy_loss(lp, old, adv, mask, 1.0, loss_type="ppo")
    with pytest.raises(ValueError, match="beta=0.1 needs ref_logprobs"):
        losses.policy_loss(lp, old, adv, mask, 1.0, beta=0.1)
    with pytest.raises(ValueError, match="needs max_completion_length"):
        losses.normalizer("dr_grpo", mask)


@pytest.mark.parametrize("loss_type", losses.LOSS_TYPES)
def test_sp_backward_with_each_loss_equals_dense_loss(loss_type):
    """Under a budget that splits groups, sp.backward with the additive loss gives the dense gradient."""
    model = tiny_model("qwen3")
    groups = random_groups(3, 2, [14, 5], [[4, 2, 6, 1], [3, 5]])
    with torch.no_grad():
        old = sp.logprobs(model, groups).logprobs + 0.05
        ref = old - 0.1
    mask = sp.logprobs(model, groups).mask
    adv = losses.group_advantages(torch.tensor([1.0, 0, 0, 1, 0.5, 0], dtype=torch.float64), 2)
    norm = losses.normalizer(loss_type, mask, max_completion_length=6)
    kw = dict(loss_type=loss_type, epsilon=0.1, beta=0.05)

    model.zero_grad(set_to_none=True)
    out = sp.logprobs(model, groups)
    dense, _ = losses.policy_loss(out.logprobs, old, adv, out.mask, norm, ref_logprobs=ref, **kw)
    dense.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    res = sp.backward(
        model,
        groups,
        lambda b: losses.policy_loss(
            b.logprobs, old[b.index], adv[b.index], b.mask, norm, ref_logprobs=ref[b.index], **kw
        )[0],
        max_tokens=12,
        prefix_activations="recompute",
    )
    assert res.loss_calls > 2  # the budget really split the batch
    assert math.isclose(res.loss, float(dense.detach()), rel_tol=1e-9)
    for n, p in model.named_parameters():
        assert (p.grad - want[n]).abs().max() <= 1e-9 * want[n].abs().max().clamp_min(1e-12), n
