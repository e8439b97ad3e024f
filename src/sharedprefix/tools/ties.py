"""Near-ties of a model's discrete choices, for ``sp.verify``'s second opinion on flipped choices.

A MoE router or a sparse-attention indexer keeps the top k of a row of scores per token. Two roundings of the same
computation (the plain low-precision run and sharedprefix's) can keep different sets where the k-th and the
(k+1)-th scores are close; elsewhere they keep the same. ``tie_margins`` runs the plain forward of each
``[prompt + completion]`` row once more, records every top-k call along the last dimension (``torch.topk`` and
``Tensor.topk``, patched for the duration of that forward only) and returns, per row position, the smallest
relative margin (v_k - v_{k+1}) / |v_k| over the calls that score one row of candidates per position. A token of
sharedprefix's result that is off by more than rounding is taken for a flipped choice only where that margin is
small at the position that predicts it.

Choices made otherwise (an argmax router, a sort) are not recorded: their positions have no margin, and verify
then excuses nothing there.

Notation: L = positions of a row, k = choices kept, n = candidates.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def _recorded(out: list):
    """Inside, each top-k call along the last dimension of an (..., n) tensor with n > k appends the (...,)
    flattened relative margins of its rows to ``out``."""
    fn, method = torch.topk, torch.Tensor.topk

    def topk(x, k, dim=-1, *args, **kwargs):
        res = fn(x, k, dim, *args, **kwargs)
        if dim in (-1, x.dim() - 1) and x.shape[-1] > k and x.is_floating_point():
            v = fn(x.detach().float(), k + 1, -1).values
            out.append(((v[..., k - 1] - v[..., k]) / v[..., k - 1].abs().clamp_min(1e-30)).reshape(-1).cpu())
        return res

    torch.topk = topk
    torch.Tensor.topk = lambda self, k, dim=-1, *args, **kwargs: topk(self, k, dim, *args, **kwargs)
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = fn, method


def tie_margins(model, groups) -> list[torch.Tensor]:
    """Per completion row (output order): (L,) float32, at each position of ``[prompt + completion]`` the smallest
    relative top-k margin of the plain forward's choices (inf where none was recorded)."""
    dev = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for g in groups:
            for c in g.completions:
                row = torch.cat([g.prompt, c])
                calls: list = []
                with _recorded(calls):
                    model(input_ids=row[None].to(dev), use_cache=False)
                per_position = [m for m in calls if m.numel() == row.numel()]
                out.append(
                    torch.stack(per_position).min(0).values
                    if per_position
                    else torch.full((row.numel(),), float("inf"))
                )
    return out
