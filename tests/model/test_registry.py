"""A hybrid family is added through the registry alone (``model.mixers.FAMILIES``): a copy of LFM2 under a new model
type, with its short-convolution mixer class renamed, is refused until one row names its path and its mixer's class
suffix, and then runs exact against one plain forward per row in float64 (log-probs 1e-9, gradients a relative 1e-9,
in one pass and under a budget that splits the groups), as ``test_hybrid_packed.py`` checks the listed families."""

import pytest
import torch
import transformers

import sharedprefix as sp
from sharedprefix.model import mixers
from sharedprefix.tools.zoo.configs import float64_norms
from support.hybrid import COMMON, CONFIGS, groups_check, groups_of

NEW = "lfm2_registered"


class RegisteredConfig(transformers.Lfm2Config):
    model_type = NEW


@pytest.fixture(scope="module")
def model():
    """LFM2's modeling code under model type ``NEW``, its ``Lfm2ShortConv`` mixers renamed ``Lfm2TokenMixer`` (the
    class stays in LFM2's modeling module, whose ``causal_conv1d_fn`` it calls)."""
    cfg = RegisteredConfig(**COMMON, **CONFIGS["lfm2"][2])
    torch.manual_seed(0)
    m = transformers.Lfm2ForCausalLM._from_config(cfg, attn_implementation="sdpa").to(torch.float64).eval()
    float64_norms(m)
    own = transformers.models.lfm2.modeling_lfm2.Lfm2ShortConv
    renamed = type("Lfm2TokenMixer", (own,), {"__module__": own.__module__})
    mods = [mod for mod in m.modules() if type(mod) is own]
    for mod in mods:
        mod.__class__ = renamed
    assert len(mods) == 2 and m.config.model_type == NEW
    return m


def test_an_unregistered_family_is_refused(model):
    assert NEW not in mixers.FAMILIES and not mixers.on_packed_path(model) and not mixers.on_cache_path(model)
    unregistered = rf"has layers of type \['conv'\], which mix tokens outside attention.*model type '{NEW}' is not one"
    with pytest.raises(ValueError, match=unregistered):
        sp.logprobs(model, groups_of())


def test_a_row_whose_mixers_are_not_the_models_is_refused(model, monkeypatch):
    monkeypatch.setitem(mixers.FAMILIES, NEW, mixers.Family(mixers.PACKED, {"ShortConv": ("conv",)}))
    with pytest.raises(ValueError, match=r"has 2 layers of types .* but sharedprefix finds 0 mixer modules"):
        sp.logprobs(model, groups_of())


def test_a_family_registered_in_the_table_runs_exact(model, monkeypatch):
    monkeypatch.setitem(mixers.FAMILIES, NEW, mixers.Family(mixers.PACKED, {"TokenMixer": ("conv",)}))
    assert mixers.on_packed_path(model) and not mixers.on_cache_path(model)
    assert [type(m).__name__ for m, kinds in mixers.mixer_modules(model) if kinds == ("conv",)] == [
        "Lfm2TokenMixer"
    ] * 2
    gs = groups_of()
    assert len(sp.plan(gs, None).passes) == 1 and sp.plan(gs, 6).splits
    groups_check(model, gs, [(None, "keep"), (6, "keep"), (6, "recompute")])
