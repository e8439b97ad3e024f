"""Hold ``sp.plan_step`` to the plain accumulation on zoo entries: one optimizer step's microbatches over one
prefix cache, against the plain transformers forward of every ``[prompt + completion]`` row of each microbatch.

``check_step(entry)`` builds the entry tiny in float64 (``zoo.configs``, as ``zoo.check``), lays out four prompts of
three completions (``step_groups``): two sharing a prefix, one that prefix itself (the strict prefix of both), one
apart; shuffles the rows (as TRL's sampler does) over ``MICROBATCHES`` microbatches so that every prompt's rows
fall in at least two of them; and requires, in each prefix mode and without a budget and under ``BUDGET`` (below
every prompt's length), that ``sp.backward`` per microbatch reports the plain log-probs to 1e-9 and accumulates
the plain gradient of ``sum_k sum(W_k * logprobs_k)`` (plus the MoE load-balancing loss of each microbatch's
rows where the config has it) to a relative 1e-9; and the same of deferred ``sp.logprobs`` per microbatch, and of the
rows given as trees (``as_tree``: the common prefixes of different prompts shared too). ``CONFIGS``: every
configuration (``python -m sharedprefix.tools.zoo --steps``); ``QUICK``: the suite's
(``tests/schedule/test_step_zoo.py``, on ``representatives``).

Where the plain float64 forward computes parts in float32 (``checks.Result.float32_inside``), both runs compute
them in float64 (``reference.Float64Inside``) and the 1e-9 tolerances hold; where float32 remains even then
(transformers' load-balancing loss), the float32 tolerances of ``zoo.check`` do.

Outcomes: ``exact``; ``refused``: a ``ValueError`` at ``plan_step`` or at the step's first call, before any
gradient exists, with a message in a ``checks.REFUSALS`` category (``single_refused`` says whether a single
call of the same rows is refused too); ``failed``: anything else (a mismatch, a crash, a late or uncategorised
refusal).
"""

from __future__ import annotations

import contextlib
import inspect
import re
import time
from dataclasses import dataclass, field

import torch

from sharedprefix.tools.zoo.checks import (
    GRAD_TOL,
    GRAD_TOL_FLOAT32_INSIDE,
    LOGPROB_TOL,
    LOGPROB_TOL_FLOAT32_INSIDE,
    LowPrecisionOps,
    features,
    grad_error,
    plain_aux_loss,
    refusal_category,
)
from sharedprefix.tools.zoo.configs import NotBuildable, build, entries, first_line, float64_norms, token_ids

# What a step refuses where single calls are exact: (label, pattern its message must match).
STEP_REFUSALS = [
    (
        "a step of a hybrid on the cache path (its group-by-group run keeps no prefix cache for a step to hold)",
        r"sp\.plan_step is not available with .*hybrid model on the cache path",
    )
]
MODES = ("keep", "offload", "recompute")
BUDGET = 6  # max_tokens below every prompt's length: each prompt in several passes, rows of a group apart
MICROBATCHES = 3
AUX_COEF = 0.5
# (prompt, completion lengths): prompt 0 is the strict prefix of prompts 1 and 2 (which share it and differ
# after), prompt 3 stands apart
PREFIX, TAILS, APART = 7, (3, 4), 8
COMPLETIONS = ((2, 5, 3), (4, 1, 6), (3, 3, 2), (5, 2, 4))


# (prefix_activations, max_tokens, deferred log-probs instead of sp.backward, the rows as trees)
CONFIGS = (
    tuple((m, b, False, False) for m in MODES for b in (None, BUDGET))
    + (("keep", BUDGET, True, False),)
    + tuple((m, BUDGET, False, True) for m in MODES)
    + (("recompute", None, True, True),)
)
# the suite's: each mode, each budget, both calls and both kinds of rows once
QUICK = (
    ("keep", None, False, False),
    ("offload", BUDGET, False, False),
    ("keep", BUDGET, True, False),
    ("recompute", BUDGET, False, True),
)


