"""Tiny models built for one feature, shared by the tests of several packages."""

import torch
import transformers

from sharedprefix.tools.zoo.configs import entries, float64_norms, tiny_config


def dsa_model(entry="deepseek_v32", **overrides):
    """The zoo's tiny ``entry`` (index_topk 4, 16 index heads), dense MLPs, float64 norms, its plain attention SDPA
    where the model has it (eager softmax is float32 in DeepSeek-V3.2) and eager otherwise."""
    cfg = tiny_config(entry)
    tc = cfg.get_text_config()
    tc.mlp_layer_types = ["dense"] * len(tc.mlp_layer_types)
    for k, v in overrides.items():
        setattr(tc, k, v)
    cls = getattr(transformers, entries()[entry])
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation="sdpa" if cls._supports_sdpa else "eager")
    model = model.to(torch.float64).eval()
    float64_norms(model)
    return model
