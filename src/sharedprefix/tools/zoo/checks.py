"""Hold sharedprefix to the plain forward on every zoo entry: exact, refused with its reason, or not buildable.

``check(entry)`` builds the entry tiny (``zoo.configs``), in float64, and requires one of:

- ``exact``: ``sp.logprobs`` equals the plain transformers forward of every ``[prompt + completion]`` row
  to 1e-9 (float64 log-probs, nats), in one pass and under a budget that splits a group across passes
  (cached prompt K/V), and the gradient of a random linear function of the log-probs equals the plain one
  to a relative 1e-9; with ``output_router_logits=True`` also the MoE load-balancing loss (``aux_loss``,
  float32 in transformers: to a relative 1e-6) against one plain forward of all rows (padding masked), and the
  gradient includes it. Where the plain forward of the float64 model itself computes in float32 (eager
  attention's softmax, routers, float32 logits: ``Result.float32_inside`` names the ops), it is only
  float32-accurate, and the zoo holds sharedprefix to 1e-6 / 1e-5 instead and says so; gradients beyond 1e-5
  pass only within twice the plain run's own error against the same model computing those ops in float64
  (``testing.Float64Inside``: the flash-attention rule), both errors relative to the model's largest gradient
  (``_grad_error_at_scale``: float32 noise of a gradient that nearly cancels is of that scale, not of its own);
- ``refused``: ``sp.logprobs`` raised ``ValueError`` before returning anything or touching a gradient,
  with a message in one of the ``REFUSALS`` categories (each names the feature and why);
- ``not buildable``: the tiny config, the model or its own plain forward fails (``EXPECTED_NOT_BUILDABLE``
  says why for each).

Anything else (a mismatch, another exception, a refusal in no category) is ``failed``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch

from sharedprefix.tools.zoo.configs import NotBuildable, build, config_value, entries, first_line, float64_norms, groups

LOGPROB_TOL = 1e-9
GRAD_TOL = 1e-9
LOGPROB_TOL_FLOAT32_INSIDE = 1e-6
GRAD_TOL_FLOAT32_INSIDE = 1e-5
AUX_TOL = 1e-6  # relative, on the MoE load-balancing loss: transformers computes it in float32 in any model
BUDGET = 12  # max_tokens of the schedule check: splits the first group (9 + 5 + 3 + 6 tokens) across passes

# Entries that cannot be built tiny here, and why (a new one fails the zoo test until it is explained).
EXPECTED_NOT_BUILDABLE = {
    "gemma3n": "its vision tower is a timm model and timm is not installed",
    "gemma4_assistant": "a draft model: its forward needs the target model's shared K/V states",
    "gemma4_unified_assistant": "a draft model: its forward needs the target model's shared K/V states",
    "xglm": "its own forward fails in float64 (it fills a float32 tensor with float64's minimum)",
}

# Refusal categories: (docs label, pattern its message must match). A refusal that fits none fails the
# zoo, so every refusal names its feature and why.
REFUSALS: list[tuple[str, str]] = [
    (
        "token mixing outside attention (state-space, linear attention, recurrence, convolution)",
        r"mix tokens outside attention|convolution over tokens",
    ),
    ("attention outside transformers' attention interface", r"bypasses transformers' attention interface"),
    (
        "positions numbered by the model itself (no position_ids input, or a numbering other than RoBERTa's)",
        r"takes no position_ids|numbers the positions of a row differently",
    ),
    ("attention masks other than causal, sliding-window or chunked", r"neither causal nor a causal sliding window"),
    ("attention-score soft-capping on a backend without it (torch's CUDA flash ops)", r"attention-score soft-capping"),
    ("query scaling by the token's index in the row (Llama 4 attn_temperature_tuning)", r"attn_temperature_tuning"),
    ("several attention calls per layer, split across passes", r"runs its attention \d+ times in one forward"),
    (
        "keys selected by an indexer (DeepSeek sparse attention), split across passes",
        r"selects the keys of each query with an indexer",
    ),
    (
        "keys selected by an indexer that overlays its own mask (Kolibri 1.1)",
        r"overlays its own selection on the attention mask",
    ),
    ("keys beyond the row (memory, compressed keys)", r"attends over \d+ keys for a row"),
    ("an LM head sharedprefix cannot reproduce", r"turns hidden states into logits"),
    ("RoPE scaling that depends on the longest position", r"RoPE scaling, whose frequencies"),
    ("other attention arguments (position biases, non-causal flags)", r"attention arguments .* cannot honour"),
    ("a decoder that fails when run on a packed row", r"fails on a probe row"),
    ("an MoE load-balancing loss sharedprefix cannot reproduce", r"output_router_logits=True, but"),
]


@dataclass
class Result:
    """One architecture's outcome.

    Attributes:
        status: "exact", "refused", "not buildable" or "failed".
        detail: the refusal message, the reason it is not buildable, or what failed.
        category: the docs label of a refusal (docs/models.md).
        logprob_err: max |sp - plain| log-prob (nats), None when not compared.
        grad_err: max relative gradient error, None when not compared.
        float32_inside: the ops the plain float64 forward runs in float32 (outside rotary embeddings), which
            hold the comparison to the float32 tolerances, or "".
        split_refusal: the refusal under a budget that splits a group (exact in one pass), or "".
        float32_rule: set when the gradients, beyond the float32 tolerance against the plain run, are within twice
            the plain run's own error against the model computing its float32 ops in float64
            (``testing.Float64Inside``), or "".
        features: attention features the entry exercised (sliding window, chunked, sinks, latent, MoE, looped).
    """

    arch: str
    model_class: str
    status: str
    detail: str = ""
    category: str = ""
    logprob_err: float | None = None
    grad_err: float | None = None
    float32_inside: str = ""
    split_refusal: str = ""
    float32_rule: str = ""
    features: list[str] = field(default_factory=list)
    seconds: float = 0.0


class LowPrecisionOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops of a float64 model that produce float32 (or lower) tensors, outside its rotary embeddings
    (whose float32 cos/sin are the same per position in both runs and so cancel in the comparison)."""

    def __init__(self, model):
        super().__init__()
        self.ops: set[str] = set()
        self.depth = 0
        self.hooks = []
        for mod in model.modules():
            if "Rotary" in type(mod).__name__:
                self.hooks.append(mod.register_forward_pre_hook(lambda *_: setattr(self, "depth", self.depth + 1)))
                self.hooks.append(mod.register_forward_hook(lambda *_: setattr(self, "depth", self.depth - 1)))

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.depth == 0:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                    self.ops.add(func.__name__.split(".")[0])
        return out


