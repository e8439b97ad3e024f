"""The chunked log-prob head: any chunking gives the same log-probs, entropies and gradients as one chunk."""

import pytest
import torch

from helpers import tiny_model
from sharedprefix.model import head
from sharedprefix.model.head import keep_logits, token_logprobs


def test_chunked_head_matches_one_chunk():
    model = tiny_model("qwen3", dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, model.config.hidden_size, dtype=torch.float64, generator=g)
    targets = torch.randint(0, model.config.vocab_size, (37,), generator=g)
    weight = model.get_output_embeddings().weight
    results = []
    for chunk in (None, 37, 5, 1):  # the default, one chunk, several with a ragged last, one row each
        h = hidden.clone().requires_grad_(True)
        tok, ent = token_logprobs(model, h, targets, temperature=0.7, entropy=True, chunk_tokens=chunk)
        (tok * torch.linspace(-1, 2, 37, dtype=torch.float64) + 0.3 * ent).sum().backward()
        results.append((tok.detach(), ent.detach(), h.grad, weight.grad.clone()))
        weight.grad = None
    logp = torch.log_softmax(hidden @ weight.detach().T / 0.7, -1)
    assert torch.allclose(results[0][0], logp.gather(-1, targets[:, None])[:, 0], rtol=0, atol=1e-12)
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_and_recomputed_logits_give_the_same_values_and_gradients(monkeypatch, entropy, temperature):
    """Float64: the head keeping its chunks' logits for the backward ("always", and "auto" under a cap they fit)
    and recomputing them ("never", and "auto" under a cap they exceed) agree with explicit log_softmax to 1e-12, and
    their gradients with autograd's; the head runs once per chunk when it keeps, twice when it recomputes."""
    model = tiny_model("qwen3", dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(23, model.config.hidden_size, dtype=torch.float64, generator=g)
    targets = torch.randint(0, model.config.vocab_size, (23,), generator=g)
    w_tok, w_ent = torch.linspace(-1, 2, 23, dtype=torch.float64), torch.linspace(0.5, -0.3, 23, dtype=torch.float64)
    weight = model.get_output_embeddings().weight
    calls = {"n": 0}
    orig = head.head_logits

    def counted(*a):
        calls["n"] += 1
        return orig(*a)

    monkeypatch.setattr(head, "head_logits", counted)
    need = 23 * model.config.vocab_size * 8  # bytes of float64 logits
    h = hidden.clone().requires_grad_(True)
    logp = torch.log_softmax(h @ weight.T / temperature, -1)
    want_tok = logp.gather(-1, targets[:, None])[:, 0]
    want_ent = -(logp.exp() * logp).sum(-1)
    loss = (want_tok * w_tok).sum() + ((want_ent * w_ent).sum() if entropy else 0.0)
    want = torch.autograd.grad(loss, (h, weight))
    for mode, cap, kept in (
        ("always", 0, True),
        ("never", 10**12, False),
        ("auto", need, True),
        ("auto", need - 1, False),
    ):
        monkeypatch.setattr(head, "CPU_KEEP_BYTES", cap)
        calls["n"] = 0
        h = hidden.clone().requires_grad_(True)
        with keep_logits(mode):
            tok, ent = token_logprobs(model, h, targets, temperature=temperature, entropy=entropy, chunk_tokens=10)
        torch.testing.assert_close(tok, want_tok, rtol=0, atol=1e-12)
        loss = (tok * w_tok).sum() + ((ent * w_ent).sum() if entropy else 0.0)
        if entropy:
            torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-12)
        got = torch.autograd.grad(loss, (h, weight))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
        assert calls["n"] == (3 if kept else 6), (mode, cap)  # 3 chunks of 10, 10, 3 rows


def test_keep_logits_refuses_an_unknown_mode():
    with pytest.raises(
        ValueError, match=r"keep_logits mode 'sometimes' .* expected one of \('auto', 'always', 'never'\)"
    ):
        with keep_logits("sometimes"):
            pass


@pytest.mark.parametrize("mode", [pytest.param("always", marks=pytest.mark.slow), "never"])
def test_compiled_head_matches_eager(mode):
    """``compiled_head()`` (the verl engine's ``use_torch_compile``): the chunks' log-probs, entropies and both
    gradients equal the eager head's in float64, with the logits kept and recomputed in the backward (the recompute
    runs compiled too: it compiles nothing new), and the chunk function really ran compiled."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from sharedprefix.model.head import compiled_head

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("qwen3", dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(29, model.config.hidden_size, dtype=torch.float64, generator=g)
    targets = torch.randint(0, model.config.vocab_size, (29,), generator=g)
    weight = model.get_output_embeddings().weight
    results = []
    for on in (False, True):
        h = hidden.clone().requires_grad_(True)
        with compiled_head(on), keep_logits(mode):
            tok, ent = token_logprobs(model, h, targets, temperature=0.7, entropy=True, chunk_tokens=10)
        (tok * torch.linspace(-1, 2, 29, dtype=torch.float64) + 0.3 * ent).sum().backward()
        results.append((tok.detach(), ent.detach(), h.grad, weight.grad.clone()))
        weight.grad = None
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-13)
    assert counters["stats"]["unique_graphs"] >= 1, "the head did not run compiled"
    assert not head._COMPILED["on"]  # restored
