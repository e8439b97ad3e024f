"""A seeded differential fuzzer: random layouts, options, models and model states, each compared with one plain
float64 forward and backward per row.

``draw(seed)`` gives a ``Case`` (everything a run needs, ``describe()`` prints it); ``check(case)`` builds its
model, runs sharedprefix (``sp.logprobs`` with grad, or ``sp.backward`` with a random loss mixing log-probs and
entropies) and the plain per-row reference over the same rows, and raises ``AssertionError`` naming the case on any
difference: log-probs, entropies and masks to 1e-9, the MoE load-balancing loss to a relative 1e-6 (transformers
computes it in float32), every parameter gradient to a relative 1e-9 (1e-5 with the float32 load-balancing loss).
A ``ValueError`` is a refusal: accepted when its message matches one of ``REFUSALS`` (a documented limit), a
failure otherwise, as is any other exception.

Rows: groups (prompts of several lengths, duplicated across groups or a prefix of another group's prompt, G from
1 to 6, completions down to one token) or a ``Tree`` of depth 2-3 (a system prompt, documents, completions, second
turns, duplicate rows and rows that are prefixes of others, random trained masks including rows with nothing
trained). Token ids include 0 and vocab - 1.

Models: besides the dense, MoE and LFM2 ones, models with float32 parts (``FLOAT32_PARTS``: exact with those parts
kept float64, then as they are within a measured multiple of the plain run's own error), cache-path hybrids
(``CACHE_PATH``) and MusicGen's several token streams per position (``STREAMS``), each where its path applies. A
``plan`` case also reuses one ``sp.plan_call`` across calls, grad modes, a second model and an optimizer step, bit
for bit against planning afresh. ``FUZZ_MEASURE=1`` prints the errors the tolerances were set from.

Run many seeds: ``python -m support.fuzz 0 200`` from ``tests/`` (PYTHONPATH=src).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import random
import re
import sys

import torch

import sharedprefix as sp
from helpers import VOCAB, tiny_model
from sharedprefix.tools.reference import Float64Inside, plain_logprobs

# (zoo entry, tiny_model overrides): a dense model of each attention flavour, MoEs with their load-balancing loss,
# a hybrid whose token mixer sharedprefix reaches (LFM2).
MODELS = {
    "qwen3": ("qwen3", {}),
    "llama": ("llama", {}),
    "gemma3_text": ("gemma3_text", dict(final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    "gemma2": ("gemma2", {}),
    "gpt_oss": ("gpt_oss", {}),
    "mixtral+aux": ("mixtral+router_aux_loss", {}),
    "gpt_oss+aux": ("gpt_oss+router_aux_loss", {}),
    "gpt2": ("gpt2", {}),
    "lfm2": ("lfm2", {}),
    "mistral+window": ("mistral", dict(sliding_window=4)),
    "qwen2_moe+aux": ("qwen2_moe+router_aux_loss", {}),
    "granite": ("granite", dict(logits_scaling=3.0, embedding_multiplier=2.0, attention_multiplier=0.3)),
    "gemma": ("gemma", {}),
    "phi": ("phi", dict(partial_rotary_factor=0.5)),
    "starcoder2": ("starcoder2", dict(sliding_window=4)),
}
# Models whose float64 forward computes parts in float32 even with float64 norms (docs/models.md): Cohere's and
# OLMo's LayerNorms, OLMo2's, Qwen3.5's gated delta rule and its gated norm. Drawn last (``draw``), so that the
# other models' seeds draw what they drew before. Their case runs twice: under ``Float64Inside`` (both runs keep
# those parts float64: the same code, so 1e-9 as for every model), then as the model is (``_check_float32_parts``).
FLOAT32_PARTS = {
    "cohere": ("cohere", {}),
    "olmo": ("olmo", {}),
    "olmo2": ("olmo2", {}),
    "qwen3_5_text": ("qwen3_5_text", {}),
}
# Hybrids on the cache path (docs/models.md "The cache path": each prompt through the model's own cache-aware
# forward, each completion from its final layer state), drawn last like FLOAT32_PARTS and only for what that path
# takes: groups (no Tree), no gradient checkpointing, no CallPlan; they run under Float64Inside like FLOAT32_PARTS
# (Zaya computes parts in float32) and as they are. MiniMax's tolerance: its lightning attention computes a row split
# at the prompt (transformers' own prompt-then-cache continuation) differently from one forward of the row, by up to
# 4e-10 in float64 log-probs and 2.2e-8 in relative gradients (seeds 26, 100, 112 with its attention kept float64),
# and ours equals that continuation to 1e-15; against one forward, seeds 0-199 measured at most 3.1e-9 (log-probs)
# and 3.3e-8 (gradients): 1e-7.
CACHE_PATH = {"minimax": ("minimax", {}), "zaya": ("zaya", {})}
TOL = {"minimax": 1e-7}  # log-probs, entropies and relative gradients; 1e-9 otherwise
# Several token streams per position (docs/streams.md): MusicGen's tiny decoder, 4 codebooks of 97 codes, its pad /
# BOS code 97 (which the heads cannot predict, as in MusicGen). A case's 1-D ids become (K, length) frames
# (``_frames``: the same ids give the same frames, so shared prompts stay shared), with pads on some codebooks. Groups
# only (sp.Tree is refused for frames), no LoRA or frozen embedding (its embeddings are a list of K tables).
STREAMS = {"musicgen": ("musicgen", {})}
K_STREAMS, PAD_CODE = 4, 97
AUX = {"mixtral+aux", "qwen2_moe+aux", "gpt_oss+aux"}  # models whose config asks for the load-balancing loss
MOE_NO_AUX = {"gpt_oss"}  # MoEs whose config leaves the load-balancing loss out (``force_aux`` asks for it)
EAGER_ONLY = {"gemma2", "gpt_oss", "gpt_oss+aux"}  # transformers refuses SDPA for them

# refusals that are documented limits (a ValueError whose message matches none of them fails the case)
REFUSALS = [
    r"defer=False with grad enabled is not possible with gradient checkpointing",
    r"gradient checkpointing with use_reentrant=True is on, and this plan splits a group",
    r"uses gradient checkpointing with use_reentrant=True, and this call trains its MoE load-balancing loss",
]


@dataclasses.dataclass
class Case:
    seed: int
    model: str
    attn: str
    tied: bool
    checkpointing: bool
    train: bool
    frozen_embeddings: bool
    lora: bool
    rows: list  # groups: [(prompt, [completions])]; tree: [row]
    trained: list | None  # tree only
    tree: bool
    max_tokens: int | None
    mode: str
    defer: bool | None
    temperature: float
    entropy: bool
    api: str  # "logprobs" (grad-enabled, loss over its output) or "backward"
    reduction: str
    calls: int  # 1, or 2: the second call accumulates onto the first
    preset_grad: bool  # .grad holds a value before the call
    nograd_first: bool = False  # also sp.logprobs under torch.no_grad() first (values only)
    force_aux: bool = False  # a MoE without output_router_logits: ask for the load-balancing loss anyway
    tensor_ids: bool = False  # token ids as int32 tensors instead of lists
    autocast: bool = False  # a float32 copy under bf16 autocast, held to twice the plain bf16 run's error
    reentrant: bool = False  # gradient checkpointing with use_reentrant=True
    lora_extra: tuple = ()  # LoRA also on these (embed_tokens, lm_head), or modules_to_save copies of them
    plan: bool = False  # also one sp.plan_call, reused across calls, models, an optimizer step and grad modes
    plan_given: bool = False  # the calls' settings given to sp.plan_call (the plan's defaults), not to each call

    def describe(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return "Case(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice((0, VOCAB - 1)) if rng.random() < 0.15 else rng.randrange(VOCAB) for _ in range(n)]


def _groups(rng: random.Random) -> list:
    out = []
    for _ in range(rng.randint(1, 4)):
        r = rng.random()
        if out and r < 0.2:  # the same prompt as an earlier group
            prompt = list(rng.choice(out)[0])
        elif out and r < 0.35:  # an earlier prompt continued, or cut
            base = list(rng.choice(out)[0])
            prompt = base + _tokens(rng, rng.randint(1, 4)) if rng.random() < 0.5 else base[: rng.randint(1, len(base))]
        else:
            prompt = _tokens(rng, rng.choice((1, 2, rng.randint(3, 10))))
        g = rng.randint(1, 6)
        comps = [_tokens(rng, rng.choice((1, rng.randint(1, 6)))) for _ in range(g)]
        if g > 1 and rng.random() < 0.2:
            comps[-1] = list(comps[0])  # a duplicate completion
        out.append((prompt, comps))
    return out


def _tree_rows(rng: random.Random) -> tuple[list, list]:
    system = _tokens(rng, rng.randint(1, 6))
    rows = []
    for _ in range(rng.randint(1, 3)):
        doc = system + _tokens(rng, rng.randint(1, 5))
        for _ in range(rng.randint(1, 3)):
            row = doc + _tokens(rng, rng.randint(1, 4))
            rows.append(row)
            if rng.random() < 0.3:  # a second turn on top of the first
                rows.append(row + _tokens(rng, rng.randint(1, 3)))
    if rng.random() < 0.3:
        rows.append(list(rng.choice(rows)))  # a duplicate row
    if rng.random() < 0.3:
        r = rng.choice(rows)
        rows.append(r[: rng.randint(1, len(r))])  # a prefix of another row
    rng.shuffle(rows)
    trained = []
    for r in rows:
        kind = rng.random()
        if kind < 0.1:
            trained.append([False] * len(r))
        elif kind < 0.4:
            trained.append([True] * len(r))
        else:
            trained.append([rng.random() < 0.6 for _ in r])
    return rows, trained


def draw(seed: int) -> Case:
    rng = random.Random(seed)
    model = rng.choice(sorted(MODELS))
    tree = rng.random() < 0.35
    rows, trained = _tree_rows(rng) if tree else (_groups(rng), None)
    total = sum(len(r) for r in rows) if tree else sum(len(p) + sum(len(c) for c in cs) for p, cs in rows)
    # a completion is never split: the smallest budget holds the longest one (a tree's rows may split anywhere)
    least = 1 if tree else max(len(c) for _, cs in rows for c in cs)
    train = rng.random() < 0.3
    case = Case(
        seed=seed,
        model=model,
        attn="eager" if model in EAGER_ONLY else rng.choice(("sdpa", "eager")),
        tied=rng.random() < 0.2,
        checkpointing=train and rng.random() < 0.5,
        train=train,
        frozen_embeddings=rng.random() < 0.15,
        lora=rng.random() < 0.1,
        rows=rows,
        trained=trained,
        tree=tree,
        max_tokens=rng.choice((None, None, least, least + 1, least + 2, rng.randint(least, max(least, total)))),
        mode=rng.choice(("keep", "offload", "recompute")),
        defer=rng.choice((None, True, False)),
        temperature=rng.choice((1.0, 1.0, 0.7, 1.6)),
        entropy=rng.random() < 0.4,
        api=rng.choice(("logprobs", "backward")),
        reduction=rng.choice(("sum", "mean")),
        calls=rng.choice((1, 1, 2)),
        preset_grad=rng.random() < 0.3,
        # drawn last, so that the fields above stay what they were for every seed
        nograd_first=rng.random() < 0.3,
        force_aux=model in MOE_NO_AUX and rng.random() < 0.5,
        tensor_ids=rng.random() < 0.2,
        autocast=rng.random() < 0.08,
        reentrant=rng.random() < 0.5,
        lora_extra=rng.choice(((), (), ("embed_tokens",), ("lm_head",), ("save:embed_tokens", "save:lm_head"))),
        plan=rng.random() < 0.1,
        plan_given=rng.random() < 0.5,
    )
    if rng.random() < 0.1:  # a model with float32 parts (drawn last: the fields above stay as they were)
        case.model = rng.choice(sorted(FLOAT32_PARTS))
        case.attn, case.force_aux = rng.choice(("sdpa", "eager")), False
    if rng.random() < 0.1 and not tree and not case.checkpointing:  # a cache-path hybrid, where it applies
        case.model = rng.choice(sorted(CACHE_PATH))
        case.force_aux = case.plan = case.autocast = False
        case.max_tokens = None if case.max_tokens is None else max(case.max_tokens, 3)  # its least budget
    if rng.random() < 0.06 and not tree:  # a model with several token streams per position
        case.model = rng.choice(sorted(STREAMS))
        case.force_aux = case.autocast = case.lora = case.frozen_embeddings = case.tied = False
    return case


def _frames(ids) -> torch.Tensor:
    """(K, len(ids)) codes of a 1-D id sequence: codebook k of token t from ``ids[t]`` alone, the pad code where
    ``(ids[t] + k) % 5 == 0`` (a delay pattern's pads, on some codebooks of some frames, all of them for ids 0)."""
    t = torch.as_tensor(list(ids), dtype=torch.int64)
    k = torch.arange(K_STREAMS)[:, None]
    codes = (t[None] * (k + 1) + 3 * k) % PAD_CODE
    return torch.where((t[None] + k) % 5 == 0, PAD_CODE, codes)


# -- the model ----------------------------------------------------------------------------------------------------


def build(case: Case) -> torch.nn.Module:
    entry, overrides = {**MODELS, **FLOAT32_PARTS, **CACHE_PATH, **STREAMS}[case.model]
    kw = dict(overrides)
    if case.tied:
        kw["tie_word_embeddings"] = True
    if case.model in STREAMS:
        import transformers as tf

        from sharedprefix.tools.zoo.configs import tiny_config

        cfg = tiny_config(entry)
        cfg = getattr(cfg, "decoder", cfg)
        cfg.pad_token_id = cfg.bos_token_id = PAD_CODE
        assert cfg.vocab_size == PAD_CODE and cfg.num_codebooks == K_STREAMS, (cfg.vocab_size, cfg.num_codebooks)
        cfg._attn_implementation = case.attn
        for name in ("dropout", "attention_dropout", "activation_dropout", "layerdrop"):  # functional: off in train()
            setattr(cfg, name, 0.0)
        torch.manual_seed(case.seed)
        model = tf.MusicgenForCausalLM(cfg).to(torch.float64)
    elif entry.endswith("+router_aux_loss"):
        from sharedprefix.tools.zoo.configs import build as zoo_build

        model, _ = zoo_build(entry, seed=case.seed)
        model.config._attn_implementation = case.attn
        from sharedprefix.tools.zoo.configs import float64_norms

        float64_norms(model)
    else:
        model = tiny_model(entry, seed=case.seed, attn=case.attn, **kw)
    model.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    for m in model.modules():  # dropout 0 everywhere, so that train() mode is deterministic
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    if case.frozen_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    if case.lora:
        import peft

        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        targets = [t for t in ("q_proj", "v_proj", "c_attn") if t in names]
        targets += [t for t in case.lora_extra if t in names]
        save = [t[5:] for t in case.lora_extra if t.startswith("save:") and t[5:] in names]
        cfg = peft.LoraConfig(r=2, target_modules=targets, modules_to_save=save or None, init_lora_weights=False)
        torch.manual_seed(case.seed)
        model = peft.get_peft_model(model, cfg).to(torch.float64)
        with torch.no_grad():  # saved copies unlike their originals, so that reading the wrong one shows
            for n, p in model.named_parameters():
                if "modules_to_save" in n:
                    p.add_(0.1 * torch.randn_like(p))
    model.train(case.train)
    return model


# -- the plain reference ------------------------------------------------------------------------------------------


class EagerSoftmax64(torch.overrides.TorchFunctionMode):
    """Eager attention's ``softmax(weights, dtype=torch.float32)`` of (b, h, q, k) float64 weights in float64: a
    float64 model's plain forward then is float64 throughout (a router's softmax, of 2-D logits, is left alone)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if (
            func is torch.nn.functional.softmax
            and isinstance(x, torch.Tensor)
            and x.dtype == torch.float64
            and x.dim() == 4
            and kwargs.get("dtype") is torch.float32
        ):
            kwargs = dict(kwargs, dtype=torch.float64)
        return func(*args, **kwargs)


def plain(case: Case, model):
    """(logprobs, entropy, mask) (N, W) float64 and the plain aux loss (or None), one plain forward per row."""
    if case.model in STREAMS:  # one (K, P + T) row of codes each: the sum over codebooks, pads left out
        groups = _inputs(case)
        lp, ent = plain_logprobs(model, groups, temperature=case.temperature, entropy=True)
        lens = torch.tensor([c.shape[-1] for g in groups for c in g.completions])
        return lp, ent, torch.arange(lp.shape[1])[None] < lens[:, None], None
    if case.tree:
        rows = case.rows
        offsets = [0] * len(rows)
        width = max(len(r) for r in rows)
        keep = [[bool(m) and t >= 1 for t, m in enumerate(tr)] for tr in case.trained]
    else:
        rows = [p + c for p, cs in case.rows for c in cs]
        offsets = [len(p) for p, cs in case.rows for _ in cs]
        width = max(len(c) for _, cs in case.rows for c in cs)
        keep = [[True] * (len(r) - o) for r, o in zip(rows, offsets)]
    n = len(rows)
    lp = torch.zeros(n, width, dtype=torch.float64)
    ent = torch.zeros(n, width, dtype=torch.float64)
    mask = torch.zeros(n, width, dtype=torch.bool)
    lp_rows, ent_rows = [], []
    for i, (r, o) in enumerate(zip(rows, offsets)):
        ids = torch.tensor(r)[None]
        logits = model(input_ids=ids, use_cache=False).logits[0].double() / case.temperature
        logp = torch.log_softmax(logits, -1)
        # column c of row i is the token at row position o + c (or c, for a tree), predicted by the one before
        cols = [c for c in range(len(r) - o) if keep[i][c] and o + c >= 1]
        if cols:
            pos = torch.tensor([o + c for c in cols])
            tok = logp[pos - 1].gather(-1, ids[0, pos, None])[:, 0]
            e = -(logp[pos - 1].exp() * logp[pos - 1]).sum(-1)
            lp_rows.append((i, cols, tok))
            ent_rows.append((i, cols, e))
            mask[i, cols] = True
    lp = _scatter(lp_rows, n, width)
    ent = _scatter(ent_rows, n, width)
    aux = _plain_aux(model, rows) if _aux(case) else None
    return lp, ent, mask, aux


def _scatter(parts, n, width):
    out = []
    for i in range(n):
        row = torch.zeros(width, dtype=torch.float64)
        for j, cols, v in parts:
            if j == i:
                row = row.index_put((torch.tensor(cols),), v)
        out.append(row)
    return torch.stack(out)


def _aux(case: Case) -> bool:
    return case.model in AUX or case.force_aux


def _plain_aux(model, rows):
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [r[0]] * (width - len(r)) for r in rows])
    attn = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    return model(input_ids=ids, attention_mask=attn, use_cache=False, output_router_logits=True).aux_loss


# -- the comparison -----------------------------------------------------------------------------------------------


def _inputs(case: Case):
    ids = (lambda x: torch.tensor(x, dtype=torch.int32)) if case.tensor_ids else list
    if case.tree:
        return sp.Tree.from_rows([ids(r) for r in case.rows], case.trained)
    if case.model in STREAMS:
        return [sp.Group(_frames(p), [_frames(c) for c in cs]) for p, cs in case.rows]
    return [sp.Group(ids(p), [ids(c) for c in cs]) for p, cs in case.rows]


def _weights(case: Case, shape):
    g = torch.Generator().manual_seed(case.seed + 1)
    return torch.randn(shape, dtype=torch.float64, generator=g), torch.randn(shape, dtype=torch.float64, generator=g)


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _preset(case: Case, model) -> dict:
    """Sets every trainable parameter's .grad to a random value (``preset_grad``) or None; returns it."""
    g = torch.Generator().manual_seed(case.seed + 2)
    out = {}
    for n, p in model.named_parameters():
        p.grad = None
        if case.preset_grad and p.requires_grad:
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=g)
            out[n] = p.grad.clone()
    return out


