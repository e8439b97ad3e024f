"""SharedPrefixGRPOTrainer against TRL's GRPOTrainer on image datasets: same seed, same data, same parameters.

Both trainers run their real ``train()`` (generation, processor, rewards, TRL's loss, SGD) on a tiny
vision-language model built from config classes (Qwen2-VL: images as patches with a (t, h, w) grid; Llava:
one (channels, height, width) entry per image; Gemma 3: likewise, with token_type_ids, its image tokens attending
to each other bidirectionally; LLaVA-NeXT: one (tiles, channels, height, width) entry per image, any-resolution
tiles with ``image_sizes``), with a dataset of conversational prompts with images (two image sizes, a prompt with
two images, two prompts with the same text and different images), and the parameters after 2 steps are compared,
vision tower included.

The processors are transformers' own ``Qwen2VLProcessor``, ``LlavaProcessor``, ``LlavaNextProcessor`` and
``Gemma3Processor`` with their PIL image processors and a word-level tokenizer built here; the Qwen2-VL one leaves
out its video processor (it needs torchvision): ``ImageOnlyQwen2VLProcessor`` declares no ``video_processor``
argument, which is how ``ProcessorMixin`` learns a processor's parts. TRL calls ``apply_chat_template``
(generation), ``__call__`` with images (the log-prob forward) and ``batch_decode``.
"""

import random

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
np = pytest.importorskip("numpy")
Image = pytest.importorskip("PIL.Image")

import transformers as tf  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil  # noqa: E402
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import sharedprefix as sp  # noqa: E402
from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer  # noqa: E402
from support.grpo import train, two_step_args  # noqa: E402
from support.vl import IMAGE, TEXT, V_END, V_START, VIDEO, VISION, gemma3_config, llava_config  # noqa: E402
from tests.helpers import call_source  # noqa: E402

pytestmark = pytest.mark.slow  # TRL's real train() on image datasets

SPECIAL = {IMAGE: "<|image_pad|>", VIDEO: "<|video_pad|>", V_START: "<|vision_start|>", V_END: "<|vision_end|>"}
LLAVA_SPECIAL = {IMAGE: "<image>"}
GEMMA3_SPECIAL = {IMAGE: "<image_soft_token>", V_START: "<start_of_image>", V_END: "<end_of_image>"}
# one user turn: its images then its text; a generation prompt is empty
TEMPLATE = (
    "<bos>{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}IMAGE"
    "{% else %} {{ p['text'] }}{% endif %}{% endfor %}{% endfor %}"
)
TEXT_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
PINPOINTS = [[8, 8], [8, 16], [16, 8]]  # LLaVA-NeXT's tile layouts, (height, width) in pixels


class ImageOnlyQwen2VLProcessor(tf.Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without a video processor (its parts are read from this signature)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def _tokenizer(special, **extra):
    """Word-level tokenizer whose ids match the model's vision tokens (100-103) and vocab (120)."""
    words = ["<pad>", "<bos>", "<eos>", "<unk>"]
    words += [special.get(i, f"w{i}") for i in range(len(words), TEXT["vocab_size"])]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(special.values()))  # "<|image_pad|><|image_pad|>..." splits into tokens
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        **extra,
    )


