"""Groups: one prompt with the G completions sampled from it, validated at the boundary.

Notation: G = completions of one group, P = prompt length, T_i = length of completion i, K = token streams per
position (a model with several, such as MusicGen's K audio codebooks, reads one "frame" of K codes per position).
Token ids are stored as 1-D int64 CPU tensors, frames as (K, length) int64 CPU tensors; nothing the user gave is
reordered, truncated or dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def as_ids(value, what: str) -> torch.Tensor:
    """Convert a list of ints or a 1-D integer tensor into a 1-D int64 CPU tensor, and K lists of ints or a
    (K, length) integer tensor (frames: one code per stream and position) into a (K, length) one."""
    frames = isinstance(value, torch.Tensor) and value.dim() == 2
    if not frames and not isinstance(value, (torch.Tensor, str, bytes)) and isinstance(value, Sequence) and value:
        # a 0-d integer tensor is one token id (``list(ids)`` of a 1-D tensor), not a stream
        frames = all(
            (isinstance(v, torch.Tensor) and v.dim() > 0)
            or (isinstance(v, Sequence) and not isinstance(v, (str, bytes)))
            for v in value
        )
    if frames:
        rows = value.unbind(0) if isinstance(value, torch.Tensor) else value
        out = [as_ids(r, f"{what}[{k}]") for k, r in enumerate(rows)]
        if any(r.dim() != 1 for r in out):
            raise ValueError(
                f"{what} nests deeper than K lists of codes; expected 1-D token ids or (K, length) frames."
            )
        lens = sorted({int(r.numel()) for r in out})
        if len(lens) != 1 or not out:
            raise ValueError(
                f"{what} holds {len(out)} token streams of lengths {lens}; expected K streams of one length (a frame "
                "of K codes per position, e.g. MusicGen's K codebooks after its delay pattern)."
            )
        if len(out) == 1:  # one stream: a batch dimension (a tokenizer's (1, P) input_ids), not frames
            raise ValueError(
                f"{what} has shape (1, {lens[0]}); expected 1-D token ids (frames need K >= 2 token streams). Pass one "
                "sequence per prompt or completion, without a batch dimension (e.g. input_ids[0])."
            )
        return torch.stack(out)
    if isinstance(value, torch.Tensor):
        if value.dtype not in _INT_DTYPES:
            raise TypeError(
                f"{what} is a tensor of dtype {value.dtype}; expected an integer tensor of token ids. "
                "Convert it with .long() if it holds whole numbers."
            )
        if value.dim() != 1:
            raise ValueError(
                f"{what} has shape {tuple(value.shape)}; expected a 1-D tensor of token ids (or a (K, length) tensor "
                "of frames for a model with K token streams). Pass one sequence per prompt or completion, without a "
                "batch dimension."
            )
        return value.detach().to(device="cpu", dtype=torch.int64).clone()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{what} is a {type(value).__name__}; expected a list of int token ids or a 1-D integer tensor. "
            "Tokenize text before building a Group."
        )
    for j, tok in enumerate(value):
        if isinstance(tok, bool) or not isinstance(tok, int):
            # numpy / torch integer scalars are accepted through __index__
            if hasattr(tok, "__index__") and not isinstance(tok, (bool, float)):
                continue
            raise TypeError(
                f"{what}[{j}] is {tok!r} ({type(tok).__name__}); expected an int token id. "
                "Token ids must be whole numbers from the tokenizer."
            )
    return torch.tensor([int(t) for t in value], dtype=torch.int64)


@dataclass(frozen=True, init=False)
class Group:
    """One prompt and the completions sampled from it.

    Args:
        prompt: token ids of the prompt, a list of ints or a 1-D integer tensor, length P >= 1. For a model
            with K token streams per position (MusicGen): frames, a (K, P) integer tensor or K lists of P codes.
        completions: G >= 1 sequences of token ids, each of length T_i >= 1 ((K, T_i) frames when the prompt
            is frames). Each completion continues the prompt: its first token is predicted by the prompt's
            last token.
        prompt_inputs: for a vision-language model, the processor's other outputs for the prompt
            alone (e.g. ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``), tensors as the
            processor returns them for one sample. The vision tower runs once per group.
    """

    prompt: torch.Tensor
    completions: tuple[torch.Tensor, ...]
    prompt_inputs: dict | None

    def __init__(
        self,
        prompt: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
        completions: Sequence[torch.Tensor | Sequence[int] | Sequence[Sequence[int]]],
        prompt_inputs: Mapping[str, Any] | None = None,
    ) -> None:
        p = as_ids(prompt, "prompt")
        if p.shape[-1] == 0:
            raise ValueError(
                "prompt is empty; expected at least one token, because the first completion token "
                "is predicted by the last prompt token. Add a BOS token or the chat template's prefix."
            )
        if (
            isinstance(completions, torch.Tensor)
            or isinstance(completions, (str, bytes))
            or not isinstance(completions, Sequence)
        ):
            raise TypeError(
                f"completions is a {type(completions).__name__}; expected a list of completions, "
                "each a list of int token ids or a 1-D integer tensor."
            )
        if len(completions) == 0:
            raise ValueError(
                "completions is empty; expected at least one completion for the prompt. "
                "Drop groups with no samples before calling sharedprefix."
            )
        cs = []
        for i, c in enumerate(completions):
            t = as_ids(c, f"completions[{i}]")
            if t.dim() != p.dim() or t.shape[:-1] != p.shape[:-1]:
                raise ValueError(
                    f"completions[{i}] has shape {tuple(t.shape)} and the prompt shape {tuple(p.shape)}; expected the "
                    "prompt's number of token streams per position in every completion (1-D token ids, or (K, T) "
                    "frames with the prompt's K)."
                )
            if t.shape[-1] == 0:
                raise ValueError(
                    f"completions[{i}] is empty; expected at least one token (an empty completion has no "
                    "log-prob to compute). Append the EOS token the sampler stopped on, or drop it."
                )
            cs.append(t)
        if prompt_inputs is not None:
            if not isinstance(prompt_inputs, dict) or not all(isinstance(k, str) for k in prompt_inputs):
                raise TypeError(
                    f"prompt_inputs is a {type(prompt_inputs).__name__}; expected a dict of the processor's outputs "
                    "for the prompt alone, e.g. {'pixel_values': ..., 'image_grid_thw': ...}."
                )
            bad = sorted(k for k, v in prompt_inputs.items() if v is not None and not isinstance(v, torch.Tensor))
            if bad:
                raise TypeError(
                    f"prompt_inputs {bad} are not tensors; pass the processor's outputs with return_tensors='pt'."
                )
            if "input_ids" in prompt_inputs or "attention_mask" in prompt_inputs:
                raise ValueError(
                    "prompt_inputs holds input_ids / attention_mask; pass the token ids as `prompt` and "
                    "leave the attention mask out (a group's prompt has no padding)."
                )
            prompt_inputs = {k: v for k, v in prompt_inputs.items() if v is not None} or None
        object.__setattr__(self, "prompt", p)
        object.__setattr__(self, "completions", tuple(cs))
        object.__setattr__(self, "prompt_inputs", prompt_inputs)

    def copy(self) -> Group:
        """This group sharing no tensor with it: its token ids and ``prompt_inputs`` copied (detached, on their own
        devices), as ``sp.plan_call`` keeps it, so that an in-place edit of this group reaches no plan."""
        out = object.__new__(Group)
        inputs = None if self.prompt_inputs is None else {k: _copied(v) for k, v in self.prompt_inputs.items()}
        object.__setattr__(out, "prompt", self.prompt.clone())
        object.__setattr__(out, "completions", tuple(c.clone() for c in self.completions))
        object.__setattr__(out, "prompt_inputs", inputs)
        return out

    @property
    def group_size(self) -> int:
        return len(self.completions)

    @property
    def streams(self) -> int | None:
        """K for a group of (K, length) frames, None for one of 1-D token ids."""
        return int(self.prompt.shape[0]) if self.prompt.dim() == 2 else None

    def __repr__(self) -> str:
        lens = [int(c.shape[-1]) for c in self.completions]
        extra = f", prompt_inputs={sorted(self.prompt_inputs)}" if self.prompt_inputs else ""
        extra += f", streams={self.streams}" if self.streams else ""
        return f"Group(prompt_len={self.prompt.shape[-1]}, completion_lens={lens}{extra})"


def check_in_vocab(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """Raise ValueError when a token id of ``ids`` lies outside ``[0, vocab_size)``; ``what`` names the sequence."""
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"{what} holds token id {bad}, outside the model's vocabulary [0, {vocab_size}). The ids must come from "
            "the model's own tokenizer; check that tokenizer and model match."
        )


def check_all_in_vocab(seqs: Sequence[tuple[str, torch.Tensor]], vocab_size: int | None) -> None:
    """``check_in_vocab`` of every ``(what, ids)`` pair in ``seqs`` (nothing when ``vocab_size`` is None), with a
    few ops over their concatenation; on a bad id, the first bad sequence raises ``check_in_vocab``'s error."""
    if vocab_size is None or not seqs:
        return
    flat = [ids if ids.dim() == 1 else ids.reshape(-1) for _, ids in seqs]
    lo, hi = torch.stack(torch.aminmax(torch.cat(flat))).tolist()
    if lo < 0 or hi >= vocab_size:
        for what, ids in seqs:
            check_in_vocab(ids, vocab_size, what)