def check(case: Case) -> str:
    """Runs the case; returns "exact" or "refused: <message>"; raises ``AssertionError`` naming the case.

    The plain float64 forward of an eager model computes its attention softmax in float32, where sharedprefix's
    attention does not: the reference computes it in float64 (``EagerSoftmax64``). A MoE router's float32 softmax
    stays as it is, in both runs."""
    try:
        return _check(case)
    except AssertionError as e:
        raise AssertionError(f"{case.describe()}\n{e}") from e
    except ValueError as e:
        if any(re.search(p, str(e)) for p in REFUSALS):
            return f"refused: {str(e)[:100]}"
        raise AssertionError(f"{case.describe()}\nunexpected refusal: {e}") from e
    except Exception as e:
        raise AssertionError(f"{case.describe()}\ncrash: {type(e).__name__}: {e}") from e


def _check(case: Case) -> str:
    model = build(case)
    _MEASURED.clear()
    with _inside(case, model):
        _check_exact(case, model)
    if os.environ.get("FUZZ_MEASURE"):
        print("EXACT", case.seed, case.model, *(f"{k} {v:.3g}" for k, v in _MEASURED.items()), flush=True)
    with _inside(case, model):
        if case.autocast:
            _check_autocast(case, model)
    if case.model in FLOAT32_PARTS or case.model in CACHE_PATH:
        _check_float32_parts(case, model)
    if case.plan:  # last: it changes the model's parameters
        with _inside(case, model):
            _check_plan(case, model)
    return "exact"


