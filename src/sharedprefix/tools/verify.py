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
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sharedprefix import settings
from sharedprefix.api import register_call_check
from sharedprefix.layout.groups import Group
from sharedprefix.parallel.tensor import is_dtensor

_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class VerifyReport:
    """``ok``: exact by the 2x rule in every configuration that ran (False on a refusal of the one-pass check), or,
    for a low-precision model that makes discrete choices per token (``choices``: MoE routing, an indexer) and fails
    that rule, exact on the float64 copy (``float64``: sharedprefix's largest error there, at most ``FLOAT64_TOL``)
    with at most ``FLIPPED_SHARE`` of the tokens (``beyond``) past twice the plain run's largest error.
    ``refusal``: a refusal of either check, or None. ``split_refusal``: the refusal of the budget that splits a
    group by a model exact in one pass only (DeepSeek sparse attention whose indexers sharedprefix cannot reach),
    or None; the same call with that budget would refuse, never mismatch. ``checks``: per configuration (budget,
    our error, the plain run's error), errors as max |delta log-prob| against the float64 reference."""

    ok: bool
    refusal: str | None = None
    checks: list = field(default_factory=list)
    split_refusal: str | None = None
    split: int | None = None
    choices: str | None = None
    float64: float | None = None
    beyond: int | None = None
    untied: int | None = None

    def __str__(self) -> str:
        if self.refusal:
            return f"refused: {self.refusal}"
        lines = [
            f"max_tokens={b!s:>5}: sharedprefix error {ours:.2e}, plain error {plain:.2e} "
            f"({'OK' if ours <= 2 * plain + 1e-12 else 'MISMATCH'})"
            for b, ours, plain in self.checks
        ]
        if self.split_refusal:
            lines.append(f"max_tokens={self.split!s:>5}: refused ({self.split_refusal})")
        verdict = "exact by the 2x rule" + (
            " in one pass; a budget that splits a group is refused" if self.split_refusal else ""
        )
        if self.float64 is not None:
            lines.append(
                f"the model makes discrete choices per token ({self.choices}), which flip at near-ties between two "
                "roundings (the plain run's against float64 too) and move that token's log-prob by more than "
                f"rounding: {self.beyond} token(s) beyond twice the plain error (at most {FLIPPED_SHARE:.0%} may be), "
                + (
                    f"{self.untied} of them where the plain run's own top-k choice is not within {TIE_MARGIN} of a tie "
                    "(none may be); "
                    if self.untied is not None
                    else ""
                )
                + f"on the float64 copy sharedprefix's error is "
                f"{self.float64:.2e} (at most {FLOAT64_TOL:.0e})"
            )
            verdict = (
                "exact on the float64 copy; in low precision the few tokens beyond the 2x rule sit where the "
                "plain run's own discrete choice nearly ties, as flipped choices do"
            )
            if not self.ok and "indexer" in (self.choices or ""):
                lines.append(
                    "an indexer scores keys in float32 even on the float64 copy, and keys whose index scores tie "
                    "exactly at its top-k boundary (e.g. clipped to 0 by its ReLU for every head) are picked by "
                    "torch.topk in an unspecified order that depends on the row's layout, in the plain run as here: "
                    "a mismatch confined to a few tokens can be such a tie (docs/models.md: DeepSeek sparse attention)"
                )
        return "\n".join(lines + [f"-> {verdict if self.ok else 'NOT EXACT'}"])


def _random_groups(vocab: int, seed: int, streams: int = 1):
    """Four random groups of token ids (of (streams, n) frames for a model with several token streams)."""
    from sharedprefix.layout.groups import Group

    g = torch.Generator().manual_seed(seed)
    shape = lambda n: (n,) if streams == 1 else (streams, n)  # noqa: E731
    ids = lambda n: torch.randint(0, vocab, shape(n), generator=g)  # noqa: E731
    # 183 completion tokens: with 27 (before), the largest error exceeded twice the plain run's on an exact dense
    # model under bfloat16 autocast for 1 seed in 5 (VaultGemma, 2.25x); with these, OPT, Llama, Gemma 2 and
    # VaultGemma in bfloat16 or under autocast stayed at or below 1.43x over 8 seeds each
    return [
        Group(ids(40), [ids(16), ids(24), ids(1), ids(9)]),
        Group(ids(7), [ids(12), ids(12), ids(20)]),
        Group(ids(24), [ids(30), ids(5)]),
        Group(ids(2), [ids(18), ids(18), ids(18)]),
    ]


def default_groups(model, seed: int = 0):
    """The random groups verify checks ``model`` on when given none (frames for a model with several streams)."""
    from sharedprefix.model.streams import head_vocab, num_streams

    return _random_groups(head_vocab(model), seed, num_streams(model))


def _plain(model, groups) -> torch.Tensor:
    from sharedprefix.model.adapter import unwrap
    from sharedprefix.tools.reference import plain_logprobs

    with torch.no_grad():
        return plain_logprobs(unwrap(model), groups)[0].double().cpu()


