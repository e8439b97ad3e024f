"""Agentic rows as a prefix tree: one system prompt shared by every row, multi-turn rollouts that branch.

    python examples/agentic_tree.py

Eight rows: two tasks, each with a user turn after the same system prompt (and tool schemas), each rolled out
four times; every rollout is assistant turn, tool result, assistant turn, and the rollouts of a task share their
first assistant turn in pairs. ``sp.Tree.from_rows`` finds every shared prefix with a token trie, so the system
prompt runs once for all eight rows, each task's user turn once for its four, and each shared turn once for its
pair. Only the assistant turns are trained (``trained``); tool results get no log-prob. The script checks the
tree's log-probs against a plain forward of every row, then takes one policy-gradient step with per-row
advantages under a budget that splits the tree across passes.

The model is a tiny random-weight Qwen3 and the turns are random token ids, so that it runs anywhere in seconds;
with a real model, the rows are the tokenized conversations.
"""

import torch
import transformers as tf

import sharedprefix as sp

torch.manual_seed(0)
config = tf.Qwen3Config(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
model = tf.Qwen3ForCausalLM(config).double()  # float64, so that the check below can be tight


def turn(n):
    return torch.randint(0, config.vocab_size, (n,)).tolist()


system = turn(48)  # system prompt and tool schemas: the same for every row
rows, trained = [], []
for _task in range(2):  # two tasks
    user = turn(12)
    for _pair in range(2):  # two pairs of rollouts per task
        first = turn(6)  # the first assistant turn, shared by two rollouts
        for _ in range(2):
            tool, second = turn(5), turn(4)  # the tool's result (not trained), then the last assistant turn
            rows.append(system + user + first + tool + second)
            trained.append(
                [False] * len(system + user) + [True] * len(first) + [False] * len(tool) + [True] * len(second)
            )
tree = sp.Tree.from_rows(rows, trained=trained)

# Log-probs aligned with the rows: out.logprobs[i, t] = log p(rows[i][t] | rows[i][:t]) where trained, else 0.
with torch.no_grad():
    out = sp.logprobs(model, tree)
    for i, row in enumerate(rows):  # the plain computation, one row at a time
        ids = torch.tensor(row)[None]
        plain = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(trained[i][1:])
        assert torch.equal(out.mask[i, 1 : len(row)], mask)
        err = (out.logprobs[i, 1 : len(row)][mask] - plain[mask]).abs().max().item()
        assert err < 1e-9, f"row {i}: {err:.1e}"
print(f"log-probs of {len(rows)} rows equal to the plain per-row forward (float64, 1e-9)")

# One policy-gradient step: per-row advantages, loss additive over rows (a global normaliser).
advantages = torch.randn(len(rows), dtype=torch.float64)
norm = float(out.mask.sum())


def loss_fn(batch):  # batch: .logprobs, .mask (n, L) and .index (n,) into the rows
    return -(batch.logprobs * batch.mask * advantages[batch.index, None]).sum() / norm


res = sp.backward(model, tree, loss_fn, max_tokens=96)  # 96 tokens per pass: the tree is split across passes
print(
    f"loss {res.loss:+.3e} in {res.passes} passes: {res.tokens_computed} tokens computed, a plain run computes "
    f"{res.tokens_plain}"
)
