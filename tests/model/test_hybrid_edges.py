"""Edge cases of the packed hybrid path found by probing beyond the families' own tests: vision-language hybrids other
than Qwen3.5, and layouts, settings and inputs nobody tried. Each against one plain forward per row in float64
(log-probs 1e-9, gradients relative 1e-9), or the 2x rule where the model computes in float32 itself.
"""

import pytest
import torch
import transformers as tf

import sharedprefix as sp
from helpers import assert_matches_plain_rows
from sharedprefix.model import mixers
from sharedprefix.tools.reference import Float64Inside, dtype_faithful_norms
from sharedprefix.tools.zoo.configs import float64_norms
from support.hybrid import (
    COMMON,
    CONFIGS,
    DEEP_ROWS,
    groups_check,
    groups_of,
    model_of,
    ssm_model,
    tree_check,
    zoo_model,
)

# -- segments shorter than the convolution's window -----------------------------------------------------------------

# a trie of one-token segments four levels deep (and a two-token leaf): a kernel of 4 reads, before a segment, inputs of
# three ancestors, cached ones under budget 1 and 2 (every inner segment cached, each from a different pass)
ONE_TOKEN_ROWS = [
    [5, 6],
    [5, 7],
    [5, 6, 8],
    [5, 6, 9],
    [5, 6, 8, 10],
    [5, 6, 8, 11],
    [5, 6, 8, 10, 12],
    [5, 6, 8, 10, 13, 14],
]


def _lfm2(**config):
    cfg_cls, model_cls, extra = CONFIGS["lfm2"]
    cfg = getattr(tf, cfg_cls)(**COMMON, **dict(extra, **config))
    torch.manual_seed(0)
    model = getattr(tf, model_cls)._from_config(cfg, attn_implementation="sdpa").to(torch.float64).eval()
    float64_norms(model)
    return model


@pytest.mark.parametrize("kernel", [4, 1])
def test_one_token_segments_deeper_than_the_convolution_window(kernel):
    """Kernel 4: every segment's window spans up to three ancestors, read from the row or from several cached tails,
    in the three modes. Kernel 1 (no past input; LFM2's ``conv_L_cache=1``): a cached segment's tail is empty (its
    index was a float tensor, and the convolution failed in torch's index_select under any splitting budget)."""
    model = _lfm2(conv_L_cache=kernel)
    assert {m.conv.kernel_size for m, _ in mixers.mixer_modules(model)} == {(kernel,)}
    trained = [[True] * len(r) for r in ONE_TOKEN_ROWS]
    p = sp.plan(sp.Tree.from_rows(ONE_TOKEN_ROWS, trained), 1)
    cached = {s for step in p.steps if isinstance(step, sp.schedule.PrefixBackward) for s in step.segments}
    assert cached == {s.parent for s in p.tree.segments if s.parent is not None}  # every inner segment, every depth
    tree_check(model, ONE_TOKEN_ROWS, trained, (None, 1, 2), ("keep", "offload", "recompute"))


# -- LFM2-VL: Siglip2's images, LFM2's convolutions ----------------------------------------------------------------

LFM2_IMAGE = 60
_SIGLIP2 = dict(
    hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, patch_size=2, num_patches=16
)


