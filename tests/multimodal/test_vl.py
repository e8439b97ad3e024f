"""Vision-language prompts: float64 log-probs and gradients against one plain forward per [prompt + completion]."""

import pytest
import torch
import transformers as tf

import sharedprefix as sp
from helpers import assert_grads_close, assert_matches_plain_rows, grads_of
from sharedprefix.tools.reference import dtype_faithful_norms

IMAGE, VIDEO, V_START, V_END = 100, 101, 102, 103
TEXT = dict(
    vocab_size=120,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
)
VISION = dict(depth=1, hidden_size=32, num_heads=2, in_channels=3, patch_size=2, spatial_merge_size=2, temporal_patch_size=2)


def _model(kind):
    if kind == "qwen3_vl":
        text = {k: v for k, v in TEXT.items() if k != "rope_scaling"}
        text.update(
            head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        )
        cfg = tf.Qwen3VLConfig(
            text_config=text,
            vision_config=dict(VISION, intermediate_size=24, out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0]),
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            vision_start_token_id=V_START,
            vision_end_token_id=V_END,
        )
        cls = tf.Qwen3VLForConditionalGeneration
    elif kind == "qwen2_vl":
        cfg = tf.Qwen2VLConfig(
            text_config=TEXT,
            vision_config=dict(VISION, embed_dim=16, mlp_ratio=2),
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            vision_start_token_id=V_START,
            vision_end_token_id=V_END,
        )
        cls = tf.Qwen2VLForConditionalGeneration
    else:
        cfg = tf.Qwen2_5_VLConfig(
            text_config=TEXT,
            vision_config=dict(VISION, intermediate_size=24, out_hidden_size=32, fullatt_block_indexes=[0], window_size=8),
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            vision_start_token_id=V_START,
            vision_end_token_id=V_END,
        )
        cls = tf.Qwen2_5_VLForConditionalGeneration
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return dtype_faithful_norms(cls(cfg).double().eval())


def _group(seed, grid, text_before, text_after, completions):
    """A prompt with one image of grid (t, h, w) patches, and its processor-like inputs."""
    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    n_tokens = t * h * w // 4  # 2x2 spatial merge
    prompt = torch.cat(
        [
            torch.randint(0, 90, (text_before,), generator=g),
            torch.tensor([V_START]),
            torch.full((n_tokens,), IMAGE),
            torch.tensor([V_END]),
            torch.randint(0, 90, (text_after,), generator=g),
        ]
    )
    inputs = {
        "pixel_values": torch.randn(t * h * w, 3 * 2 * 2 * 2, generator=g, dtype=torch.float64),
        "image_grid_thw": torch.tensor([grid]),
        "mm_token_type_ids": (prompt == IMAGE).int(),
    }
    comps = [torch.randint(0, 90, (n,), generator=g) for n in completions]
    return sp.Group(prompt, comps, prompt_inputs=inputs)


def plain(model, groups):
    rows = []
    T = max(c.numel() for g in groups for c in g.completions)
    for g in groups:
        for c in g.completions:
            ids = torch.cat([g.prompt, c])[None]
            kw = {}
            if g.prompt_inputs:
                kw = dict(
                    pixel_values=g.prompt_inputs["pixel_values"],
                    image_grid_thw=g.prompt_inputs["image_grid_thw"],
                    mm_token_type_ids=torch.cat([g.prompt_inputs["mm_token_type_ids"], torch.zeros(c.numel(), dtype=torch.int32)])[None],
                )
            logits = model(input_ids=ids, use_cache=False, **kw).logits[0, g.prompt.numel() - 1 : -1]
            lp = torch.log_softmax(logits, -1).gather(-1, c[:, None])[:, 0]
            rows.append(torch.nn.functional.pad(lp, (0, T - c.numel())))
    return torch.stack(rows)


GROUPS = lambda: [  # noqa: E731
    _group(0, (1, 4, 4), 2, 3, [3, 1, 4]),
    _group(1, (1, 2, 4), 1, 0, [2, 5]),
    sp.Group(torch.tensor([5, 6, 7]), [torch.tensor([8, 9])]),  # text only, in the same model
    _group(2, (1, 4, 2), 0, 2, [1]),
]


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
    model = _model(kind)
    # a budget splits the first group: its prompt (11 tokens) is cached, completions later
    got = assert_matches_plain_rows(model, GROUPS(), budget, mode, plain=plain)
    assert any("visual" in n for n in got)  # the vision tower is trained through the shared prompt


