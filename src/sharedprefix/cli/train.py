"""GRPO with sharedprefix on an embedded default, or on a local model checkpoint.

With no arguments: a small Qwen3-architecture model built from the config shipped in the
package (random weights), a locally built tokenizer, and the ``kv`` task (a document of
key-value records and a question about one key; reward 1 for the right value). A short
supervised warm-up teaches the answer format with random values; GRPO then has to find the
values. Writes ``metrics.jsonl``, ``reward.png``, a checkpoint and the trained model to ``--output``
(``model/``: ``save_pretrained`` of the model and tokenizer, loadable by
``AutoModelForCausalLM.from_pretrained``; with ``--lora-r`` the LoRA adapter in PEFT's format),
and prints the speed-up of sharedprefix over the plain run measured on the same step shape.

Options come from flags or a JSON config file (``--config``; flags win). A run resumes from
its last checkpoint in ``--output`` unless ``--no-resume`` is given. Under ``torchrun`` each
rank trains on its own share of the groups (``sp.shard_groups``) and gradients are averaged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

HELP = "GRPO on an embedded default task and model (the main job)"


def add_arguments(p):
    from sharedprefix.recipes.grpo.config import TrainConfig

    p.add_argument("--config", help="JSON file with any of the options below")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",) or isinstance(f.default, bool):
            p.add_argument(flag, dest=f.name, action=argparse_bool(), default=None, help=f"(default {f.default})")
        else:
            p.add_argument(flag, dest=f.name, default=None, type=_parser(f), help=f"(default {f.default})")


def argparse_bool():
    import argparse

    return argparse.BooleanOptionalAction


def _parser(f):
    t = str(f.type)
    if "int" in t and "None" in t:
        return lambda s: None if s.lower() == "none" else int(s)
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def resolve_config(args):
    from sharedprefix.recipes.grpo.config import TrainConfig

    values = {}
    if args.config:
        if not os.path.isfile(args.config):
            raise ValueError(f"--config {args.config!r} does not exist; expected a JSON file of training options.")
        with open(args.config) as fh:
            values = json.load(fh)
        names = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"--config has unknown options {unknown}; known options are {sorted(names)}.")
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return TrainConfig(**values)


def run(args):
    from sharedprefix.recipes.grpo.run import train

    try:
        cfg = resolve_config(args)
        return train(cfg)
    except ValueError as e:
        print(f"sharedprefix train: error: {e}", file=sys.stderr)
        return 2
