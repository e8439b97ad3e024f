"""The trained model `sharedprefix train` writes to OUTPUT/model/: a save_pretrained folder with its tokenizer that
transformers loads (a PEFT adapter for a LoRA run), and the loading code of docs/train.md runs as written."""

import json
import random
import re
from pathlib import Path

import torch
import transformers as tf

from sharedprefix.cli.main import main
from sharedprefix.recipes.grpo.config import TrainConfig
from sharedprefix.recipes.grpo.run import load_model
from sharedprefix.recipes.grpo.tasks import KeyValueTask, build_tokenizer
from tests.cli.runs import train_args
from tests.cli.weights import assert_same_weights

RUN = train_args(2)
PAGE = Path(__file__).resolve().parents[2] / "docs" / "train.md"


def docs_code():
    """The python blocks of docs/train.md's section on loading the trained model."""
    text = PAGE.read_text()
    section = text[text.index("## Loading the trained model") :]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _initial_weights():
    return load_model(TrainConfig(), build_tokenizer()).state_dict()


def test_model_loads_with_auto_classes_and_samples_as_the_docs_show(tmp_path, capsys):
    out = tmp_path / "r"
    assert main([*RUN, "--output", str(out)]) == 0
    model = tf.AutoModelForCausalLM.from_pretrained(out / "model")
    tok = tf.AutoTokenizer.from_pretrained(out / "model")
    # the trained weights: those of the last checkpoint, and not the initial ones
    assert_same_weights(out / "model", out / "checkpoint" / "model")
    init = _initial_weights()
    trained = model.state_dict()
    assert sorted(trained) == sorted(init)
    assert sum(not torch.equal(trained[k], init[k]) for k in init) >= len(init) - 1
    # the tokenizer it was trained with
    ref = build_tokenizer()
    prompt = KeyValueTask(records=8).sample(random.Random(0)).prompt
    assert tok(prompt, add_special_tokens=False)["input_ids"] == ref(prompt, add_special_tokens=False)["input_ids"]
    assert (tok.eos_token_id, tok.pad_token_id) == (ref.eos_token_id, ref.pad_token_id)
    # the page's code, on this output folder
    capsys.readouterr()
    exec(docs_code()[0].replace("runs/default", str(out)), {})
    answer = capsys.readouterr().out.strip().split()
    assert 1 <= len(answer) <= 3 and all(w in ref.get_vocab() for w in answer)


def test_lora_run_writes_a_peft_adapter_of_its_base(tmp_path):
    out = tmp_path / "lora"
    assert main([*RUN, "--lora-r", "4", "--output", str(out)]) == 0
    cfg = json.loads((out / "model" / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", 4, 32)
    assert cfg["base_model_name_or_path"] == str(out / "base_model")
    assert not (out / "model" / "model.safetensors").exists()  # the adapter only
    assert_same_weights(out / "model", out / "checkpoint" / "model")
    # the base is the embedded default's initial model, untouched by training
    base = tf.AutoModelForCausalLM.from_pretrained(out / "base_model")
    init = _initial_weights()
    assert all(torch.equal(v, init[k]) for k, v in base.state_dict().items())
    # the page's code loads base and adapter; the trained adapter changes the outputs
    ns = {}
    exec(docs_code()[1].replace("runs/lora", str(out)), ns)
    merged = ns["model"]
    assert type(merged) is type(base)
    ids = torch.tensor(
        [
            build_tokenizer()(KeyValueTask(records=8).sample(random.Random(1)).prompt, add_special_tokens=False)[
                "input_ids"
            ]
        ]
    )
    with torch.no_grad():
        assert (merged(ids).logits - base(ids).logits).abs().max() > 1e-4
    # a LoRA run stopped after one step and resumed ends with the same adapter
    cut = tmp_path / "cut"
    assert main([*RUN, "--lora-r", "4", "--steps", "1", "--output", str(cut)]) == 0
    assert main([*RUN, "--lora-r", "4", "--output", str(cut)]) == 0
    assert_same_weights(out / "model", cut / "model")


def test_lora_on_a_local_model_names_that_folder_as_base(tmp_path):
    from peft import PeftModel

    tok = build_tokenizer()
    load_model(TrainConfig(), tok).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "out"
    assert main([*RUN, "--steps", "1", "--lora-r", "4", "--model", str(tmp_path / "ckpt"), "--output", str(out)]) == 0
    cfg = json.loads((out / "model" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tmp_path / "ckpt")
    assert not (out / "base_model").exists()
    model = PeftModel.from_pretrained(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt"), out / "model")
    assert any("lora_A" in n for n, _ in model.named_parameters())