def _grads(model, fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    fn().backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def grad_error(got: dict, want: dict) -> float:
    """Max over tensors of |got - want| / max|want|; a tensor whose exact gradient is zero is held to 1e-6
    of the model's largest gradient instead of its own rounding noise."""
    if set(got) != set(want):
        return float("inf")
    floor = 1e-6 * max(float(w.abs().max()) for w in want.values())
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(floor)) for n in want)


def _grad_error_at_scale(got: dict, want: dict) -> float:
    """Max over tensors of |got - want|, relative to the model's largest gradient: the scale of float32 rounding in
    gradients that are sums of larger terms (a tensor whose gradient nearly cancels, such as a gated delta net's
    ``A_log``, carries float32 noise of the model's scale, far beyond its own size)."""
    if set(got) != set(want):
        return float("inf")
    scale = max(float(w.abs().max()) for w in want.values())
    return max(float((got[n] - want[n]).abs().max()) for n in want) / scale


def refusal_category(msg: str) -> str:
    return next((label for label, pat in REFUSALS if re.search(pat, msg, re.S)), "")


def check(entry: str, grads: bool = True) -> Result:
    """Build a zoo entry tiny and hold sharedprefix to the plain forward (see the module docstring)."""
    start = time.perf_counter()
    res = Result(entry, entries()[entry], "failed")
    try:
        model, _ = build(entry)
    except NotBuildable as e:
        res.status, res.detail = "not buildable", str(e)
    else:
        _check_model(model, grads, res)
    res.seconds = time.perf_counter() - start
    return res


def _plain(model, gs):
    """(N, T) plain log-probs and the ops the model ran in float32 (None, error when the forward fails)."""
    from sharedprefix.tools.reference import plain_logprobs

    low = LowPrecisionOps(model)
    try:
        with torch.no_grad(), low:
            return plain_logprobs(model, gs)[0], low.ops, None
    except Exception as e:  # noqa: BLE001  (transformers' own forward fails at this size or in float64)
        return None, None, e