_DEPTH: list = []  # the Float64Inside modes entered by ``_enter`` and their module-call depth


def _enter(mod, args):
    if not _DEPTH:
        mode = Float64Inside()
        mode.__enter__()
        _DEPTH.append(mode)
    _DEPTH.append(None)


def _leave(mod, args, out):
    _DEPTH.pop()
    if len(_DEPTH) == 1:
        _DEPTH.pop().__exit__(None, None, None)


sp.allow_hook(_enter)  # token-wise: they set the dtype the module computes in, whatever the rows
sp.allow_hook(_leave)


@contextlib.contextmanager
def _inside(case: Case, model):
    """For a model with float32 parts (``FLOAT32_PARTS``): ``Float64Inside`` entered by the outermost module call
    (forward hooks on every module), so that it also holds where autograd runs the model's forward again, outside
    any ``with`` block here: a deferred ``sp.logprobs``'s backward, gradient checkpointing's recomputation."""
    if case.model not in FLOAT32_PARTS and case.model not in CACHE_PATH:
        yield
        return
    mods = list(model.modules())
    handles = [m.register_forward_pre_hook(_enter) for m in mods]
    handles += [m.register_forward_hook(_leave, always_call=True) for m in mods]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _check_exact(case: Case, model) -> None:
    tol = TOL.get(case.model, 1e-9)
    gtol = 1e-5 if _aux(case) else tol
    with EagerSoftmax64():
        want_lp, want_ent, want_mask, want_aux = plain(case, model)
    w_lp, w_ent = _weights(case, want_lp.shape)
    coef = 0.5 if _aux(case) else None

    def loss_of(lp, ent, aux, index=None):
        wl, we = (w_lp, w_ent) if index is None else (w_lp[index], w_ent[index])
        loss = (lp * wl).sum()
        if case.entropy:
            loss = loss + (ent * we).sum()
        if aux is not None:
            loss = loss + coef * aux
        return loss

    # the plain gradient
    for p in model.parameters():
        p.grad = None
    with EagerSoftmax64():
        lp, ent, _, aux = plain(case, model)
        ref_loss = loss_of(lp, ent, aux)
        if ref_loss.requires_grad:  # (nothing trained: no gradient anywhere)
            ref_loss.backward()
    want = _grads(model)
    want_loss = float(loss_of(want_lp, want_ent, want_aux).detach())

    if case.checkpointing:  # the reference ran without: the same gradient, and no recomputation outside the mode
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": case.reentrant})
    pre = _preset(case, model)
    inputs = _inputs(case)
    if case.nograd_first:
        with torch.no_grad():
            out = sp.logprobs(
                model, inputs, temperature=case.temperature, entropy=case.entropy, max_tokens=case.max_tokens
            )
        assert torch.equal(out.mask, want_mask), "no-grad mask differs"
        err = float((out.logprobs - want_lp).abs().max())
        assert err <= tol, f"no-grad log-probs differ by {err:.3g}"
        assert all(p.grad is None or n in pre for n, p in model.named_parameters()), "no-grad call touched .grad"
    batches: list = []
    for _ in range(case.calls):
        batches.clear()
        if case.api == "logprobs":
            out = sp.logprobs(
                model,
                inputs,
                aux_loss=True if case.force_aux else None,
                temperature=case.temperature,
                entropy=case.entropy,
                max_tokens=case.max_tokens,
                defer=case.defer,
                prefix_activations=case.mode,
                grad_reduction=case.reduction,
            )
            assert out.logprobs.shape == want_lp.shape, (out.logprobs.shape, want_lp.shape)
            assert torch.equal(out.mask, want_mask), "mask differs"
            err = float((out.logprobs.detach() - want_lp).abs().max())
            _MEASURED["log-probs"] = max(_MEASURED.get("log-probs", 0.0), err)
            assert err <= tol, f"log-probs differ by {err:.3g}"
            if case.entropy:
                err = float((out.entropy.detach() - want_ent).abs().max())
                assert err <= tol, f"entropies differ by {err:.3g}"
            else:
                assert out.entropy is None
            assert (out.aux_loss is None) == (want_aux is None), f"aux loss {out.aux_loss} against {want_aux}"
            if want_aux is not None:
                rel = float((out.aux_loss.detach().double() - want_aux.double()).abs() / want_aux.double().abs())
                assert rel <= 1e-6, f"aux loss {float(out.aux_loss)} against plain {float(want_aux)}"
            ent_out = out.entropy if case.entropy else None
            loss_of(out.logprobs, ent_out, out.aux_loss if coef else None).backward()
        else:

            def loss_fn(b):
                assert b.logprobs.shape[1] == want_lp.shape[1]
                assert torch.equal(b.mask, want_mask[b.index.cpu()]), "batch mask differs"
                err = float((b.logprobs.detach() - want_lp[b.index]).abs().max())
                assert err <= tol, f"batch log-probs differ by {err:.3g}"
                if case.entropy:
                    err = float((b.entropy.detach() - want_ent[b.index]).abs().max())
                    assert err <= tol, f"batch entropies differ by {err:.3g}"
                batches.append(b.index.tolist())
                return loss_of(b.logprobs, b.entropy if case.entropy else None, None, b.index)

            res = sp.backward(
                model,
                inputs,
                loss_fn,
                max_tokens=case.max_tokens,
                prefix_activations=case.mode,
                temperature=case.temperature,
                entropy=case.entropy,
                grad_reduction=case.reduction,
                aux_loss_coef=coef,
            )
            seen = sorted(i for b in batches for i in b)
            assert seen == list(range(want_lp.shape[0])), f"batches covered rows {seen}"
            rel = 1e-6 if coef else tol  # the load-balancing loss is float32
            assert abs(res.loss - want_loss) <= rel * max(1.0, abs(want_loss)), f"loss {res.loss} vs {want_loss}"
    got = _grads(model)
    expect = {n: case.calls * g + pre.get(n, 0) for n, g in want.items()}
    for n in pre:
        expect.setdefault(n, pre[n])
    _compare_grads(got, expect, gtol)