def _processor(kind):
    """Qwen2-VL: 8x8 pixel images become (1, 4, 4) patch grids (4 image tokens), 8x16 ones (1, 4, 8) grids (8 image
    tokens). Llava: every image is resized and cropped to 8x8, 4x4 patches: 4 image tokens."""
    if kind == "gemma3":  # every image resized to 8x8: 4 image tokens between begin and end of image
        tok = _tokenizer(
            GEMMA3_SPECIAL,
            extra_special_tokens={
                "boi_token": GEMMA3_SPECIAL[V_START],
                "eoi_token": GEMMA3_SPECIAL[V_END],
                "image_token": GEMMA3_SPECIAL[IMAGE],
            },
        )
        images = Gemma3ImageProcessorPil(size={"height": 8, "width": 8})
        return tf.Gemma3Processor(
            image_processor=images,
            tokenizer=tok,
            image_seq_length=4,
            chat_template=TEMPLATE.replace("IMAGE", GEMMA3_SPECIAL[V_START]),
        )
    if kind in (
        "llava",
        "llava_next",
    ):  # LLaVA-NeXT: any-resolution, an 8x8 overview plus 8x8 tiles (1 for 8x8, 2 for 8x16 or 16x8)
        crop = dict(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
        if kind == "llava_next":
            cls, images = tf.LlavaNextProcessor, LlavaNextImageProcessorPil(**crop, image_grid_pinpoints=PINPOINTS)
        else:
            cls, images = tf.LlavaProcessor, CLIPImageProcessorPil(**crop)
        return cls(
            image_processor=images,
            tokenizer=_tokenizer(LLAVA_SPECIAL),
            patch_size=4,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=TEMPLATE.replace("IMAGE", "<image>"),
        )
    images = Qwen2VLImageProcessorPil(
        patch_size=VISION["patch_size"],
        merge_size=VISION["spatial_merge_size"],
        temporal_patch_size=VISION["temporal_patch_size"],
        min_pixels=16,
        max_pixels=256,
    )
    return ImageOnlyQwen2VLProcessor(
        image_processor=images,
        tokenizer=_tokenizer(SPECIAL),
        chat_template=TEMPLATE.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>"),
    )


def _model(kind):
    torch.manual_seed(0)
    if kind == "llava":
        return tf.LlavaForConditionalGeneration(llava_config(**TEXT_IDS))
    if kind == "llava_next":  # 10 image tokens for an 8x8 image, 14 for 8x16 or 16x8
        cfg = llava_config(**TEXT_IDS).to_dict()
        cfg = tf.LlavaNextConfig(
            **{
                k: cfg[k]
                for k in (
                    "vision_config",
                    "text_config",
                    "image_token_index",
                    "vision_feature_layer",
                    "projector_hidden_act",
                )
            },
            image_grid_pinpoints=PINPOINTS,
        )
        cfg._attn_implementation = "sdpa"
        return tf.LlavaNextForConditionalGeneration(cfg)
    if kind == "gemma3":
        # images of 4 tokens, attending to each other bidirectionally, under a window of 3
        return tf.Gemma3ForConditionalGeneration(gemma3_config(3, patch=4, **TEXT_IDS))
    cfg = tf.Qwen2VLConfig(
        text_config=dict(TEXT, **TEXT_IDS),
        vision_config=dict(VISION, embed_dim=16, mlp_ratio=2),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=V_START,
        vision_end_token_id=V_END,
    )
    cfg._attn_implementation = "sdpa"
    return tf.Qwen2VLForConditionalGeneration(cfg)


def _dataset():
    """6 prompts with images of 8x8, 8x16 or 16x8 pixels, one with two images; prompts 0 and 1 share their text
    and image size, not their image."""
    rng, npr = random.Random(0), np.random.RandomState(0)
    texts = [" ".join(f"w{rng.randrange(4, 60)}" for _ in range(rng.randrange(1, 4))) for _ in range(5)]
    texts.insert(1, texts[0])
    sizes = [[(8, 8)], [(8, 8)], [(8, 16)], [(16, 8), (8, 8)], [(8, 16)], [(8, 8)]]
    images = [[Image.fromarray(npr.randint(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in row] for row in sizes]
    return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in texts], "images": images})


def _reward(completions, **kw):
    """Rewards words with an even id, so completions differ in advantage."""
    words = [c[0]["content"].split() if isinstance(c, list) else c.split() for c in completions]
    return [sum(1.0 for w in ws if w[1:].isdigit() and int(w[1:]) % 2 == 0) + 0.1 * len(ws) for ws in words]


