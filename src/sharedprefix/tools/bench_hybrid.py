"""The hybrid benchmark (``sharedprefix bench --hybrid``): a model whose layers mix tokens outside attention.

Shape: the speed benchmark's group (prompt 2048, G = 8 completions of 128) on an LFM2 architecture of the same
size (hidden 512, 4 layers alternating short convolutions and attention, 8/4 heads, vocab 32000), random weights,
float32, forward+backward. The plain run is the G rows ``[prompt + completion_i]`` in one batch with logits at
completion positions only; sharedprefix is the hybrid path (``schedule.hybrid``): the prompt once through the
model's own cache-aware forward, each completion from its final layer state. Reported against the token ratio
(tokens a plain run computes / tokens sharedprefix computes), the ratio a run bound by its per-token layers would
reach; attention's share of the FLOPs is smaller here than in the all-attention benchmark.
"""

from __future__ import annotations

import torch

from sharedprefix.tools import bench


def hybrid_model(layers=4, dtype=torch.float32, seed=0):
    import transformers as tf

    types = ["conv", "full_attention"] * (layers // 2) + ["conv"] * (layers % 2)
    cfg = tf.Lfm2Config(
        hidden_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1536,
        block_auto_adjust_ff_dim=False,
        vocab_size=32000,
        max_position_embeddings=16384,
        layer_types=types,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return tf.Lfm2ForCausalLM(cfg).to(dtype).eval()


def run(layers=4, repeats=2, prompt=2048, completion=128, G=8) -> list[str]:
    model = hybrid_model(layers)
    groups = bench.make_groups(1, prompt, completion, G)

    def step(fn):
        return lambda: (model.zero_grad(set_to_none=True), fn(model, groups))

    t_plain = bench.best_time(step(bench.plain_step), repeats)  # each after one warm-up call
    t_ours = bench.best_time(step(bench.shared_step), repeats)
    plain_tokens, ours_tokens = G * (prompt + completion), prompt + G * completion
    return [
        f"model: LFM2 hidden 512, {layers} layers ({', '.join(model.config.layer_types)}), 8/4 heads, vocab 32000, float32, cpu",
        f"group: prompt {prompt}, G={G} completions of {completion} tokens; forward+backward, best of {repeats}",
        f"plain run (rows in one batch, logits_to_keep): {t_plain:8.3f} s   tokens {plain_tokens}",
        f"sharedprefix (hybrid path)             : {t_ours:8.3f} s   tokens {ours_tokens}",
        f"speed-up {t_plain / t_ours:.2f}x | token ratio {plain_tokens / ours_tokens:.2f}x",
    ]
