"""The Conv1d seam (``model.mixers.conv_module``) on LFM2 in float64, against one plain forward per row (log-probs 1e-9,
gradients relative 1e-9).

transformers 5.24's ``Lfm2ShortConv`` always calls its module-level ``causal_conv1d_fn`` (a torch fallback when the
hub kernel is absent), with no path through its ``nn.Conv1d``; transformers 5.10 (verl's) has ``causal_conv1d_fn =
None`` without the causal_conv1d package and runs ``self.conv(Bx)[..., :seqlen]`` instead. So these tests make the
5.24 model behave as 5.10's does: ``causal_conv1d_fn`` set to None and ``Lfm2ShortConv.forward`` replaced, for the
test, by ``slow_forward`` below (5.10's computation without a cache). The plain rows run the same forward, so any
difference is the packed path's. Controls: the Conv1d's hook gone (refused: the mixer's forward reached no seam),
and the hook returning the module's own convolution over the whole packed row (it reads across segments: far beyond
the tolerance).
"""

import sys
from dataclasses import replace

import pytest

import sharedprefix as sp
from helpers import assert_matches_plain_rows
from sharedprefix.model import mixers
from sharedprefix.model.mixers import conv_module
from support.hybrid import DEEP_ROWS, groups_of, logprob_error, model_of, tree_check


def slow_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """5.10's ``Lfm2ShortConv.slow_forward`` without a cache: the Conv1d (zero padding K), its first L outputs."""
    if cache is not None:
        raise RuntimeError("this test's LFM2 stand-in runs without a cache")
    src = sys.modules[type(self).__module__]
    x = src.apply_mask_to_padding_states(hidden_states, attention_mask)
    B, C, x = self.in_proj(x).transpose(-1, -2).chunk(3, dim=-2)
    conv_out = self.conv(B * x)[..., : hidden_states.shape[1]]
    return self.out_proj((C * conv_out).transpose(-1, -2).contiguous())


@pytest.fixture
def model(monkeypatch):
    """The tiny float64 LFM2 with 5.10's convolution path; counts the Conv1d forwards (the seam must be the module)."""
    m = model_of("lfm2")
    mods = mixers.mixer_modules(m)
    src = sys.modules[type(mods[0][0]).__module__]
    monkeypatch.setattr(src, "causal_conv1d_fn", None)
    monkeypatch.setattr(type(mods[0][0]), "forward", slow_forward)
    calls = []
    handles = [
        conv_module.find(mod).register_forward_hook(sp.allow_hook(lambda *_: calls.append(1))) for mod, _ in mods
    ]
    m.conv_calls = calls
    yield m
    for h in handles:
        h.remove()


@pytest.mark.parametrize("budget, mode", [(None, None), (6, "keep"), (6, "recompute")])
def test_groups_through_the_conv1d_seam_match_plain_rows(model, budget, mode):
    """Three groups in one pass, and a budget that cuts the 9-token prompt into a chain and splits its completions
    (cached conv tails read back as leaves), in keep and recompute."""
    assert conv_module.find(mixers.mixer_modules(model)[0][0]) is not None
    assert_matches_plain_rows(model, groups_of(), budget=budget, mode=mode)
    assert model.conv_calls  # the convolution ran through the module, not a function


@pytest.mark.slow
def test_a_depth_4_tree_through_the_conv1d_seam(model):
    """The depth-4 trie of ``test_hybrid_packed``: whole, and under budgets caching inner segments of every depth."""
    trained = [[t >= 8 for t in range(len(r))] for r in DEEP_ROWS]
    tree_check(model, DEEP_ROWS, trained, (None, 3), ("keep", "recompute"))
    assert model.conv_calls


def test_control_without_the_hook_the_mixer_is_refused(model, monkeypatch):
    """The Conv1d's hook removed: its convolution would read across the packed row's segments; the mixer's forward
    reached no seam, and sharedprefix refuses it rather than return mixed rows."""
    monkeypatch.setitem(mixers.KINDS, "conv", replace(mixers.KINDS["conv"], hooks=lambda mixer, kind: []))
    with pytest.raises(ValueError, match=r"Lfm2ShortConv ran its forward without calling \['causal_conv1d_fn'\]"):
        sp.logprobs(model, groups_of())


def test_control_the_modules_own_convolution_over_the_row_is_caught(model, monkeypatch):
    """The hook counting the seam but returning the convolution over the whole packed row (each segment after the
    row's previous tokens, a sibling's or another group's): far beyond the tolerance."""
    whole_row = lambda own, state, slot, first, x, *a, **k: own(x, *a, **k)  # noqa: E731
    monkeypatch.setitem(mixers.KINDS, "conv", replace(mixers.KINDS["conv"], packed=whole_row))
    assert logprob_error(model, groups_of(), None) > 1e-6


def test_a_conv1d_that_is_not_causal_depthwise_is_no_seam(model, monkeypatch):
    """Without ``causal_conv1d_fn``, a Conv1d of another padding is not taken for the seam: refused at the call."""
    for mod, _ in mixers.mixer_modules(model):
        monkeypatch.setattr(mod.conv, "padding", (0,))
    with pytest.raises(
        ValueError, match=r"Lfm2ShortConv's modeling module .* has no \['causal_conv1d_fn'\].*nn.Conv1d"
    ):
        sp.logprobs(model, groups_of())


def test_the_hook_is_removed_after_a_call_and_after_one_that_raises(model, monkeypatch):
    """Only the fixture's counting hook stays on the Conv1d after a call, and after one that raises inside the seam."""
    convs = [conv_module.find(mod) for mod, _ in mixers.mixer_modules(model)]
    sp.logprobs(model, groups_of())
    assert [len(c._forward_hooks) for c in convs] == [1] * len(convs)

    def boom(*args, **kwargs):
        raise RuntimeError("inside the seam")

    monkeypatch.setitem(mixers.KINDS, "conv", replace(mixers.KINDS["conv"], packed=boom))
    with pytest.raises(RuntimeError, match="inside the seam"):
        sp.logprobs(model, groups_of())
    assert [len(c._forward_hooks) for c in convs] == [1] * len(convs)
