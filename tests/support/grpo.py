"""SharedPrefixGRPOTrainer built for the tests: the key-value task's reward and dataset, a tiny model of a zoo config
with the tokenizer's special tokens, and the trainer built (not trained) with warnings silenced; the TRL ``train()``
comparisons' config and run (2 plain-SGD steps), and the tiny Qwen3, LFM2 and MoE models they train. Needs trl and
datasets: import it after ``pytest.importorskip`` of both."""

import warnings

import torch
import transformers as tf

from helpers import tiny_model
from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer
from sharedprefix.recipes.grpo.tasks import KeyValueTask
from sharedprefix.tools.zoo.configs import tiny_config

TASK = KeyValueTask(records=6)


def reward(completions, answer, **kw):
    """The task's reward plus 0.1 per word of the completion."""
    return [TASK.reward(c, a) + 0.1 * len(c.split()) for c, a in zip(completions, answer)]


def dataset():
    """Eight samples of ``TASK`` (seed 0) as a ``datasets.Dataset`` of prompts and answers."""
    import random

    import datasets

    rng = random.Random(0)
    samples = [TASK.sample(rng) for _ in range(8)]
    return datasets.Dataset.from_dict({"prompt": [s.prompt for s in samples], "answer": [s.answer for s in samples]})


def varied_dataset():
    """``dataset()`` with prompts of 6 lengths: sample i keeps its last 6 - (i % 6) records (after ``<bos>``), so the
    prompts of a generation batch differ in length and TRL left-pads them."""
    import datasets

    d = dataset()
    prompts = []
    for i, p in enumerate(d["prompt"]):
        records = p.removeprefix("<bos> ").split(" ; ")
        prompts.append("<bos> " + " ; ".join(records[i % 6 :]))
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": d["answer"]})


def build_trainer(
    model, tok, tmp_path, trainer_cls=SharedPrefixGRPOTrainer, config_cls=SharedPrefixGRPOConfig, peft_config=None, **kw
):
    """A SharedPrefixGRPOTrainer (or ``trainer_cls`` with ``config_cls``) on ``dataset()`` and ``reward`` (CPU,
    float32, groups of 4); ``peft_config`` to the trainer; ``kw``: settings to add."""
    args = config_cls(
        output_dir=str(tmp_path),
        num_generations=4,
        per_device_train_batch_size=8,
        report_to=[],
        use_cpu=True,
        **{"bf16": False, **kw},
    )
    peft = {} if peft_config is None else {"peft_config": peft_config}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_cls(
            model=model, reward_funcs=reward, args=args, train_dataset=dataset(), processing_class=tok, **peft
        )


def tiny_for_tokenizer(model_type: str, tok, cls):
    """``cls`` on the zoo's tiny config of ``model_type``, with ``tok``'s vocabulary and special tokens (seed 0)."""
    cfg = tiny_config(model_type)
    cfg.vocab_size = len(tok)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(0)
    return cls(cfg)


def two_step_args(cfg_cls, out, **settings):
    """``cfg_cls`` (``GRPOConfig`` or ``SharedPrefixGRPOConfig``) for 2 plain-SGD steps at a constant rate of 0.5, on
    CPU in float32, seed 0, logging every step, no saving or reporting; ``settings`` add to or override these."""
    base = dict(
        output_dir=str(out),
        max_steps=2,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=True,
        bf16=False,
    )
    return cfg_cls(**{**base, **settings})


