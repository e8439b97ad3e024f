"""The model zoo: every causal-LM architecture transformers registers, built tiny, through sharedprefix.

For each entry of ``transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` this
module builds a random-weight float64 model from the architecture's own config class, shrunk to a
few layers of width 32 (``tiny_config``): sliding windows, chunked attention, layer-type patterns,
MoE routing and latent attention are set small enough to bite on rows of a dozen tokens, and every
distinct layer type of the default configuration is kept. ``check`` then requires one of:

- ``exact``: ``sp.logprobs`` equals the plain transformers forward of every ``[prompt + completion]``
  row to 1e-9 (float64), and the gradient of a random linear function of the log-probs equals the
  plain one (relative 1e-9, or the model's own float32 rounding level where the model computes in
  float32 inside a float64 run, which ``Result.grad_note`` names);
- ``refused``: ``sp.logprobs`` raised ``ValueError`` before returning anything or touching a gradient,
  with a message that falls in one of the ``REFUSALS`` categories (each names the feature and why);
- ``not buildable``: the tiny config, the model or the plain forward itself fails, with the reason.

Anything else (a mismatch, another exception, a refusal outside the categories) is ``failed``, and
the zoo test fails on it. The README's table is generated from these results
(``python -m sharedprefix.zoo --write-readme``), so it cannot drift from what the zoo checks.

Notation: N = completions, T = longest completion, L = layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from dataclasses import dataclass

import torch

VOCAB = 97
NUM_LAYERS_MAX = 8  # layers kept so that every distinct layer type of the default config appears
WINDOW = 4  # sliding window / attention chunk (tokens): bites on the rows below
LOGPROB_TOL = 1e-9
GRAD_TOL = 1e-9
# where the plain forward of the float64 model computes in float32 (eager attention's softmax, routers,
# float32 logits), it is itself only float32-accurate: the zoo holds sharedprefix to that level and says so
LOGPROB_TOL_FLOAT32_INSIDE = 1e-6
GRAD_TOL_FLOAT32_INSIDE = 1e-5
BUDGET = 12  # max_tokens of the schedule check: splits the first group (9 + 5 + 3 + 6 tokens) across passes

# (prompt length, completion lengths) per group: positions reach 15, beyond WINDOW.
LAYOUT = ((9, (5, 3, 6)), (4, (4,)))

# Size fields set wherever the architecture's config class has them.
SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, n_embd=32, n_layer=2, n_head=4,
    n_positions=128, n_inner=48, n_ctx=128, d_model=32, decoder_layers=2, decoder_attention_heads=4,
    decoder_ffn_dim=48, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=48, num_layers=2,
    num_heads=4, n_layers=2, n_heads=4, ffn_dim=48, num_kv_heads=2, embedding_size=32,
    # MoE: few small experts, two per token, a dense first layer where the config has one
    moe_intermediate_size=16, num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, moe_k=2, moe_topk=2, n_shared_experts=1, shared_expert_intermediate_size=16,
    first_k_dense_replace=1, n_group=1, topk_group=1,
    # multi-head latent attention: value head dim (6) != query/key head dim (8 + 4)
    kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
    # windows and chunks that bite on short rows
    sliding_window=WINDOW, attention_chunk_size=WINDOW, window_size=WINDOW, rotary_dim=4,
    # decoder use of encoder architectures (BERT-like): causal self-attention
    is_decoder=True,
)


class NotBuildable(Exception):
    """The tiny config, the model or its plain forward cannot be built; the message says why."""


def architectures() -> dict[str, str]:
    """model_type -> causal-LM class name, as transformers registers them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
_TOKEN_ID = re.compile(r"(^|_)(pad|bos|eos|sep|cls|mask|unk|decoder_start|forced_eos)_token_id$")


