"""Layers that run their attention several times per forward (differential attention, looped layers): one cached
prompt K/V per call, so a budget that splits groups stays exact (refused under gradient checkpointing).

DiffLlama computes its lambda in float32 even in a float64 model: both runs keep it float64 (``Float64Inside``)."""

import pytest

import sharedprefix as sp
from helpers import assert_matches_plain_rows, random_groups, tiny_model
from sharedprefix.tools.reference import Float64Inside

GROUPS = lambda: random_groups(0, 3, [9, 5, 7], [[4, 1, 6], [3, 2], [5]])  # noqa: E731


def _diffllama():
    return tiny_model("diffllama", max_position_embeddings=128)


@pytest.mark.parametrize("mode", ["keep", "offload", "recompute"])
def test_differential_attention_split_across_passes(mode):
    with Float64Inside():
        assert_matches_plain_rows(_diffllama(), GROUPS(), 12, mode)


def test_checkpointing_with_a_split_budget_is_refused():
    """A model that checkpoints each attention call separately (Dory, HRM) recomputes the calls in reverse order,
    which the per-call cache cannot tell apart: refused before any pass (one pass reads no cache and runs)."""
    model = _diffllama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing runs in training mode (no dropout in this config)
    with pytest.raises(ValueError, match="runs an attention module 2 times per forward.*gradient checkpointing is on"):
        sp.backward(model, GROUPS(), lambda b: b.logprobs.sum(), max_tokens=12)
    assert all(p.grad is None for p in model.parameters())
    sp.backward(model, GROUPS(), lambda b: b.logprobs.sum())  # one pass: no cache, nothing to refuse
    assert any(p.grad is not None for p in model.parameters())


def test_one_cached_kv_per_layer_would_be_wrong(monkeypatch):
    """With one cached K/V per layer (each call's keys written to the same slot, the last call's kept), the split
    run is wrong: the tests above see the per-call cache."""
    from sharedprefix.schedule.cache import PrefixCache

    write, read = PrefixCache.write_kv, PrefixCache.read_kv
    monkeypatch.setattr(
        PrefixCache, "write_kv", lambda self, m, s, k, v: write(self, m[0] if isinstance(m, tuple) else m, s, k, v)
    )
    monkeypatch.setattr(PrefixCache, "read_kv", lambda self, m, s: read(self, m[0] if isinstance(m, tuple) else m, s))
    with Float64Inside(), pytest.raises(AssertionError):
        assert_matches_plain_rows(_diffllama(), GROUPS(), 12, "keep")
