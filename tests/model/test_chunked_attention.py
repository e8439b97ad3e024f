"""Llama 4's chunked attention, beyond the first chunk, and its query temperature: exact against the plain forward.

A query at position p sees the keys at positions floor(p / C) * C .. p. The chunk boundaries are positions, so
a completion continues its prompt's chunk and sees the prompt's keys from that chunk's start on. The model here
is Llama 4 text with chunks of 4 positions, dense MLPs and no QK norm, and a float64 rotary embedding (Llama 4's
own rounds q and k to float32 even in a float64 model, which would hold the comparison to float32 accuracy), so
that the plain float64 forward is float64 throughout and 1e-9 can fail. Its NoPE layer scales queries by a
temperature of the token's index in the row (``attn_temperature_tuning``, growing every ``floor_scale`` = 4
tokens here), which sharedprefix rescales to the token's position.
"""

import pytest
import torch
from transformers.models.llama4 import modeling_llama4

import sharedprefix as sp
from helpers import assert_matches_plain_rows, plain_logprobs, random_groups, tiny_model
from sharedprefix.attention import checks

CHUNK = 4
# prompts of 9 and 6 tokens (positions 0..8: chunks 0..3, 4..7, 8..), completions that cross chunk boundaries
PROMPTS, COMPLETIONS = (9, 6), ((5, 3, 6, 1), (2, 7))


def _rotary64(xq, xk, freqs_cis):
    """Llama 4's apply_rotary_emb in float64 (the same complex rotation, without the float32 round trip)."""
    cis = freqs_cis.to(torch.complex128)[:, :, None, :]
    rot = lambda x: torch.view_as_real(torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2)) * cis)  # noqa: E731
    return rot(xq).flatten(3).type_as(xq), rot(xk).flatten(3).type_as(xk)


@pytest.fixture
def model(monkeypatch):
    monkeypatch.setattr(modeling_llama4, "apply_rotary_emb", _rotary64)
    m = tiny_model(
        "llama4_text",
        num_hidden_layers=4,
        max_position_embeddings=128,
        intermediate_size_mlp=48,
        num_local_experts=16,
        num_experts_per_tok=1,
        attention_chunk_size=CHUNK,
        attn_temperature_tuning=True,
        floor_scale=4,
        use_qk_norm=False,
        moe_layers=[],
        no_rope_layers=[1, 1, 1, 0],  # layers 0-2 chunked with RoPE, layer 3 full attention without
    )
    assert [str(t) for t in m.config.layer_types] == ["chunked_attention"] * 3 + ["full_attention"]
    return m


def _groups():
    return random_groups(0, 2, PROMPTS, COMPLETIONS)


@pytest.mark.parametrize("budget, mode", [(None, "keep"), (12, "keep"), (12, "recompute"), (7, "offload")])
def test_chunked_attention_beyond_the_first_chunk_matches_plain_rows(model, budget, mode):
    assert_matches_plain_rows(model, _groups(), budget, mode)


def _without_prompt_keys(own):
    """A completion that restarts its chunks instead of continuing its prompt's: no ancestor keys in its chunk."""
    return lambda layout, base, x, lo: [] if lo % CHUNK == 0 else own(layout, base, x, lo)


@pytest.mark.parametrize("mistake", ["chunks ignored", "completions restart the chunk", "temperature of the index"])
def test_the_check_fails_when_chunks_are_computed_wrongly(model, monkeypatch, mistake):
    """Each plausible mistake changes the log-probs far beyond 1e-9 on these rows, so the test above can fail."""
    from sharedprefix.layout import calls

    if mistake == "chunks ignored":
        monkeypatch.setattr(checks, "layer_chunk", lambda module: None)
    elif mistake == "temperature of the index":
        monkeypatch.setattr(checks, "index_to_position_temperature", lambda module, q, pos: q)
    else:
        monkeypatch.setattr(calls, "_ancestor_keys", _without_prompt_keys(calls._ancestor_keys))
    groups = _groups()
    ref = plain_logprobs(model, groups)[0]
    with torch.no_grad():
        assert (sp.logprobs(model, groups).logprobs - ref).abs().max() > 1e-5
