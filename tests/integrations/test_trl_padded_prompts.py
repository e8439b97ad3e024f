"""Prompts of different lengths (TRL left-pads them) through SharedPrefixGRPOTrainer and SharedPrefixRLOOTrainer: the
parameters equal the exact float64 run's (a plain forward of each row alone); and for a model with absolute position
embeddings (GPT-2), where TRL's own trainer scores a padded prompt at positions shifted by its padding, the trainer
warns when built, and follows the exact run, not TRL's (the control: TRL's differs by far more than rounding).

The covering table (``test_trl_settings.py``) trains on prompts of one length, which never pads; here sample i keeps
6 - (i % 6) of its records (``varied_dataset``), and each run checks that the hook was given padded prompts.
Float64, two plain-SGD steps, groups of 3, 6 rows a microbatch, as in the table.
"""

import re
import warnings

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

from sharedprefix.integrations.trl import (  # noqa: E402
    SharedPrefixGRPOConfig,
    SharedPrefixGRPOTrainer,
    SharedPrefixRLOOConfig,
    SharedPrefixRLOOTrainer,
)
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import (  # noqa: E402
    dataset,
    float64_qwen3_norms,
    gpt2_model,
    plain_rows,
    qwen3_model,
    reward,
    train_two_steps,
    varied_dataset,
)

F64 = {"model_init_kwargs": {"dtype": torch.float64}}
WARNING = r"gives a left-padded row other log-probs than the row alone .*TRL's GRPOTrainer scores"


def _counting_pads(cls, pads):
    """``cls`` whose log-prob hook records, per call, how many rows have a padded prompt."""

    class CountingPads(cls):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **kw):
            P = input_ids.shape[1] - logits_to_keep
            pads.append(int((attention_mask[:, :P] == 0).any(1).sum()))
            hook = super()._get_per_token_logps_and_entropies
            return hook(model, input_ids, attention_mask, logits_to_keep, *a, **kw)

    return CountingPads


def _update(cls, cfg_cls, init, tok, out, **settings):
    tok_eos = {"sequence_bias": [[[tok.eos_token_id], 3.0]]}
    common = dict(num_generations=3, per_device_train_batch_size=6, generation_kwargs=tok_eos, beta=0.04, **F64)
    t = train_two_steps(cls, cfg_cls, init, tok, out, data=varied_dataset(), **{**common, **settings})
    return torch.cat([p.detach().double().flatten() for _, p in t.model.named_parameters()])


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, settings",
    [
        ("grpo", dict(loss_type="dapo", steps_per_generation=2, sharedprefix_max_tokens=16)),
        ("rloo", dict(steps_per_generation=2, gradient_accumulation_steps=2, sharedprefix_max_tokens=16)),
    ],
)
def test_padded_prompts_train_to_the_exact_runs_parameters(tmp_path, monkeypatch, kind, settings):
    float64_qwen3_norms(monkeypatch)
    tok = build_tokenizer()
    base = qwen3_model(tok)
    base.save_pretrained(tmp_path / "init")
    init = torch.cat([p.detach().double().flatten() for _, p in base.named_parameters()])
    trl_cls, cfg, ours_cls, ours_cfg = {
        "grpo": (GRPOTrainer, GRPOConfig, SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig),
        "rloo": (RLOOTrainer, RLOOConfig, SharedPrefixRLOOTrainer, SharedPrefixRLOOConfig),
    }[kind]
    theirs = {k: v for k, v in settings.items() if not k.startswith("sharedprefix_")}
    want = _update(plain_rows(trl_cls), cfg, str(tmp_path / "init"), tok, tmp_path / "exact", **theirs) - init
    pads = []
    got = _update(_counting_pads(ours_cls, pads), ours_cfg, str(tmp_path / "init"), tok, tmp_path / "ours", **settings)
    assert max(pads) > 0  # the hook was given left-padded prompts
    scale = float(want.abs().max())
    assert scale > 1e-3
    err = float((got - init - want).abs().max())
    assert err <= 1e-9 * scale, (err, scale)  # measured 2.3e-15 (GRPO), 1.0e-15 (RLOO) of the update


@pytest.mark.slow
def test_absolute_positions_warn_and_follow_generation_not_trl(tmp_path):
    """GPT-2 numbers positions over TRL's left padding; ours scores each row from its first token, as generation
    sampled it: the exact run's parameters to 1e-9, where GRPOTrainer's own are 0.25 of the update away."""
    tok = build_tokenizer()
    base = gpt2_model(tok)
    base.save_pretrained(tmp_path / "init")
    init = torch.cat([p.detach().double().flatten() for _, p in base.named_parameters()])
    path = str(tmp_path / "init")
    want = _update(plain_rows(GRPOTrainer), GRPOConfig, path, tok, tmp_path / "exact") - init
    trl = _update(GRPOTrainer, GRPOConfig, path, tok, tmp_path / "trl") - init
    pads = []
    got = _update(_counting_pads(SharedPrefixGRPOTrainer, pads), SharedPrefixGRPOConfig, path, tok, tmp_path / "ours")
    assert max(pads) > 0
    scale = float(want.abs().max())
    assert float((got - init - want).abs().max()) <= 1e-9 * scale  # measured 1.9e-15
    assert float((trl - want).abs().max()) > 1e-2 * scale  # TRL's own: measured 0.25


def test_padding_dependent_positions_warn_when_built(tmp_path):
    """The probe warns for GPT-2 (absolute positions over the padding) and not for Qwen3 (rotary), in float32."""
    tok = build_tokenizer()
    caught = {}
    for name, model in (("gpt2", gpt2_model(tok)), ("qwen3", qwen3_model(tok))):
        out = str(tmp_path / name)
        args = SharedPrefixGRPOConfig(
            output_dir=out, num_generations=4, per_device_train_batch_size=8, report_to=[], use_cpu=True
        )
        with warnings.catch_warnings(record=True) as caught[name]:
            warnings.simplefilter("always")
            SharedPrefixGRPOTrainer(
                model=model, reward_funcs=reward, args=args, train_dataset=dataset(), processing_class=tok
            )
    assert [w for w in caught["gpt2"] if re.search(WARNING, str(w.message))]
    assert not [w for w in caught["qwen3"] if "left-padded row" in str(w.message)]