def _check_model(model, grads: bool, res: Result) -> None:
    import sharedprefix as sp

    gs = groups(model)
    patched = float64_norms(model)
    ref, low_ops, plain_error = _plain(model, gs)
    if plain_error is not None and patched:  # a norm replacement that does not fit this model's use of it
        for mod in patched:
            del mod.forward
        ref, low_ops, plain_error = _plain(model, gs)
    model.zero_grad(set_to_none=True)
    try:
        out = sp.logprobs(model, gs)  # grad enabled: a refusal must come before any gradient exists
    except ValueError as e:
        touched = [n for n, p in model.named_parameters() if p.grad is not None]
        res.detail = str(e)
        res.category = refusal_category(res.detail)
        if plain_error is not None and not res.category:  # the model's own error, as in its plain forward
            res.status = "not buildable"
            res.detail = f"plain forward fails: {type(plain_error).__name__}: {first_line(plain_error)}"
        elif touched:
            res.detail = f"refused after gradients reached {touched[:3]}: {e}"
        elif not res.category:
            res.detail = f"refusal in no category of zoo.REFUSALS: {e}"
        else:
            res.status = "refused"
        return
    except Exception as e:  # noqa: BLE001  (a crash is a failure: it must become exact or a clear refusal)
        if plain_error is None:
            res.detail = f"{type(e).__name__}: {first_line(e)}"
            return
    if plain_error is not None:
        res.status = "not buildable"
        res.detail = f"plain forward fails: {type(plain_error).__name__}: {first_line(plain_error)}"
        return
    _compare(model, gs, ref, out, low_ops, grads, res)


def plain_aux_loss(model, gs):
    """The MoE load-balancing loss of one plain forward of every ``[prompt + completion]`` row, right-padded with
    the row's first token and masked out; None when the model returns none, or for groups of frames (models with
    several token streams per position, MusicGen's, have no experts)."""
    if any(g.streams for g in gs):
        return None
    rows = [torch.cat([g.prompt, c]) for g in gs for c in g.completions]
    width = max(r.numel() for r in rows)
    ids = torch.stack([torch.cat([r, r[:1].expand(width - r.numel())]) for r in rows])
    mask = (torch.arange(width)[None] < torch.tensor([r.numel() for r in rows])[:, None]).long()
    return getattr(model(input_ids=ids, attention_mask=mask, use_cache=False), "aux_loss", None)


def _aux_error(got, want) -> float:
    if got is None or want is None:
        return 0.0 if got is None and want is None else float("inf")
    return float((got.detach().double() - want.detach().double()).abs() / want.detach().double().abs().clamp_min(1e-12))