def train(cls, args, **trainer_kwargs):
    """``cls(args=args, **trainer_kwargs)`` built and trained with warnings silenced; returns the trainer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(args=args, **trainer_kwargs)
        trainer.train()
    return trainer


def train_two_steps(cls, cfg_cls, model, tok, tmp_path, peft_config=None, data=None, eval_data=None, **kw):
    """``cls`` (``GRPOTrainer``, ``RLOOTrainer`` or ours) trained 2 steps (``two_step_args``) on ``data`` (default
    ``dataset()``) and ``reward``: groups of 4, 8 rows a step, completions of up to 3 tokens at temperature 1;
    ``peft_config`` and ``eval_data`` (its ``eval_dataset``) to the trainer; ``kw``: settings to add or override.
    Returns the trainer."""
    settings = dict(
        num_generations=4,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        temperature=1.0,
        max_completion_length=3,
    )
    args = two_step_args(cfg_cls, tmp_path, **{**settings, **kw})
    peft = {} if peft_config is None else {"peft_config": peft_config}
    if eval_data is not None:
        peft["eval_dataset"] = eval_data
    data = dataset() if data is None else data
    return train(cls, args, model=model, reward_funcs=reward, train_dataset=data, processing_class=tok, **peft)


def qwen3_model(tok, **overrides):
    """A tiny Qwen3 (2 layers, hidden size 32, sdpa) with ``tok``'s vocabulary and special tokens (seed 0);
    ``overrides`` set on its config."""
    model = tiny_model(
        "qwen3",
        dtype=torch.float32,
        vocab_size=len(tok),
        intermediate_size=64,
        head_dim=8,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **overrides,
    )
    return model.train()  # as built: TRL's trainer sets the mode


def lfm2_model(tok):
    """A tiny LFM2 (short convolutions beside attention, on the packed path)."""
    model = tiny_model(
        "lfm2",
        dtype=torch.float32,
        vocab_size=len(tok),
        num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"],
        full_attn_idxs=None,
        conv_L_cache=3,
        block_auto_adjust_ff_dim=False,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return model.train()  # as built: TRL's trainer sets the mode


def gpt2_model(tok):
    """A tiny GPT-2 (learned absolute position embeddings, numbered 0..L-1 over a padded row) with ``tok``'s
    vocabulary and special tokens (seed 0)."""
    model = tiny_model(
        "gpt2",
        dtype=torch.float32,
        vocab_size=len(tok),
        n_positions=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return model.train()  # as built: TRL's trainer sets the mode


MOE_MODELS = {"qwen3_moe": tf.Qwen3MoeForCausalLM, "gpt_oss": tf.GptOssForCausalLM}


def moe_model(tmp_path, tok, kind):
    """The zoo's tiny ``kind`` (a key of ``MOE_MODELS``) with ``tok``'s vocabulary and special tokens and
    ``router_aux_loss_coef`` 0.5 (seed 0), saved to ``tmp_path / "init"``. Returns (that folder, its state dict)."""
    cfg = tiny_config(kind)
    cfg.vocab_size = len(tok)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    cfg.router_aux_loss_coef = 0.5  # large enough that the aux term moves the update (checked in test_trl_moe.py)
    cfg.max_position_embeddings = 256
    assert hasattr(cfg, "output_router_logits") and not cfg.output_router_logits
    torch.manual_seed(0)
    impl = "sdpa" if MOE_MODELS[kind]._supports_sdpa else "eager"  # GPT-OSS (attention sinks): eager
    model = MOE_MODELS[kind]._from_config(cfg, attn_implementation=impl)
    model.save_pretrained(tmp_path / "init")
    return str(tmp_path / "init"), model.state_dict()


def plain_rows(cls):
    """``cls`` (a TRL trainer) whose log-prob hook is a plain transformers forward of each row alone, without its
    padding (positions from 0), log-softmax in the model's dtype: with ``float64_qwen3_norms``, the float64 reference.
    TRL's own hook runs its fused LM head in float32 even for a float64 model, so a float64 TRL run agrees with the
    exact one to float32 rounding only. Text rows without holes, no aux loss."""

    class PlainRows(cls):
        def _get_per_token_logps_and_entropies(
            self, model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **kw
        ):
            assert not kw.get("compute_aux_loss") and kw.get("pixel_values") is None
            C = logits_to_keep
            dtype = next(model.parameters()).dtype
            lp = torch.zeros(input_ids.shape[0], C, dtype=dtype)
            ent = torch.zeros_like(lp)
            for b in range(input_ids.shape[0]):
                n = int(attention_mask[b, -C:].sum())
                if n == 0:
                    continue
                row = input_ids[b][attention_mask[b].bool()]
                logp = (model(input_ids=row[None]).logits[0, -n - 1 : -1] / self.temperature).log_softmax(-1)
                lp[b, :n] = logp.gather(-1, row[-n:, None]).squeeze(-1)
                ent[b, :n] = -(logp.exp() * logp).sum(-1)
            if not lp.requires_grad and torch.is_grad_enabled():  # every row masked: a zero with a graph, as TRL's
                lp = lp + 0.0 * sum(p.reshape(-1)[:1].sum() for p in model.parameters() if p.requires_grad)
            return lp, (ent if compute_entropy else None), None

    return PlainRows


def float64_qwen3_norms(monkeypatch):
    """Qwen3's RMSNorm computed in its input's dtype for the rest of the test (transformers' rounds to float32 even in a
    float64 model, so a float64 run is only float32-accurate there). Patched on the class, since TRL's ``train()``
    drops a replacement set on the modules (``dtype_faithful_norms``); float32 inputs give what the original gives."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(tf.models.qwen3.modeling_qwen3.Qwen3RMSNorm, "forward", forward)
