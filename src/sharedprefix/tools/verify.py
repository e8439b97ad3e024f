"""``sp.verify(model)``: check a user's own model before training on it.

Runs a few groups (random ones sized to the model, or the caller's batch) through sharedprefix
and through the plain forward of each ``[prompt + completion]`` row, in the model's own dtype
and on its own device, with one pass and with a budget that splits a group, and judges the error
by the flash-attention rule: sharedprefix's error against a float64 copy of the model is at most
twice the plain same-dtype run's own error (plus 1e-12, which only matters in float64). A
refusal is reported with its reason. The float64 copy costs the model's size twice over, on the
model's device; pass ``reference_device="cpu"`` to keep it in host memory.

``SHAREDPREFIX_SELF_CHECK=1`` makes the first ``sp.logprobs`` / ``sp.backward`` call on each model
verify on that call's own groups first and refuse to continue on a mismatch.

Notation: N = completions, T = longest completion.
"""

from __future__ import annotations

import copy
import os
import weakref
from dataclasses import dataclass, field

import torch

_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class VerifyReport:
    """``ok``: exact by the 2x rule in every configuration that ran (False on a refusal of the one-pass check).
    ``refusal``: a refusal of either check, or None. ``split_refusal``: the refusal of the budget that splits a
    group by a model exact in one pass only (DeepSeek sparse attention: the indexer keys of cached prompts are not
    kept), or None; the same call with that budget would refuse, never mismatch. ``checks``: per configuration (budget, our error, the
    plain run's error), errors as max |delta log-prob| against the float64 reference."""

    ok: bool
    refusal: str | None = None
    checks: list = field(default_factory=list)
    split_refusal: str | None = None
    split: int | None = None

    def __str__(self) -> str:
        if self.refusal:
            return f"refused: {self.refusal}"
        lines = [f"max_tokens={b!s:>5}: sharedprefix error {ours:.2e}, plain error {plain:.2e} "
                 f"({'OK' if ours <= 2 * plain + 1e-12 else 'MISMATCH'})" for b, ours, plain in self.checks]
        if self.split_refusal:
            lines.append(f"max_tokens={self.split!s:>5}: refused ({self.split_refusal})")
        verdict = "exact by the 2x rule" + (" in one pass; a budget that splits a group is refused" if self.split_refusal
                                            else "")
        return "\n".join(lines + [f"-> {verdict if self.ok else 'NOT EXACT'}"])


def _random_groups(vocab: int, seed: int, streams: int = 1):
    """Two random groups of token ids (of (streams, n) frames for a model with several token streams)."""
    from sharedprefix.layout.groups import Group

    g = torch.Generator().manual_seed(seed)
    shape = lambda n: (n,) if streams == 1 else (streams, n)  # noqa: E731
    ids = lambda n: torch.randint(0, vocab, shape(n), generator=g)  # noqa: E731
    return [Group(ids(24), [ids(5), ids(9), ids(1)]), Group(ids(7), [ids(6), ids(6)])]


def _plain(model, groups) -> torch.Tensor:
    from sharedprefix.modeling import unwrap
    from sharedprefix.tools.reference import plain_logprobs

    with torch.no_grad():
        return plain_logprobs(unwrap(model), groups)[0].double().cpu()


def verify(model, groups=None, max_tokens: int | None = None, seed: int = 0,
           reference_device: str | torch.device | None = None) -> VerifyReport:
    """Check sharedprefix against the plain forward on ``model`` (see the module docstring).

    Args:
        groups: the groups to check on (default: two random groups sized to the model's vocabulary).
        max_tokens: the budget of the split check (default: half the longest group, so a group splits).
    """
    import sharedprefix as sp
    from sharedprefix.attention import indexed
    from sharedprefix.modeling import unwrap

    base = unwrap(model)
    from sharedprefix.streams import head_vocab, num_streams

    groups = groups if groups is not None else _random_groups(head_vocab(base), seed, num_streams(base))
    sizes = [int(g.prompt.shape[-1]) + sum(int(c.shape[-1]) for c in g.completions) for g in groups]  # positions
    split = max_tokens or max(max(int(c.shape[-1]) for g in groups for c in g.completions), max(sizes) // 2)
    outs, split_refusal = [], None
    with torch.no_grad():
        try:
            outs.append((None, sp.logprobs(model, groups).logprobs.double().cpu()))
        except ValueError as e:
            return VerifyReport(False, refusal=str(e))
        try:
            outs.append((split, sp.logprobs(model, groups, max_tokens=split).logprobs.double().cpu()))
        except ValueError as e:
            if str(e) != indexed.split_refusal(type(base).__name__):  # the model or the budget refused: as such
                return VerifyReport(False, refusal=f"with max_tokens={split}: {e}")
            split_refusal = str(e)  # the model is exact in one pass only: the split call refuses, never mismatches
    plain = _plain(model, groups)
    dev = reference_device or next(base.parameters()).device
    ref_model = copy.deepcopy(base).to(device=dev, dtype=torch.float64)
    from sharedprefix.tools.reference import dtype_faithful_norms

    dtype_faithful_norms(ref_model)
    exact = _plain(ref_model, groups)
    del ref_model
    checks = [(b, float((o - exact).abs().max()), float((plain - exact).abs().max())) for b, o in outs]
    return VerifyReport(all(ours <= 2 * pl + 1e-12 for _, ours, pl in checks), checks=checks,
                        split_refusal=split_refusal, split=split)


def self_check(model, groups) -> None:
    """With ``SHAREDPREFIX_SELF_CHECK=1``: verify once per model on its first real groups; raise on a mismatch."""
    if os.environ.get("SHAREDPREFIX_SELF_CHECK", "0") in ("", "0") or not isinstance(groups, list):
        return
    from sharedprefix.modeling import unwrap

    base = unwrap(model)
    if _CHECKED.get(base):
        return
    _CHECKED[base] = True  # before the check: its own sharedprefix calls must not check again
    with torch.random.fork_rng(devices=[]):
        report = verify(model, groups)
    if not report.ok:
        _CHECKED.pop(base, None)
        raise ValueError(
            f"SHAREDPREFIX_SELF_CHECK: sharedprefix does not reproduce the plain forward of "
            f"{type(base).__name__} on this batch:\n{report}\nDo not train with sharedprefix on this model; please "
            "report it with the model's config."
        )
