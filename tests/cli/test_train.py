"""`sharedprefix train`: a short run, resume without losing or repeating a step, and bad input."""

import json
import math
import os

import pytest
import torch

from sharedprefix.cli.main import main
from sharedprefix.recipes.grpo.loop import TrainConfig, Trainer, check_rewards, encode_prompt, read_metrics
from sharedprefix.recipes.grpo.run import load_model
from sharedprefix.recipes.grpo.tasks import KeyValueTask, build_tokenizer
from tests.cli.runs import train_args
from tests.cli.weights import assert_same_weights


def _run(out, steps, *extra):
    return main(train_args(steps, "--checkpoint-every", "2", "--output", str(out), *extra))


def test_short_run_writes_metrics_plot_and_checkpoint(tmp_path, capsys):
    assert _run(tmp_path / "r", 4) == 0
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(0 <= r["reward"] <= 1.2 and r["tokens_computed"] < r["tokens_plain"] for r in rows)
    assert (tmp_path / "r" / "reward.png").stat().st_size > 1000
    assert (tmp_path / "r" / "checkpoint" / ".complete").exists()
    assert not (tmp_path / "r" / "checkpoint.tmp").exists() and not (tmp_path / "r" / "checkpoint.old").exists()
    state = torch.load(tmp_path / "r" / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 4 and state["warm_done"] and state["optimizer"]["state"]
    # the final model and the last checkpoint's model are the same weights
    assert_same_weights(tmp_path / "r" / "model", tmp_path / "r" / "checkpoint" / "model")
    out = capsys.readouterr().out
    assert "GRPO steps" in out and f"trained model and tokenizer (save_pretrained): {tmp_path / 'r' / 'model'}" in out


def test_resume_neither_loses_nor_repeats_a_step(tmp_path):
    assert _run(tmp_path / "full", 6) == 0
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert _run(tmp_path / "cut", 4) == 0
    # a crash after logging step 4 but before its checkpoint: the resumed run must redo step 4 once
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**full[4], "reward": -1.0}) + "\n")
    assert _run(tmp_path / "cut", 6) == 0
    cut = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert [r["step"] for r in cut] == list(range(6))
    assert [r["reward"] for r in cut] == [r["reward"] for r in full]
    assert_same_weights(tmp_path / "full" / "model", tmp_path / "cut" / "model")


def test_missing_model_folder_is_refused_before_writing(tmp_path, capsys):
    assert _run(tmp_path / "out", 2, "--model", str(tmp_path / "nope")) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_non_causal_lm_folder_is_refused(tmp_path, capsys):
    import transformers as tf

    tf.ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8).save_pretrained(
        tmp_path / "vit"
    )
    assert _run(tmp_path / "out", 2, "--model", str(tmp_path / "vit")) == 2
    assert "'vit' model, which is not a causal LM" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_config_file_and_unknown_option(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(
        json.dumps(
            {
                "steps": 2,
                "records": 8,
                "group_size": 4,
                "prompts_per_step": 2,
                "warmup_steps": 1,
                "bench": False,
                "output": str(tmp_path / "o"),
            }
        )
    )
    assert main(["train", "--config", str(cfg)]) == 0
    assert len(read_metrics(tmp_path / "o" / "metrics.jsonl")) == 2
    cfg.write_text(json.dumps({"stepz": 2}))
    assert main(["train", "--config", str(cfg)]) == 2
    assert "unknown options ['stepz']" in capsys.readouterr().err
    assert main(["train", "--group-size", "1", "--output", str(tmp_path / "g")]) == 2
    assert "GRPO needs at least 2" in capsys.readouterr().err


def test_bad_prompt_and_rewards():
    tok = build_tokenizer()
    with pytest.raises(ValueError, match="tokenizes to no tokens"):
        encode_prompt(tok, "")
    with pytest.raises(ValueError, match="returned 2 values for 3 completions"):
        check_rewards([1.0, 0.0], 3)
    with pytest.raises(ValueError, match="returned nan for completion 1"):
        check_rewards([1.0, math.nan, 0.0], 3)


def test_bad_reward_function_stops_before_the_update(tmp_path):
    cfg = TrainConfig(records=8, prompts_per_step=2, group_size=4, output=str(tmp_path))
    tok = build_tokenizer()
    model = load_model(cfg, tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(cfg, model, tok, KeyValueTask(records=8), reward_fn=lambda comps, answers: [0.0] * 3)
    with pytest.raises(ValueError, match="returned 3 values for 8 completions"):
        trainer.train_step()
    assert trainer.step == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not os.listdir(tmp_path)


def test_local_checkpoint_folder_trains(tmp_path):
    cfg = TrainConfig()
    tok = build_tokenizer()
    load_model(cfg, tok).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    assert _run(tmp_path / "out", 2, "--model", str(tmp_path / "ckpt")) == 0
    assert len(read_metrics(tmp_path / "out" / "metrics.jsonl")) == 2