def _copied(value):
    """``value`` sharing no tensor with it: tensors detached and cloned, dicts, lists and tuples copied through,
    anything else (a processor's scalar) as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


def validate_groups(groups, vocab_size: int | None = None, streams: bool = False) -> list[Group]:
    """Check a list of groups (and token ids against ``vocab_size``); return it as a list. Groups of frames
    ((K, length) token streams) are refused when ``vocab_size`` is given (a one-stream model's check), and
    accepted as they are with ``streams=True`` (the caller checks them against its model)."""
    if isinstance(groups, Group):
        raise TypeError("groups is a single Group; expected a list of Group objects. Wrap it: [group].")
    if not isinstance(groups, Sequence) or isinstance(groups, (str, bytes)):
        raise TypeError(f"groups is a {type(groups).__name__}; expected a list of sharedprefix.Group.")
    if len(groups) == 0:
        raise ValueError("groups is empty; expected at least one sharedprefix.Group.")
    out: list[Group] = []
    seqs: list[tuple[str, torch.Tensor]] = []  # (name, ids) for one vocabulary check, run before any later error
    for gi, g in enumerate(groups):
        if not isinstance(g, Group):
            check_all_in_vocab(seqs, vocab_size)
            raise TypeError(
                f"groups[{gi}] is a {type(g).__name__}; expected sharedprefix.Group(prompt=..., completions=...)."
            )
        if g.streams and vocab_size is not None and not streams:
            check_all_in_vocab(seqs, vocab_size)
            raise ValueError(
                f"groups[{gi}] holds frames of {g.streams} token streams per position (a prompt of shape "
                f"{tuple(g.prompt.shape)}), but the model reads one token per position. Pass 1-D token ids "
                "(frames are for models with several token streams per position, such as MusicGen)."
            )
        if vocab_size is not None:
            seqs.append((f"groups[{gi}].prompt", g.prompt))
            seqs += [(f"groups[{gi}].completions[{i}]", c) for i, c in enumerate(g.completions)]
        out.append(g)
    check_all_in_vocab(seqs, vocab_size)
    return out
