"""The README's quickstart, runnable: verify a model, then one GRPO step with ``sp.logprobs`` and ``sp.backward``.

    python examples/core_api.py                          # a tiny random-weight Qwen3 (no download), on CPU
    python examples/core_api.py --model Qwen/Qwen3-0.6B  # the README's model, loaded with from_pretrained

With ``--model`` this is the README's quickstart (``tests/test_examples.py`` checks that the two make the same
calls). Without it, the model is a two-layer Qwen3 built from a
config with random weights and the tokenizer is the package's word-level one (words ``k0..k63``, ``v0..v15``), so
that the script runs anywhere in seconds; the calls into sharedprefix are the same.
"""

import argparse

import torch
import transformers as tf

import sharedprefix as sp
from sharedprefix.losses import group_advantages, normalizer, policy_loss

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", help="a transformers causal LM to load with from_pretrained (default: a tiny one)")
args = parser.parse_args()

if args.model:
    tok = tf.AutoTokenizer.from_pretrained(args.model)
    model = tf.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    prompt_text, answers = "Question: what is 6 x 7? Think, then answer.\nAnswer:", [" 42", " 36", " 42.", " forty-two"]
else:
    from sharedprefix.recipes.grpo.tasks import build_tokenizer

    tok = build_tokenizer()
    config = tf.Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(config)
    prompt_text, answers = "<bos> k3 v5 ; k17 v2 ; k40 v7 ? k17", ["v2 <eos>", "v5 <eos>", "v2", "v7 v7 <eos>"]

# 1. Is sharedprefix exact on this model? Random groups through it and through the plain forward, judged by the
#    2x rule against a float64 copy; a refused model says why.
report = sp.verify(model)
print(report)
assert report.ok, report

# 2. A group: one prompt, G = 4 sampled completions (token ids), and their rewards.
prompt = tok(prompt_text, add_special_tokens=False)["input_ids"]
completions = [tok(a, add_special_tokens=False)["input_ids"] for a in answers]
groups = [sp.Group(prompt=prompt, completions=completions)]
rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])

# 3. Old-policy log-probs: (N, T) for the N = 4 completions, each prompt computed once.
with torch.no_grad():
    old = sp.logprobs(model, groups)
advantages = group_advantages(rewards, group_size=4)
norm = normalizer("grpo", old.mask)  # a global normaliser, so the loss is additive over completions


def loss_fn(batch):  # batch: .logprobs, .mask (n, T) and .index (n,) into the N completions
    loss, _ = policy_loss(batch.logprobs, old.logprobs[batch.index], advantages[batch.index], batch.mask, norm)
    return loss


# 4. The policy gradient, the prompt computed once, at most max_tokens tokens per pass.
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
res = sp.backward(model, groups, loss_fn, max_tokens=4096)
optimizer.step()
print(f"loss {res.loss:+.3e}: {res.tokens_computed} tokens computed, a plain run computes {res.tokens_plain}")