def _train(cls, cfg_cls, init, kind, tmp_path, **kw):
    settings = dict(
        num_generations=3,
        per_device_train_batch_size=9,
        gradient_accumulation_steps=1,
        max_completion_length=4,
        temperature=1.0,
        beta=0.1,
    )
    args = two_step_args(cfg_cls, tmp_path, **{**settings, **kw})
    return train(
        cls, args, model=init, reward_funcs=_reward, train_dataset=_dataset(), processing_class=_processor(kind)
    )


def _swap_images(cls):
    """``cls`` that misroutes images: in each batch, two rows with the same prompt tokens and different images get
    each other's image before the log-prob hook (the negative control: the comparison must catch this)."""

    class SwapImages(cls):
        def _get_per_token_logps_and_entropies(
            self,
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            *args,
            pixel_values=None,
            image_grid_thw=None,
            num_images=None,
            **kw,
        ):
            P = input_ids.shape[1] - logits_to_keep
            per_image = (
                torch.ones(sum(num_images), dtype=torch.long) if image_grid_thw is None else image_grid_thw.prod(-1)
            )
            per_row = [int(n.sum()) for n in per_image.split(num_images)]  # pixel_values entries of each row
            first = [0, *torch.tensor(per_row).cumsum(0).tolist()]  # row b's: first[b] to first[b + 1]
            rows = [
                (input_ids[b, :P][attention_mask[b, :P].bool()].tolist(), pixel_values[first[b] : first[b + 1]])
                for b in range(input_ids.shape[0])
            ]
            pairs = [
                (a, b)
                for b in range(len(rows))
                for a in range(b)
                if rows[a][0] == rows[b][0] and not torch.equal(rows[a][1], rows[b][1])
            ]
            if pairs:
                (a, b), pixel_values = pairs[0], pixel_values.clone()
                pixel_values[first[a] : first[a + 1]], pixel_values[first[b] : first[b + 1]] = rows[b][1], rows[a][1]
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                *args,
                pixel_values=pixel_values,
                image_grid_thw=image_grid_thw,
                num_images=num_images,
                **kw,
            )

    return SwapImages


@pytest.mark.parametrize("kind, budget", [("qwen2_vl", 24), ("llava", 16), ("gemma3", 18), ("llava_next", 34)])
def test_image_dataset_trains_as_grpo_trainer(tmp_path, monkeypatch, kind, budget):
    calls = []

    def spy(model, source, **kw):
        calls.append((call_source(source), sp.plan(call_source(source), kw["max_tokens"])))
        return logprobs(model, source, **kw)

    logprobs = sp.logprobs
    monkeypatch.setattr(sp, "logprobs", spy)
    _model(kind).save_pretrained(tmp_path / "init")
    init = str(tmp_path / "init")
    init_state = type(_model(kind)).from_pretrained(init).state_dict()

    def delta(trainer, only=""):
        return torch.cat(
            [(p.detach() - init_state[n]).flatten() for n, p in trainer.model.named_parameters() if only in n]
        )

    # the budget holds one prompt (up to 14 tokens for Qwen2-VL, 12 for Llava) and a few of its completions:
    # groups are split
    budget = dict(sharedprefix_max_tokens=budget, sharedprefix_prefix_activations="recompute")
    plain_trainer = _train(GRPOTrainer, GRPOConfig, init, kind, tmp_path / "plain")
    plain = delta(plain_trainer)
    vision = delta(plain_trainer, "visual" if kind == "qwen2_vl" else "vision_tower")
    ours = delta(_train(SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, init, kind, tmp_path / "sp", **budget))
    # what sharedprefix ran: image groups split by the budget, a prompt with 2 images, and in one batch two groups
    # with the same prompt tokens and different images (regrouping by prompt alone would misroute one of them)
    assert len(calls) == 4  # 2 steps x (reference, policy)
    # LLaVA-NeXT's prompts range from 13 tokens to 30 (two images, 26 image tokens): a budget that holds the longest
    # with one completion leaves the short groups whole, so only some passes split
    split = any if kind == "llava_next" else all
    assert split(plan.splits for _, plan in calls)
    assert all(g.prompt_inputs is not None for groups, _ in calls for g in groups)
    if kind == "qwen2_vl":
        grids = {tuple(g.prompt_inputs["image_grid_thw"].flatten().tolist()) for groups, _ in calls for g in groups}
        assert {(1, 4, 4), (1, 4, 8), (1, 8, 4, 1, 4, 4)} <= grids, grids
    else:
        assert {g.prompt_inputs["pixel_values"].shape[0] for groups, _ in calls for g in groups} == {1, 2}
    assert any(
        torch.equal(a.prompt, b.prompt)
        and not torch.equal(a.prompt_inputs["pixel_values"], b.prompt_inputs["pixel_values"])
        for groups, _ in calls
        for i, a in enumerate(groups)
        for b in groups[:i]
    )
    scale = float(plain.abs().max())
    assert scale > 1e-3 and float(vision.abs().max()) > 1e-2 * scale  # language model and vision tower both moved
    # float32: the two runs compute the same sums in other orders (one packed prompt per group, completions in
    # budgeted passes, vs one padded row each), so the updates agree to float32 rounding (measured 1.3e-7 of the
    # largest update for Qwen2-VL, 2.3e-7 for Llava); 1e-4 is far above that and far below what misrouted images
    # give (below: 1.4e-2 of it for both).
    err = float((ours - plain).abs().max())
    assert err <= 1e-4 * scale, (err, scale)
    swapped = delta(
        _train(_swap_images(SharedPrefixGRPOTrainer), SharedPrefixGRPOConfig, init, kind, tmp_path / "swap", **budget)
    )
    assert float((swapped - plain).abs().max()) > 1e-3 * scale


