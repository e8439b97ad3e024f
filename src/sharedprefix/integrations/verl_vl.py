"""Vision-language rows in verl's engine: ``multi_modal_inputs`` -> ``sp.Group(prompt_inputs=...)``, and the model's
own forward during sharedprefix's passes.

verl 0.9.1's ``apply_monkey_patch`` (run when an engine builds its model) replaces class attributes of
transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL modules, process-wide: the attention forward of Qwen2/2.5-VL (with
``use_remove_padding`` or Ulysses: verl's flash-attention call, which bypasses transformers' attention interface,
so sharedprefix's attention would never run), the multimodal model's and the conditional-generation model's
forwards (verl's image-text mixing and LM-head wrappers), Qwen3-VL's vision position interpolation, and with Ulysses
the text models' forwards. sharedprefix computes with the model's own modules, so:

- ``ORIGINALS``: when this module is imported (through ``VERL_USE_EXTERNAL_MODULES`` at ``import verl``, before any
  engine is built), every function defined on a class of those transformers modules is recorded. Each must be the
  model's own: defined in transformers, or a wrapper that the modeling module's own ``use_kernelized_func`` decoration
  put on the class when it was defined (with the ``kernels`` package, a dependency from transformers 5.25, it
  replaces the attention classes' ``__init__`` and ``forward``; the wrappers' code is ``kernels``', and what they
  close over must be the model's own in turn). Any other function was put there before this import, and the model
  type is refused (``MISSING``).
- ``own_forward()``: for the duration of one sharedprefix call (forward and backward, so that gradient
  checkpointing recomputes the same way) every recorded attribute that someone replaced is set back to
  transformers' function, and verl's is put back on exit, also when the call raises.

Rows: verl's ``multi_modal_inputs`` hold one dict per row (``pixel_values`` (patches, dim), ``image_grid_thw``
(images, 3), ``images_seqlens`` (verl's own bookkeeping, not a model input), videos likewise); images belong to the
prompt, so a micro-batch's rows are grouped by prompt tokens AND identical inputs (``vl_groups``: wherever they lie
in verl's order; the step merges a prompt's groups across micro-batches), and each group's ``prompt_inputs`` are its
rows' inputs plus ``mm_token_type_ids`` of the prompt (1 on image tokens, 2 on video tokens, as verl computes them for
the positions). verl's 3-D position ids (text row, then the model's M-RoPE rows) must be the model's own:
``check_mrope_positions`` compares them with the model's ``get_rope_index`` on each row (the core computes the
same positions itself, from the prompt alone).

Notation: B = rows of a micro-batch, L = longest row, len_i / P_i = row i's length / prompt length.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from contextlib import contextmanager

import torch

import sharedprefix as sp

# transformers modules verl's apply_monkey_patch touches for the vision-language model types sharedprefix supports
VL_MODULES = {
    "qwen2_vl": "transformers.models.qwen2_vl.modeling_qwen2_vl",
    "qwen2_5_vl": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "qwen3_vl": "transformers.models.qwen3_vl.modeling_qwen3_vl",
}
_NOT_INPUTS = ("images_seqlens",)  # verl's own bookkeeping in multi_modal_inputs (image sequence lengths)


def _decoration_code(mod) -> set:
    """Code objects of the functions that ``mod``'s own ``use_kernelized_func`` decoration puts on a class (empty
    where it leaves the class as it is: transformers before 5.25 without ``kernels``), found by decorating a probe
    class the way the modeling module decorates its attention classes."""
    decorate = getattr(mod, "use_kernelized_func", None)
    if decorate is None:
        return set()

    def probe_fn(x):
        return x

    probe_fn.kernel_layer_name = "sharedprefix_probe"  # type: ignore[attr-defined]  # what kernels asks of one

    def forward(self, x):
        return x

    probe = type("SharedprefixProbe", (torch.nn.Module,), {"forward": forward})
    mine = {torch.nn.Module.__init__.__code__, forward.__code__}
    probe = decorate(probe_fn)(probe)
    return {f.__code__ for f in vars(probe).values() if inspect.isfunction(f) and f.__code__ not in mine}


def _foreign(fn, decoration: set):
    """The function in ``fn`` that is not the model's own (``fn`` or one a decoration wrapper closes
    over), else None."""
    if fn.__code__ not in decoration:
        return None if fn.__module__.startswith("transformers.") else fn
    for cell in fn.__closure__ or ():
        inner = cell.cell_contents
        if inspect.isfunction(inner) and (bad := _foreign(inner, decoration)) is not None:
            return bad
    return None


def _record() -> tuple[dict, dict]:
    """(ORIGINALS: {(class, name): the model's own function}, MISSING: {model_type: why it cannot be restored})."""
    originals, missing = {}, {}
    for model_type, name in VL_MODULES.items():
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            missing[model_type] = f"this transformers version has no {name} ({e})"
            continue
        decoration, replaced = _decoration_code(mod), []
        for cls in vars(mod).values():
            if not (inspect.isclass(cls) and cls.__module__ == name):
                continue
            for attr, fn in vars(cls).items():
                if inspect.isfunction(fn):
                    if (bad := _foreign(fn, decoration)) is not None:
                        replaced.append(f"{cls.__name__}.{attr} (by {bad.__module__}.{bad.__qualname__})")
                    originals[(cls, attr)] = fn
        if replaced:
            missing[model_type] = (
                f"{', '.join(replaced)} already replaced when sharedprefix.integrations.verl was imported (expected "
                f"functions of {name} or of its own kernels decoration), so the model's own functions are unknown; "
                "import it first, through VERL_USE_EXTERNAL_MODULES=sharedprefix.integrations.verl"
            )
    return originals, missing


ORIGINALS, MISSING = _record()


@contextmanager
def own_forward():
    """Transformers' own class functions for the duration (see the module docstring); the replacements come back on
    exit, also when the body raises."""
    swapped = []
    try:
        for (cls, attr), fn in ORIGINALS.items():
            current = cls.__dict__.get(attr)
            if current is not fn:
                swapped.append((cls, attr, current))
                setattr(cls, attr, fn)
        yield
    finally:
        for cls, attr, current in reversed(swapped):
            if current is None:
                delattr(cls, attr)
            else:
                setattr(cls, attr, current)


def check_vl_config(hf_config, ulysses: int) -> None:
    """Raise ``ValueError`` for a vision-language model this engine does not compute."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in VL_MODULES:
        raise ValueError(
            f"model_type={model_type!r} is a vision-language model; sharedprefix's verl engine turns verl's "
            f"multi_modal_inputs into prompt_inputs for {sorted(VL_MODULES)} (M-RoPE models whose verl patches it "
            "undoes during its passes) only. Train this model without sharedprefix's verl engine, or use "
            "sp.Group(prompt_inputs=...) directly."
        )
    if model_type in MISSING:
        raise ValueError(f"model_type={model_type!r}: {MISSING[model_type]}.")
    if ulysses > 1:
        raise ValueError(
            f"ulysses_sequence_parallel_size={ulysses} with the vision-language model {model_type!r}: sharedprefix's "
            "sequence-parallel path refuses prompt_inputs, because the vision tower's features are placed into the "
            "whole packed row's embeddings while each rank computes only its slice of the row. Set "
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 for vision-language models."
        )


def row_inputs(data, B: int) -> list[dict | None]:
    """verl's per-row ``multi_modal_inputs`` (B dicts or None; None/empty for a text row) as a list."""
    if "multi_modal_inputs" not in data.keys():
        return [None] * B
    raw = data["multi_modal_inputs"]
    items = raw.tolist() if hasattr(raw, "tolist") else list(raw)
    out = []
    for x in items:
        x = getattr(x, "data", x)
        out.append({k: v for k, v in x.items() if v is not None and k not in _NOT_INPUTS} if x else None)
    if len(out) != B:
        raise ValueError(
            f"multi_modal_inputs has {len(out)} entries for {B} rows; expected one dict (or None) per row."
        )
    return out


def image_keys(inputs: list[dict | None]) -> list[bytes]:
    """One key per row's inputs: the SHA-256 of every input's name, dtype, shape and raw bytes (identical images give
    identical keys; different ones collide with probability 2^-256). A text row's key is empty."""
    keys = []
    for x in inputs:
        h = hashlib.sha256()
        for k, v in sorted((x or {}).items()):
            h.update(repr((k, str(v.dtype), tuple(v.shape))).encode())
            flat = v.detach().cpu().contiguous().reshape(-1)
            if flat.numel():
                h.update(flat.view(torch.uint8).numpy().data)  # the raw bytes (any dtype, bfloat16 included)
        keys.append(h.digest() if x else b"")
    return keys


def vl_groups(rows: list[torch.Tensor], plen, inputs, config) -> tuple[list[sp.Group], list[list[int]]]:
    """B rows ``[prompt | response]`` (1-D token tensors, CPU), (B,) prompt lengths and per-row inputs -> (groups,
    members): rows with the same prompt tokens and inputs form one group, wherever they lie among the rows (verl's
    micro-batches hold them in verl's order: a group's rows need not be adjacent), the groups in the order of their
    first rows; ``members[g]``: group g's rows, in order (its completions' order)."""
    media = {getattr(config, "image_token_id", None): 1, getattr(config, "video_token_id", None): 2}
    media.pop(None, None)
    groups: list[tuple] = []
    members: list[list[int]] = []
    index: dict[tuple, int] = {}
    for i, (row, x) in enumerate(zip(rows, inputs)):
        p = int(plen[i])
        prompt, response = row[:p], row[p:]
        hits = [t for t in media if bool((response == t).any())]
        if hits:
            raise ValueError(
                f"row {i}'s response holds image/video token ids {hits}; sharedprefix's verl engine puts images in the "
                "prompt (computed once per group), so multi-turn rows with images after the prompt are not supported."
            )
        key = (prompt.numpy().tobytes(), image_keys([x])[0])
        if key in index:
            groups[index[key]][1].append(response)
            members[index[key]].append(i)
            continue
        pi = None
        if x:
            pi = dict(x)
            types = torch.zeros_like(prompt, dtype=torch.int32)
            for t, v in media.items():
                types[prompt == t] = v
            pi["mm_token_type_ids"] = types
        index[key] = len(groups)
        groups.append((prompt, [response], pi))
        members.append([i])
    return [sp.Group(p, cs, prompt_inputs=pi) for p, cs, pi in groups], members


def to_rows(values: torch.Tensor, groups, members, lengths, plen) -> torch.Tensor:
    """(N, T) completion values in group order -> (B, L) aligned with the rows (``[i, t]`` about token t), zero on
    prompt tokens. Differentiable."""
    B, L = len(lengths), int(lengths.max())
    order = [i for m in members for i in m]
    dev = values.device
    T = values.shape[1]
    cols = torch.arange(L, device=dev)[None] - plen.to(dev)[:, None]  # (B, L): completion column of each token
    keep = (cols >= 0) & (torch.arange(L, device=dev)[None] < lengths.to(dev)[:, None])
    by_row = values.new_zeros(B, T).index_copy(0, torch.tensor(order, device=dev), values)
    picked = by_row.gather(1, cols.clamp(0, T - 1))
    return torch.where(keep, picked, torch.zeros((), dtype=values.dtype, device=dev))


def from_rows(values: torch.Tensor, groups, members, plen) -> torch.Tensor:
    """``to_rows``' inverse on the response tokens: (B, >= L) values aligned with the rows -> (N, T) completion values
    in group order (T = longest completion), zero past each completion. Differentiable."""
    dev = values.device
    order = torch.tensor([i for m in members for i in m], device=dev)
    clen = torch.tensor([c.numel() for g in groups for c in g.completions], device=dev)
    T = int(clen.max())
    cols = plen.to(dev)[order][:, None] + torch.arange(T, device=dev)[None]  # (N, T): row column of each token
    keep = torch.arange(T, device=dev)[None] < clen[:, None]
    picked = values[order].gather(1, cols.clamp(max=values.shape[1] - 1))
    return torch.where(keep, picked, torch.zeros((), dtype=values.dtype, device=dev))


def check_mrope_positions(module, position_ids, groups, members, lengths) -> None:
    """verl's (B, 4, j) position ids (text positions, then the model's 3-D M-RoPE positions) must be those the model
    computes for each row (``get_rope_index``), which sharedprefix computes itself; others would be silently
    ignored."""
    if position_ids.dim() != 3:
        raise ValueError(
            f"position_ids has {position_ids.dim()} dimensions for a vision-language model; expected verl's (B, 4, j) "
            "layout (text positions, then the M-RoPE temporal, height and width positions)."
        )
    base = getattr(module, "model", module)
    rope_args = set(inspect.signature(base.get_rope_index).parameters)
    per_row = position_ids.unbind()
    for g, rows in zip(groups, members):
        for c, i in zip(g.completions, rows):
            got = per_row[i].cpu()  # (4, len_i)
            want_text = torch.arange(int(lengths[i]))
            full = torch.cat([g.prompt, c])
            if g.prompt_inputs:
                kw = {k: v for k, v in g.prompt_inputs.items() if k in rope_args and k != "mm_token_type_ids"}
                types = torch.cat(
                    [g.prompt_inputs["mm_token_type_ids"].cpu(), torch.zeros(c.numel(), dtype=torch.int32)]
                )
                if "mm_token_type_ids" in rope_args:
                    kw["mm_token_type_ids"] = types[None]
                with torch.no_grad():  # a function of the config and the inputs (no parameters): on the host
                    pos, _ = base.get_rope_index(input_ids=full[None], **{k: v.cpu() for k, v in kw.items()})
                want = torch.cat([want_text[None], pos[:, 0].cpu()])
            else:
                want = want_text[None].expand(4, -1)
            if got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
                raise ValueError(
                    f"position_ids of row {i} are not the model's own (text positions 0..len-1, then the M-RoPE "
                    f"positions of {type(base).__name__}.get_rope_index for the row); sharedprefix computes each "
                    "token's position itself, so other position ids would be silently ignored. Use verl's default "
                    "position ids."
                )