def _per_layer(default, names: set[str]) -> dict:
    """Fewest layers (2..NUM_LAYERS_MAX) that keep every distinct layer type of the default config.

    Lists with one entry per layer are cut to that many layers; lists of layer indices are filtered.
    """
    count = next((k for k in _LAYER_COUNTS if k in names and isinstance(getattr(default, k, None), int)), None)
    if count is None:
        return {}
    total = getattr(default, count)
    lists = {k: v for k, v in vars(default).items() if k in names and isinstance(v, list) and v}
    per_layer = {k: v for k, v in lists.items() if len(v) == total}
    typed = [v for v in per_layer.values() if all(isinstance(x, str) for x in v)]
    n = 2
    while n < min(NUM_LAYERS_MAX, total) and any(set(v[:n]) != set(v) for v in typed):
        n += 1
    n = min(n, total) if total >= 2 else total
    out = {count: n}
    for k, v in per_layer.items():
        out[k] = [SIZES[k]] * n if k in SIZES else v[:n]
    for k, v in lists.items():
        if k in per_layer or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            continue
        if all(0 <= x < total for x in v) and v == sorted(set(v)):  # layer indices
            out[k] = [x for x in v if x < n]
    return out


def _tiny(cls, extra: dict | None = None):
    """A tiny instance of config class ``cls`` (and of its sub-configs); ``extra`` wins, a dict value for a
    sub-config key is merged into that sub-config."""
    extra = dict(extra or {})
    names = _fields(cls)
    try:
        default = cls()
    except Exception as e:  # noqa: BLE001  (a config class that cannot even build its defaults)
        raise NotBuildable(f"{cls.__name__}() fails: {type(e).__name__}: {_first_line(e)}") from e
    kw = {k: v for k, v in SIZES.items() if k in names}
    if "kv_lora_rank" in names:  # latent attention: K/V heads are expanded from the latent, one per query head
        kw.pop("head_dim", None)
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    for k in names:
        v = getattr(default, k, None)
        if _TOKEN_ID.search(k) and v is not None:
            kw[k] = 0 if k.startswith("pad") else 1 if k.startswith("bos") else 2
    kw.update(_per_layer(default, names))
    for key in getattr(cls, "sub_configs", None) or {}:
        sub = getattr(default, key, None)
        if key in names and hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            kw[key] = _tiny(type(sub), extra.pop(key, None))
    kw.update(extra)
    try:
        return cls(**kw)
    except Exception as e:  # noqa: BLE001
        raise NotBuildable(f"{cls.__name__}(tiny sizes) fails: {type(e).__name__}: {_first_line(e)}") from e


def _first_line(e: BaseException, limit: int = 200) -> str:
    s = str(e).strip().splitlines()
    s = " ".join(x.strip() for x in s[:3]) if s else type(e).__name__
    return s if len(s) <= limit else s[: limit - 3] + "..."


# Per-architecture settings the generic sizes cannot infer (each with its reason).
ARCH: dict[str, dict] = {}

# Architectures that cannot be built tiny here, with the reason.
NOT_BUILDABLE: dict[str, str] = {}


def tiny_config(model_type: str):
    """The tiny config of ``model_type`` (raises ``NotBuildable``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type in NOT_BUILDABLE:
        raise NotBuildable(NOT_BUILDABLE[model_type])
    return _tiny(CONFIG_MAPPING[model_type], ARCH.get(model_type))


def build(model_type: str, seed: int = 0):
    """(model, attention implementation of its plain forward): float64, eval mode, dtype-faithful norms.

    The plain forward uses transformers' SDPA where the model supports it (exact in float64) and its
    eager attention otherwise.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    from sharedprefix.testing import dtype_faithful_norms

    cfg = tiny_config(model_type)
    cls = getattr(transformers, architectures()[model_type])
    impl = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
        model.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
        model = model.to(torch.float64).eval()
    except Exception as e:  # noqa: BLE001
        raise NotBuildable(f"{cls.__name__}(tiny config) fails: {type(e).__name__}: {_first_line(e)}") from e
    try:
        dtype_faithful_norms(model)
    except ValueError as e:
        raise NotBuildable(str(e)) from e
    return model, impl


