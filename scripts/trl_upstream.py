"""Run one of TRL's own trainer test files twice: as is, and with TRL's trainer and config swapped for ours.

Usage (TRL's tests are not in its pip package: take them from a checkout, or from a bare git directory such as the
one the ``fetch`` tool leaves under /work/.mirror)::

    PYTHONPATH=src python scripts/trl_upstream.py tests/test_rloo_trainer.py \\
        --git-dir /work/.mirror/huggingface+trl/repo -k "TestRLOOTrainer and not vllm" [--timeout 1200]
    PYTHONPATH=src python scripts/trl_upstream.py /path/to/trl/tests/test_grpo_trainer.py -k ...

It copies the test file with TRL's ``tests/__init__.py``, ``conftest.py`` (its fixtures: ``use_cpu`` forced without
an accelerator, so TRL's default ``bf16=True`` runs as CPU autocast), ``testing_utils.py`` and
``testing_constants.py`` into a scratch folder, adds a ``conftest.py`` of its own above them and runs pytest twice
(once as is, once swapped), then prints one row per test: ``pass/pass``, ``pass/FAIL`` (fails only with ours: a
bug), ``fail/pass``, ``fail/fail``, ``skip/skip``, ... It exits 1 when some test fails only with ours.

Stand-ins, because nothing can be downloaded: every ``trl-internal-testing/<name>`` the file names is built in the
scratch folder under that relative path, which transformers and datasets read as a local folder (the runs start
there, offline):

- ``tiny-<ModelClass>[-suffix]``: that transformers class on the sharedprefix zoo's tiny config of its model type
  (random weights, seed 0), with a tokenizer built here: byte-level BPE without merges, filler tokens up to the
  Qwen2.5 special ids (``<|endoftext|>`` 151643 = pad, ``<|im_start|>`` 151644, ``<|im_end|>`` 151645 = eos, as
  TRL's tests hard-code them) and TRL's own chat template of the family (``trl/chat_templates``). Sequence
  classifiers get one label. Classes it cannot build (remote code, vision-language models) are left out: their
  tests fail for both runs.
- ``zen``: built by TRL's own ``scripts/generate_zen_dataset.py`` (read from the same place as the tests), its train
  splits cut to ``--train-rows`` rows (default 4, for time; 0 keeps all, which the tests that count steps over the
  whole dataset need). Stand-ins are rebuilt only in a fresh scratch folder: pass a new ``--keep`` after changing it.

The conftest also gives ``trl.import_utils`` the availability checks a newer ``testing_utils.py`` imports and the
installed TRL lacks, each reporting False (the tests that need them skip). ``--swap on`` replaces
``trl.GRPOTrainer``/``GRPOConfig`` and ``trl.RLOOTrainer``/``RLOOConfig`` by the sharedprefix
classes before the test file is imported; every assertion of the file is kept.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import xml.etree.ElementTree as ET
from pathlib import Path

SUPPORT = ("tests/__init__.py", "tests/conftest.py", "tests/testing_utils.py", "tests/testing_constants.py")
TEMPLATES = {  # model type -> TRL's chat template
    "qwen2": "qwen2_5",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "cohere2": "cohere2",
    "gpt_oss": "gptoss",
    "glm4_moe": "glm4moe",
    "llama": "llama3_2",
    "nemotron_h": "nemotron_3_nano",
}
PAD, IM_START, EOS = 151643, 151644, 151645
VOCAB = 151936

CONFTEST = r"""
import importlib
import os
import pathlib
import re

_utils = importlib.import_module("trl.import_utils")

# testing_utils of a newer TRL may import availability checks the installed TRL lacks: they report False
_src = (pathlib.Path(__file__).parent / "tests" / "testing_utils.py").read_text()
_block = re.search(r"from trl\.import_utils import \((.*?)\)", _src, re.S)
for _name in re.findall(r"\w+", _block.group(1)) if _block else []:
    if not hasattr(_utils, _name):
        setattr(_utils, _name, lambda: False)

if os.environ.get("SP_SWAP") == "on":
    import trl
    import sharedprefix.integrations.trl as ours
    trl.GRPOTrainer, trl.GRPOConfig = ours.SharedPrefixGRPOTrainer, ours.SharedPrefixGRPOConfig
    trl.RLOOTrainer, trl.RLOOConfig = ours.SharedPrefixRLOOTrainer, ours.SharedPrefixRLOOConfig
