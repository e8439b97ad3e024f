"""Models with K token streams per position (MusicGen's audio codebooks): frames in, one log-prob per frame out.

MusicGen's decoder reads ``input_ids`` of shape (batch * K, L), one row per codebook, and embeds position t as the
sum over codebooks of ``embed_tokens[k](codes[k, t])`` (each of ``vocab_size + 1`` entries: the last id is the
pad / BOS of its delay pattern); its causal LM predicts every codebook of the next position with one head per
codebook, independently given the hidden state: logits (batch * K, L, vocab_size). Its token mixing is attention
only, so sharedprefix shares a prompt of such a model exactly, with these semantics:

- A group holds frames: a (K, P) prompt and (K, T_i) completions (``layout.groups``).
- The log-prob of a completion frame is the joint log-prob of its codes, the sum over codebooks of
  log p_k(code_k), excluding codebooks whose code is the delay pattern's pad (``config.pad_token_id``, which
  generation forces and MusicGen's own loss ignores). Output stays (N, T): one value per frame. Entropy is the sum
  of the per-codebook entropies over the same codebooks; the temperature divides each head's logits.

Inside sharedprefix a frame is one id (``layout.frames``: segments, packing and the planner are unchanged), and
``framed`` turns a packed row of frame ids into the decoder's (K, L) codes, with a forward pre-hook on the decoder
that lives for the duration of one sharedprefix call (also its model checks, whose short rows of ordinary ids
become frames of that id in every codebook). ``head.token_logprobs`` takes (M, K) code targets.

Notation: K = streams, P / T = prompt / completion frames, E = input embedding entries per stream, V = head
vocabulary per stream, L = frames of a row, M = predicted frames.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from sharedprefix.layout import frames as frame_ids
from sharedprefix.layout.groups import validate_groups
from sharedprefix.layout.rows import Tree


def num_streams(model) -> int:
    """K: 1 for a model with one input embedding and one LM head; the number of embeddings for a model with one
    embedding and one linear head per stream (MusicGen). Raises ValueError for any other combination."""
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    lists = [isinstance(m, torch.nn.ModuleList) for m in (emb, out)]
    if not any(lists):
        return 1
    ok = (
        all(lists)
        and len(emb) == len(out) > 0
        and all(isinstance(e, torch.nn.Embedding) for e in emb)
        and all(isinstance(h, torch.nn.Linear) for h in out)
    )
    if not ok:
        what = lambda m: (  # noqa: E731
            f"{len(m)} {sorted({type(x).__name__ for x in m})}"
            if isinstance(m, torch.nn.ModuleList)
            else type(m).__name__
        )
        raise ValueError(
            f"{type(model).__name__} has input embeddings {what(emb)} and output embeddings {what(out)}; sharedprefix "
            "takes several token streams per position only as one nn.Embedding and one nn.Linear head per stream, "
            "as many of each (MusicGen's codebooks). This model is not supported."
        )
    return len(emb)


def _first(m):
    return m[0] if isinstance(m, torch.nn.ModuleList) else m


def embedding_size(model) -> int:
    """E: the entries of the (smallest) input embedding."""
    emb: Any = model.get_input_embeddings()
    embs: list[Any] = list(emb) if isinstance(emb, torch.nn.ModuleList) else [emb]
    return min(_embedding_rows(e) for e in embs)


def _embedding_rows(emb) -> int:
    """An input embedding's entries: its ``num_embeddings``, read through an adapter wrapper (PEFT's LoRA
    ``Embedding`` keeps the wrapped ``nn.Embedding`` as its base layer, and declares ``out_features`` as the
    embedding width, not the vocabulary), or its weight's rows for a module that declares none."""
    base = emb.get_base_layer() if hasattr(emb, "get_base_layer") else emb
    n = getattr(base, "num_embeddings", None)
    return int(n) if isinstance(n, int) else int(base.weight.shape[0])


def head_vocab(model) -> int:
    """V: the rows of the (smallest) output embedding."""
    out: Any = model.get_output_embeddings()
    heads: list[Any] = list(out) if isinstance(out, torch.nn.ModuleList) else [out]
    return min(declared_rows(h) for h in heads)