def verify(
    model: torch.nn.Module,
    groups: Sequence[Group] | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
    reference_device: str | torch.device | None = None,
) -> VerifyReport:
    """Check sharedprefix against the plain forward on ``model`` (see the module docstring).

    Args:
        groups: the groups to check on (default: ``default_groups``, four random groups sized to the model's
            vocabulary).
        max_tokens: the budget of the split check (default: half the longest group, so a group splits).
    """
    import sharedprefix as sp
    from sharedprefix.attention import indexed
    from sharedprefix.model.adapter import unwrap

    base = unwrap(model)
    groups = groups if groups is not None else default_groups(base, seed)
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
    ref_model = float64_copy(base, dev)
    if getattr(ref_model.config, "_experts_implementation", None) not in (None, "eager"):
        ref_model.config._experts_implementation = "eager"  # the copy's own config: grouped_mm has no float64 kernel
    from sharedprefix.tools.reference import dtype_faithful_norms

    dtype_faithful_norms(ref_model)
    exact = _plain(ref_model, groups)
    plain_err = float((plain - exact).abs().max())
    checks = [(b, float((o - exact).abs().max()), plain_err) for b, o in outs]
    ok = all(ours <= 2 * pl + 1e-12 for _, ours, pl in checks)
    low = next(base.parameters()).dtype != torch.float64
    choices, float64, beyond, untied = (discrete_choices(base) if not ok and low else None), None, None, None
    if choices:  # a second opinion: the same algorithm on the float64 copy, where near-ties do not flip
        with torch.no_grad():
            float64 = max(
                float((sp.logprobs(ref_model, groups, max_tokens=b).logprobs.double().cpu() - exact).abs().max())
                for b, _ in outs
            )
        off = [((o - exact).abs() > 2 * plain_err + 1e-12).nonzero().tolist() for _, o in outs]
        beyond = max(len(x) for x in off)
        tokens = sum(int(c.shape[-1]) for g in groups for c in g.completions)
        # a flipped choice moves a few tokens; a low-precision error of the computation itself moves most
        ok = float64 <= FLOAT64_TOL and beyond <= max(1, tokens * FLIPPED_SHARE)
        if ok:  # and each of them where the plain run's own choice, at the position predicting it, nearly ties
            from sharedprefix.tools.ties import tie_margins

            margins = tie_margins(base, groups)
            prompt = [int(g.prompt.shape[-1]) for g in groups for _ in g.completions]
            untied = len({(r, t) for x in off for r, t in x if not float(margins[r][prompt[r] + t - 1]) < TIE_MARGIN})
            ok = untied == 0
    del ref_model
    return VerifyReport(
        ok,
        checks=checks,
        split_refusal=split_refusal,
        split=split,
        choices=choices,
        float64=float64,
        beyond=beyond,
        untied=untied,
    )


def float64_copy(base, device) -> torch.nn.Module:
    """A float64 copy of ``base`` on ``device``, outside any parallelism: a deep copy, or, where parameters are
    DTensors (tensor parallelism, FSDP2), the same class built from a copy of its config, with every tensor of the
    state dict gathered whole (``full_tensor``, a collective every rank of the mesh runs in the same order)."""
    state = base.state_dict()
    if not any(is_dtensor(t) for t in state.values()):
        return copy.deepcopy(base).to(device=device, dtype=torch.float64)
    cfg = copy.deepcopy(base.config)
    if hasattr(cfg, "distributed_config"):
        cfg.distributed_config = None  # the copy is built whole on this process
    whole = {k: t.full_tensor() if is_dtensor(t) else t for k, t in state.items()}
    ref = type(base)._from_config(cfg, attn_implementation=base.config._attn_implementation)
    ref.load_state_dict(whole, strict=True)
    return ref.to(device=device, dtype=torch.float64).eval()


FLOAT64_TOL = 1e-5  # |delta log-prob| of the float64 copy (routers and indexers score in float32 even there)
# At most this share of the tokens (and at least one) beyond twice the plain error, for flipped choices: 40 runs of 5
# tiny MoE models in bfloat16 (8 seeds each) flipped one token once; a bug confined to the first token of each
# completion (12 of the default 183) is not excused.
FLIPPED_SHARE = 0.02
# A token off by more than rounding is a flipped choice only where the plain run's top-k choice at the position
# predicting it is within this relative margin of a tie (``tools.ties``): the one flip of those 40 runs sat at
# 0.0077 (the row's median margin 0.61); indexer ties clipped to 0 by its ReLU sit at 0.
TIE_MARGIN = 0.05


def discrete_choices(model) -> str | None:
    """What per-token discrete choices ``model`` makes (top-k expert routing, an indexer's top-k keys), or None.
    Such a choice flips at a near-tie between two roundings of the same computation (the plain run against a
    float64 copy, or against sharedprefix), and a flipped choice moves that token's log-prob by far more than
    rounding, so the 2x rule on the largest error does not judge these models in low precision."""
    from sharedprefix.attention import indexed, switch

    out = []
    names = [type(m).__name__.lower() for m in model.modules()]
    # the modules of a routed layer (not every class of a MoE family: a tiny config may hold dense layers only)
    if any("experts" in n or "router" in n or n.endswith(("moe", "moeblock", "moelayer")) for n in names):
        out.append("top-k expert routing")
    if indexed.is_indexed(switch.model_configs(model)):
        out.append("an indexer's top-k keys")
    return " and ".join(out) or None


def self_check(model, groups) -> None:
    """With ``SHAREDPREFIX_SELF_CHECK=1``: verify once per model on its first real groups; raise on a mismatch."""
    if settings.read("SHAREDPREFIX_SELF_CHECK") == "0" or not isinstance(groups, list):
        return
    from sharedprefix.model.adapter import unwrap

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
    if report.float64 is not None:  # passed on the float64 copy's second opinion: said, not silent
        warnings.warn(f"SHAREDPREFIX_SELF_CHECK on {type(base).__name__}:\n{report}", stacklevel=3)


register_call_check(self_check)