"""


def build_tokenizer(template: str | None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab.update({f"<extra_{i}>": i for i in range(len(vocab), PAD)})
    vocab.update({"<|endoftext|>": PAD, "<|im_start|>": IM_START, "<|im_end|>": EOS})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    if template:
        import trl

        fast.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja").read_text()
    return fast


def build_model(name: str, folder: Path) -> bool:
    """The stand-in for ``trl-internal-testing/<name>`` saved in ``folder``; False when it is not built here."""
    import torch
    import transformers

    from sharedprefix.tools.zoo.configs import tiny_config

    cls = getattr(transformers, re.sub(r"-.*$", "", name.removeprefix("tiny-")), None)
    if cls is None or "ForConditionalGeneration" in name:
        return False
    model_type = cls.config_class.model_type
    cfg = tiny_config(model_type)
    cfg.vocab_size = VOCAB
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = PAD, EOS, None
    if "SequenceClassification" in name:
        cfg.num_labels = 1
    torch.manual_seed(0)
    cls(cfg).save_pretrained(folder)
    build_tokenizer(TEMPLATES.get(model_type, "qwen2_5")).save_pretrained(folder)
    return True


def build_zen(folder: Path, generator: str, train_rows: int) -> None:
    """``zen`` as TRL's ``scripts/generate_zen_dataset.py`` (``generator``, its source) builds it, every
    configuration saved as a local dataset folder, the train splits cut to ``train_rows`` rows (0: all)."""
    import datasets

    configs = {}
    module = types.ModuleType("zen_generator")  # registered: its dataclasses look their module up
    sys.modules[module.__name__] = module
    exec(compile(generator, "generate_zen_dataset.py", "exec"), module.__dict__)
    namespace = module.__dict__
    original = datasets.DatasetDict.push_to_hub
    datasets.DatasetDict.push_to_hub = lambda self, repo_id, config_name, **kw: configs.__setitem__(config_name, self)
    try:
        namespace["main"](0.1, True, "local")
    finally:
        datasets.DatasetDict.push_to_hub = original
    card = ["---", "configs:"]
    for config, splits in configs.items():
        card += [f"- config_name: {config}", "  data_files:"]
        for split, data in splits.items():
            if split == "train" and train_rows:
                data = data.select(range(min(train_rows, len(data))))
            data.to_json(folder / config / f"{split}.jsonl")
            card += [f"  - split: {split}", f"    path: {config}/{split}.jsonl"]
    (folder / "README.md").write_text("\n".join(card + ["---", ""]))


def read(rel: str, test_file: str, git_dir: str | None) -> str:
    """``rel`` (a path in TRL's repository) from ``git_dir``'s HEAD, or beside the checkout's ``test_file``."""
    if git_dir:
        out = subprocess.run(["git", "--git-dir", git_dir, "show", f"HEAD:{rel}"], capture_output=True, text=True)
        return out.stdout
    src = Path(test_file).resolve().parents[1] / rel
    return src.read_text() if src.exists() else ""


def prepare(test_file: str, git_dir: str | None, work: Path, train_rows: int) -> Path:
    """The scratch folder: TRL's test file and support files under ``tests/``, our conftest, the stand-ins."""
    (work / "tests").mkdir(parents=True)
    for rel in (f"tests/{Path(test_file).name}", *SUPPORT):
        (work / "tests" / Path(rel).name).write_text(read(rel, test_file, git_dir))
    (work / "conftest.py").write_text(CONFTEST)  # beside TRL's own tests/conftest.py, loaded before it
    source = (work / "tests" / Path(test_file).name).read_text()
    for name in sorted(set(re.findall(r"trl-internal-testing/([\w.\-]+)", source))):
        target = work / "trl-internal-testing" / name
        if target.exists():
            continue
        if name == "zen":
            build_zen(target, read("scripts/generate_zen_dataset.py", test_file, git_dir), train_rows)
        elif name.startswith("tiny-") and not build_model(name, target):
            print(f"stand-in not built: trl-internal-testing/{name}", file=sys.stderr)
    return work / "tests" / Path(test_file).name


def run(test: Path, swap: str, keyword: str | None, timeout: int) -> dict[str, str]:
    """pytest on ``test`` from its scratch folder; {test id: pass | fail | skip}."""
    xml = test.parent / f"junit-{swap}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", str(test)]
    cmd += ["-k", keyword] if keyword else []
    env = {**os.environ, "SP_SWAP": swap, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH", "")])
    with open(test.parent / f"log-{swap}.txt", "w") as log:
        subprocess.run(cmd, cwd=test.parent.parent, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "skip" if "skipped" in kinds else "fail" if kinds & {"failure", "error"} else "pass"
        results[f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"] = outcome
    return results


def table(plain: dict[str, str], ours: dict[str, str]) -> str:
    rows, counts = [], {}
    for name in sorted(set(plain) | set(ours)):
        a, b = plain.get(name, "-"), ours.get(name, "-")
        cell = f"{a}/{'FAIL' if (a, b) == ('pass', 'fail') else b}"
        counts[cell] = counts.get(cell, 0) + 1
        rows.append(f"{cell:12} {name}")
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    return "\n".join(["TRL / ours   test", *rows, "", summary])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("test_file", help="TRL's test file: a path, or with --git-dir a path inside that repository")
    p.add_argument("--git-dir", help="a bare git directory of TRL (its HEAD is read)")
    p.add_argument("-k", dest="keyword", help="pytest -k expression selecting the tests")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--train-rows", type=int, default=4, help="rows of zen's train splits (0: all), for time")
    p.add_argument("--keep", help="scratch folder to use and keep (logs, junit files; its stand-ins are reused)")
    args = p.parse_args(argv)
    work = Path(args.keep or tempfile.mkdtemp(prefix="trl-upstream-"))
    if (work / "tests").exists():  # a kept folder: fresh tests, stand-ins reused
        shutil.rmtree(work / "tests")
    test = prepare(args.test_file, args.git_dir, work, args.train_rows)
    plain = run(test, "off", args.keyword, args.timeout)
    ours = run(test, "on", args.keyword, args.timeout)
    print(table(plain, ours))
    print(f"logs: {work / 'tests'}")
    return 1 if any(plain.get(n) == "pass" and ours.get(n) == "fail" for n in plain) else 0


if __name__ == "__main__":
    sys.exit(main())