def groups(model, seed: int = 0):
    """The zoo's groups: token ids that are not special tokens of the model's config."""
    import sharedprefix as sp

    special = set()
    for cfg in _all_configs(model.config):
        for k, v in vars(cfg).items():
            if k.endswith(("token_id", "token_index", "token_ids")):
                special.update(x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, int))
    allowed = torch.tensor([t for t in range(VOCAB) if t not in special and t > 2])
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: allowed[torch.randint(0, len(allowed), (n,), generator=g)]  # noqa: E731
    return [sp.Group(ids(p), [ids(t) for t in ts]) for p, ts in LAYOUT]


def _all_configs(cfg) -> list:
    out, stack = [], [cfg]
    while stack:
        c = stack.pop()
        out.append(c)
        stack += [v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]
    return out


# Refusal categories: (README label, pattern its message must match). A refusal that fits none fails the
# zoo, so every refusal names its feature and why.
REFUSALS: list[tuple[str, str]] = [
    ("token mixing outside attention (state-space, linear attention, recurrence, convolution)",
     r"mix tokens outside attention|convolution over tokens"),
    ("sparse attention over indexer-selected or compressed keys", r"sparse attention over the keys|attention over compressed"),
    ("attention outside transformers' attention interface", r"bypasses transformers' attention interface"),
    ("positions numbered by the model itself (no position_ids input, RoBERTa offsets)",
     r"takes no position_ids|numbers the positions of a row differently"),
    ("attention masks other than causal, sliding-window or chunked", r"neither causal nor a causal sliding window"),
    ("attention-score soft-capping", r"attention-score soft-capping"),
    ("query scaling by the token's index in the row (Llama 4 attn_temperature_tuning)", r"attn_temperature_tuning"),
    ("chunked attention on rows longer than one chunk", r"uses chunked attention"),
    ("a looped layer split across passes (recurrent depth)", r"a looped, recurrent-depth model"),
    ("keys beyond the row (memory, compressed keys)", r"attends over \d+ keys for a row"),
    ("an LM head sharedprefix cannot reproduce", r"turns hidden states into logits"),
    ("RoPE scaling that depends on the longest position", r"RoPE scaling, whose frequencies"),
    ("other attention arguments (position biases, non-causal flags)", r"attention arguments .* cannot honour"),
]


@dataclass
class Result:
    """One architecture's outcome.

    Attributes:
        status: "exact", "refused", "not buildable" or "failed".
        detail: the refusal message, the reason it is not buildable, or what failed.
        category: the README label of a refusal.
        logprob_err: max |sp - plain| log-prob (nats), None when not compared.
        grad_err: max relative gradient error, None when not compared.
        grad_note: why the errors are held to the float32 tolerances (ops the model runs in float32), or "".
        split_refusal: the refusal under a budget that splits a group (exact in one pass), or "".
    """

    arch: str
    model_class: str
    status: str
    detail: str = ""
    category: str = ""
    logprob_err: float | None = None
    grad_err: float | None = None
    grad_note: str = ""
    split_refusal: str = ""
    seconds: float = 0.0


class _LowPrecisionOps(torch.utils._python_dispatch.TorchDispatchMode):
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


def _grad_error(got: dict, want: dict) -> float:
    """Max over tensors of |got - want| / max|want|; a tensor whose exact gradient is zero is held to 1e-6
    of the model's largest gradient instead of its own rounding noise."""
    if set(got) != set(want):
        return float("inf")
    floor = 1e-6 * max(float(w.abs().max()) for w in want.values())
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(floor)) for n in want)


def _category(msg: str) -> str:
    return next((label for label, pat in REFUSALS if re.search(pat, msg, re.S)), "")