# ``_check_float32_parts``'s bound, measured (FUZZ_MEASURE=1) over seeds 0-499 with every case's model set to one of
# FLOAT32_PARTS: the plain run's own error against the float64-inside run is 1e-12 to 2e-7 (the float32 parts'
# rounding, float32's eps 1.2e-7 damped by the layers after them); ours is at most 2.01 times it for log-probs and
# entropies (seed 399), and 3.5 times for the gradients (the largest error over all parameters: another summation
# order flips other float32 roundings; seeds 271 Qwen3.5, 52 Cohere: 3.5, 3.0), hence 4. Where the plain run's
# error is 0 (nothing trained, no rounding reached), ours is float64 noise, at most 1.8e-15: the floor 1e-12 (a
# cache-path model's: its tolerance, ``TOL``). A mechanism error (the packed or cached path computing something
# else) is far above both, and the float64-inside check holds everything to 1e-9 anyway.
F32_FACTOR = {"log-probs": 4.0, "entropies": 4.0, "gradients": 4.0}
F32_FLOOR = 1e-12


def _check_float32_parts(case: Case, model) -> None:
    """A model with float32 parts as it is (``FLOAT32_PARTS``): sharedprefix's log-probs, entropies and gradients
    within twice the plain run's own error against the float64-inside run (the flash-attention rule: the plain run
    here is the model's float64 forward with its float32 parts, eager softmax kept float64 in both as elsewhere)."""
    model.zero_grad(set_to_none=True)
    if case.checkpointing:
        model.gradient_checkpointing_disable()  # the plain runs: no recomputation
    w_lp, w_ent = _weights(case, (0, 0))

    def run_plain():
        with EagerSoftmax64():
            lp, ent, mask, _ = plain(case, model)
            w_lp, w_ent = _weights(case, lp.shape)
            loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if case.entropy else 0.0)
            if loss.requires_grad:
                loss.backward()
        g = _grads(model)
        model.zero_grad(set_to_none=True)
        return lp.detach(), ent.detach(), mask, g

    with Float64Inside():
        truth_lp, truth_ent, mask, truth = run_plain()
    plain_lp, plain_ent, _, plain_g = run_plain()
    w_lp, w_ent = _weights(case, truth_lp.shape)
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": case.reentrant})
    # the cache path runs the model's own attention: its eager softmax float64 there too, as in the plain runs
    softmax64 = EagerSoftmax64() if case.model in CACHE_PATH else contextlib.nullcontext()
    with torch.no_grad(), softmax64:
        out = sp.logprobs(model, _inputs(case), temperature=case.temperature, entropy=True, max_tokens=case.max_tokens)

    def loss_fn(b):
        return (b.logprobs * w_lp[b.index]).sum() + ((b.entropy * w_ent[b.index]).sum() if case.entropy else 0.0)

    with softmax64:
        sp.backward(
            model,
            _inputs(case),
            loss_fn,
            max_tokens=case.max_tokens,
            prefix_activations=case.mode,
            temperature=case.temperature,
            entropy=case.entropy,
        )
    ours_g = _grads(model)
    model.zero_grad(set_to_none=True)
    scale = max([float(g.abs().max()) for g in truth.values()] + [1e-30])
    errs = {  # (ours, plain) against the float64-inside run: max abs, gradients at the largest gradient's scale
        "log-probs": (float((out.logprobs - truth_lp).abs().max()), float((plain_lp - truth_lp).abs().max())),
        "entropies": (float((out.entropy - truth_ent).abs().max()), float((plain_ent - truth_ent).abs().max())),
        "gradients": tuple(
            max([float((g[n] - t).abs().max()) / scale for n, t in truth.items()] + [0.0]) for g in (ours_g, plain_g)
        ),
    }
    if os.environ.get("FUZZ_MEASURE"):
        print("MEASURE", case.seed, case.model, *(f"{k} {o:.3g} {p:.3g}" for k, (o, p) in errs.items()), flush=True)
    for name, (ours_err, plain_err) in errs.items():
        assert ours_err <= F32_FACTOR[name] * plain_err + max(F32_FLOOR, TOL.get(case.model, 0.0)), (
            f"float32 parts, {name}: {ours_err:.3g} from the float64-inside run, plain {plain_err:.3g}"
        )