@pytest.mark.parametrize("kind, budget", [("qwen2_vl", 24), ("llava", 16)])
def test_groups_split_across_microbatches_train_as_grpo_trainer(tmp_path, monkeypatch, kind, budget):
    """TRL's own microbatches (the default): 3 rows each, drawn by TRL's shuffle from a generation batch of 3 groups
    (steps_per_generation=3, an optimizer step per microbatch), so a microbatch holds part of a group. The hook
    regroups each microbatch's rows by prompt and image, whatever rows it gets: the same parameters as GRPOTrainer
    (float32; 1e-4 of the update as above), with the budgets above."""
    calls = []
    logprobs = sp.logprobs
    monkeypatch.setattr(
        sp,
        "logprobs",
        lambda model, source, **kw: (
            calls.append((call_source(source), torch.is_grad_enabled())) or logprobs(model, source, **kw)
        ),
    )
    _model(kind).save_pretrained(tmp_path / "init")
    init = str(tmp_path / "init")
    init_state = type(_model(kind)).from_pretrained(init).state_dict()

    def delta(trainer):
        return torch.cat([(p.detach() - init_state[n]).flatten() for n, p in trainer.model.named_parameters()])

    split = dict(per_device_train_batch_size=3, steps_per_generation=3)
    plain = delta(_train(GRPOTrainer, GRPOConfig, init, kind, tmp_path / "plain", **split))
    budget = dict(sharedprefix_max_tokens=budget, sharedprefix_prefix_activations="recompute")
    ours = delta(
        _train(SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, init, kind, tmp_path / "sp", **split, **budget)
    )
    policy = [groups for groups, grad in calls if grad]
    assert policy and all(sum(len(g.completions) for g in groups) == 3 for groups in policy)
    assert any(len(g.completions) < 3 for groups in policy for g in groups)  # part of a group in a microbatch
    assert all(sum(len(g.completions) for g in groups) == 9 for groups, grad in calls if not grad)  # whole batch
    scale = float(plain.abs().max())
    assert scale > 1e-3
    err = float((ours - plain).abs().max())
    assert err <= 1e-4 * scale, (err, scale)


def _vision_tower(model):
    inner = model.model
    return inner.visual if hasattr(inner, "visual") else inner.vision_tower