def check(model_type: str, grads: bool = True) -> Result:
    """Build ``model_type`` tiny and hold sharedprefix to the plain forward (see the module docstring)."""
    import sharedprefix as sp
    from sharedprefix.testing import plain_logprobs

    start = time.perf_counter()
    res = Result(model_type, architectures()[model_type], "failed")
    try:
        model, _ = build(model_type)
        gs = groups(model)
        probe = _LowPrecisionOps(model)
        with torch.no_grad(), probe:
            ref, _ = plain_logprobs(model, gs)
    except NotBuildable as e:
        res.status, res.detail = "not buildable", str(e)
    except Exception as e:  # noqa: BLE001  (transformers' own forward fails at this size)
        res.status, res.detail = "not buildable", f"plain forward fails: {type(e).__name__}: {_first_line(e)}"
    else:
        _compare(model, gs, ref, probe.ops, grads, res, sp, plain_logprobs)
    res.seconds = time.perf_counter() - start
    return res


def _compare(model, gs, ref, low_ops, grads, res, sp, plain_logprobs):
    model.zero_grad(set_to_none=True)
    try:
        out = sp.logprobs(model, gs)  # grad enabled: a refusal must come before any gradient exists
    except ValueError as e:
        touched = [n for n, p in model.named_parameters() if p.grad is not None]
        res.detail = str(e)
        res.category = _category(res.detail)
        if touched:
            res.detail = f"refused after gradients reached {touched[:3]}: {e}"
        elif not res.category:
            res.detail = f"refusal in no category of zoo.REFUSALS: {e}"
        else:
            res.status = "refused"
        return
    except Exception as e:  # noqa: BLE001  (a crash is a failure: it must become exact or a clear refusal)
        res.detail = f"{type(e).__name__}: {_first_line(e)}"
        return
    tol, gtol = LOGPROB_TOL, GRAD_TOL
    if low_ops:  # the plain forward itself is only float32-accurate there
        res.grad_note = "computes " + ", ".join(sorted(low_ops)) + " in float32"
        tol, gtol = LOGPROB_TOL_FLOAT32_INSIDE, GRAD_TOL_FLOAT32_INSIDE
    res.logprob_err = float((out.logprobs.detach() - ref).abs().max())
    if not res.logprob_err <= tol:
        res.detail = f"silent mismatch: max |d logprob| = {res.logprob_err:.3g} > {tol}"
        return
    try:
        with torch.no_grad():  # the schedule: a group split across passes, with cached prompt K/V
            split = sp.logprobs(model, gs, max_tokens=BUDGET).logprobs
    except ValueError as e:  # exact in one pass, refused when split: fine if the refusal says why
        res.split_refusal = str(e)
        if not _category(str(e)):
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
        want = _grads(model, lambda: (plain_logprobs(model, gs)[0] * w).sum())
        got = _grads(model, lambda: (sp.logprobs(model, gs).logprobs * w).sum())
        res.grad_err = _grad_error(got, want)
        if not res.grad_err <= gtol:
            res.detail = f"gradient mismatch: relative error {res.grad_err:.3g} > {gtol}"
            return
    res.status = "exact"


def run(archs=None, grads: bool = True, log=None) -> list[Result]:
    out = []
    for arch in archs or architectures():
        r = check(arch, grads)
        out.append(r)
        if log:
            log(f"{arch:28s} {r.status:14s} {r.seconds:5.1f}s  {r.category or r.detail[:160]}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sharedprefix.zoo", description=__doc__.split("\n\n")[0])
    p.add_argument("archs", nargs="*", help="model types (default: all registered causal LMs)")
    p.add_argument("--no-grads", action="store_true")
    p.add_argument("--write-readme", metavar="PATH", nargs="?", const="README.md")
    args = p.parse_args(argv)
    from transformers.utils import logging

    logging.set_verbosity_error()
    results = run(args.archs or None, grads=not args.no_grads, log=print)
    counts = {s: sum(r.status == s for r in results) for s in ("exact", "refused", "not buildable", "failed")}
    print(counts, f"{sum(r.seconds for r in results):.0f}s")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
