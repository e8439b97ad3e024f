"""What one attention layer computes, read from the probe and the layer's own attributes: its sliding window, its
attention chunk, Llama 4's query temperature, and the refusal of soft-capping on a backend without it.

Shapes as transformers passes them: query (1, H, L, D), L the packed row.
"""

from __future__ import annotations

import torch

from sharedprefix.attention import probe
from sharedprefix.attention.kernels import flex


def softcap_refusal(name: str, softcap: float, backend: str) -> str:
    """The refusal of attention-score soft-capping on a backend without it (the CUDA flash ops)."""
    return (
        f"{name} uses attention-score soft-capping (softcap={softcap}), which the attention backend {backend!r} "
        "cannot compute: torch's own CUDA flash kernels have no soft-capping. Install the flash-attn package "
        "(its varlen kernels take softcap) and pass backend='flash_attn', or run on the CPU ('cpu' computes it "
        "exactly); do not set config.attn_logit_softcapping=None unless the model was trained without it."
    )


def softcap_refusal_on(name: str, softcap: float | None, impl, device) -> str | None:
    """The refusal of soft-capping ``softcap`` with the primitive ``impl`` on ``device``, or None where it is computed:
    by the primitive itself, or, where the primitive cannot, by FlexAttention (``kernels.flex``, CUDA)."""
    if softcap is None or getattr(impl, "SOFTCAP", False) or (why := flex.unavailable(device)) is None:
        return None
    return softcap_refusal(name, softcap, impl.name) + f" (FlexAttention is no way out here: {why}.)"


def _temperature(module, x: torch.Tensor) -> torch.Tensor:
    """Llama 4's query temperature of row index or position ``x``, float32 as the model computes it."""
    return torch.log1p(torch.floor((x.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def index_to_position_temperature(module, query: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Llama 4's NoPE layers (``attn_temperature_tuning``) scale each query by log1p(floor((i + 1) / floor_scale))
    * attn_scale + 1 of its index i in the row (arXiv 2501.19399), which in a plain row is its position. In a packed
    row the index is not the position: rescale (1, H, L, D) ``query`` by t(position) / t(index), once, in float32
    (float64 for a float64 model); exact up to that one rounding, and autograd carries the factor to dQ."""
    idx = torch.arange(query.shape[2], device=query.device)
    pos = position_ids[0].to(query.device)
    t_pos, t_idx = _temperature(module, pos), _temperature(module, idx)
    if torch.equal(t_pos, t_idx):  # rows shorter than floor_scale: every factor is 1
        return query
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    ratio = t_pos.to(acc) / t_idx.to(acc)
    return (query.to(acc) * ratio[None, None, :, None]).to(query.dtype)


def layer_window(module, passed: int | None) -> int | None:
    """The sliding window (tokens) of this layer, None when it has none.

    What the plain forward does comes from the masks transformers builds for the layer (``attention.probe``,
    run once per model before any pass); ``config.layer_types`` and a window the layer passes must agree with
    it.
    """
    name = type(module).__name__
    pat = layer_pattern(module)
    cfg = getattr(module, "config", None)
    types = getattr(cfg, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    kind = str(types[idx]) if types is not None and isinstance(idx, int) and idx < len(types) else None
    desc = {
        "full": "causal without a window",
        "sliding": f"a sliding window of {pat.size} tokens",
        "chunked": f"chunks of {pat.size} positions",
    }[pat.kind]
    said = f"config.layer_types says {kind!r} and " if kind is not None else ""
    expected = {"sliding_attention": "sliding", "chunked_attention": "chunked"}.get(kind or "")
    if expected is not None and pat.kind != expected:
        raise ValueError(
            f"{name} (layer {idx}): config.layer_types says {kind!r}, but the plain forward's mask for this layer is "
            f"{desc} on a short row, so sharedprefix cannot see the layer's window or chunk and refuses the model."
        )
    window = pat.size if pat.kind == "sliding" else None
    if passed is not None and (window is None or int(passed) != window):
        raise ValueError(
            f"{name} (layer {idx}) passes sliding_window={passed} to attention, but {said}the plain forward's mask "
            f"for this layer is {desc}; the two disagree and sharedprefix refuses rather than pick one. Fix the "
            "model's configuration."
        )
    return window


def layer_chunk(module) -> int | None:
    """The attention chunk (positions) of this layer, None when it has none: a query at position p sees the keys
    at positions floor(p / chunk) * chunk .. p (Llama 4). The chunk boundaries are positions, so a completion
    continues its prompt's chunk (``layout.calls``)."""
    pat = layer_pattern(module)
    return pat.size if pat.kind == "chunked" else None


def layer_pattern(module) -> probe.LayerPattern:
    pat = probe.pattern(module)
    if pat is None:
        raise RuntimeError(
            f"{type(module).__name__}: its model was not probed (model.checks.verify_head) before a sharedprefix pass, "
            "so the layer's window is unknown. This is a bug in the caller: every pass must follow verify_head."
        )
    return pat
