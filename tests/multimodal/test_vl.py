"""Vision-language prompts: float64 log-probs and gradients against one plain forward per [prompt + completion]."""

import pytest
import torch

import sharedprefix as sp
from helpers import assert_grads_close, assert_matches_plain_rows, grads_of
from support.vl import (
    GEMMA3_GROUPS,
    MROPE_GROUPS,
    gemma3_group,
    gemma3_model,
    llava_group,
    llava_model,
    mrope_group,
    mrope_model,
    plain_gemma3,
    plain_llava,
    plain_mrope,
)


@pytest.mark.parametrize(
    "kind, budget, mode",
    [
        ("qwen2_vl", None, "keep"),
        ("qwen2_vl", 16, "offload"),
        ("qwen2_vl", 16, "recompute"),
        ("qwen2_5_vl", None, "keep"),
        ("qwen2_5_vl", 16, "keep"),
        ("qwen3_vl", None, "keep"),
        ("qwen3_vl", 16, "recompute"),
    ],
)
def test_vision_language_groups_match_plain_rows(kind, budget, mode):
    model = mrope_model(kind)
    # a budget splits the first group: its prompt (11 tokens) is cached, completions later
    got = assert_matches_plain_rows(model, MROPE_GROUPS(), budget, mode, plain=plain_mrope)
    assert any("visual" in n for n in got)  # the vision tower is trained through the shared prompt


def test_vision_tower_runs_once_per_group():
    model = mrope_model("qwen2_vl")
    calls = []
    model.model.visual.register_forward_hook(sp.allow_hook(lambda m, i, o: calls.append(i[0].shape[0])))
    groups = MROPE_GROUPS()
    with torch.no_grad():
        sp.logprobs(model, groups)
    assert calls == [16 + 8 + 8]  # one call, the three images' patches, not once per completion


def test_multimodal_refusals():
    model = mrope_model("qwen2_vl")
    g = mrope_group(0, (1, 4, 4), 2, 3, [3])
    with pytest.raises(ValueError, match="multimodal prompt of 11 tokens but max_tokens=8"):
        sp.logprobs(model, [g], max_tokens=8)
    bad = sp.Group(
        g.prompt,
        g.completions,
        prompt_inputs={
            "pixel_values": g.prompt_inputs["pixel_values"],
            "image_grid_thw": g.prompt_inputs["image_grid_thw"],
        },
    )
    with pytest.raises(ValueError, match="has no mm_token_type_ids"):
        sp.logprobs(model, [bad])
    with pytest.raises(ValueError, match=r"prompt_inputs has \['audio_values'\]"):
        sp.logprobs(
            model,
            [sp.Group(g.prompt, g.completions, prompt_inputs={**g.prompt_inputs, "audio_values": torch.zeros(1)})],
        )
    with pytest.raises(TypeError, match="are not tensors"):
        sp.Group([1], [[2]], prompt_inputs={"pixel_values": [1, 2]})


@pytest.mark.parametrize("budget", [None, 12])
def test_llava_style_groups_match_plain_rows(budget):
    model = llava_model()
    groups = [llava_group(0, [3, 1, 4]), llava_group(1, [2, 5])]
    ref = plain_llava(model, groups).detach()
    with torch.no_grad():
        assert (sp.logprobs(model, groups, max_tokens=budget).logprobs - ref).abs().max() <= 1e-9
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = grads_of(model, lambda: (plain_llava(model, groups) * w).sum())
    got = grads_of(
        model,
        lambda: (
            sp.backward(
                model,
                groups,
                lambda b: (b.logprobs * w[b.index]).sum(),
                max_tokens=budget,
                prefix_activations="recompute",
            )
            and None
        ),
    )
    assert_grads_close(got, want, 1e-9)


@pytest.mark.parametrize(
    "window, budget, mode",
    [(4, None, "keep"), (4, 40, "recompute"), (4, 40, "offload"), (64, None, "keep"), (64, 40, "keep")],
)
def test_gemma3_bidirectional_images_match_plain_rows(window, budget, mode):
    """Gemma 3's image tokens see their whole image (16 tokens, longer than a window of 4: AND(window, OR(causal,
    image))); two adjacent images stay two blocks; text tokens and completions stay causal."""
    model = gemma3_model(window)
    got = assert_matches_plain_rows(model, GEMMA3_GROUPS(), budget, mode, plain=plain_gemma3)
    assert any("vision_tower" in n for n in got)


def test_gemma3_blocks_change_the_result():
    """The test above can fail: with the image blocks dropped, the log-probs move far beyond the tolerance."""
    model = gemma3_model(64)
    groups = GEMMA3_GROUPS()[:2]
    ref = plain_gemma3(model, groups)
    from sharedprefix.model import multimodal

    orig = multimodal.Multimodal.row_blocks
    multimodal.Multimodal.row_blocks = lambda self, layout: []
    try:
        with torch.no_grad():
            wrong = sp.logprobs(model, groups).logprobs
    finally:
        multimodal.Multimodal.row_blocks = orig
    assert (wrong - ref).abs().max() > 1e-3


def test_token_type_ids_refused_where_the_model_does_not_use_them():
    model = mrope_model("qwen2_vl")
    g = mrope_group(0, (1, 4, 4), 2, 3, [3])
    bad = sp.Group(
        g.prompt,
        g.completions,
        prompt_inputs={**g.prompt_inputs, "token_type_ids": g.prompt_inputs["mm_token_type_ids"]},
    )
    with pytest.raises(ValueError, match=r"prompt_inputs has \['token_type_ids'\]"):
        sp.logprobs(model, [bad])
    gem = gemma3_group(0, [2, "i", 3], [3])
    short = sp.Group(
        gem.prompt,
        gem.completions,
        prompt_inputs={**gem.prompt_inputs, "token_type_ids": gem.prompt_inputs["token_type_ids"][1:]},
    )
    with pytest.raises(ValueError, match=r"token_type_ids'\] has shape \(22,\); expected \(23,\)"):
        sp.logprobs(gemma3_model(4), [short])
