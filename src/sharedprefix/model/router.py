"""The MoE load-balancing loss of the plain run (``output_router_logits=True``), each prompt token counted once per row.

transformers' MoE causal LMs return, next to their logits, ``aux_loss = load_balancing_loss_func(router_logits,
num_experts, top_k, attention_mask)``: E * sum_e f_e * P_e over every token of the batch the attention mask keeps,
where f_e is the share of the tokens' top-k choices that go to expert e and P_e the mean router probability of e
(Switch Transformer, eqs. 4-6). Both are means over tokens weighted by the mask, so the plain run's loss over the
rows ``[prompt, completion_i]`` is the same function of the packed tokens, each weighted by the number of plain rows
that contain it (the G completions of a group count its prompt tokens G times, each completion token once):
sharedprefix calls the model module's own ``load_balancing_loss_func`` with those multiplicities as the attention
mask. The plain run this reproduces is one forward of all the rows of the call, padding masked out.

The loss is a product of two means over all tokens, not a sum over completions, but its gradient is additive: with
the routing counts f_e fixed (they have no gradient), d aux / d theta = sum over tokens of g_t . d z_t / d theta, where
z_t is token t's (E,) router logits and g_t = d aux / d z_t at the forward's values (each shared token's g_t already
carries its multiplicity). So a call that runs its backward per pass (``sp.backward``, deferred log-probs) first runs a
no-grad forward of every row (``segment_grads``: g_t from the model's own function, by autograd on its inputs, per
segment of the plan), then adds the linear term sum_t g_t . z_t of the tokens each pass computes with grad
(``linear_term``) to that pass's loss: exact by the chain rule, under any budget. ``sp.logprobs`` with grad and no
deferral keeps the loss itself, with its graph (``LogProbs.aux_loss``).

``verify`` checks the reproduction once per model against the model's own forward: rows [A, A, A, B] (B padded)
against this function on [A, B] with multiplicities 3 and 1. Like the model's, the loss is float32 (its sums are).

Notation: L = row length, E = experts, k = experts per token.
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref

import torch

from sharedprefix.model.forward_mode import uses_reentrant_checkpointing
from sharedprefix.model.identity import model_key
from sharedprefix.model.streams import declared_rows

# model -> (its ``model_key`` when verified, (function, num_experts, top_k))
_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def enabled(model) -> bool:
    """True when the model returns a load-balancing loss by default (``config.output_router_logits``); a call can
    also ask for it (``sp.logprobs(aux_loss=True)``, ``sp.backward(aux_loss_coef=...)``), as TRL does."""
    return bool(getattr(model.config.get_text_config(), "output_router_logits", False))


@contextlib.contextmanager
def recording(model, on: bool):
    """With ``on``, the decoder returns its router logits for the duration (``config.output_router_logits`` set
    True, then restored): a call can ask for the loss where the config does not (TRL does). The config, not a
    keyword, because transformers passes the keyword on to every layer's attention."""
    cfg = model.config.get_text_config()
    before = getattr(cfg, "output_router_logits", None)
    if not on or before:
        yield
        return
    cfg.output_router_logits = True
    try:
        yield
    finally:
        cfg.output_router_logits = before


def check_coef(model, coef) -> float:
    """``sp.backward``'s ``aux_loss_coef`` as a float (0.0: no aux loss); refuses a missing one where the config
    turns the loss on, and a non-number."""
    if coef is None:
        if enabled(model):
            raise ValueError(
                f"{type(model).__name__} has output_router_logits=True, so its forward returns an MoE load-balancing "
                "loss, and aux_loss_coef is None. Pass aux_loss_coef=model.config.router_aux_loss_coef to add "
                "coef * aux_loss (the plain forward's, over all rows; exact under any budget), or aux_loss_coef=0.0 to "
                "leave it out."
            )
        return 0.0
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef):
        raise TypeError(f"aux_loss_coef={coef!r}; expected a finite number (e.g. config.router_aux_loss_coef) or None.")
    return float(coef)