def _compare(model, gs, ref, out, low_ops, grads, res):
    import sharedprefix as sp
    from sharedprefix.tools.reference import plain_logprobs

    tol, gtol = LOGPROB_TOL, GRAD_TOL
    if low_ops:  # the plain forward itself is only float32-accurate there
        res.float32_inside = ", ".join(sorted(low_ops))
        tol, gtol = LOGPROB_TOL_FLOAT32_INSIDE, GRAD_TOL_FLOAT32_INSIDE
    res.logprob_err = float((out.logprobs.detach() - ref).abs().max())
    if not res.logprob_err <= tol:
        res.detail = f"silent mismatch: max |d logprob| = {res.logprob_err:.3g} > {tol}"
        return
    with torch.no_grad():
        want_aux = plain_aux_loss(model, gs)
    if want_aux is not None:  # a float32 loss: its gradient is float32-accurate too
        res.float32_inside = ", ".join(x for x in (res.float32_inside, "aux_loss") if x)
        gtol = GRAD_TOL_FLOAT32_INSIDE
    if not _aux_error(out.aux_loss, want_aux) <= AUX_TOL:
        res.detail = f"silent mismatch of the load-balancing loss: {out.aux_loss} against the plain {want_aux}"
        return
    try:
        with torch.no_grad():  # the schedule: a group split across passes, with cached prompt K/V
            split_out = sp.logprobs(model, gs, max_tokens=BUDGET)
            split = split_out.logprobs
        if not _aux_error(split_out.aux_loss, want_aux) <= AUX_TOL:
            res.detail = (
                f"silent mismatch of the load-balancing loss under max_tokens={BUDGET}: {split_out.aux_loss} against "
                f"the plain {want_aux}"
            )
            return
    except ValueError as e:  # exact in one pass, refused when split: fine if the refusal says why
        res.split_refusal = str(e)
        if not refusal_category(str(e)):
            res.detail = f"refusal under max_tokens={BUDGET} in no category of zoo.REFUSALS: {e}"
            return
    else:
        err = float((split - ref).abs().max())
        if not err <= tol:
            res.detail = f"silent mismatch under max_tokens={BUDGET}: max |d logprob| = {err:.3g} > {tol}"
            return
        res.logprob_err = max(res.logprob_err, err)
    if grads:
        w = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(1))

        def plain_loss():
            aux = plain_aux_loss(model, gs) if want_aux is not None else 0.0
            return (plain_logprobs(model, gs)[0] * w).sum() + aux

        def ours():
            o = sp.logprobs(model, gs)
            return (o.logprobs * w).sum() + (o.aux_loss if o.aux_loss is not None else 0.0)

        want = _grads(model, plain_loss)
        got = _grads(model, ours)
        res.grad_err = grad_error(got, want)
        if not res.grad_err <= gtol and low_ops:
            # the plain run is itself only float32-accurate here: hold sharedprefix to twice its error against the
            # same model computing those ops in float64 (the flash-attention rule), errors at the model's gradient scale
            from sharedprefix.tools.reference import Float64Inside

            with Float64Inside():
                truth = _grads(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
            plain_err, ours_err = _grad_error_at_scale(want, truth), _grad_error_at_scale(got, truth)
            if ours_err <= 2 * plain_err:
                res.grad_err = grad_error(got, truth)
                res.float32_rule = (
                    f"gradients {ours_err:.2g} from float64 at the largest gradient's scale, the plain run's "
                    f"{plain_err:.2g}"
                )
            else:
                res.detail = (
                    f"gradient mismatch: relative error {res.grad_err:.3g} > {gtol} against the plain run, "
                    f"and {ours_err:.3g} > twice the plain run's {plain_err:.3g} against float64 (at the "
                    "largest gradient's scale)"
                )
                return
        elif not res.grad_err <= gtol:
            res.detail = f"gradient mismatch: relative error {res.grad_err:.3g} > {gtol}"
            return
    res.features = features(model)
    res.status = "exact"


def features(model) -> list[str]:
    """The attention features a probed model exercises, as docs/models.md names them."""
    from sharedprefix.attention import probe

    pats = [p for p in map(probe.pattern, model.modules()) if p is not None]
    cfg = model.config.get_text_config()
    # (per-layer configs refuse some global reads)
    v, qk = (
        config_value(cfg, "v_head_dim"),
        config_value(cfg, "qk_head_dim"),
    )
    if qk is None and config_value(cfg, "qk_nope_head_dim") is not None:
        qk = cfg.qk_nope_head_dim + (config_value(cfg, "qk_rope_head_dim") or 0)
    out = []
    if any(p.kind == "sliding" for p in pats):
        out.append("sliding window")
    if any(p.kind == "chunked" for p in pats):
        out.append("chunked attention")
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        out.append("attention sinks")
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        out.append("attention-score soft-capping")
    if v is not None and qk is not None and v != qk:
        out.append("latent attention (value head dim != query head dim)")
    if any("expert" in type(m).__name__.lower() for m in model.modules()):
        out.append("MoE")
    if getattr(cfg, "output_router_logits", False):
        out.append("MoE load-balancing loss")
    if any(p.indexed for p in pats):
        out.append("keys selected by an indexer (DeepSeek sparse attention)")
    if any(p.calls > 1 for p in pats):
        out.append("several attention calls per layer (looped layers, differential attention)")
    from sharedprefix.model.mixers import on_cache_path, on_packed_path

    if on_cache_path(model):
        out.append("layers that mix tokens outside attention (each completion from the prompt's layer state)")
    if on_packed_path(model):
        out.append("layers that mix tokens outside attention (each segment from its parent's state, packed)")
    return out


def run(names=None, grads: bool = True, log=None) -> list[Result]:
    """``check`` every entry in ``names`` (default: all), in order; ``log`` gets one line per entry."""
    out = []
    for name in names or entries():
        r = check(name, grads)
        out.append(r)
        if log:
            log(f"{name:28s} {r.status:14s} {r.seconds:5.1f}s  {r.category or r.detail[:160]}")
    return out
