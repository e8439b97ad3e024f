"""The chunked log-prob head: any chunking gives the same log-probs, entropies and gradients as one chunk."""

import torch

from helpers import tiny_model
from sharedprefix.model.head import token_logprobs


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
