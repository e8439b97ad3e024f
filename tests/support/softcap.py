"""Gemma 2's eager attention with a float64 softmax, so that its plain float64 forward (soft-capped scores, which
SDPA cannot take) is float64 throughout: patch it over ``modeling_gemma2.eager_attention_forward``."""

import torch
from transformers.models.gemma2 import modeling_gemma2


def eager64(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """Gemma 2's eager attention with the softmax in the inputs' dtype (float64 here) instead of float32."""
    key = modeling_gemma2.repeat_kv(key, module.num_key_value_groups)
    value = modeling_gemma2.repeat_kv(value, module.num_key_value_groups)
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.softmax(w, dim=-1)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w