def _check_plan(case: Case, model) -> None:
    """``sp.plan_call`` reuse: one plan, run several times, must give bit for bit (``torch.equal``) what planning
    afresh gives, for no-grad log-probs and then ``sp.backward`` with the same plan, on a second model of the same
    configuration (other weights), and on the first model again after an optimizer step changed its parameters (the
    log-probs must change too, or the comparison could not fail)."""
    if case.checkpointing:  # (``_check_autocast`` turns it off)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": case.reentrant})
    opts = dict(temperature=case.temperature, entropy=case.entropy)
    back = dict(prefix_activations=case.mode, grad_reduction=case.reduction, aux_loss_coef=0.5 if _aux(case) else None)
    cp = sp.plan_call(model, _inputs(case), max_tokens=case.max_tokens, **(opts if case.plan_given else {}))
    with_plan = {} if case.plan_given else opts  # the settings a call of the plan passes itself

    def values(m, source, call_opts):
        with torch.no_grad():
            out = sp.logprobs(m, source, aux_loss=True if case.force_aux else None, **call_opts)
        return out.logprobs, out.entropy, out.mask, out.aux_loss

    def grads(m, source, call_opts):
        for p in m.parameters():
            p.grad = None
        g = torch.Generator().manual_seed(case.seed + 3)
        w = None

        def loss_fn(b):
            nonlocal w
            if w is None:  # one weight per (row, column), drawn once for all batches
                w = torch.randn(b.mask.shape[1] * 64, dtype=torch.float64, generator=g)
            cols = w[: b.logprobs.shape[1]]
            loss = (b.logprobs * cols * (1 + b.index[:, None].to(cols))).sum()
            return loss + (b.entropy.sum() if case.entropy else 0.0)

        res = sp.backward(m, source, loss_fn, **back, **call_opts)
        return res.loss, _grads(m)

    def same(a, b, what):
        for x, y in zip(a, b):
            if isinstance(x, dict):
                assert x.keys() == y.keys(), f"{what}: gradients of other parameters"
                assert all(torch.equal(x[n], y[n]) for n in x), f"{what}: gradients differ from planning afresh"
            elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                assert torch.equal(x, y), f"{what}: differs from planning afresh"
            else:
                assert x == y, f"{what}: {x} against {y} planning afresh"

    fresh = dict(max_tokens=case.max_tokens, **opts)
    first = values(model, cp, with_plan)
    same(first, values(model, _inputs(case), fresh), "plan reused: no-grad log-probs")
    backward = grads(model, cp, with_plan)
    same(backward, grads(model, _inputs(case), fresh), "plan reused: sp.backward after no_grad")
    other = copy.deepcopy(model)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(case.seed + 4)
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, dtype=p.dtype, generator=gen))
    same(values(other, cp, with_plan), values(other, _inputs(case), fresh), "plan on a second model")
    step = backward[1]  # the gradient above, for the optimizer step
    for n, p in model.named_parameters():
        p.grad = step.get(n)
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3).step()
    after = values(model, cp, with_plan)
    # (a zero gradient is possible: OLMo's parameter-free final norm of a padding embedding's zero hidden states)
    moved = any(bool(g.any()) for g in step.values())
    assert not torch.equal(after[0], first[0]) or not moved, "the optimizer step changed no log-prob"
    same(after, values(model, _inputs(case), fresh), "plan after an optimizer step")
    same(grads(model, cp, with_plan), grads(model, _inputs(case), fresh), "plan after an optimizer step: backward")
    for p in model.parameters():
        p.grad = None


