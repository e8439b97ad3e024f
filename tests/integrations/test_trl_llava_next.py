"""LLaVA-NeXT's any-resolution tiles through SharedPrefixGRPOTrainer's log-prob hook.

TRL hands the hook one (tiles, channels, height, width) entry of ``pixel_values`` per image with ``image_sizes``
(images, 2) and ``num_images`` per row. The rows are regrouped by prompt and images, so each group's vision tower
and prompt run once. A tiny float64 LLaVA-NeXT (8x8 tiles, pinpoints 8x16 and 16x8: 14 image tokens per image):
log-probs, entropies and gradients (vision tower included) equal one plain forward per row to 1e-9, in one pass and
under a budget that splits groups; GRPOTrainer's own hook agrees with that reference to its float32 head.
"""

import pytest
import torch

pytest.importorskip("trl")

import transformers as tf  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

import sharedprefix as sp  # noqa: E402
from sharedprefix.integrations.trl import SharedPrefixGRPOTrainer  # noqa: E402
from sharedprefix.integrations.trl_batch import image_groups  # noqa: E402
from sharedprefix.tools.reference import dtype_faithful_norms  # noqa: E402
from support.trl_hook import padded_rows, run_hook, trainer_stub  # noqa: E402
from support.vl import IMAGE, TEXT  # noqa: E402

SIZES = ([8, 16], [16, 8])  # (height, width) of the images: two 8x8 tiles each, plus the 8x8 overview


def _llava_next():
    cfg = tf.LlavaNextConfig(
        vision_config=tf.CLIPVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
        ),
        text_config=tf.LlamaConfig(**{k: v for k, v in TEXT.items() if k != "rope_scaling"}),
        image_token_index=IMAGE,
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        image_grid_pinpoints=[[8, 8], [8, 16], [16, 8]],
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = dtype_faithful_norms(tf.LlavaNextForConditionalGeneration(cfg).double().eval())
    add_fused_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy"))
    return model


def _batch(model, G=3, C=4):
    """Three prompts x G rows: one image, none, two images."""
    g = torch.Generator().manual_seed(0)
    per_prompt = [[0], [], [1, 0]]
    prompts = []
    for which in per_prompt:
        pix = torch.randn(len(which), 3, 3, 8, 8, generator=g, dtype=torch.float64)
        sizes = torch.tensor([SIZES[i] for i in which], dtype=torch.long).reshape(-1, 2)
        tokens = []
        for k in range(len(which)):
            n = (
                model.model.get_image_features(pixel_values=pix[k : k + 1], image_sizes=sizes[k : k + 1])
                .pooler_output[0]
                .shape[0]
            )
            tokens.append(torch.full((n,), IMAGE))
        text = torch.randint(0, 90, (4,), generator=g)
        prompts.append((torch.cat([text[:2], *tokens, text[2:]]), pix, sizes))
    input_ids, attention_mask, which = padded_rows([p for p, _, _ in prompts], G, C, g)
    pix, sizes = torch.cat([prompts[i][1] for i in which]), torch.cat([prompts[i][2] for i in which])
    extra = dict(pixel_values=pix, image_sizes=sizes, num_images=[prompts[i][1].shape[0] for i in which])
    return input_ids, attention_mask, C, extra


def _plain_hook(stub, model, input_ids, attention_mask, C, compute_entropy, pixel_values, image_sizes, num_images):
    """One forward per row, unpadded, with that row's images and sizes; float64 log-softmax."""
    first = [0, *torch.tensor(num_images).cumsum(0).tolist()]
    lps, ents = [], []
    for b in range(input_ids.shape[0]):
        keep = attention_mask[b].bool()
        kw = {}
        if num_images[b]:
            kw = dict(
                pixel_values=pixel_values[first[b] : first[b + 1]], image_sizes=image_sizes[first[b] : first[b + 1]]
            )
        ids = input_ids[b][keep]
        t = int(keep[-C:].sum())
        logits = (
            model(input_ids=ids[None], use_cache=False, **kw).logits[0, ids.numel() - t - 1 : -1] / stub.temperature
        )
        logp = torch.log_softmax(logits, -1)
        lps.append(torch.nn.functional.pad(logp.gather(-1, ids[-t:, None])[:, 0], (0, C - t)))
        ents.append(torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (0, C - t)))
    return torch.stack(lps), torch.stack(ents), None


@pytest.mark.parametrize("budget, mode", [(None, "keep"), pytest.param(36, "recompute", marks=pytest.mark.slow)])
def test_llava_next_tiles_match_plain_rows_and_grpo_trainer(budget, mode):
    model = _llava_next()
    batch = _batch(model)
    groups, members = image_groups(*batch[:3], **batch[3])
    assert len(groups) == 3 and [len(m) for m in members] == [3, 3, 3]  # one group per prompt and images
    assert [tuple(g.prompt_inputs["image_sizes"].flatten().tolist()) for g in groups if g.prompt_inputs] == [
        (8, 16),
        (16, 8, 8, 16),
    ]
    if budget is not None:
        assert sp.plan(groups, budget).splits
    want = run_hook(_plain_hook, trainer_stub(), model, batch)
    got = run_hook(SharedPrefixGRPOTrainer._get_per_token_logps_and_entropies, trainer_stub(budget, mode), model, batch)
    trl = run_hook(GRPOTrainer._get_per_token_logps_and_entropies, trainer_stub(), model, batch)
    assert float(want[0].abs().max()) > 0.1
    for a, b, c in zip(got[:2], want[:2], trl[:2]):
        assert torch.allclose(a, b, rtol=0, atol=1e-9), float((a - b).abs().max())
        assert torch.allclose(c.double(), b, rtol=0, atol=1e-5), float((c - b).abs().max())  # TRL: float32 head
    assert set(got[2]) == set(want[2]) and any("vision_tower" in n for n in want[2])
    for n, w in want[2].items():
        assert (got[2][n] - w).abs().max() <= 1e-9 * max(1.0, float(w.abs().max())), n


def test_image_sizes_of_the_wrong_shape_are_refused():
    model = _llava_next()
    input_ids, attention_mask, C, extra = _batch(model)
    extra["image_sizes"] = extra["image_sizes"][:-1]
    with pytest.raises(ValueError, match=r"image_sizes of shape \(8, 2\) for 9 images; expected \(9, 2\)"):
        SharedPrefixGRPOTrainer._get_per_token_logps_and_entropies(
            trainer_stub(), model, input_ids, attention_mask, C, **extra
        )