@dataclass
class StepResult:
    """One entry's outcome under ``plan_step``.

    Attributes:
        status: "exact", "refused", "failed" or "not buildable".
        detail: the refusal message or what failed (with the configuration).
        category: a refusal's ``REFUSALS`` label.
        single_refused: a refusal's: a single ``sp.logprobs`` call of the same rows is refused too.
        logprob_err: max |step - plain| log-prob over every configuration (nats).
        grad_err: max relative gradient error over every configuration.
        float64_inside: the model's float32 ops computed in float64 for the comparison (``Float64Inside``).
        tolerance: (log-prob, gradient) tolerances held to.
        features: ``checks.features`` of the model.
    """

    arch: str
    status: str = "failed"
    detail: str = ""
    category: str = ""
    single_refused: bool = False
    logprob_err: float = 0.0
    grad_err: float = 0.0
    float64_inside: bool = False
    tolerance: tuple[float, float] = (LOGPROB_TOL, GRAD_TOL)
    features: list[str] = field(default_factory=list)
    seconds: float = 0.0


def step_groups(model, seed: int = 0) -> list:
    """The ``LAYOUT`` groups of token ids the model treats as ordinary (frames for several token streams)."""
    import sharedprefix as sp

    ids = token_ids(model, seed)
    prefix, apart = ids(PREFIX), ids(APART)
    if prefix.dim() == 2:  # frames: a prompt opens with the BOS frame (as ``configs.groups``)
        prefix[:, 0] = apart[:, 0] = model.config.get_text_config().bos_token_id
    prompts = [prefix] + [torch.cat([prefix, ids(n)], -1) for n in TAILS] + [apart]
    return [sp.Group(p, [ids(n) for n in ns]) for p, ns in zip(prompts, COMPLETIONS)]


