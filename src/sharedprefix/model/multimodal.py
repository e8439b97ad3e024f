"""Vision-language prompts: the vision tower runs once per group, completions continue its positions.

A group's ``prompt_inputs`` are the processor's outputs for the prompt alone. The pass that
computes a prompt hands them to the model's own multimodal module (``model.model``: the vision
tower, the placeholder scatter, the language model), concatenated over the prompts of the row in
row order; passes without a prompt (completions reading cached K/V) run the same module without
them. Positions are the model's own: for M-RoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) the
prompt's 3-D positions come from the model's ``get_rope_index`` on the prompt alone, and every
later token of the group (completions, deeper segments) continues at ``1-D position + delta``
on all three axes, delta = (largest prompt position + 1) - P, exactly what the model computes for
the full row. Models without M-RoPE (Llava-style) keep 1-D positions.

Gemma 3's image tokens attend to each other bidirectionally: its ``token_type_ids`` (1 on image
tokens) become the row's ``blocks``, every maximal run of image tokens one block, which the
attention cascade completes with the block's later keys, under the model's own mask
AND(sliding window, OR(causal, same block)). Without ``token_type_ids`` the model's mask is causal,
and so is ours.

Refused: prompts that would be cut into a chain (raise ``max_tokens`` to hold the prompt), other
models that take ``token_type_ids`` (their masks differ: PaliGemma's prefix is bidirectional as a
whole), models whose multimodal module takes none of the given inputs, and inputs that cannot be
batched over the prompts of one pass (``check_batchable``: per-image inputs of different trailing
shapes, or an input that is not per image, such as MiniCPM-V's ``target_sizes``, beside another
group's inputs in the same pass).

Notation: L = row length, P = prompt length.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

# inputs concatenated over the prompts of a row (first dimension), as the processor batches them
_CAT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "image_sizes",
    "pixel_attention_mask",
    "image_grid_hws",
    "spatial_shapes",  # LFM2-VL (Siglip2): (images, 2) patch grids
    "image_grid_hw",  # Nemotron-H Omni: (images, 2) patch grids
)
# used for positions or the attention's blocks only (the pass hands positions and blocks themselves)
_POSITION_ONLY = ("mm_token_type_ids", "token_type_ids")


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


class Multimodal:
    """The multimodal module of ``model`` and the positions of the groups with ``prompt_inputs``."""

    def __init__(self, model, groups):
        name = type(model).__name__
        self.module: Any = getattr(model, "model", None)
        cfg = model.config
        if self.module is None or not hasattr(self.module, "get_input_embeddings"):
            raise ValueError(f"{name} has no multimodal base module (model.model); prompt_inputs are not supported.")
        accepted = _params(self.module.forward)
        gemma3 = getattr(cfg, "model_type", None) == "gemma3"
        if "token_type_ids" in accepted and not gemma3:
            raise ValueError(
                f"{name} takes token_type_ids, with which its attention mask is not causal (bidirectional image "
                "tokens or a bidirectional prefix); sharedprefix reproduces Gemma 3's image blocks only, and refuses "
                f"model_type={getattr(cfg, 'model_type', None)!r}, whose mask it has not verified."
            )
        self.blocks = {gi: _image_blocks(gi, g) for gi, g in enumerate(groups) if gemma3 and g.prompt_inputs}
        self.mrope = hasattr(self.module, "get_rope_index")
        used = {"token_type_ids"} if gemma3 else set()
        if self.mrope:
            used |= set(_POSITION_ONLY) & _params(self.module.get_rope_index)
        for gi, g in enumerate(groups):
            extra = sorted(set(g.prompt_inputs or {}) - (accepted - set(_POSITION_ONLY)) - used)
            if extra:
                raise ValueError(
                    f"groups[{gi}].prompt_inputs has {extra}, which {type(self.module).__name__}.forward does not "
                    f"take; expected some of {sorted(accepted & set(_CAT_KEYS))} (the processor's outputs for the "
                    "prompt)."
                )
        self.delta: dict[int, int] = {}
        self.prompt_pos: dict[int, torch.Tensor] = {}
        if self.mrope:
            rope_args = _params(self.module.get_rope_index)
            for gi, g in enumerate(groups):
                if not g.prompt_inputs:
                    continue
                kw = {k: _batched(k, v) for k, v in g.prompt_inputs.items() if k in rope_args}
                if "mm_token_type_ids" in rope_args and "mm_token_type_ids" not in kw:
                    raise ValueError(
                        f"groups[{gi}].prompt_inputs has no mm_token_type_ids, which {name} needs for its 3-D "
                        "positions; pass the processor's mm_token_type_ids for the prompt."
                    )
                dev = next(model.parameters()).device
                with torch.no_grad():
                    pos, delta = self.module.get_rope_index(
                        input_ids=g.prompt[None].to(dev), **{k: v.to(dev) for k, v in kw.items()}
                    )
                self.prompt_pos[gi] = pos[:, 0].cpu()  # (3, P)
                self.delta[gi] = int(delta.reshape(-1)[0])

    def positions(self, layout) -> torch.Tensor:
        """(1, L) 1-D positions, or (3, 1, L) M-RoPE positions of the row."""
        pos = layout.position_ids
        if not self.mrope:
            return pos
        segs = layout.tree.segments
        shift = torch.cat([torch.full((segs[s].length,), self.delta.get(segs[s].group, 0)) for s in layout.segments])
        out = (pos[0] + shift)[None, None].expand(3, 1, -1).clone()
        for gi, r, n in _row_prompts(layout):
            if gi in self.prompt_pos:
                out[:, 0, r : r + n] = self.prompt_pos[gi]
        return out

    def row_blocks(self, layout) -> list[tuple[int, int]]:
        """The bidirectional blocks of the prompts this row computes, as row ranges."""
        return [(r + a, r + b) for gi, r, _ in _row_prompts(layout) for a, b in self.blocks.get(gi, ())]

    def inputs(self, layout, groups) -> dict:
        """The prompt inputs of the prompts this row computes, concatenated in row order."""
        parts: dict[str, list] = {}
        for gi, _, _ in _row_prompts(layout):
            if gi < len(groups) and groups[gi].prompt_inputs:
                for k, v in groups[gi].prompt_inputs.items():
                    if k not in _POSITION_ONLY:
                        parts.setdefault(k, []).append(_batched(k, v) if k in _CAT_KEYS else v)
        return {k: torch.cat(v) if k in _CAT_KEYS else v[0] for k, v in parts.items()}


def check_batchable(groups, plan) -> None:
    """Refuse prompt inputs that one pass of ``plan`` could not batch. A pass batches the prompts it computes (its root
    segments) by concatenating each of ``_CAT_KEYS`` along its first dimension, which needs the same trailing shape in
    each of them; another input (not per image) is taken from one group, so it is refused where another group of the
    same pass has inputs too (MiniCPM-V's ``target_sizes``, whose pixels are packed along their last dimension).
    Groups whose prompts fall in different passes are never batched together, and are not refused."""
    segs = plan.tree.segments
    for p in plan.passes:
        together = sorted({segs[s].group for s in p.segments if segs[s].parent is None})
        _check_together(groups, [gi for gi in together if groups[gi].prompt_inputs])


def _check_together(groups, carriers: list[int]) -> None:
    """``check_batchable`` for one pass, whose prompts are those of ``groups[gi]`` for gi in ``carriers``."""
    having: dict[str, list[int]] = {}
    for gi in carriers:
        for k in groups[gi].prompt_inputs:
            if k not in _POSITION_ONLY:
                having.setdefault(k, []).append(gi)
    for k, gis in having.items():
        if k not in _CAT_KEYS and len(carriers) > 1:
            other = next(gi for gi in carriers if gi != gis[0])
            raise ValueError(
                f"groups[{gis[0]}].prompt_inputs has {k!r}, which sharedprefix does not know how to batch with "
                f"groups[{other}]'s inputs in one pass: the prompts of a pass are batched by concatenating "
                f"{list(_CAT_KEYS)} image by image, and {k!r} is none of them, so one pass could not give each prompt "
                "its own value. Pass the groups with this input in separate calls (or under a max_tokens that puts "
                "their prompts in separate passes)."
            )
    for k, gis in having.items():
        tensors = {gi: groups[gi].prompt_inputs[k] for gi in gis if k in _CAT_KEYS}
        shapes = {gi: tuple(_batched(k, v).shape[1:]) for gi, v in tensors.items() if isinstance(v, torch.Tensor)}
        first = min(shapes, default=-1)
        for gi, shape in shapes.items():
            if shape != shapes[first]:
                raise ValueError(
                    f"groups[{gi}].prompt_inputs[{k!r}] has shape {tuple(groups[gi].prompt_inputs[k].shape)}, "
                    f"groups[{first}]'s has trailing shape {shapes[first]}: the prompts of a pass are batched by "
                    "concatenating it along the first dimension, which needs the same other dimensions. Pad them "
                    "alike (one processor setting, e.g. the same max_num_patches, for every group)."
                )


def _row_prompts(layout):
    """(group, row offset, length) of every prompt the row computes (its root segments), in row order."""
    segs = layout.tree.segments
    for s in layout.segments:
        if segs[s].parent is None:
            yield segs[s].group, layout.row_start[s], segs[s].length


def _image_blocks(gi: int, g) -> list[tuple[int, int]]:
    """Gemma 3: the maximal runs of ``token_type_ids == 1`` of a prompt, [start, end) prompt positions, as its
    ``get_block_sequence_ids_for_mask`` numbers them (each run one block)."""
    tt = g.prompt_inputs.get("token_type_ids")
    if tt is None:
        return []
    tt = tt.reshape(-1) if tt.dim() == 2 and tt.shape[0] == 1 else tt
    if tt.dim() != 1 or tt.numel() != g.prompt.numel():
        raise ValueError(
            f"groups[{gi}].prompt_inputs['token_type_ids'] has shape {tuple(g.prompt_inputs['token_type_ids'].shape)}; "
            f"expected ({g.prompt.numel()},) or (1, {g.prompt.numel()}): the processor's token_type_ids for the prompt."
        )
    img = (tt == 1).tolist()
    out, start = [], None
    for p, x in enumerate(img + [False]):
        if x and start is None:
            start = p
        elif not x and start is not None:
            out.append((start, p))
            start = None
    return out


def _batched(key: str, v: torch.Tensor) -> torch.Tensor:
    """Token-aligned inputs get a batch dimension of 1; per-image inputs stay as the processor gives them."""
    if key in ("mm_token_type_ids",) and v.dim() == 1:
        return v[None]
    return v


def check_prompt_fits(groups, max_tokens) -> None:
    """A multimodal prompt is never cut into a chain: the vision tower's output must land in one pass."""
    if max_tokens is None:
        return
    for gi, g in enumerate(groups):
        if g.prompt_inputs and g.prompt.numel() > max_tokens:
            raise ValueError(
                f"groups[{gi}] has a multimodal prompt of {g.prompt.numel()} tokens but max_tokens={max_tokens}; a "
                "prompt with images is computed in one pass (its vision tower's output cannot be split). Set "
                f"max_tokens >= {g.prompt.numel()}."
            )