def _lfm2_vl():
    """A tiny LFM2-VL. Siglip2 resizes its position embeddings in float32 even in a float64 model, so their gradient
    is float32-rounded in the plain run as in ours (summed over the rows there, once here): frozen, so that every other
    gradient is held to 1e-9 (the forward values, float32 part included, are the same ops on the same inputs)."""
    text = dict(COMMON, **CONFIGS["lfm2"][2], model_type="lfm2")
    cfg = tf.Lfm2VlConfig(
        text_config=text,
        vision_config=dict(_SIGLIP2, vision_use_head=False),
        image_token_id=LFM2_IMAGE,
        projector_hidden_size=24,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = dtype_faithful_norms(tf.Lfm2VlForConditionalGeneration(cfg).double().eval())
    model.model.vision_tower.embeddings.position_embedding.weight.requires_grad_(False)
    return model


def _lfm2_vl_group(seed, hw, before, after, completions, max_patches=16):
    """A prompt with one image of (h, w) patches (2x2 patches a token), padded as the processor pads, to max_patches."""
    g = torch.Generator().manual_seed(seed)
    h, w = hw
    prompt = torch.cat(
        [
            torch.randint(3, 55, (before,), generator=g),
            torch.full((h * w // 4,), LFM2_IMAGE),
            torch.randint(3, 55, (after,), generator=g),
        ]
    )
    pixels = torch.zeros(1, max_patches, 3 * 2 * 2, dtype=torch.float64)
    pixels[0, : h * w] = torch.randn(h * w, 12, generator=g, dtype=torch.float64)
    mask = (torch.arange(max_patches) < h * w)[None]
    inputs = dict(pixel_values=pixels, spatial_shapes=torch.tensor([[h, w]]), pixel_attention_mask=mask)
    return sp.Group(prompt, [torch.randint(3, 55, (n,), generator=g) for n in completions], prompt_inputs=inputs)


def _plain_vl(model, groups):
    """One plain forward per [prompt + completion] row, with the prompt's inputs."""
    T = max(c.numel() for g in groups for c in g.completions)
    rows = []
    for g in groups:
        for c in g.completions:
            logits = model(input_ids=torch.cat([g.prompt, c])[None], use_cache=False, **(g.prompt_inputs or {})).logits
            lp = torch.log_softmax(logits[0, g.prompt.numel() - 1 : -1], -1).gather(-1, c[:, None])[:, 0]
            rows.append(torch.nn.functional.pad(lp, (0, T - c.numel())))
    return torch.stack(rows)


@pytest.mark.parametrize("budget", [None, pytest.param(12, marks=pytest.mark.slow)])
def test_lfm2_vl_images_of_different_shapes_in_one_pass(budget):
    """Two images of different patch grids (4 x 4 and 4 x 2) and a text-only group: in one pass, the prompts'
    ``spatial_shapes`` are concatenated like their pixels (they were taken from the first group alone, and
    transformers failed with an IndexError); under a budget, the first group's prompt is cached."""
    model = _lfm2_vl()
    assert mixers.on_packed_path(model)
    groups = [
        _lfm2_vl_group(0, (4, 4), 2, 3, [3, 1, 4]),
        _lfm2_vl_group(1, (4, 2), 1, 0, [2, 5]),
        sp.Group([5, 6, 7], [[8, 9]]),
    ]
    got = assert_matches_plain_rows(model, groups, budget, "keep", plain=_plain_vl)
    assert any("vision_tower" in n for n in got)


def test_prompt_inputs_that_cannot_be_batched_are_refused():
    """Pixels padded to different sizes cannot be concatenated into one pass, and an input sharedprefix does not batch
    image by image cannot share a pass with another group's inputs (the one value would apply to every image): both
    refused at the call, naming the groups and the input."""
    model = _lfm2_vl()
    a, b = _lfm2_vl_group(0, (4, 4), 2, 3, [3]), _lfm2_vl_group(1, (4, 2), 1, 0, [2], max_patches=8)
    with pytest.raises(
        ValueError, match=r"groups\[1\]\.prompt_inputs\['pixel_values'\] has shape \(1, 8, 12\), groups\[0\]'s"
    ):
        sp.logprobs(model, [a, b])
    b = _lfm2_vl_group(1, (4, 2), 1, 0, [2])
    a.prompt_inputs["mm_encoder_outputs"] = {}  # (in one group only: still applied to the other's image)
    with pytest.raises(
        ValueError,
        match=r"groups\[0\]\.prompt_inputs has 'mm_encoder_outputs', which sharedprefix does not know how to batch "
        r"with groups\[1\]'s",
    ):
        sp.logprobs(model, [a, b])


# -- LFM3-VL: a vision tower with short convolutions of its own -----------------------------------------------------


def _lfm3_vl():
    """A tiny LFM3-VL: the zoo's LFM3 as its language model, and a vision tower of attention and 2-D ShortConv
    layers (``Lfm3VlVisionShortConv``, a depthwise convolution over each image's patch grid)."""
    from sharedprefix.tools import zoo

    text = zoo.tiny_config("lfm3").to_dict()
    vision = dict(
        hidden_size=16,
        intermediate_size=24,
        patch_size=2,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    V = text["vocab_size"]
    cfg = tf.Lfm3VlConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=V - 4,
        video_token_id=V - 3,
        vision_start_token_id=V - 2,
        vision_end_token_id=V - 1,
        projector_hidden_size=24,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return dtype_faithful_norms(tf.Lfm3VlForConditionalGeneration(cfg).double().eval())


def _lfm3_vl_group(model, seed, hw, before, after, completions):
    """A prompt with one image of (h, w) patches (2x2 patches a token) between the vision start and end tokens."""
    cfg, g = model.config, torch.Generator().manual_seed(seed)
    h, w = hw
    text = lambda n: torch.randint(3, cfg.image_token_id, (n,), generator=g)  # noqa: E731
    image = [
        torch.tensor([cfg.vision_start_token_id]),
        torch.full((h * w // 4,), cfg.image_token_id),
        torch.tensor([cfg.vision_end_token_id]),
    ]
    inputs = dict(
        pixel_values=torch.randn(h * w, 3 * 2 * 2 * 2, generator=g, dtype=torch.float64),
        image_grid_thw=torch.tensor([[1, h, w]]),
    )
    return sp.Group(
        torch.cat([text(before), *image, text(after)]), [text(n) for n in completions], prompt_inputs=inputs
    )


def test_lfm3_vl_with_images_matches_plain_rows():
    """The vision tower's own ShortConv layers are not language-model mixers (they were counted as such, and the model
    refused as one whose mixers sharedprefix cannot find): only the language model's three are driven from the layout,
    and images of two grids in one pass, with a text-only group, match the plain rows."""
    model = _lfm3_vl()
    assert [type(m).__name__ for m, _ in mixers.mixer_modules(model)] == ["Lfm3ShortConv"] * 3
    assert any(type(m).__name__ == "Lfm3VlVisionShortConv" for m in model.modules())
    groups = [
        _lfm3_vl_group(model, 0, (4, 4), 2, 3, [3, 1, 4]),
        _lfm3_vl_group(model, 1, (2, 4), 1, 0, [2, 5]),
        sp.Group([5, 6, 7], [[8, 9]]),
    ]
    with Float64Inside():  # the vision tower's attention computes in float32
        got = assert_matches_plain_rows(model, groups, plain=_plain_vl)
    assert any("vision_tower" in n for n in got)


# -- MiniCPM-V 4.6: Qwen3.5's gated delta-nets under a NaViT vision tower -------------------------------------------


def _minicpm_v():
    from sharedprefix.tools import zoo

    text = zoo.tiny_config("qwen3_5_text").to_dict()
    vision = dict(
        hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, patch_size=2, image_size=16
    )
    V = text["vocab_size"]
    cfg = tf.MiniCPMV4_6Config(
        text_config=text, vision_config=vision, insert_layer_id=0, image_token_id=V - 1, video_token_id=V - 2
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return dtype_faithful_norms(tf.MiniCPMV4_6ForConditionalGeneration(cfg).double().eval())


def _minicpm_v_group(model, seed, hw, completions):
    """One image of (h, w) patches (16 patches a token), its pixels NaViT-packed along the last dimension."""
    g, (h, w) = torch.Generator().manual_seed(seed), hw
    text = lambda n: torch.randint(3, model.config.image_token_id - 2, (n,), generator=g)  # noqa: E731
    prompt = torch.cat([text(2), torch.full((h * w // 16,), model.config.image_token_id), text(3)])
    inputs = dict(
        pixel_values=torch.randn(1, 3, 2, h * w * 2, generator=g, dtype=torch.float64),
        target_sizes=torch.tensor([[h, w]]),
    )
    return sp.Group(prompt, [text(n) for n in completions], prompt_inputs=inputs)


def test_minicpm_v_one_image_per_call_is_exact_and_two_are_refused():
    """MiniCPM-V 4.6 (a Qwen3.5 language model): an image group beside a text-only one matches the plain rows, in one
    pass and with the prompt cached. Two image groups in one pass are refused, naming ``target_sizes``: its pixels are
    packed along their last dimension and the model reads ``pixel_values[:1]``, so concatenating them image by image,
    as for the other models, would drop the second image (transformers then failed on the placeholder count); under a
    budget that computes their prompts in different passes, nothing is batched, and they match the plain rows."""
    model = _minicpm_v()
    assert mixers.on_packed_path(model)
    text_only = sp.Group([5, 6, 7, 9, 10], [[8, 9], [4]])
    with Float64Inside():  # the gated delta rule computes in float32
        got = assert_matches_plain_rows(
            model, [_minicpm_v_group(model, 0, (8, 8), [3, 1, 4]), text_only], 12, "keep", plain=_plain_vl
        )
    assert any("vision_tower" in n for n in got)
    two = [_minicpm_v_group(model, 0, (8, 8), [3]), _minicpm_v_group(model, 1, (8, 4), [2])]
    with pytest.raises(
        ValueError,
        match=r"groups\[0\]\.prompt_inputs has 'target_sizes', which sharedprefix does not know how to batch "
        r"with groups\[1\]'s",
    ):
        sp.logprobs(model, two)
    # under a budget that computes the two prompts (9 and 7 tokens) in different passes (splitting the first group),
    # nothing is batched: exact
    segs = sp.plan(two, 10).tree.segments
    prompts = [{segs[s].group for s in q.segments if segs[s].parent is None} for q in sp.plan(two, 10).passes]
    assert sorted(sorted(gs) for gs in prompts if gs) == [[0], [1]]  # one prompt a pass
    with Float64Inside():
        assert_matches_plain_rows(model, two, 10, "keep", plain=_plain_vl)


# -- hybrid MoE with the load-balancing loss -----------------------------------------------------------------------


def test_hybrid_moe_aux_loss_under_a_budget():
    """Qwen3.5-MoE (gated delta-nets and MoE layers) with ``output_router_logits=True``: the loss over packed passes
    that split the groups is the plain run's (float32, relative 1e-6), and ``sp.backward``'s gradient of log-probs
    plus 3 x the loss is within twice the plain float32 run's own error against the float64-inside result (the delta
    rule's float32 dominates both: ``sp``'s aux loss passes float weights to transformers' loss function, whose scatter
    then fails under ``Float64Inside``, so this path has no float64-inside 1e-9 check)."""
    from helpers import grads_of, plain_logprobs
    from sharedprefix.tools.zoo.checks import plain_aux_loss

    model = zoo_model("qwen3_5_moe_text")
    model.config.output_router_logits = True
    gs = groups_of()
    assert sp.plan(gs, 6).splits
    want = plain_aux_loss(model, gs)
    out = sp.logprobs(model, gs, max_tokens=6)
    assert float((out.aux_loss.double() - want.double()).abs() / want.double().abs()) <= 1e-6
    w = torch.randn(out.logprobs.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    plain = lambda: (plain_logprobs(model, gs)[0] * w).sum() + 3.0 * plain_aux_loss(model, gs)  # noqa: E731
    with Float64Inside():
        truth = grads_of(model, plain)
    scale = max(float(g.abs().max()) for g in truth.values())

    def err(got):
        return max(float((got[n] - truth[n]).abs().max()) for n in truth) / scale

    ours = grads_of(
        model,
        lambda: (
            sp.backward(model, gs, lambda b: (b.logprobs * w[b.index]).sum(), max_tokens=6, aux_loss_coef=3.0) and None
        ),
    )
    assert any("gate" in n for n in ours) and err(ours) <= 2 * err(grads_of(model, plain))


def test_lfm2_moe_aux_loss_is_refused_with_its_reason():
    """LFM2-MoE returns no load-balancing loss (its module has no ``load_balancing_loss_func``): asked for one, the
    call is refused, naming the model, the missing function and the fix."""
    model = zoo_model("lfm2_moe")
    model.config.output_router_logits = True
    with pytest.raises(
        ValueError,
        match=r"Lfm2MoeForCausalLM's MoE load-balancing loss .* no load_balancing_loss_func "
        r".*config\.output_router_logits=False",
    ):
        sp.logprobs(model, groups_of())


# -- pins of what held (one case each) -----------------------------------------------------------------------------


def test_delta_rule_segments_at_and_across_its_64_token_chunks():
    """Qwen3-Next's delta rule runs in chunks of 64: a 63-token prompt with children of 1, 64 and 65 tokens (so that
    the level's right-padded batch ends at, and crosses, chunk multiples) and a 64-token prompt whose first child ends
    one chunk later, whole and under budgets of 64 and 65 tokens (a segment cached exactly at a chunk boundary)."""
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(3, 61, (n,), generator=g).tolist()  # noqa: E731
    p, q = ids(63), ids(64)
    rows = [p + ids(1) + ids(3), p + ids(64), p + ids(65), q + ids(64), q + ids(64) + ids(2)]
    trained = [[t >= 32 for t in range(len(r))] for r in rows]
    with Float64Inside():
        tree_check(model_of("qwen3_next"), rows, trained, (None, 64, 65), ("keep",))


def test_temperature_entropy_defer_and_duplicate_rows_on_a_hybrid():
    """LFM2 under a budget: temperature and entropies against the plain rows; three deferred calls (temperature,
    entropy, a subset of the groups) before one backward; groups of one completion, two identical completions."""
    from helpers import assert_grads_close, grads_of, plain_logprobs

    model = model_of("lfm2")
    gs = groups_of() + [sp.Group([4, 5, 6], [[7, 8], [7, 8], [9]])]
    lp, ent = plain_logprobs(model, gs, temperature=0.7, entropy=True)
    with torch.no_grad():
        out = sp.logprobs(model, gs, temperature=0.7, entropy=True, max_tokens=6)
    assert (
        float((out.logprobs - lp).abs().max()) <= 1e-9 and float(((out.entropy - ent) * out.mask).abs().max()) <= 1e-9
    )
    w = torch.randn(lp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def plain():
        return (
            (plain_logprobs(model, gs, temperature=0.7)[0] * w).sum()
            + (plain_logprobs(model, gs, entropy=True)[1] * w).sum()
            + plain_logprobs(model, gs[:2])[0].sum()
        )

    def ours():
        a = sp.logprobs(model, gs, temperature=0.7, max_tokens=6, defer=True)
        b = sp.logprobs(model, gs, entropy=True, max_tokens=6, defer=True)
        c = sp.logprobs(model, gs[:2], max_tokens=6, defer=True)
        return (a.logprobs * w).sum() + (b.entropy * b.mask * w).sum() + (c.logprobs * c.mask).sum()

    assert_grads_close(grads_of(model, ours), grads_of(model, plain), 1e-9)


def test_bfloat16_mamba2_tree_within_twice_the_plain_error():
    """Nemotron-H in bfloat16 on the depth-5 trie, every inner segment cached (budget 3): log-probs and gradients
    within twice the plain bfloat16 run's own error against the float64-inside result (gradient errors at the scale of
    the largest gradient)."""
    import copy

    from helpers import grads_of
    from support.trees import plain_rows

    trained = [[t >= 8 for t in range(len(r))] for r in DEEP_ROWS]
    tree, m64 = sp.Tree.from_rows(DEEP_ROWS, trained), ssm_model("nemotron_h")
    with Float64Inside():
        truth = plain_rows(m64, DEEP_ROWS, trained).detach()
        w = torch.randn(truth.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        g_truth = grads_of(m64, lambda: (plain_rows(m64, DEEP_ROWS, trained) * w).sum())
    model = copy.deepcopy(m64).to(torch.bfloat16)
    g_scale = max(float(g.abs().max()) for g in g_truth.values())

    def g_err(g):
        return max(float((g[n].double() - g_truth[n]).abs().max()) for n in g_truth) / g_scale

    plain = plain_rows(model, DEEP_ROWS, trained).detach().double()
    with torch.no_grad():
        ours = sp.logprobs(model, tree, max_tokens=3).logprobs.double()
    assert float((plain - truth).abs().max()) > 0  # bfloat16 really rounds
    assert float((ours - truth).abs().max()) <= 2 * float((plain - truth).abs().max())
    g_plain = grads_of(model, lambda: (plain_rows(model, DEEP_ROWS, trained).double() * w).sum())
    loss = lambda b: (b.logprobs.double() * w[b.index]).sum()  # noqa: E731
    g_ours = grads_of(
        model, lambda: sp.backward(model, tree, loss, max_tokens=3, prefix_activations="recompute") and None
    )
    assert g_err(g_ours) <= 2 * g_err(g_plain)


def test_training_mode_and_use_cache_change_nothing():
    """Nemotron-H in ``train()`` (dropout 0) with ``config.use_cache=True``: the mixers take the same packed seams, and
    the result is the plain rows' under a budget."""
    model = ssm_model("nemotron_h")
    before = model.config.use_cache
    model.train()
    model.config.use_cache = True
    try:
        with Float64Inside():
            groups_check(model, groups_of(), [(6, "keep")])
    finally:
        model.eval()
        model.config.use_cache = before
