"""SharedPrefixGRPOTrainer built for the tests: the key-value task's reward and dataset, a tiny model of a zoo config
with the tokenizer's special tokens, and the trainer built (not trained) with warnings silenced. Needs trl and
datasets: import it after ``pytest.importorskip`` of both."""

import warnings

import torch

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


def build_trainer(model, tok, tmp_path, **kw):
    """A SharedPrefixGRPOTrainer on ``dataset()`` and ``reward`` (CPU, float32, groups of 4); ``kw``: settings to add."""
    args = SharedPrefixGRPOConfig(
        output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=8, report_to=[], use_cpu=True, **{"bf16": False, **kw}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SharedPrefixGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset(), processing_class=tok)


def tiny_for_tokenizer(model_type: str, tok, cls):
    """``cls`` on the zoo's tiny config of ``model_type``, with ``tok``'s vocabulary and special tokens (seed 0)."""
    cfg = tiny_config(model_type)
    cfg.vocab_size = len(tok)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(0)
    return cls(cfg)