def check_checkpointing(model) -> None:
    """Refuses the load-balancing loss's gradient under reentrant gradient checkpointing: transformers records the
    router logits inside each checkpointed layer, whose reentrant forward runs without grad, so the plain run's
    ``aux_loss`` has no gradient at all (silently), and a pass's linear term (``linear_term``) would be wrong."""
    if uses_reentrant_checkpointing(model):
        raise ValueError(
            f"{type(model).__name__} uses gradient checkpointing with use_reentrant=True, and this call trains its MoE "
            "load-balancing loss: transformers records the router logits inside each checkpointed layer, whose "
            "reentrant forward runs without grad, so the loss gets no gradient (in a plain forward too, silently). "
            "Use gradient_checkpointing_kwargs={'use_reentrant': False} (the transformers default; for torch's "
            "checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT), or leave the loss "
            "out (aux_loss=False / aux_loss_coef=0.0; TRL: router_aux_loss_coef=0.0)."
        )


def refuse_hybrid(model) -> None:
    raise ValueError(
        f"{type(model).__name__} is a hybrid model (layers that mix tokens outside attention), whose path runs the "
        "model's own cache-aware forward, which sharedprefix does not read router logits from: its MoE load-balancing "
        "loss is not reproduced. Leave it out (aux_loss=None / aux_loss_coef=0.0; TRL: router_aux_loss_coef=0.0); "
        "routing itself stays exact."
    )


def scaled_grads(model, records, coef: float):
    """(``segment_grads`` times ``coef``, the loss's value as a float) from a no-grad forward's records."""
    grads = {s: [g * coef for g in gs] for s, gs in segment_grads(model, records).items()}
    return grads, float(aux_loss(model, records))


def spans(layout) -> list[tuple[int, int, int]]:
    """(segment, start, end) of each segment the packed row computes, in row order."""
    return [(s, layout.row_start[s], layout.row_end[s]) for s in layout.segments]


def segment_grads(model, records) -> dict[int, list[torch.Tensor]]:
    """From a no-grad forward's records: segment -> per MoE layer the (len, E) gradient d aux / d router logits of
    its tokens, where aux is ``aux_loss(model, records)`` (the model's own function, differentiated by autograd)."""
    fn, num_experts, top_k = _VERIFIED[model][1]
    layers = len(records[0][0])
    leaves = [[r[i].detach().requires_grad_(True) for i in range(layers)] for r, _, _ in records]
    with torch.enable_grad():
        logits = tuple(torch.cat([leaf[i] for leaf in leaves]) for i in range(layers))
        weights = torch.cat([w.to(logits[0].device) for _, w, _ in records])[None]
        grads = torch.autograd.grad(
            fn(logits, num_experts, top_k, weights), [t for leaf in leaves for t in leaf], allow_unused=True
        )
    out: dict[int, list[torch.Tensor]] = {}
    for k, (_, _, sp_) in enumerate(records):
        per_layer = [
            g if g is not None else torch.zeros_like(leaves[k][i])
            for i, g in enumerate(grads[k * layers : (k + 1) * layers])
        ]
        for seg, a, b in sp_:
            out[seg] = [g[a:b] for g in per_layer]
    return out


def linear_term(router_logits, row_spans, grads: dict[int, list[torch.Tensor]], scale: float) -> torch.Tensor | None:
    """``scale * sum_t g_t . z_t`` over the tokens of ``row_spans`` (see ``spans``) of one pass; None without any."""
    total = None
    for seg, a, b in row_spans:
        for z, g in zip(router_logits, grads[seg]):
            term = (z[a:b] * g.to(z.device, z.dtype)).sum()
            total = term if total is None else total + term
    return None if total is None else total * scale


def multiplicity(layout) -> torch.Tensor:
    """(L,) float64: for each token of the packed row, the number of output rows whose path contains it."""
    tree = layout.tree
    count = [0] * len(tree.segments)
    for r in tree.rows:
        for s in tree.path(r.end):
            count[s] += 1
    return torch.cat(
        [
            torch.full((layout.row_end[s] - layout.row_start[s],), float(count[s]), dtype=torch.float64)
            for s in layout.segments
        ]
    )


