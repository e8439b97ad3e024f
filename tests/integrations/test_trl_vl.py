"""SharedPrefixGRPOTrainer with images: the log-probs, entropies and gradients of the plain per-row forward.

TRL hands its log-prob hook the rows [left-padded prompt | right-padded completion] with every row's images
(Qwen-style: patches of all images in row order, a (t, h, w) grid per image; Llava-style: one (channels,
height, width) entry per image; ``num_images`` per row). The trainer regroups the rows by prompt and image,
so each group's vision tower and prompt run once. On a tiny Qwen2-VL and a tiny Llava in float64, one pass
and a budget that splits a group: equal (1e-9) to one plain forward per row with its own images, and
GRPOTrainer's own hook agrees with that reference to float32 rounding (TRL's fused LM head computes in
float32 even for a float64 model).
"""

import contextlib

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head, split_pixel_values_by_grid, unsplit_pixel_values_by_grid  # noqa: E402

import sharedprefix as sp  # noqa: E402
from sharedprefix.integrations.trl import SharedPrefixGRPOTrainer, _group_preserving_shuffle  # noqa: E402
from sharedprefix.integrations.trl_batch import image_groups  # noqa: E402
from sharedprefix.tools.reference import Float64Inside  # noqa: E402
from support.trl_hook import padded_rows, run_hook, trainer_stub  # noqa: E402
from support.vl import IMAGE, V_END, V_START, gemma3_model, llava_model, mrope_model  # noqa: E402

PATCH_DIM = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch


