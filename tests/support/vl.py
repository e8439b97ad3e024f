"""Tiny vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL with M-RoPE; Llava; Gemma 3), float64, their prompt
groups with images, and the plain forward of each [prompt + completion] row."""

import torch
import transformers as tf

import sharedprefix as sp
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
VISION = dict(
    depth=1, hidden_size=32, num_heads=2, in_channels=3, patch_size=2, spatial_merge_size=2, temporal_patch_size=2
)


def mrope_model(kind):
    if kind == "qwen3_vl":
        text = {k: v for k, v in TEXT.items() if k != "rope_scaling"}
        text.update(
            head_dim=8,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        )
        cfg = tf.Qwen3VLConfig(
            text_config=text,
            vision_config=dict(
                VISION,
                intermediate_size=24,
                out_hidden_size=32,
                num_position_embeddings=16,
                deepstack_visual_indexes=[0],
            ),
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
            vision_config=dict(
                VISION, intermediate_size=24, out_hidden_size=32, fullatt_block_indexes=[0], window_size=8
            ),
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            vision_start_token_id=V_START,
            vision_end_token_id=V_END,
        )
        cls = tf.Qwen2_5_VLForConditionalGeneration
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return dtype_faithful_norms(cls(cfg).double().eval())


def mrope_group(seed, grid, text_before, text_after, completions):
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


def plain_mrope(model, groups):
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
                    mm_token_type_ids=torch.cat(
                        [g.prompt_inputs["mm_token_type_ids"], torch.zeros(c.numel(), dtype=torch.int32)]
                    )[None],
                )
            logits = model(input_ids=ids, use_cache=False, **kw).logits[0, g.prompt.numel() - 1 : -1]
            lp = torch.log_softmax(logits, -1).gather(-1, c[:, None])[:, 0]
            rows.append(torch.nn.functional.pad(lp, (0, T - c.numel())))
    return torch.stack(rows)


MROPE_GROUPS = lambda: [  # noqa: E731
    mrope_group(0, (1, 4, 4), 2, 3, [3, 1, 4]),
    mrope_group(1, (1, 2, 4), 1, 0, [2, 5]),
    sp.Group(torch.tensor([5, 6, 7]), [torch.tensor([8, 9])]),  # text only, in the same model
    mrope_group(2, (1, 4, 2), 0, 2, [1]),
]


def vl_microbatches():
    """Qwen2-VL groups with images (``support.vl``) spread over three microbatches: two image prompts shared by two
    microbatches each, a text prompt, an image prompt in one microbatch, and a group with group 0's prompt tokens but
    another image (a prompt of its own: the step merges groups by prompt tokens and inputs)."""
    g = MROPE_GROUPS()
    other = torch.randn(g[0].prompt_inputs["pixel_values"].shape, dtype=torch.float64, generator=torch.Generator())
    twin = sp.Group(g[0].prompt, [torch.tensor([4, 7])], prompt_inputs=dict(g[0].prompt_inputs, pixel_values=other))

    def sub(x, idx):
        return sp.Group(x.prompt, [x.completions[i] for i in idx], prompt_inputs=x.prompt_inputs)

    return [[sub(g[0], [0]), sub(g[1], [0]), twin], [sub(g[0], [1, 2]), g[2]], [sub(g[1], [1]), g[3]]]


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


def llava_model():
    torch.manual_seed(0)
    return dtype_faithful_norms(tf.LlavaForConditionalGeneration(llava_config()).double().eval())


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
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=8,
            patch_size=patch,
        ),
        mm_tokens_per_image=(8 // patch) ** 2,
        image_token_index=IMAGE,
        boi_token_index=V_START,
        eoi_token_index=V_END,
    )
    cfg._attn_implementation = "sdpa"  # eager's softmax runs in float32, even in a float64 model
    return cfg


def gemma3_model(window):
    torch.manual_seed(0)
    return dtype_faithful_norms(tf.Gemma3ForConditionalGeneration(gemma3_config(window)).double().eval())


def qwen3_5_vl():
    """A tiny Qwen3.5 vision-language model (gated delta-nets beside attention, interleaved M-RoPE), float64."""
    text = {k: v for k, v in TEXT.items() if k != "rope_scaling"}
    text.update(
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    )
    cfg = tf.Qwen3_5Config(
        text_config=text,
        vision_config=dict(VISION, intermediate_size=24, out_hidden_size=32, num_position_embeddings=16),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=V_START,
        vision_end_token_id=V_END,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return dtype_faithful_norms(tf.Qwen3_5ForConditionalGeneration(cfg).double().eval())


def llava_group(seed, completions):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.cat(
        [
            torch.randint(0, 90, (2,), generator=g),
            torch.full((4,), IMAGE),  # 2x2 patches, CLS dropped
            torch.randint(0, 90, (3,), generator=g),
        ]
    )
    comps = [torch.randint(0, 90, (n,), generator=g) for n in completions]
    return sp.Group(
        prompt, comps, prompt_inputs={"pixel_values": torch.randn(1, 3, 8, 8, generator=g, dtype=torch.float64)}
    )


def plain_llava(model, groups):
    rows, T = [], max(c.numel() for g in groups for c in g.completions)
    for g in groups:
        for c in g.completions:
            out = model(
                input_ids=torch.cat([g.prompt, c])[None], pixel_values=g.prompt_inputs["pixel_values"], use_cache=False
            )
            lp = torch.log_softmax(out.logits[0, g.prompt.numel() - 1 : -1], -1).gather(-1, c[:, None])[:, 0]
            rows.append(torch.nn.functional.pad(lp, (0, T - c.numel())))
    return torch.stack(rows)


def gemma3_group(seed, layout, completions, token_types=True):
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


def plain_gemma3(model, groups):
    rows, T = [], max(c.numel() for g in groups for c in g.completions)
    for g in groups:
        for c in g.completions:
            kw = {}
            if "token_type_ids" in (g.prompt_inputs or {}):
                kw["token_type_ids"] = torch.cat([g.prompt_inputs["token_type_ids"], torch.zeros_like(c)])[None]
            out = model(
                input_ids=torch.cat([g.prompt, c])[None],
                pixel_values=(g.prompt_inputs or {}).get("pixel_values"),
                use_cache=False,
                **kw,
            )
            lp = torch.log_softmax(out.logits[0, g.prompt.numel() - 1 : -1], -1).gather(-1, c[:, None])[:, 0]
            rows.append(torch.nn.functional.pad(lp, (0, T - c.numel())))
    return torch.stack(rows)


GEMMA3_GROUPS = lambda: [  # noqa: E731
    gemma3_group(0, [2, "i", 3], [3, 1, 4]),
    gemma3_group(1, ["i", "i", 1], [2, 5]),
    sp.Group(torch.tensor([5, 6, 7]), [torch.tensor([8, 9])]),
    gemma3_group(2, [1, "i"], [1, 2], token_types=False),
]  # the model's causal mask
