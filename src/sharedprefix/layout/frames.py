"""Frames as 1-D ids: groups of (K, length) frames become groups of frame ids, so that segments, packing and the
planner stay one token per position.

A model with K token streams per position (MusicGen's audio codebooks) reads one frame of K codes per position.
``encode`` numbers the distinct frames of one call: frame ``f`` of the table gets the id ``offset + f``, with
``offset`` at least the largest code + 1, so that a frame id never equals a code. ``Frames.codes`` maps ids back to
frames; an id below ``offset`` (the short rows sharedprefix's model checks run, of ordinary token ids) maps to the
frame that holds that id in every stream.

Notation: K = streams, F = distinct frames of the call, L = ids.
"""

from __future__ import annotations

import torch

from sharedprefix.layout.groups import Group
from sharedprefix.layout.once import built_once


class Frames:
    """The frame table of one call: ``table`` (F, K) int64 codes; frame id ``offset + f`` is row ``f``."""

    def __init__(self, table: torch.Tensor, offset: int):
        self.table = table
        self.offset = int(offset)
        self._on: dict = {}  # device -> the table there

    @property
    def streams(self) -> int:
        return int(self.table.shape[1])

    def codes(self, ids: torch.Tensor) -> torch.Tensor:
        """(...,) int64 frame ids -> (..., K) int64 codes, on the ids' device."""
        table = built_once(self._on, ids.device, lambda: self.table.to(ids.device))
        same = ids[..., None].expand(*ids.shape, self.streams)  # an id below the offset, in every stream
        if not len(self.table):
            return same
        framed = ids >= self.offset
        rows = table.index_select(0, (ids - self.offset).clamp_min(0).reshape(-1)).view(*ids.shape, -1)
        return torch.where(framed[..., None], rows, same)


def encode(groups: list[Group], offset: int = 0) -> tuple[list[Group], Frames]:
    """Groups of (K, length) frames -> (the same groups as 1-D frame ids, their ``Frames`` table). ``offset``: the
    least first frame id (raised to the largest code + 1). Every group must hold frames of one K (the caller
    checks that against its model first, with its own message)."""
    ks = [g.streams for g in groups]
    for gi, k in enumerate(ks):
        if k is None or k != ks[0]:
            raise ValueError(
                f"groups[{gi}] holds {'1-D token ids' if k is None else f'frames of {k} streams'} and groups[0] "
                f"{'1-D token ids' if ks[0] is None else f'frames of {ks[0]} streams'}; expected frames of one number "
                "of token streams K in every group of a call."
            )
    parts = [t for g in groups for t in (g.prompt, *g.completions)]
    codes = torch.cat(parts, 1)  # (K, all frames of the call)
    offset = max(int(offset), int(codes.max()) + 1 if codes.numel() else 0)
    table, inverse = torch.unique(codes.t(), dim=0, return_inverse=True)  # (F, K), (all frames,)
    ids = (inverse + offset).split([int(t.shape[1]) for t in parts])
    out, i = [], 0
    for g in groups:
        n = 1 + len(g.completions)
        out.append(Group(ids[i], list(ids[i + 1 : i + n]), g.prompt_inputs))
        i += n
    return out, Frames(table, offset)