def _batch(seed=0, G=3, C=5, kind="qwen2_vl"):
    """Four prompts x G rows, as TRL batches them: Qwen2-VL, one image of 4x4 or 2x4 patches, or two images, or
    none; Llava, one or two 8x8 images (4 tokens each), or none."""
    g = torch.Generator().manual_seed(seed)
    images = [[(1, 4, 4)], None, [(1, 2, 4)], [(1, 2, 4), (1, 4, 2)]]
    prompts = []
    for grids in images:
        text = torch.randint(0, 90, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        if grids is None:
            prompts.append((text, None, None))
            continue
        if kind == "llava":
            tokens = [torch.full((4,), IMAGE) for _ in grids]
            pix = torch.randn(len(grids), 3, 8, 8, generator=g, dtype=torch.float64)
        elif kind == "gemma3":  # 16 image tokens per 8x8 image, between begin- and end-of-image tokens
            tokens = [
                torch.cat([torch.tensor([V_START]), torch.full((16,), IMAGE), torch.tensor([V_END])]) for _ in grids
            ]
            pix = torch.randn(len(grids), 3, 8, 8, generator=g, dtype=torch.float64)
        else:
            tokens = [
                torch.cat([torch.tensor([V_START]), torch.full((t * h * w // 4,), IMAGE), torch.tensor([V_END])])
                for t, h, w in grids
            ]
            pix = torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM, generator=g, dtype=torch.float64)
        ids = torch.cat([text[:1], *tokens, text[1:]])
        prompts.append((ids, pix, torch.tensor(grids)))
    input_ids, attention_mask, which = padded_rows([p for p, _, _ in prompts], G, C, g)
    pix = [prompts[i][1] for i in which if prompts[i][1] is not None]
    grids = [prompts[i][2] for i in which if prompts[i][1] is not None]
    num_images = [0 if prompts[i][1] is None else len(prompts[i][2]) for i in which]
    if kind == "llava":
        return input_ids, attention_mask, C, dict(pixel_values=torch.cat(pix), num_images=num_images)
    if kind == "gemma3":  # as TRL extends the processor's token_type_ids: zeros over padding and completions
        return (
            input_ids,
            attention_mask,
            C,
            dict(
                pixel_values=torch.cat(pix),
                num_images=num_images,
                token_type_ids=(input_ids == IMAGE).long() * attention_mask,
            ),
        )
    extra = dict(
        pixel_values=torch.cat(pix),
        image_grid_thw=torch.cat(grids),
        num_images=num_images,
        mm_token_type_ids=(input_ids == IMAGE).int() * attention_mask,
    )
    return input_ids, attention_mask, C, extra


def _plain_hook(
    stub,
    model,
    input_ids,
    attention_mask,
    C,
    compute_entropy,
    pixel_values,
    num_images,
    image_grid_thw=None,
    mm_token_type_ids=None,
    token_type_ids=None,
):
    """The reference: one forward per row, unpadded, with that row's images; float64 log-softmax."""
    first = [0, *torch.tensor(num_images).cumsum(0).tolist()]
    # row b's pixel_values entries: its images' patches (Qwen) or its images (Llava)
    entry0 = range(first[-1] + 1) if image_grid_thw is None else [0, *image_grid_thw.prod(-1).cumsum(0).tolist()]
    lps, ents = [], []
    for b in range(input_ids.shape[0]):
        keep = attention_mask[b].bool()
        kw = {}
        if num_images[b]:
            kw = dict(pixel_values=pixel_values[entry0[first[b]] : entry0[first[b + 1]]])
            if image_grid_thw is not None:
                kw.update(
                    image_grid_thw=image_grid_thw[first[b] : first[b + 1]],
                    mm_token_type_ids=mm_token_type_ids[b][keep][None],
                )
        if token_type_ids is not None:
            kw.update(token_type_ids=token_type_ids[b][keep][None])
        ids = input_ids[b][keep]
        t = int(keep[-C:].sum())
        logits = (
            model(input_ids=ids[None], use_cache=False, **kw).logits[0, ids.numel() - t - 1 : -1] / stub.temperature
        )
        logp = torch.log_softmax(logits, -1)
        lps.append(torch.nn.functional.pad(logp.gather(-1, ids[-t:, None])[:, 0], (0, C - t)))
        ents.append(torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (0, C - t)))
    return torch.stack(lps), torch.stack(ents), None


@pytest.mark.parametrize(
    "kind, budget, mode",
    [
        ("qwen2_vl", None, "keep"),
        ("qwen2_vl", 14, "recompute"),
        ("llava", None, "keep"),
        ("llava", 14, "offload"),
        ("gemma3", None, "keep"),
        ("gemma3", 44, "recompute"),
        ("qwen3_5", None, "keep"),
    ],
)
def test_image_rows_match_grpo_trainer(kind, budget, mode):
    """TRL's rows with their images through our hook, TRL's own and one plain forward per row (Qwen3.5: a hybrid,
    its gated delta-nets on the packed path, their float32 scans kept float64 in all three by ``Float64Inside``)."""
    with Float64Inside() if kind == "qwen3_5" else contextlib.nullcontext():
        _check_image_rows(kind, budget, mode)


@pytest.mark.parametrize("mode", ["keep", "offload"])
def test_qwen3_5_image_rows_under_a_splitting_budget_by_the_2x_rule(mode):
    """Qwen3.5 with images through our hook under a budget that splits groups: the hook's log-probs are deferred
    (grad-enabled), so the cached prompts are recomputed inside autograd's backward, where ``Float64Inside`` does not
    reach, and the gated delta rule runs in float32 there (as it does in the model's own plain forward). Log-probs:
    1e-9 from the float64-inside plain rows; gradients: within twice the plain rows' own float32 error against them,
    at the scale of the largest gradient."""
    from support.vl import qwen3_5_vl

    model = qwen3_5_vl()
    add_fused_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy"))
    batch = _batch(kind="qwen3_5")
    assert sp.plan(image_groups(*batch[:3], **batch[3])[0], 14).splits
    with Float64Inside():
        truth = run_hook(_plain_hook, trainer_stub(), model, batch)
        got = run_hook(SharedPrefixGRPOTrainer._get_per_token_logps_and_entropies, trainer_stub(14, mode), model, batch)
    plain = run_hook(_plain_hook, trainer_stub(), model, batch)  # the model's own float32 delta rule
    for a, b in zip(got[:2], truth[:2]):
        assert float((a - b).abs().max()) <= 1e-9
    scale = max(float(t.abs().max()) for t in truth[2].values())

    def err(g):
        return max(float((g[n] - t).abs().max()) for n, t in truth[2].items()) / scale

    print(f"qwen3_5 split {mode}: ours {err(got[2]):.2e}, plain float32 {err(plain[2]):.2e}")
    assert 0 < err(plain[2]) and err(got[2]) <= 2 * err(plain[2]), (err(got[2]), err(plain[2]))


def _check_image_rows(kind, budget, mode):
    from support.vl import qwen3_5_vl

    builders = {"llava": llava_model, "gemma3": lambda: gemma3_model(4), "qwen3_5": qwen3_5_vl}
    model = builders.get(kind, lambda: mrope_model(kind))()
    add_fused_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy"))
    batch = _batch(kind=kind)
    if (
        budget is not None
    ):  # prompts of 2 to 11 tokens (Gemma 3: up to 41), groups of up to 26: the budget splits groups
        assert sp.plan(image_groups(*batch[:3], **batch[3])[0], budget).splits
    want = run_hook(_plain_hook, trainer_stub(), model, batch)
    got = run_hook(SharedPrefixGRPOTrainer._get_per_token_logps_and_entropies, trainer_stub(budget, mode), model, batch)
    trl = run_hook(GRPOTrainer._get_per_token_logps_and_entropies, trainer_stub(), model, batch)
    assert float(want[0].abs().max()) > 0.1
    for a, b, c in zip(got[:2], want[:2], trl[:2]):
        assert torch.allclose(a, b, rtol=0, atol=1e-9), float((a - b).abs().max())
        assert torch.allclose(c.double(), b, rtol=0, atol=1e-5), float((c - b).abs().max())  # TRL: float32 head
    assert set(got[2]) == set(want[2]) and any("visual" in n or "vision_tower" in n for n in want[2])
    for n, w in want[2].items():
        assert (got[2][n] - w).abs().max() <= 1e-9 * max(1.0, float(w.abs().max())), n


def test_group_shuffle_keeps_each_rows_images():
    """The whole-group shuffle moves each row's patches and grid with it (TRL splits them per row first)."""
    input_ids, attention_mask, C, extra = _batch(seed=1)
    batch = {
        "prompt_ids": input_ids[:, :-C],
        "prompt_mask": attention_mask[:, :-C],
        "completion_ids": input_ids[:, -C:],
        **extra,
    }
    torch.manual_seed(3)
    out = unsplit_pixel_values_by_grid(_group_preserving_shuffle(split_pixel_values_by_grid(batch)))
    first = [0, *torch.tensor(extra["num_images"]).cumsum(0).tolist()]
    patch0 = [0, *extra["image_grid_thw"].prod(-1).cumsum(0).tolist()]
    by_row = {
        tuple(input_ids[b].tolist()): extra["pixel_values"][patch0[first[b]] : patch0[first[b + 1]]]
        for b in range(input_ids.shape[0])
    }
    f2 = [0, *torch.tensor(out["num_images"]).cumsum(0).tolist()]
    p2 = [0, *out["image_grid_thw"].prod(-1).cumsum(0).tolist()]
    moved = False
    for b in range(input_ids.shape[0]):
        row = tuple(torch.cat([out["prompt_ids"][b], out["completion_ids"][b]]).tolist())
        moved |= row != tuple(input_ids[b].tolist())
        assert torch.equal(out["pixel_values"][p2[f2[b]] : p2[f2[b + 1]]], by_row[row])
    assert moved


def test_other_image_layouts_are_refused_with_what_is_supported():
    input_ids, attention_mask, C, extra = _batch(kind="llava")
    hook = SharedPrefixGRPOTrainer._get_per_token_logps_and_entropies
    tiles = dict(extra, num_tiles=[2] * len(extra["num_images"]))
    with pytest.raises(ValueError, match=r"multimodal inputs \['num_images', 'num_tiles', 'pixel_values'\].*Llava"):
        hook(trainer_stub(), llava_model(), input_ids, attention_mask, C, **tiles)
    # image_sizes asks for LLaVA-NeXT's tiles: one (tiles, channels, height, width) entry per image, not these
    with pytest.raises(
        ValueError, match=r"shape \(12, 3, 8, 8\) for 12 images .*with image_sizes one \(tiles, channels"
    ):
        hook(
            trainer_stub(),
            llava_model(),
            input_ids,
            attention_mask,
            C,
            **extra,
            image_sizes=torch.ones(8, 2, dtype=torch.long),
        )
    per_row = dict(
        pixel_values=torch.zeros(input_ids.shape[0], 2, 3, 8, 8, dtype=torch.float64), num_images=extra["num_images"]
    )  # Idefics-style: padded to one entry per row
    with pytest.raises(
        ValueError, match=r"shape \(12, 2, 3, 8, 8\) for 12 images .*one \(channels, height, width\) entry per"
    ):
        hook(trainer_stub(), llava_model(), input_ids, attention_mask, C, **per_row)


def test_token_type_ids_outside_a_prompts_images_are_refused():
    input_ids, attention_mask, C, extra = _batch(kind="gemma3")
    hook = SharedPrefixGRPOTrainer._get_per_token_logps_and_entropies
    bad = extra["token_type_ids"].clone()
    bad[0, -C] = 1  # row 0's first completion token marked as an image token
    with pytest.raises(ValueError, match=r"row 0 has token_type_ids .* a 1 \(image token\) in its completion"):
        hook(trainer_stub(), gemma3_model(4), input_ids, attention_mask, C, **dict(extra, token_type_ids=bad))