def _check_autocast(case: Case, model64) -> None:
    """A float32 copy of the model under CPU bf16 autocast: sharedprefix's log-probs and gradients (at the largest
    gradient's scale) within twice the plain bf16 run's own error against float64 (the flash-attention rule), plus
    a floor of bf16's own resolution for the rare case where the plain run happens to be nearly exact."""
    model64.zero_grad(set_to_none=True)
    if case.checkpointing:
        model64.gradient_checkpointing_disable()
    with EagerSoftmax64():
        truth_lp, truth_ent, _, truth_aux = plain(case, model64)
    w_lp, w_ent = _weights(case, truth_lp.shape)
    coef = 0.5 if _aux(case) else 0.0

    def loss(lp, ent, aux, index=None):
        wl, we = (w_lp, w_ent) if index is None else (w_lp[index], w_ent[index])
        out = (lp.double() * wl).sum() + ((ent.double() * we).sum() if case.entropy else 0.0)
        return out + (coef * aux if aux is not None else 0.0)

    with EagerSoftmax64():
        loss(truth_lp, truth_ent, truth_aux).backward()
    truth = _grads(model64)
    model = copy.deepcopy(model64).float()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent, _, aux = plain(case, model)
        loss(lp, ent, aux).backward()
    plain_g = _grads(model)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            ours_lp = sp.logprobs(
                model, _inputs(case), temperature=case.temperature, max_tokens=case.max_tokens
            ).logprobs
        sp.backward(
            model,
            _inputs(case),
            lambda b: loss(b.logprobs, b.entropy, None, b.index),
            max_tokens=case.max_tokens,
            prefix_activations=case.mode,
            temperature=case.temperature,
            entropy=case.entropy,
            aux_loss_coef=coef if _aux(case) else None,
        )
    ours_g = _grads(model)
    plain_err = float((lp.detach().double() - truth_lp).abs().max())
    ours_err = float((ours_lp.double() - truth_lp).abs().max())
    assert ours_err <= 2 * plain_err + 1e-2, f"bf16 log-probs: {ours_err:.3g} from float64, plain {plain_err:.3g}"
    scale = max(float(g.abs().max()) for g in truth.values())
    for n, t in truth.items():
        pe = float((plain_g[n].double() - t).abs().max()) / scale
        oe = float((ours_g[n].double() - t).abs().max()) / scale
        assert oe <= 2 * pe + 1e-2, f"bf16 gradient of {n}: {oe:.3g} from float64, plain {pe:.3g}"