def microbatches(gs: list, k: int = MICROBATCHES, seed: int = 0) -> list[list]:
    """The rows of ``gs`` shuffled over ``k`` microbatches (TRL's sampler), the first shuffle that spreads every
    group over at least two; a microbatch's consecutive rows of one prompt form one group."""
    import sharedprefix as sp

    rows = [(gi, ci) for gi, g in enumerate(gs) for ci in range(len(g.completions))]
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
        parts = [order[i * len(order) // k : (i + 1) * len(order) // k] for i in range(k)]
        if all(len({j for j, part in enumerate(parts) for gi, _ in part if gi == g}) >= 2 for g in range(len(gs))):
            break
    out = []
    for part in parts:
        mb: list = []
        for gi, ci in part:
            if mb and mb[-1][0] == gi:
                mb[-1][1].append(gs[gi].completions[ci])
            else:
                mb.append((gi, [gs[gi].completions[ci]]))
        out.append([sp.Group(gs[gi].prompt, cs) for gi, cs in mb])
    return out


def as_tree(mb: list):
    """The rows ``[prompt + completion]`` of a microbatch of groups as an ``sp.Tree`` (completion tokens trained:
    the same log-probs, but every common prefix of the step's rows shared, a prompt that is the strict prefix of
    others a node of the trie), and ``cols`` (n, T): each completion token's column in its tree row (padding: -1)."""
    import sharedprefix as sp

    rows, trained, cols = [], [], []
    T = max(c.shape[-1] for g in mb for c in g.completions)
    for g in mb:
        P = g.prompt.shape[-1]
        for c in g.completions:
            rows.append(torch.cat([g.prompt, c]))
            trained.append([False] * P + [True] * c.shape[-1])
            cols.append(torch.cat([torch.arange(P, P + c.shape[-1]), torch.full((T - c.shape[-1],), -1)]))
    return sp.Tree.from_rows(rows, trained), torch.stack(cols)


def _weights(mbs, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(
            sum(len(g.completions) for g in mb),
            max(c.shape[-1] for g in mb for c in g.completions),
            dtype=torch.float64,
            generator=gen,
        )
        for mb in mbs
    ]


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def check_step(entry: str, configs: tuple = CONFIGS) -> StepResult:
    """Build a zoo entry tiny and hold ``sp.plan_step`` to the plain accumulation (the module docstring)."""
    start = time.perf_counter()
    res = StepResult(entry)
    try:
        model, _ = build(entry)
    except NotBuildable as e:
        res.status, res.detail = "not buildable", str(e)
    else:
        try:
            _check_model(model, res, configs)
        except NotBuildable as e:
            res.status, res.detail = "not buildable", str(e)
        except Exception as e:  # noqa: BLE001  (the probe's own setup: the plain forward of the model)
            res.status, res.detail = "failed", f"{type(e).__name__}: {first_line(e)}"
    res.seconds = time.perf_counter() - start
    return res


def _check_model(model, res: StepResult, configs: tuple) -> None:
    gs = step_groups(model)
    mbs = microbatches(gs)
    Ws = _weights(mbs)
    patched = float64_norms(model)
    low, plain_error = _plain_ops(model, gs)
    if plain_error is not None and patched:  # a norm replacement that does not fit this model's use of it
        for mod in patched:
            del mod.forward
        low, plain_error = _plain_ops(model, gs)
    try:  # a refusal first, as zoo.check's: before the plain run's gradient (Reformer's needs train mode)
        _run_step(model, mbs, Ws, None, "keep", None, False, False, res, plan_only=True)
    except _Refused:
        if res.status == "refused" or plain_error is None:
            return
    except Exception:
        if plain_error is None:
            raise
    if plain_error is not None:  # the model's own forward fails
        msg = f"plain forward fails: {type(plain_error).__name__}: {first_line(plain_error)}"
        raise NotBuildable(msg) from plain_error
    mode: contextlib.AbstractContextManager = contextlib.nullcontext()
    if low is not None and low.ops and not getattr(model.config.get_text_config(), "output_router_logits", False):
        res.float64_inside = True  # (not where transformers' load-balancing loss runs: it fails in float64)
        mode = float64_inside()
    with mode:
        _compare(model, gs, mbs, Ws, res, configs)
    res.features = features(model)


def _plain_ops(model, gs):
    """(the ops of the plain forward that compute below float64, or None; the forward's error, or None)."""
    from sharedprefix.tools.reference import plain_logprobs

    low = LowPrecisionOps(model)
    try:
        with torch.no_grad(), low:
            plain_logprobs(model, gs)
    except Exception as e:  # noqa: BLE001  (transformers' own forward fails at this size or in float64)
        return None, e
    return low, None


@contextlib.contextmanager
def float64_inside():
    """``reference.Float64Inside``, also inside the backward of autograd functions (torch leaves function modes
    outside the backward pass; sharedprefix's deferred log-probs run their passes there)."""
    from torch.autograd.function import BackwardCFunction

    from sharedprefix.tools.reference import Float64Inside

    own = BackwardCFunction.apply

    def apply(self, *args):
        with Float64Inside():
            return own(self, *args)

    BackwardCFunction.apply = apply  # type: ignore[method-assign]
    try:
        with Float64Inside():
            yield
    finally:
        BackwardCFunction.apply = own  # type: ignore[method-assign]


def _compare(model, gs, mbs, Ws, res: StepResult, configs: tuple) -> None:
    from sharedprefix.tools.reference import plain_logprobs

    low = LowPrecisionOps(model)
    with torch.no_grad(), low:
        want_lp = [plain_logprobs(model, mb)[0] for mb in mbs]
        aux = [plain_aux_loss(model, mb) for mb in mbs]
    coef = AUX_COEF if aux[0] is not None else None
    if low.ops or coef is not None:  # float32 left inside (transformers' load-balancing loss)
        res.tolerance = (LOGPROB_TOL_FLOAT32_INSIDE, GRAD_TOL_FLOAT32_INSIDE)

    def plain_loss():
        total = sum((plain_logprobs(model, mb)[0] * W).sum() for mb, W in zip(mbs, Ws))
        return total + (coef * sum(plain_aux_loss(model, mb) for mb in mbs) if coef is not None else 0.0)

    model.zero_grad(set_to_none=True)
    plain_loss().backward()
    want = _grads(model)
    for prefix_mode, budget, deferred, tree in configs:
        if tree and gs[0].prompt.dim() == 2:  # (trees hold token ids, not frames)
            continue
        where = (
            f"{'trees' if tree else 'groups'}, prefix_activations={prefix_mode!r}, max_tokens={budget}"
            f"{', deferred log-probs' if deferred else ''}"
        )
        try:
            got_lp = _run_step(model, mbs, Ws, coef, prefix_mode, budget, deferred, tree, res)
        except _Refused:
            res.detail = f"{where}: {res.detail}"
            return
        except Exception as e:  # noqa: BLE001  (a crash is a failure: it must become exact or a clear refusal)
            model.zero_grad(set_to_none=True)
            res.status, res.detail = "failed", f"{where}: {type(e).__name__}: {first_line(e)}"
            return
        got = _grads(model)
        lp_err = max(float((g - w).abs().max()) for g, w in zip(got_lp, want_lp))
        grad_err = grad_error(got, want)
        res.logprob_err, res.grad_err = max(res.logprob_err, lp_err), max(res.grad_err, grad_err)
        tol, gtol = res.tolerance
        if not (lp_err <= tol and grad_err <= gtol):
            res.status = "failed"
            res.detail = (
                f"{where}: silent mismatch: log-probs {lp_err:.3g} (tol {tol}), gradients {grad_err:.3g} ({gtol})"
            )
            return
    res.status = "exact"


class _Refused(Exception):
    pass


def _run_step(
    model, mbs, Ws, coef, prefix_mode, budget, deferred, tree, res: StepResult, plan_only: bool = False
) -> list[torch.Tensor]:
    """Run one step of ``mbs`` (as trees: ``as_tree``); the log-probs each microbatch reported, (n_k, T_k) as the
    groups' (``Ws``). A ``ValueError`` at ``plan_step`` or at the first call is recorded in ``res`` as a refusal
    (``_Refused``)."""
    import sharedprefix as sp

    cols = [None] * len(mbs)
    if tree:
        trees = [as_tree(mb) for mb in mbs]
        mbs, cols = [t for t, _ in trees], [c for _, c in trees]
        # each completion token's weight at its tree column (the columns of padding weigh 0)
        Ws = [
            torch.zeros(c.shape[0], int(c.max()) + 2, dtype=W.dtype).scatter_(1, c + 1, W)[:, 1:]
            for c, W in zip(cols, Ws)
        ]
    model.zero_grad(set_to_none=True)
    step = None
    out = []
    k = 0
    try:
        step = sp.plan_step(model, mbs, max_tokens=budget, prefix_activations=prefix_mode)
        if plan_only:
            step.release()
            return []
        for k, W in enumerate(Ws):
            if deferred:
                o = sp.logprobs(model, step.microbatch(k))
                out.append(_columns(o.logprobs.detach(), cols[k]))
                loss = (o.logprobs * W).sum() + (coef * o.aux_loss if coef is not None else 0.0)
                loss.backward()
            else:
                lp = torch.zeros_like(W)

                def loss_fn(b, W=W, lp=lp):
                    lp[b.index, : b.logprobs.shape[1]] = b.logprobs.detach().to(lp.dtype) * b.mask
                    return (b.logprobs * W[b.index, : b.logprobs.shape[1]] * b.mask).sum()

                kw = {"aux_loss_coef": coef} if coef is not None else {}
                sp.backward(model, step.microbatch(k), loss_fn, **kw)
                out.append(_columns(lp, cols[k]))
    except ValueError as e:
        touched = [n for n, p in model.named_parameters() if p.grad is not None]
        if step is not None:
            step.release()
        model.zero_grad(set_to_none=True)
        if k > 0 or touched or out:
            raise RuntimeError(f"refused at microbatch {k}, after gradients reached {touched[:3]}: {e}") from e
        res.detail = f"{'sp.plan_step' if step is None else 'the first call'}: {e}"
        res.category = refusal_category(str(e)) or next(
            (label for label, pat in STEP_REFUSALS if re.search(pat, str(e), re.S)), ""
        )
        res.single_refused = _single_refused(model, mbs)
        if not res.category:
            res.detail = f"refusal in no category of zoo.REFUSALS: {res.detail}"
            res.status = "failed"
        else:
            res.status = "refused"
        raise _Refused from e
    return out


def _columns(lp: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
    """(n, T) completion log-probs from a tree's (n, L) (``as_tree``'s ``cols``; padding 0)."""
    if cols is None:
        return lp
    return lp.gather(1, cols.clamp_min(0)) * (cols >= 0)


def _single_refused(model, mbs) -> bool:
    import sharedprefix as sp

    try:
        with torch.no_grad():
            sp.logprobs(model, mbs[0])
    except ValueError:
        return True
    return False


# -- a representative subset ------------------------------------------------------------------------------------------
# The feature classes a step can break on, each held by one exact entry of the zoo: the attention features
# ``checks.features`` reports (read from the zoo table of docs/models.md, which ``tests/model/test_zoo.py`` keeps equal
# to them), and what a tiny config or the model class says (hybrid families, tied embeddings, a vision tower, positions
# the model numbers itself).
FEATURES = (
    "sliding window",
    "chunked attention",
    "attention sinks",
    "attention-score soft-capping",
    "latent attention (value head dim != query head dim)",
    "MoE load-balancing loss",
    "keys selected by an indexer (DeepSeek sparse attention)",
    "several attention calls per layer (looped layers, differential attention)",
)
CONFIG_CLASSES = (
    "tied embeddings",
    "untied embeddings",
    "vision tower",
    "positions numbered by the model (no position_ids input)",
)


def classes() -> tuple[str, ...]:
    """Every class ``representative`` picks an entry for."""
    from sharedprefix.model.mixers.families import FAMILIES

    kinds = sorted({_hybrid_kind(fam) for fam in FAMILIES.values()})
    return FEATURES + CONFIG_CLASSES + tuple(f"hybrid: {k}" for k in kinds)


def _hybrid_kind(fam) -> str:
    """A hybrid family's class name: its token mixers' kinds joined ("conv+delta"), else its path ("cache")."""
    return "+".join(k for f in (fam.mixers or {}).values() for k in f) or fam.path


def zoo_table(page: str) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """(entries exact to 1e-9, entries exact at the float32 level, feature -> entries): the zoo table of a docs page."""
    from sharedprefix.tools.zoo.readme import current_block

    with open(page, encoding="utf-8") as f:
        block = current_block(f.read()) or ""
    rows = [line for line in block.splitlines() if line.startswith("| exact")]
    names = [re.findall(r"`([^`]+)`", r.rsplit("|", 2)[1].split("; gradients of")[0]) for r in rows[:2]]
    feats = {}
    for f, listed in re.findall(r"(?:: |; )([^;:]+?) \(\d+: ([^)]*)\)", block):
        feats[f] = re.findall(r"`([^`]+)`", listed)
    return names[0], names[1], feats


def _has_class(entry: str, cls: str) -> bool:
    """Whether ``entry`` has a class of ``CONFIG_CLASSES`` or ``hybrid: ...``: from its model class where that says
    it, else from its tiny config."""
    import transformers

    from sharedprefix.model.mixers.families import FAMILIES
    from sharedprefix.tools.zoo.configs import all_configs, tiny_config

    model_class = getattr(transformers, entries()[entry])
    if cls == "vision tower":
        return any("vision" in name for name in getattr(model_class.config_class, "sub_configs", {}))
    if cls == "positions numbered by the model (no position_ids input)":
        return "position_ids" not in inspect.signature(model_class.forward).parameters
    if cls.startswith("hybrid: "):
        fam = FAMILIES.get(entry.split("+")[0])
        return fam is not None and cls == "hybrid: " + _hybrid_kind(fam)
    tied = any(getattr(c, "tie_word_embeddings", False) for c in all_configs(tiny_config(entry)))
    return tied == (cls == "tied embeddings")


def representatives(page: str) -> dict[str, str]:
    """class -> the entry that holds it in the suite: an entry already picked when it has the class, else the first
    entry in zoo order (exact to 1e-9 before float32-level ones: no ``Float64Inside``, faster) that has it; hybrids of
    the cache path, refused by a step, from the zoo's entries of that path."""
    from sharedprefix.model.mixers.families import CACHE, on_path

    exact, exact32, feats = zoo_table(page)
    order = exact + exact32
    hybrids_cache = [e for e in entries() if e in order and on_path(e, CACHE)]

    def has(entry, cls):
        return entry in feats.get(cls, ()) if cls in FEATURES else _has_class(entry, cls)

    out: dict[str, str] = {}
    for cls in classes():
        pool = hybrids_cache if cls == "hybrid: cache" else order
        picked = [e for e in dict.fromkeys(out.values()) if e in pool and has(e, cls)]
        found = picked[:1] or [e for e in pool if has(e, cls)][:1]
        if found:
            out[cls] = found[0]
    return out


def run(names=None, log=None, configs: tuple = CONFIGS) -> list[StepResult]:
    """``check_step`` every entry in ``names`` (default: all); ``log`` gets one line per entry."""
    out = []
    for name in names or entries():
        r = check_step(name, configs)
        out.append(r)
        if log:
            errs = f"lp {r.logprob_err:.1e} grad {r.grad_err:.1e}" if r.status == "exact" else ""
            log(f"{name:28s} {r.status:14s} {r.seconds:5.1f}s {errs} {r.category or r.detail[:200]}")
    return out