def test_vision_tower_runs_once_per_group():
    model = _model("qwen2_vl")
    calls = []
    model.model.visual.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    groups = GROUPS()
    with torch.no_grad():
        sp.logprobs(model, groups)
    assert calls == [16 + 8 + 8]  # one call, the three images' patches, not once per completion


def test_multimodal_refusals():
    model = _model("qwen2_vl")
    g = _group(0, (1, 4, 4), 2, 3, [3])
    with pytest.raises(ValueError, match="multimodal prompt of 11 tokens but max_tokens=8"):
        sp.logprobs(model, [g], max_tokens=8)
    bad = sp.Group(
        g.prompt,
        g.completions,
        prompt_inputs={"pixel_values": g.prompt_inputs["pixel_values"], "image_grid_thw": g.prompt_inputs["image_grid_thw"]},
    )
    with pytest.raises(ValueError, match="has no mm_token_type_ids"):
        sp.logprobs(model, [bad])
    with pytest.raises(ValueError, match=r"prompt_inputs has \['audio_values'\]"):
        sp.logprobs(model, [sp.Group(g.prompt, g.completions, prompt_inputs={**g.prompt_inputs, "audio_values": torch.zeros(1)})])
    with pytest.raises(TypeError, match="are not tensors"):
        sp.Group([1], [[2]], prompt_inputs={"pixel_values": [1, 2]})


def llava_config(**text):
    """A tiny Llava: CLIP tower on 8x8 images in 4x4 patches (4 image tokens, CLS dropped), Llama text model."""
    cfg = tf.LlavaConfig(
        vision_config=tf.CLIPVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
        ),
        text_config=tf.LlamaConfig(**{k: v for k, v in TEXT.items() if k != "rope_scaling"}, **text),
        image_token_index=IMAGE,
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def _llava():
    torch.manual_seed(0)
    return dtype_faithful_norms(tf.LlavaForConditionalGeneration(llava_config()).double().eval())


def _llava_group(seed, completions):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.cat(
        [
            torch.randint(0, 90, (2,), generator=g),
            torch.full((4,), IMAGE),  # 2x2 patches, CLS dropped
            torch.randint(0, 90, (3,), generator=g),
        ]
    )
    comps = [torch.randint(0, 90, (n,), generator=g) for n in completions]
    return sp.Group(prompt, comps, prompt_inputs={"pixel_values": torch.randn(1, 3, 8, 8, generator=g, dtype=torch.float64)})


def _plain_llava(model, groups):
    rows, T = [], max(c.numel() for g in groups for c in g.completions)
    for g in groups:
        for c in g.completions:
            out = model(input_ids=torch.cat([g.prompt, c])[None], pixel_values=g.prompt_inputs["pixel_values"], use_cache=False)
            lp = torch.log_softmax(out.logits[0, g.prompt.numel() - 1 : -1], -1).gather(-1, c[:, None])[:, 0]
            rows.append(torch.nn.functional.pad(lp, (0, T - c.numel())))
    return torch.stack(rows)


@pytest.mark.parametrize("budget", [None, 12])
def test_llava_style_groups_match_plain_rows(budget):
    model = _llava()
    groups = [_llava_group(0, [3, 1, 4]), _llava_group(1, [2, 5])]
    ref = _plain_llava(model, groups).detach()
    with torch.no_grad():
        assert (sp.logprobs(model, groups, max_tokens=budget).logprobs - ref).abs().max() <= 1e-9
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = grads_of(model, lambda: (_plain_llava(model, groups) * w).sum())
    got = grads_of(
        model,
        lambda: (
            sp.backward(model, groups, lambda b: (b.logprobs * w[b.index]).sum(), max_tokens=budget, prefix_activations="recompute")
            and None
        ),
    )
    assert_grads_close(got, want, 1e-9)


def gemma3_config(window, patch=2, **text):
    """A tiny Gemma 3: SigLIP tower on 8x8 images in ``patch`` x ``patch`` patches ((8 / patch)^2 image tokens: 16
    by default), 3 text layers (sliding, full, sliding) with a window of ``window`` tokens."""
    cfg = tf.Gemma3Config(
        text_config=dict(
            vocab_size=120,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            **text,
        ),
        vision_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=patch
        ),
        mm_tokens_per_image=(8 // patch) ** 2,
        image_token_index=IMAGE,
        boi_token_index=V_START,
        eoi_token_index=V_END,
    )
    cfg._attn_implementation = "sdpa"  # eager's softmax runs in float32, even in a float64 model
    return cfg


