"""Built-in tasks with a long shared context and a verifiable reward, and the local tokenizer.

``kv``: the prompt is a document of R key-value records followed by ``? k`` naming one key;
the answer is that key's value. Values follow a fixed hidden table (the same key always has
the same value, 8 values), so the policy can improve either by reading the document or by
learning the table. Reward: 1.0 when the first answer token is the right value, plus 0.2
when the answer then stops (EOS). The prompt is 3R + 2 tokens (``k v ;`` per record), shared
by the G completions, which are 1 to 3 tokens.

The tokenizer is built locally (no download): a word-level vocabulary of the task's tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "?", ":", ";"]


def build_tokenizer(n_keys: int = 64, n_values: int = 16) -> PreTrainedTokenizerFast:
    words = SPECIALS + [f"k{i}" for i in range(n_keys)] + [f"v{i}" for i in range(n_values)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.padding_side = "left"
    return fast


@dataclass
class Sample:
    prompt: str
    answer: str


class KeyValueTask:
    """Documents of ``records`` key-value pairs and a question about one of them."""

    name = "kv"

    def __init__(self, records: int = 48, n_keys: int = 64, n_values: int = 8, seed: int = 1234):
        if records < 1 or records > n_keys:
            raise ValueError(f"records={records}; expected 1 <= records <= n_keys={n_keys} (keys are distinct).")
        self.records, self.n_keys, self.n_values = records, n_keys, n_values
        table_rng = random.Random(seed)
        self.table = [table_rng.randrange(n_values) for _ in range(n_keys)]

    def sample(self, rng: random.Random) -> Sample:
        keys = rng.sample(range(self.n_keys), self.records)
        doc = " ; ".join(f"k{k} v{self.table[k]}" for k in keys)
        q = rng.choice(keys)
        return Sample(prompt=f"<bos> {doc} ? k{q}", answer=f"v{self.table[q]}")

    def reward(self, completion: str, answer: str) -> float:
        words = completion.split()
        if not words or words[0] != answer:
            return 0.0
        return 1.0 + (0.2 if len(words) == 1 or words[1] == "<eos>" else 0.0)

    def warmup_target(self, rng: random.Random) -> str:
        """A well-formed answer with a random value: teaches the format, not the values."""
        return f"v{rng.randrange(self.n_values)} <eos>"


TASKS = {"kv": KeyValueTask}


def make_task(name: str, **kw):
    if name not in TASKS:
        raise ValueError(f"task={name!r}; expected one of {sorted(TASKS)}.")
    return TASKS[name](**kw)
