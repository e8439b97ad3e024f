"""The MoE load-balancing loss of the plain run (``output_router_logits=True``), each prompt token counted once per row.

transformers' MoE causal LMs return, next to their logits, ``aux_loss = load_balancing_loss_func(router_logits,
num_experts, top_k, attention_mask)``: E * sum_e f_e * P_e over every token of the batch the attention mask keeps,
where f_e is the share of the tokens' top-k choices that go to expert e and P_e the mean router probability of e
(Switch Transformer, eqs. 4-6). Both are means over tokens weighted by the mask, so the plain run's loss over the
rows ``[prompt, completion_i]`` is the same function of the packed tokens, each weighted by the number of plain rows
that contain it (the G completions of a group count its prompt tokens G times, each completion token once):
sharedprefix calls the model module's own ``load_balancing_loss_func`` with those multiplicities as the attention
mask. The plain run this reproduces is one forward of all the rows of the call, padding masked out.

The loss is a product of two means over all tokens, not a sum over completions: it exists only once every row
ran, so ``sp.logprobs`` returns it (``LogProbs.aux_loss``, with grad when grad is enabled, add
``router_aux_loss_coef * aux_loss`` to the loss), and ``sp.backward``, which takes its loss per pass, refuses it.

``verify`` checks the reproduction once per model against the model's own forward: rows [A, A, A, B] (B padded)
against this function on [A, B] with multiplicities 3 and 1. Like the model's, the loss is float32 (its sums are).

Notation: L = row length, E = experts, k = experts per token.
"""

from __future__ import annotations

import sys
import weakref

import torch

_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (function, num_experts, top_k)


def enabled(model) -> bool:
    """True when the model returns a load-balancing loss (``config.output_router_logits``)."""
    return bool(getattr(model.config.get_text_config(), "output_router_logits", False))


def refuse_per_pass(model, where: str) -> None:
    """Raise the refusal for a call that cannot form the loss of all rows at once (``where`` says which)."""
    if enabled(model):
        raise ValueError(
            f"{type(model).__name__} has output_router_logits=True, and {where}: its MoE load-balancing loss "
            "E * sum_e f_e * P_e is a product of two means over every token of the batch (f_e: share of the top-k "
            "choices that go to expert e, P_e: mean router probability), not a sum over completions, so it cannot be "
            "taken per pass. Call sharedprefix.logprobs(model, groups) with grad enabled and no gradient "
            "checkpointing or DDP: its .aux_loss is the plain forward's aux_loss over all rows of the call (each "
            "prompt token counted once per completion), to add as router_aux_loss_coef * aux_loss to the loss "
            "before .backward(); or set config.output_router_logits=False (routing itself stays exact)."
        )


def multiplicity(layout) -> torch.Tensor:
    """(L,) float64: for each token of the packed row, the number of output rows whose path contains it."""
    tree = layout.tree
    count = [0] * len(tree.segments)
    for r in tree.rows:
        for s in tree.path(r.end):
            count[s] += 1
    return torch.cat(
        [torch.full((layout.row_end[s] - layout.row_start[s],), float(count[s]), dtype=torch.float64) for s in layout.segments]
    )


def aux_loss(model, records: list[tuple[tuple, torch.Tensor]]) -> torch.Tensor:
    """The plain run's load-balancing loss from each pass's ``(router_logits, weights)``.

    ``router_logits``: one (L, E) tensor per MoE layer, as the decoder returns them; ``weights``: (L,) from
    ``multiplicity``. The rows of every pass are concatenated (the loss sums over tokens; order is irrelevant).
    """
    fn, num_experts, top_k = _VERIFIED[model]
    layers = len(records[0][0])
    if any(len(r) != layers for r, _ in records):
        raise RuntimeError("the passes of one call returned router logits of different numbers of layers.")
    logits = tuple(torch.cat([r[i] for r, _ in records]) for i in range(layers))
    weights = torch.cat([w.to(logits[0].device) for _, w in records])[None]
    return fn(logits, num_experts, top_k, weights)


def _parts(model):
    """(load_balancing_loss_func of the model's module, num_experts, top_k) as the model's forward passes them."""
    name = type(model).__name__
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    cfg = model.config.get_text_config()
    num_experts = getattr(model, "num_experts", None) or getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None) or getattr(cfg, "num_experts_per_tok", None)
    if fn is None or not num_experts or not top_k:
        raise ValueError(
            f"{name} has output_router_logits=True, but sharedprefix finds no load_balancing_loss_func in its module "
            f"{type(model).__module__} (or no expert count / top-k: {num_experts}, {top_k}), so it cannot compute its "
            "load-balancing loss as the plain run does. Set config.output_router_logits=False (routing itself is "
            "per token and stays exact)."
        )
    return fn, int(num_experts), int(top_k)


def verify(model, decoder, device) -> None:
    """Once per model: the model's own aux_loss over rows [A, A, A, B] equals ``aux_loss`` on [A, B] weighted 3, 1."""
    if model in _VERIFIED or not enabled(model):
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        _VERIFIED[model] = _verify(model, decoder, device)


def _verify(model, decoder, device):
    name = type(model).__name__
    fn, num_experts, top_k = parts = _parts(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    a = (torch.arange(5, device=device) * 7 + 3).remainder(vocab)
    b = (torch.arange(3, device=device) * 11 + 5).remainder(vocab)
    pad = torch.zeros(2, dtype=a.dtype, device=device) + b[0]
    rows = torch.stack([a, a, a, torch.cat([b, pad])])
    mask = torch.ones_like(rows)
    mask[3, 3:] = 0
    forward = getattr(model, "_sharedprefix_own_forward", model)
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