def aux_loss(model, records: list[tuple[tuple, torch.Tensor, object]]) -> torch.Tensor:
    """The plain run's load-balancing loss from each pass's ``(router_logits, weights, spans)``.

    ``router_logits``: one (L, E) tensor per MoE layer, as the decoder returns them; ``weights``: (L,) from
    ``multiplicity``; ``spans``: from ``spans``. The rows of every pass are concatenated (the loss sums over tokens;
    order is irrelevant).
    """
    fn, num_experts, top_k = _VERIFIED[model][1]
    layers = len(records[0][0])
    if any(len(r) != layers for r, _, _ in records):
        raise RuntimeError("the passes of one call returned router logits of different numbers of layers.")
    logits = tuple(torch.cat([r[i] for r, _, _ in records]) for i in range(layers))
    weights = torch.cat([w.to(logits[0].device) for _, w, _ in records])[None]
    return fn(logits, num_experts, top_k, weights)


def _parts(model):
    """(load_balancing_loss_func of the model's module, num_experts, top_k) as the model's forward passes them."""
    name = type(model).__name__
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    cfg = model.config.get_text_config()
    num_experts = (
        getattr(model, "num_experts", None)
        or getattr(cfg, "num_experts", None)
        or getattr(cfg, "num_local_experts", None)
    )
    top_k = getattr(model, "num_experts_per_tok", None) or getattr(cfg, "num_experts_per_tok", None)
    if fn is None or not num_experts or not top_k:
        raise ValueError(
            f"{name}'s MoE load-balancing loss is asked for (output_router_logits=True, aux_loss=True, or TRL's "
            f"router_aux_loss_coef != 0), but sharedprefix finds no load_balancing_loss_func in its module "
            f"{type(model).__module__} (or no expert count / top-k: {num_experts}, {top_k}), so it cannot compute its "
            "load-balancing loss as the plain run does. Leave the loss out: config.output_router_logits=False "
            "(TRL: router_aux_loss_coef=0.0); routing itself is per token and stays exact."
        )
    return fn, int(num_experts), int(top_k)


def check_available(model) -> None:
    """Raise now, before any forward, when the model's module has no load-balancing loss sharedprefix can call."""
    _parts(model)


def verify(model, decoder, device) -> None:
    """Once per model and ``model_key`` (again when a module or its ``forward`` changed): the model's own aux_loss
    over rows [A, A, A, B] equals ``aux_loss`` on [A, B] weighted 3, 1."""
    key = model_key(model)
    if model in _VERIFIED and _VERIFIED[model][0] == key:
        return
    _VERIFIED.pop(model, None)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        _VERIFIED[model] = key, _verify(model, decoder, device)


def _verify(model, decoder, device):
    name = type(model).__name__
    fn, num_experts, top_k = parts = _parts(model)
    vocab = declared_rows(model.get_input_embeddings())
    a = (torch.arange(5, device=device) * 7 + 3).remainder(vocab)
    b = (torch.arange(3, device=device) * 11 + 5).remainder(vocab)
    pad = torch.zeros(2, dtype=a.dtype, device=device) + b[0]
    rows = torch.stack([a, a, a, torch.cat([b, pad])])
    mask = torch.ones_like(rows)
    mask[3, 3:] = 0
    forward = getattr(model, "_sharedprefix_own_forward", model)
    with recording(model, True):
        want = getattr(forward(input_ids=rows, attention_mask=mask, use_cache=False), "aux_loss", None)
        out = decoder(input_ids=rows[2:], attention_mask=mask[2:], use_cache=False)
    logits = getattr(out, "router_logits", None)
    weights = torch.tensor([[3.0] * 5, [1.0, 1.0, 1.0, 0.0, 0.0]], dtype=torch.float64, device=device)
    got = fn(logits, num_experts, top_k, weights) if logits else None
    if (
        not isinstance(want, torch.Tensor)
        or not isinstance(got, torch.Tensor)
        or not torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-7)
    ):
        raise ValueError(
            f"{name} has output_router_logits=True, but its load-balancing loss is not what sharedprefix reproduces "
            f"(the model's aux_loss {_num(want)} on rows [A, A, A, B], load_balancing_loss_func of its module with "
            f"num_experts={num_experts}, top_k={top_k} and multiplicities 3, 1 on [A, B]: {_num(got)}), so it refuses "
            "rather than return a different loss. Set config.output_router_logits=False (routing itself is per "
            "token and stays exact)."
        )
    return parts


def _num(x) -> str:
    return f"{float(x):.6g}" if isinstance(x, torch.Tensor) and x.numel() == 1 else repr(type(x).__name__)