@pytest.mark.parametrize(
    "kind, trl, ours",
    [
        ("qwen2_vl", {}, dict(sharedprefix_max_tokens=24, sharedprefix_prefix_activations="recompute")),
        ("llava", dict(gradient_checkpointing=False), {}),
    ],
)
def test_an_optimizer_steps_microbatches_run_each_image_prompt_once(tmp_path, monkeypatch, kind, trl, ours):
    """TRL's default with accumulation: steps_per_generation = gradient_accumulation_steps = 3, microbatches of 3 rows
    drawn by TRL's shuffle from a generation batch of 3 groups of 3, so groups are split across micro-steps. The
    three micro-steps' policy passes run as one ``sp.plan_step`` step of image groups: each image prompt's vision
    tower runs with grad once per optimizer step (a call per microbatch: once per microbatch holding rows of it), and
    the parameters equal GRPOTrainer's (float32, 1e-4 of the update as above; misrouted images are caught). Qwen2-VL
    with a splitting budget and TRL's gradient checkpointing (deferred backward, recompute), Llava with the graph
    kept. Images swapped between rows before the hook are refused: the step computes the rows it planned from
    TRL's inputs, and the hook's must equal them."""
    steps, plan_step = [], sp.plan_step
    monkeypatch.setattr(sp, "plan_step", lambda model, mbs, **kw: steps.append(mbs) or plan_step(model, mbs, **kw))
    _model(kind).save_pretrained(tmp_path / "init")
    init = str(tmp_path / "init")
    init_state = type(_model(kind)).from_pretrained(init).state_dict()

    def run(cls, cfg_cls, out, **kw):
        seen = []  # pixel rows through the vision tower with grad, per optimizer step

        class Counted(cls):
            def create_optimizer(self):
                hook = lambda m, args, kwargs: (  # noqa: E731  (it only counts: declared)
                    seen.append((self.state.global_step, (args[0] if args else kwargs["pixel_values"]).shape[0]))
                    if torch.is_grad_enabled()
                    else None
                )
                _vision_tower(self.model).register_forward_pre_hook(sp.allow_hook(hook), with_kwargs=True)
                return super().create_optimizer()

        split = dict(per_device_train_batch_size=3, steps_per_generation=3, gradient_accumulation_steps=3)
        trainer = _train(Counted, cfg_cls, init, kind, tmp_path / out, **split, **kw)
        delta = torch.cat([(p.detach() - init_state[n]).flatten() for n, p in trainer.model.named_parameters()])
        return delta, [sum(n for s, n in seen if s == step) for step in range(2)]

    plain, _ = run(GRPOTrainer, GRPOConfig, "plain", **trl)
    mine, rows = run(SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, "sp", **trl, **ours)
    off = dict(sharedprefix_step=False)
    _, per_microbatch = run(SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, "mb", **off, **trl, **ours)
    # the steps: 3 microbatches of image groups each, every optimizer step; some group split across them
    assert len(steps) == 2 and all(len(mbs) == 3 for mbs in steps)
    assert all(g.prompt_inputs is not None for mbs in steps for groups in mbs for g in groups)
    assert all(any(len(g.completions) < 3 for groups in mbs for g in groups) for mbs in steps)

    def key(g):
        return tuple(g.prompt.tolist()), g.prompt_inputs["pixel_values"].numpy().tobytes()

    def pixel_rows(groups):
        return sum(g.prompt_inputs["pixel_values"].shape[0] for g in {key(g): g for g in groups}.values())

    once = [pixel_rows([g for groups in mbs for g in groups]) for mbs in steps]
    assert rows == once, (rows, once)
    assert all(m > o for m, o in zip(per_microbatch, once)), (per_microbatch, once)
    scale = float(plain.abs().max())
    assert scale > 1e-3
    err = float((mine - plain).abs().max())
    assert err <= 1e-4 * scale, (err, scale)
    with pytest.raises(RuntimeError, match="other than those of micro-step"):
        run(_swap_images(SharedPrefixGRPOTrainer), SharedPrefixGRPOConfig, "swap", **trl, **ours)
