"""The vision-language benchmark (``sharedprefix bench --vision``): images in a shared prompt.

Shape: a prompt with 1024 visual tokens (one image of 64 x 64 patches, 2 x 2 merged) and 256
text tokens, G = 8 completions of 256; a Qwen2-VL architecture with the speed benchmark's text
model (hidden 512, 8/4 heads, vocab 32000) and a vision tower of 2 blocks (hidden 512, 8
heads), random weights, float32, forward+backward. The plain run is one row per completion, each
with its image (what a trainer without sharedprefix does); sharedprefix runs the vision tower
and the prompt once. The vision tower's share of the saving is its own forward+backward,
measured alone, times the G - 1 runs the plain run adds.
"""

from __future__ import annotations

import torch

import sharedprefix as sp
from sharedprefix.tools import bench
from sharedprefix.tools.timing import best_interleaved

IMAGE, V_START, V_END = 31990, 31991, 31992


def vl_model(layers=4):
    import transformers as tf

    cfg = tf.Qwen2VLConfig(
        text_config=dict(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=layers,
            bos_token_id=None,
            eos_token_id=None,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=8192,
            rope_scaling={"type": "mrope", "mrope_section": [16, 8, 8]},
        ),
        vision_config=dict(
            depth=2,
            embed_dim=512,
            hidden_size=512,
            num_heads=8,
            mlp_ratio=2,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=IMAGE,
        video_token_id=31993,
        vision_start_token_id=V_START,
        vision_end_token_id=V_END,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.Qwen2VLForConditionalGeneration(cfg).eval()


def vl_group(visual=1024, text=256, G=8, completion=256, seed=0) -> sp.Group:
    g = torch.Generator().manual_seed(seed)
    side = int((visual * 4) ** 0.5)  # patches per side before the 2 x 2 merge
    prompt = torch.cat(
        [
            torch.tensor([V_START]),
            torch.full((visual,), IMAGE),
            torch.tensor([V_END]),
            torch.randint(0, 31000, (text - 2,), generator=g),
        ]
    )
    inputs = {
        "pixel_values": torch.randn(side * side, 3 * 2 * 14 * 14, generator=g),
        "image_grid_thw": torch.tensor([[1, side, side]]),
        "mm_token_type_ids": (prompt == IMAGE).int(),
    }
    comps = [torch.randint(0, 31000, (completion,), generator=g) for _ in range(G)]
    return sp.Group(prompt, comps, prompt_inputs=inputs)


def _plain(model, group):
    """One row per completion with its image; logits only at completion positions."""
    P = group.prompt.numel()
    for c in group.completions:
        ids = torch.cat([group.prompt, c])[None]
        mm = torch.cat([group.prompt_inputs["mm_token_type_ids"], torch.zeros(c.numel(), dtype=torch.int32)])[None]
        out = model(
            input_ids=ids,
            pixel_values=group.prompt_inputs["pixel_values"],
            image_grid_thw=group.prompt_inputs["image_grid_thw"],
            mm_token_type_ids=mm,
            use_cache=False,
            logits_to_keep=c.numel() + 1,
        )
        logits = out.logits[0, -c.numel() - 1 : -1]
        (-torch.log_softmax(logits.float(), -1).gather(-1, c[:, None]).sum()).backward()
    return P


def _vision(model, group):
    feats = model.model.get_image_features(group.prompt_inputs["pixel_values"], group.prompt_inputs["image_grid_thw"])
    torch.cat(feats.pooler_output).sum().backward()


def flops(model, group, shared: bool) -> float:
    """Forward+backward FLOPs (3x forward) of the text layers, the LM head on completion tokens and the vision
    tower (patch embedding, blocks with their attention over the image's patches, merger), run once (shared) or
    once per completion (plain). An estimate from the shapes, the same formula for both runs."""
    t, v = model.config.text_config, model.config.vision_config
    P, G = group.prompt.numel(), group.group_size
    Ts = [c.numel() for c in group.completions]
    if shared:
        tokens, pairs = P + sum(Ts), P * (P + 1) / 2 + sum(T * P + T * (T + 1) / 2 for T in Ts)
    else:
        tokens, pairs = sum(P + T for T in Ts), sum((P + T) * (P + T + 1) / 2 for T in Ts)
    n = int(group.prompt_inputs["image_grid_thw"].prod())
    vd, mlp = v.embed_dim, int(v.embed_dim * v.mlp_ratio)
    vision = n * 2 * 3 * 2 * 14 * 14 * vd + v.depth * (n * 2 * (4 * vd * vd + 2 * vd * mlp) + n * n * 4 * vd)
    vision += (n // 4) * 2 * (4 * vd * 4 * vd + 4 * vd * v.hidden_size)
    text = bench.text_flops(t, tokens, pairs, sum(Ts), head_dim=t.hidden_size // t.num_attention_heads)
    return text + 3.0 * vision * (1 if shared else G)


def run(layers=4, **shape) -> list[str]:
    model = vl_model(layers)
    group = vl_group(**shape)
    small = vl_group(visual=16, text=8, G=2, completion=4, seed=1)
    _plain(model, small)  # warm-up
    sp.backward(model, [small], lambda b: -(b.logprobs * b.mask).sum())
    calls = [
        ("ours", lambda: sp.backward(model, [group], lambda b: -(b.logprobs * b.mask).sum())),
        ("plain", lambda: _plain(model, group)),
        ("vision", lambda: _vision(model, group)),
    ]
    best = best_interleaved(calls * 2, before=lambda: model.zero_grad(set_to_none=True))  # best of 2, interleaved
    t_ours, t_plain, t_vis = (best[k][0] for k in ("ours", "plain", "vision"))
    G, P = group.group_size, group.prompt.numel()
    T = group.completions[0].numel()
    fr = flops(model, group, False) / flops(model, group, True)
    return [
        f"vision-language shape: prompt {P} tokens (1024 visual + text), G={G} x {T}; Qwen2-VL architecture, text "
        f"hidden 512, {layers} layers, vocab 32000; vision tower 2 blocks, hidden 512; float32, cpu; best of 2 steps",
        f"plain rows (each with its image): {t_plain:8.2f} s   tokens {G * (P + T)}, vision tower runs {G}",
        f"sharedprefix                    : {t_ours:8.2f} s   tokens {P + G * T}, vision tower runs 1",
        f"speed-up {t_plain / t_ours:.2f}x | FLOP ratio {fr:.2f}x (estimate, vision tower included)",
        f"the vision tower alone (forward+backward) {t_vis:.2f} s, so "
        f"{(G - 1) * t_vis:.2f} s of the {t_plain - t_ours:.2f} s saved ({(G - 1) * t_vis / (t_plain - t_ours):.0%}) "
        "is the vision tower run once instead of G times",
    ]
