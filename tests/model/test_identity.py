"""A model changed after its first call is checked again, never run on what was found for it before.

The head check (``checks.verify_head``: the model's own logits against the decoder and ``head_logits``, with the
position and attention probes) runs a forward, so its findings are kept per model with the model's ``model_key``;
the vocabulary is checked when a plan is made. Each change below comes after a first call (and a plan made before
it): a ``forward`` patched on the instance or on its class to scale the logits, an embedding or head replaced by
one of a smaller vocabulary with the config unchanged. Each is refused as a fresh model would be, with and without
the plan; without the re-check the patched forward ran unpatched (log-probs 1.0 away from the plain patched
forward's) and the smaller vocabulary raised a raw IndexError. A model that did not change is not checked again.
"""

from __future__ import annotations

import pytest
import torch

import sharedprefix as sp
from helpers import plain_logprobs, random_groups, tiny_model
from sharedprefix.model import checks
from sharedprefix.model.identity import model_key

GROUPS = random_groups(4, 2, [10, 7], [[5, 3], [4]])
HEAD_REFUSAL = r"Qwen3ForCausalLM's forward turns hidden states into logits in a way sharedprefix does not reproduce"


def _scaling(forward):
    """``forward`` with its logits scaled by 10 (an inverse temperature folded into the model after its first call)."""

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 10
        return out

    return scaled


def _calls(model):
    with torch.no_grad():
        return sp.logprobs(model, GROUPS), sp.logprobs(model, sp.plan_call(model, GROUPS))


@pytest.mark.parametrize("where", ["instance", "class"])
def test_a_forward_patched_after_the_first_call_is_checked_again(where, monkeypatch):
    model = tiny_model()
    cp = sp.plan_call(model, GROUPS)
    with torch.no_grad():
        before = sp.logprobs(model, cp).logprobs
    if where == "instance":
        model.forward = _scaling(model.forward)
    else:
        monkeypatch.setattr(type(model), "forward", _scaling(type(model).forward))
    want = plain_logprobs(model, GROUPS)[0].detach()  # the plain forward of the patched model
    assert float((want - before).abs().max()) > 0.5  # control: what the unpatched run would return is far off
    for source in (GROUPS, cp):
        with pytest.raises(ValueError, match=HEAD_REFUSAL):
            sp.logprobs(model, source)


def test_a_forward_patch_that_keeps_the_logits_runs_and_is_exact():
    """A wrapper around the model's forward (as accelerate adds one) after the first call: checked again, it gives
    the model's own logits, so the call runs and matches the plain forward in float64."""
    model = tiny_model()
    cp = sp.plan_call(model, GROUPS)
    _calls(model)
    own = model.forward
    model.forward = lambda *a, **kw: own(*a, **kw)
    want = plain_logprobs(model, GROUPS)[0].detach()
    for out in _calls(model) + (sp.logprobs(model, cp),):
        assert float((out.logprobs.detach() - want).abs().max()) <= 1e-9


@pytest.mark.parametrize("part", ["embedding", "head"])
def test_a_smaller_vocabulary_after_the_first_call_is_refused_naming_the_token_id(part):
    model = tiny_model()
    cp = sp.plan_call(model, GROUPS)
    _calls(model)
    width = model.config.hidden_size
    if part == "embedding":
        model.set_input_embeddings(torch.nn.Embedding(50, width, dtype=torch.float64))
    else:
        model.lm_head = torch.nn.Linear(width, 50, bias=False, dtype=torch.float64)
    bad = int(GROUPS[0].prompt.max())
    assert bad >= 50  # control: the first prompt holds an id the smaller vocabulary lacks
    msg = rf"groups\[0\]\.prompt holds token id {bad}, outside the model's vocabulary \[0, 50\)"
    for source in (GROUPS, cp):
        with pytest.raises(ValueError, match=msg):
            sp.logprobs(model, source)


def test_an_unchanged_model_is_verified_once(monkeypatch):
    """The key is the same from call to call (the float64 test models carry forwards patched onto their norms), so
    a reused plan runs no check forward; a module replaced by an equal one is checked again."""
    model = tiny_model()
    ran = []
    verify = checks._verify
    monkeypatch.setattr(checks, "_verify", lambda *a, **kw: ran.append(1) or verify(*a, **kw))
    cp = sp.plan_call(model, GROUPS)
    key = model_key(model)
    with torch.no_grad():
        for _ in range(3):
            sp.logprobs(model, cp)
    assert len(ran) == 1 and model_key(model) == key
    model.model.norm = type(model.model.norm)(model.config.hidden_size).to(torch.float64)
    assert model_key(model) != key
    with torch.no_grad():
        sp.logprobs(model, cp)
    assert len(ran) == 2