_MEASURED: dict = {}  # the exact check's largest errors (FUZZ_MEASURE=1 prints them)


def _compare_grads(got, want, rtol):
    # a parameter the plain backward left at None may get a zero gradient from sharedprefix (and vice versa)
    names = set(got) | set(want)
    floor = 1e-6 * max([float(w.abs().max()) for w in want.values()] + [1e-30])
    for n in sorted(names):
        g = got.get(n)
        w = want.get(n)
        if g is None or w is None:
            other = g if w is None else w
            side = "ours" if w is None else "plain"
            assert float(other.abs().max()) == 0.0, f"{n}: gradient only on one side ({side})"
            continue
        scale = w.abs().max().clamp_min(floor)
        err = float((g - w).abs().max() / scale)
        if os.environ.get("FUZZ_MEASURE"):
            _MEASURED["gradients"] = max(_MEASURED.get("gradients", 0.0), err)
        assert err <= rtol, f"{n}: relative gradient error {err:.3g} > {rtol}"


def main(argv):
    start, stop = int(argv[0]), int(argv[1])
    fails = 0
    for seed in range(start, stop):
        case = draw(seed)
        try:
            r = check(case)
            print(seed, case.model, r, flush=True)
        except AssertionError as e:
            fails += 1
            print(f"FAIL {seed}: {e}", flush=True)
    print("failures:", fails)


if __name__ == "__main__":
    main(sys.argv[1:])
