"""The hybrid benchmark (``sharedprefix bench --hybrid``): a model whose layers mix tokens outside attention.

Shape: the speed benchmark's group (prompt 2048, G = 8 completions of 128) on a Qwen3.5-style architecture (hidden
512, gated delta-net and attention layers 3:1, 8/4 attention heads of 64, delta-net 4 key / 8 value heads of 64,
vocab 32000), random weights, float32, forward+backward. Three runs in the same process:

- plain: the G rows ``[prompt + completion_i]`` in one batch, logits at completion positions only;
- packed: ``sp.backward``, the packed path (``model.mixers``): the prompt once, every completion in the same row,
  each from the prompt's final conv inputs and recurrent state;
- cache path: ``schedule.hybrid.backward`` (the path these models took before, still the one of LFM3,
  MiniMax and others): the prompt once through the model's own cache-aware forward, the completions as right-padded rows
  from copies of its cache.

Reported against the token ratio (tokens a plain run computes / tokens sharedprefix computes), the ratio a run bound
by its per-token layers would reach.
"""

from __future__ import annotations

import torch

from sharedprefix.tools import bench


def hybrid_model(layers=4, dtype=torch.float32, seed=0):
    import transformers as tf

    types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4) + ["linear_attention"] * (layers % 4)
    cfg = tf.Qwen3_5TextConfig(
        hidden_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        intermediate_size=1536,
        vocab_size=32000,
        max_position_embeddings=16384,
        layer_types=types,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return tf.Qwen3_5ForCausalLM(cfg).to(dtype).eval()


def cache_path_step(model, groups):
    """The cache-driven path these families took before the packed one (``schedule.hybrid``)."""
    from sharedprefix.schedule import hybrid

    return hybrid.backward(model, groups, bench._loss, None, "keep", 1.0, False, "cpu")


def run(layers=4, repeats=2, prompt=2048, completion=128, G=8) -> list[str]:
    model = hybrid_model(layers)
    groups = bench.make_groups(1, prompt, completion, G)

    def step(fn):
        return lambda: (model.zero_grad(set_to_none=True), fn(model, groups))

    t_plain = bench.best_time(step(bench.plain_step), repeats)  # each after one warm-up call
    t_ours = bench.best_time(step(bench.shared_step), repeats)
    t_cache = bench.best_time(step(cache_path_step), repeats)
    plain_tokens, ours_tokens = G * (prompt + completion), prompt + G * completion
    return [
        f"model: Qwen3.5-style, hidden 512, {layers} layers ({', '.join(model.config.layer_types)}), float32, cpu",
        f"group: prompt {prompt}, G={G} completions of {completion} tokens; forward+backward, best of {repeats}",
        f"plain run (rows in one batch, logits_to_keep): {t_plain:8.3f} s   tokens {plain_tokens}",
        f"sharedprefix, packed path                   : {t_ours:8.3f} s   tokens {ours_tokens}",
        f"old cache path (schedule.hybrid)            : {t_cache:8.3f} s   tokens {ours_tokens} (completions padded)",
        f"speed-up over plain {t_plain / t_ours:.2f}x | over the cache path {t_cache / t_ours:.2f}x | "
        f"token ratio {plain_tokens / ours_tokens:.2f}x | packed / token ratio {(t_plain / t_ours) / (plain_tokens / ours_tokens):.2f}",
    ]
