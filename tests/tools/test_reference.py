"""The float64 reference: ``dtype_faithful_norms`` replaces a norm only by one that matches it, and says why not."""

import pytest
import torch

from sharedprefix.tools.reference import dtype_faithful_norms


class ExpertNorm(torch.nn.Module):
    """An RMSNorm with one weight per expert, chosen per token (Ergo's, transformers 5.25)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(3, 8, dtype=torch.float64) + 0.5)
        self.eps = 1e-6

    def forward(self, x, expert_ids):
        return (
            torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight[expert_ids]
        )


class RMSNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(8, dtype=torch.float64) + 0.5)
        self.variance_epsilon = 1e-6

    def forward(self, x):
        y = x.float()
        return self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


def test_a_norm_that_needs_more_than_its_input_is_named_not_called():
    with pytest.raises(ValueError, match=r"\(ExpertNorm\): its forward needs expert_ids besides the input"):
        dtype_faithful_norms(ExpertNorm())


def test_a_plain_rms_norm_becomes_float64():
    norm = RMSNorm()
    x = torch.randn(4, 8, dtype=torch.float64)
    before = norm(x)
    dtype_faithful_norms(norm)
    exact = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert "forward" in vars(norm) and torch.allclose(norm(x), before, rtol=1e-5, atol=1e-6)
    assert torch.equal(norm(x), exact)