def _gemma3(window):
    torch.manual_seed(0)
    return dtype_faithful_norms(tf.Gemma3ForConditionalGeneration(gemma3_config(window)).double().eval())


def _gemma3_group(seed, layout, completions, token_types=True):
    """A prompt of text runs and images ("i": 16 image tokens between begin/end-of-image tokens), as its processor
    lays it out, with token_type_ids 1 on the image tokens."""
    g = torch.Generator().manual_seed(seed)
    parts, n_images = [], 0
    for x in layout:
        if x == "i":
            parts += [torch.tensor([V_START]), torch.full((16,), IMAGE), torch.tensor([V_END])]
            n_images += 1
        else:
            parts.append(torch.randint(0, 90, (x,), generator=g))
    prompt = torch.cat(parts)
    inputs = {"pixel_values": torch.randn(n_images, 3, 8, 8, generator=g, dtype=torch.float64)}
    if token_types:
        inputs["token_type_ids"] = (prompt == IMAGE).long()
    return sp.Group(prompt, [torch.randint(0, 90, (n,), generator=g) for n in completions], prompt_inputs=inputs)


def _plain_gemma3(model, groups):
    rows, T = [], max(c.numel() for g in groups for c in g.completions)
    for g in groups:
        for c in g.completions:
            kw = {}
            if "token_type_ids" in (g.prompt_inputs or {}):
                kw["token_type_ids"] = torch.cat([g.prompt_inputs["token_type_ids"], torch.zeros_like(c)])[None]
            out = model(
                input_ids=torch.cat([g.prompt, c])[None], pixel_values=(g.prompt_inputs or {}).get("pixel_values"), use_cache=False, **kw
            )
            lp = torch.log_softmax(out.logits[0, g.prompt.numel() - 1 : -1], -1).gather(-1, c[:, None])[:, 0]
            rows.append(torch.nn.functional.pad(lp, (0, T - c.numel())))
    return torch.stack(rows)


GEMMA3_GROUPS = lambda: [  # noqa: E731
    _gemma3_group(0, [2, "i", 3], [3, 1, 4]),
    _gemma3_group(1, ["i", "i", 1], [2, 5]),
    sp.Group(torch.tensor([5, 6, 7]), [torch.tensor([8, 9])]),
    _gemma3_group(2, [1, "i"], [1, 2], token_types=False),
]  # the model's causal mask


@pytest.mark.parametrize(
    "window, budget, mode", [(4, None, "keep"), (4, 40, "recompute"), (4, 40, "offload"), (64, None, "keep"), (64, 40, "keep")]
)
def test_gemma3_bidirectional_images_match_plain_rows(window, budget, mode):
    """Gemma 3's image tokens see their whole image (16 tokens, longer than a window of 4: AND(window, OR(causal,
    image))); two adjacent images stay two blocks; text tokens and completions stay causal."""
    model = _gemma3(window)
    got = assert_matches_plain_rows(model, GEMMA3_GROUPS(), budget, mode, plain=_plain_gemma3)
    assert any("vision_tower" in n for n in got)


def test_gemma3_blocks_change_the_result():
    """The test above can fail: with the image blocks dropped, the log-probs move far beyond the tolerance."""
    model = _gemma3(64)
    groups = GEMMA3_GROUPS()[:2]
    ref = _plain_gemma3(model, groups)
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
    model = _model("qwen2_vl")
    g = _group(0, (1, 4, 4), 2, 3, [3])
    bad = sp.Group(g.prompt, g.completions, prompt_inputs={**g.prompt_inputs, "token_type_ids": g.prompt_inputs["mm_token_type_ids"]})
    with pytest.raises(ValueError, match=r"prompt_inputs has \['token_type_ids'\]"):
        sp.logprobs(model, [bad])
    gem = _gemma3_group(0, [2, "i", 3], [3])
    short = sp.Group(
        gem.prompt, gem.completions, prompt_inputs={**gem.prompt_inputs, "token_type_ids": gem.prompt_inputs["token_type_ids"][1:]}
    )
    with pytest.raises(ValueError, match=r"token_type_ids'\] has shape \(22,\); expected \(23,\)"):
        sp.logprobs(_gemma3(4), [short])