def declared_rows(mod) -> int:
    """The rows of ``mod``'s weight as the module declares them (a linear's ``out_features``, an embedding's
    ``num_embeddings``), which hold however an engine stores the parameter (ZeRO-3 leaves it empty outside the
    module's forward); the weight's own shape only for a module that declares none."""
    for name in ("out_features", "num_embeddings"):
        if isinstance(getattr(mod, name, None), int):
            return int(getattr(mod, name))
    return int(mod.weight.shape[0])


def head_device(model) -> torch.device:
    return _first(model.get_output_embeddings()).weight.device


def pad_id(model) -> int | None:
    """The delay pattern's pad code (``config.pad_token_id``), excluded from a frame's log-prob; None if unset."""
    pad = getattr(model.config.get_text_config(), "pad_token_id", None)
    return pad if isinstance(pad, int) and not isinstance(pad, bool) else None


def encode(model, source):
    """Check ``source`` (a list of groups of frames) against the K-stream ``model``; return (the groups as 1-D
    frame ids, their ``layout.frames.Frames``). Raises before any computation for what it cannot take."""
    name, k = type(model).__name__, num_streams(model)
    if isinstance(source, Tree):
        raise ValueError(
            f"{name} reads {k} token streams per position and got an sp.Tree (rows of single token ids, as the TRL "
            "trainer and verl build them); sharedprefix takes frames for it only as a list of sp.Group with (K, P) "
            "prompts and (K, T) completions. Pass groups to sp.logprobs / sp.backward."
        )
    groups = validate_groups(source, streams=True)
    e, v, pad = embedding_size(model), head_vocab(model), pad_id(model)
    for gi, g in enumerate(groups):
        if g.streams != k:
            got = "1-D token ids" if g.streams is None else f"frames of {g.streams} streams"
            raise ValueError(
                f"groups[{gi}] holds {got} (prompt shape {tuple(g.prompt.shape)}), but {name} reads {k} token streams "
                f"per position (one code per codebook). Pass the prompt as a ({k}, P) integer tensor (or {k} lists) "
                f"and each completion as ({k}, T): the codes after the model's delay pattern."
            )
        if g.prompt_inputs:
            raise ValueError(
                f"groups[{gi}] carries prompt_inputs {sorted(g.prompt_inputs)}; {name} reads frames "
                "of codes only, and sharedprefix takes no other inputs for it."
            )
        _check_codes(g.prompt, e, None, f"groups[{gi}].prompt", "input embedding", e)
        for i, c in enumerate(g.completions):
            _check_codes(c, v, pad, f"groups[{gi}].completions[{i}]", "heads' vocabulary", e)
    return frame_ids.encode(groups, offset=e)


def _check_codes(codes: torch.Tensor, size: int, pad: int | None, what: str, of: str, e: int) -> None:
    bad = (codes < 0) | (codes >= size)
    if pad is not None:
        bad &= codes != pad
    if bad.any():
        k, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{what} holds code {int(codes[k, t])} in stream {k} at position {t}, outside the {of} [0, {size})"
            + (f" and not the pad id {pad}" if pad is not None else "")
            + f". Prompt codes must be in [0, {e}) (the last entries are the delay pattern's pad / BOS); a "
            "completion's codes are predicted, so they must be in the heads' vocabulary, or the pad id (excluded from "
            "the log-prob)."
        )


@contextmanager
def framed(model, dec: torch.nn.Module, table: frame_ids.Frames | None = None):
    """For a K-stream ``model``: while inside, ``dec`` called with (B, L) ids runs on their (B * K, L) codes
    (``table``'s frames; ids below its offset, or every id without a table, as that id in every stream). For a
    one-stream model: nothing."""
    k = num_streams(model)
    if k == 1:
        yield
        return
    if table is None:
        table = frame_ids.Frames(torch.zeros(0, k, dtype=torch.int64), embedding_size(model))

    def to_codes(_mod, args, kwargs):
        positional = "input_ids" not in kwargs
        ids = args[0] if positional and args else kwargs.get("input_ids")
        if ids is None:
            return None
        codes = table.codes(ids).movedim(-1, 1).reshape(-1, ids.shape[-1])  # (B, L, K) -> (B * K, L)
        return ((codes, *args[1:]), kwargs) if positional else (args, {**kwargs, "input_ids": codes})

    hook = dec.register_forward_pre_hook(to_codes, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()
