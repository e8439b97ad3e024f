"""TRL's log-prob batches as sharedprefix sources: a token tree for text rows, image groups for rows with images.

``GRPOTrainer`` hands its log-prob hook (B, L) rows ``[left-padded prompt | right-padded completion]``
(``logits_to_keep`` = C completion columns) and, for vision-language models, every row's images in one of
several layouts. The layouts taken here, the ones sharedprefix computes exactly through
``sp.Group(prompt_inputs=...)`` (tests/multimodal):

- grid (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``pixel_values`` (patches, dim) of every image of every row in row
  order, ``image_grid_thw`` (images, 3) giving each image's patches, ``mm_token_type_ids`` (B, L) for the
  3-D positions.
- per image (Llava; Gemma 3 with ``token_type_ids`` (B, L), 1 on image tokens, whose image tokens attend to
  each other bidirectionally): ``pixel_values`` (images, channels, height, width), one entry per image in row
  order; LLaVA-NeXT's any-resolution tiles: ``pixel_values`` (images, tiles, channels, height, width) with
  ``image_sizes`` (images, 2), each image's (height, width), which the group's ``prompt_inputs`` carry too.

Both come with ``num_images`` (B,): images of each row. Other layouts (tiles with ``num_tiles`` or
``spatial_shapes``, ``image_position_ids``, pixel values padded to one entry per row) are refused by
``check_image_inputs``; so are ``token_type_ids`` with a 1 outside a row's prompt.

Notation: B = rows of a microbatch, C = completion columns, P = L - C prompt columns, N = non-empty rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import sharedprefix as sp

MULTIMODAL = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
_LAYOUTS = {  # required keys -> keys allowed beside them
    "grid": ({"pixel_values", "image_grid_thw", "num_images"}, {"mm_token_type_ids"}),
    "per image": ({"pixel_values", "num_images"}, {"mm_token_type_ids", "token_type_ids", "image_sizes"}),
}
_SUPPORTED = (
    "images of Qwen-style vision-language models (pixel_values with image_grid_thw: Qwen2-VL, Qwen2.5-VL, "
    "Qwen3-VL), images of Llava-style ones and Gemma 3 (pixel_values with one (channels, height, width) "
    "entry per image; Gemma 3's token_type_ids), LLaVA-NeXT's tiles (one (tiles, channels, height, width) entry "
    "per image with image_sizes) and text"
)


def check_image_inputs(extra: dict) -> bool:
    """True when ``extra`` (the hook's keyword arguments) holds images in a layout taken here, False for text;
    raises for any other multimodal input, before anything is computed."""
    used = {k for k in MULTIMODAL if extra.get(k) is not None}
    if used == {"token_type_ids"} and not bool(extra["token_type_ids"].any()):
        return False  # Gemma 3's processor on text alone: every token a text token
    if not used:
        return False
    for required, allowed in _LAYOUTS.values():
        if required <= used <= required | allowed:
            shape, n = tuple(extra["pixel_values"].shape), sum(extra["num_images"])
            tiles = "image_sizes" in used  # LLaVA-NeXT: (images, tiles, channels, height, width), (images, 2) sizes
            if "image_grid_thw" in used or (len(shape) == 4 + tiles and shape[0] == n):
                if tiles and tuple(extra["image_sizes"].shape) != (n, 2):
                    raise ValueError(
                        f"image_sizes of shape {tuple(extra['image_sizes'].shape)} for {n} images; expected ({n}, 2), "
                        "one (height, width) per image, as LLaVA-NeXT's processor gives them."
                    )
                return True
            raise ValueError(
                f"pixel_values of shape {shape} for {n} images (num_images={list(extra['num_images'])}): without "
                "image_grid_thw, the sharedprefix TRL trainers expect one (channels, height, width) entry per image, "
                "(images, channels, height, width), or with image_sizes one (tiles, channels, height, width) entry per "
                "image; other layouts (e.g. padded to one entry per row, Idefics-style) are not supported. They take "
                f"{_SUPPORTED}."
            )
    raise ValueError(
        f"multimodal inputs {sorted(used)} are not supported by the sharedprefix TRL trainers: they take {_SUPPORTED}."
    )


@dataclass
class TreeRows:
    """How the rows of a microbatch map onto the rows of a ``sharedprefix.Tree``."""

    tree: sp.Tree | None
    row_of: list[int]  # tree row i -> microbatch row b
    prompt_len: list[int]  # tree row i -> its prompt's length without padding (its first completion column)
    lengths: list[int]  # tree row i -> its completion's number of tokens


def tree_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> TreeRows:
    """(B, L) rows ``[left-padded prompt | right-padded completion]`` -> a Tree of every [prompt + completion] row.

    Completion tokens are trained. A row whose completion holds no token (TRL masks it: truncated with
    ``mask_truncated_completions``) stays in the tree as its prompt alone, nothing trained: its log-probs are zeros
    that still belong to the graph (so a microbatch with no trained token gives a zero loss whose backward runs,
    as GRPOTrainer's does), and its prompt tokens count in the MoE load-balancing loss, as in TRL's forward.
    """
    P = input_ids.shape[1] - logits_to_keep
    ids, att = input_ids.cpu(), attention_mask.cpu().bool()
    rows, trained, row_of, plen, lens = [], [], [], [], []
    for b in range(input_ids.shape[0]):
        prompt, completion = _row(ids, att, b, P)
        rows.append(torch.cat([prompt, completion]))
        trained.append(torch.arange(rows[-1].numel()) >= prompt.numel())
        row_of.append(b)
        plen.append(int(prompt.numel()))
        lens.append(int(completion.numel()))
    return TreeRows(sp.Tree.from_rows(rows, trained) if rows else None, row_of, plen, lens)


def _row(ids: torch.Tensor, att: torch.Tensor, b: int, P: int):
    """Row ``b`` of TRL's (B, L) layout [left-padded prompt | right-padded completion] as (prompt, completion)
    without padding; the completion is empty when its mask holds no token (TRL masks the row)."""
    prompt, cmask = ids[b, :P][att[b, :P]], att[b, P:]
    t = int(cmask.sum())
    if not bool(cmask[:t].all()):
        raise ValueError(
            f"row {b} has a completion mask with holes ({cmask.int().tolist()}); sharedprefix expects each "
            "completion to be a run of tokens followed by padding."
        )
    if prompt.numel() == 0:
        raise ValueError(f"row {b} has an empty prompt; expected at least one prompt token (e.g. BOS).")
    return prompt, ids[b, P : P + t]


def _row_images(pixel_values: torch.Tensor, num_images: list[int], image_grid_thw: torch.Tensor | None = None):
    """Row b -> its images' inputs: (pixel_values, image_grid_thw or None), each row's slice of the batch's."""
    first_image = [0, *torch.tensor(num_images, dtype=torch.long).cumsum(0).tolist()]
    if image_grid_thw is None:  # per image: entry i is image i
        return lambda b: (pixel_values[first_image[b] : first_image[b + 1]], None)
    first_patch = [0, *image_grid_thw.prod(-1).cpu().cumsum(0).tolist()]
    if first_patch[-1] != pixel_values.shape[0]:
        raise ValueError(
            f"image_grid_thw gives {first_patch[-1]} patches, pixel_values has {pixel_values.shape[0]} rows."
        )
    return lambda b: (
        pixel_values[first_patch[first_image[b]] : first_patch[first_image[b + 1]]],
        image_grid_thw[first_image[b] : first_image[b + 1]],
    )


def image_groups(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    pixel_values: torch.Tensor | None = None,
    num_images: list[int] | None = None,
    image_grid_thw: torch.Tensor | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    token_type_ids: torch.Tensor | None = None,
    image_sizes: torch.Tensor | None = None,
):
    """TRL's (B, L) rows with their images (a layout of the module docstring), or text rows (``pixel_values`` None:
    hybrid models, which take groups, not trees) -> (groups, members).

    Rows with the same prompt tokens and the same images form one ``sp.Group`` whose ``prompt_inputs`` are that
    prompt's images, so its vision tower and prompt run once; ``members[i]`` lists the microbatch rows of group i,
    in the order of its completions. Rows whose completion holds no token are left out (TRL masks them).
    """
    B, L = input_ids.shape
    P = L - logits_to_keep
    if pixel_values is None:
        num_images = [0] * B
    if len(num_images) != B:
        raise ValueError(f"num_images has {len(num_images)} entries for {B} rows; expected one per row.")
    empty = torch.zeros(0)
    images_of = (
        _row_images(pixel_values, num_images, image_grid_thw) if pixel_values is not None else (lambda b: (empty, None))
    )
    ids, att = input_ids.cpu(), attention_mask.cpu().bool()
    first_image = [0, *torch.tensor(num_images, dtype=torch.long).cumsum(0).tolist()]
    keys: dict[tuple, int] = {}
    prompts, completions, members = [], [], []
    for b in range(B):
        prompt, completion = _row(ids, att, b, P)
        if not completion.numel():  # nothing to compute for this row (TRL masks it); a group needs a completion
            continue
        pix, grid = images_of(b)
        types = None
        if token_type_ids is not None:
            row_types = token_type_ids[b].cpu()
            types = row_types[:P][att[b, :P]]
            if bool(row_types[P:][att[b, P:]].any()) or (not num_images[b] and bool(types.any())):
                raise ValueError(
                    f"row {b} has token_type_ids {row_types[att[b]].tolist()}: a 1 (image token) in its completion, or "
                    "in a prompt without images; expected 1 only on the image tokens of a prompt (as Gemma 3's "
                    "processor marks them)."
                )
        sizes = None if image_sizes is None else image_sizes[first_image[b] : first_image[b + 1]]
        key = (
            tuple(prompt.tolist()),
            tuple(pix.shape),
            pix.detach().cpu().numpy().tobytes(),
            None if grid is None else tuple(grid.flatten().tolist()),
            None if types is None else tuple(types.tolist()),
            None if sizes is None else tuple(sizes.flatten().tolist()),
        )
        if key in keys:
            completions[keys[key]].append(completion)
            members[keys[key]].append(b)
            continue
        inputs = None
        if num_images[b]:
            inputs = {"pixel_values": pix} if grid is None else {"pixel_values": pix, "image_grid_thw": grid}
            if sizes is not None:
                inputs["image_sizes"] = sizes
            if mm_token_type_ids is not None:
                inputs["mm_token_type_ids"] = mm_token_type_ids[b, :P][att[b, :P].to(mm_token_type_ids.device)]
            if types is not None:
                inputs["token_type_ids"] = types
        keys[key] = len(prompts)
        prompts.append((prompt, inputs))
        completions.append([completion])
        members.append([b])
    groups = [sp.Group(p, cs, prompt_inputs=inputs) for (p, inputs), cs in zip(prompts, completions)]
    return groups, members


def from_groups(values: torch.Tensor, members: list[list[int]], B: int, C: int, dtype: torch.dtype) -> torch.Tensor:
    """(N, T) aligned with ``image_groups``' groups (their completions in order, T <= C columns from the first
    completion token) -> (B, C) in microbatch order (``members``: each group's rows), zero elsewhere."""
    order = torch.tensor([b for m in members for b in m], device=values.device)
    out = torch.zeros(B, C, dtype=dtype, device=values.device)
    return out.index_copy(0, order, torch.nn.functional.pad(values, (0, C - values.shape[1])).to(dtype))


def to_rows(values: torch.Tensor, tr: TreeRows, B: int, C: int) -> torch.Tensor:
    """(N, L) aligned with the tree's rows -> (B, C) completion columns in microbatch order, zero elsewhere."""
    dev = values.device
    cols = torch.tensor(tr.prompt_len, device=dev)[:, None] + torch.arange(C, device=dev)[None]
    keep = torch.arange(C, device=dev)[None] < torch.tensor(tr.lengths, device=dev)[:, None]
    picked = values.gather(1, cols.clamp(max=values.shape[1] - 1))
    picked = torch.where(keep, picked, torch.zeros((), dtype=values.dtype, device=dev))
    out = values.new_zeros(B, C)
    return out.index_copy(0, torch.tensor(tr.row_of, device=dev), picked)
