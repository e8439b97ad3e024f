"""Refusals of one call, in the order a call meets them: ``check_window`` (what a plan rules out for a dynamic-mask
model), ``check_call`` (what its model, plan, settings and parallelism decide, before any pass), ``sequence_refusals``
(what sequence parallelism does not reproduce), ``check_after_probe`` (what the probe of the layers rules out with
gradient checkpointing) and ``check_calls`` (after each pass: some attention bypassed sharedprefix); ``agree_setup`` /
``stop_every_rank``: the ranks' agreement on a refusal before any collective. Refusals inside one attention call are
the attention function's (``attention.interface``).
"""

from __future__ import annotations

import torch

from sharedprefix.attention import indexed
from sharedprefix.attention.dynamic_mask import has_dynamic_mask
from sharedprefix.attention.interface import PassState
from sharedprefix.attention.layers import softcap_refusal_on
from sharedprefix.attention.switch import implementation
from sharedprefix.model.adapter import decoder, num_attention_layers, unwrap
from sharedprefix.model.forward_mode import uses_checkpointing, uses_reentrant_checkpointing
from sharedprefix.model.positions import takes_position_ids
from sharedprefix.parallel import sequence
from sharedprefix.parallel.detect import detect


def check_call(
    model, plan, options, par, impl, device, leaves: bool, images: bool, router_logits: bool, aux_grads: bool
) -> None:
    """Every refusal of one call that its model, plan, settings (``CallOptions``) and parallelism decide, before any
    pass; the engine ``par`` (``parallel.engine``) refuses what it cannot run. ``impl``: the attention primitive the
    call selected, on ``device``; ``leaves``: an ``sp.backward``; ``images``: groups with ``prompt_inputs``;
    ``router_logits`` / ``aux_grads``: the call records the MoE router logits / adds the load-balancing loss's
    gradient term to its passes."""
    name = type(model).__name__
    if plan.splits and torch.is_grad_enabled() and uses_reentrant_checkpointing(model):
        raise ValueError(
            "gradient checkpointing with use_reentrant=True is on, and this plan splits a group across passes: "
            "reentrant checkpointing only returns gradients to a layer's explicit inputs, so the cached prompt "
            "K/V read inside each layer would get none. Enable it with "
            "gradient_checkpointing_kwargs={'use_reentrant': False} (the transformers default; for torch's "
            "checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT), or raise max_tokens so that every "
            "group fits one pass."
        )
    if plan.splits and implementation(model) == indexed.NAME and not indexed.indexers(model):
        raise ValueError(indexed.split_refusal(name))
    mode = options.prefix_activations
    if leaves:
        par.check_prefix_mode(mode, bool(plan.splits))
        par.check_sync(options.sync)
    cap = getattr(model.config.get_text_config(), "attn_logit_softcapping", None)
    if (why := softcap_refusal_on(name, cap, impl, device)) is not None:  # before any pass; the attention would too
        raise ValueError(why)
    if aux_grads:
        par.check_aux_term(name)
    if (router_logits or aux_grads) and images:
        raise ValueError(
            f"{name} has output_router_logits=True and the groups carry prompt_inputs: "
            "sharedprefix reproduces the load-balancing loss of text rows only. Set "
            "config.output_router_logits=False (routing itself stays exact)."
        )


def sequence_refusals(model, engine, images: bool, frames: bool, router_logits: bool) -> dict:
    """{feature: reason} of what a call on ``model`` under ``engine`` uses that sequence parallelism does not
    reproduce (``images``: groups with prompt_inputs; ``frames``: a multi-stream model; ``router_logits``: the call
    records the MoE router logits)."""
    out = dict(engine.sequence_refusals(model))  # the engine's first (DDP; FSDP2 without a mesh over every rank)
    if images:
        out["prompt_inputs"] = "the vision tower's features are placed into the whole row's embeddings"
    if frames:
        out["several token streams"] = "the frames are encoded per row"
    if router_logits:
        out["output_router_logits=True"] = "the load-balancing loss counts the routing of the whole row"
    if implementation(model) == indexed.NAME or any(has_dynamic_mask(m) for m in model.modules()):
        out["an indexer or a dynamic mask"] = "their key selection reads the whole row's visibility mask"
    if not takes_position_ids(decoder(model)):
        out["a decoder that takes no position_ids"] = "its positions are renumbered by hooks over the whole row"
    return out


def check_after_probe(model, plan, calls: int) -> None:
    """A refusal that needs the probe's view of the layers (``calls``: the most attention calls of a module per
    forward) and the model's state (gradient checkpointing), before any pass of ``plan``."""
    name = type(model).__name__
    if calls > 1 and plan.splits and uses_checkpointing(model):
        raise ValueError(
            f"{name} runs an attention module {calls} times per forward (looped layers or differential attention) "
            "and gradient checkpointing is on, with a budget that splits a group: the prompt cache holds one K/V "
            "per call in forward order, but a model that checkpoints each call separately recomputes them in "
            "reverse, so sharedprefix refuses the combination. Turn gradient checkpointing off, or raise "
            "max_tokens so that every group fits one pass."
        )


def check_window(name: str, plan, keep: int | None) -> None:
    """A dynamic-mask (Doge) model's refusals (``keep``: its keep_window_size, or None): rows or passes longer than
    the keys it keeps, whose top-k selection over the plain row's keys is not reproduced."""
    if keep is None:
        return
    longest, widest = (plan.tree.longest_row(), max((plan.pass_tokens(p) for p in plan.passes), default=0))
    if longest > keep:
        raise ValueError(
            f"{name}'s dynamic mask keeps only the top keep_window_size={keep} keys of each query once a row is "
            f"longer than that, and the longest [prompt + completion] row here has {longest} tokens: its selection "
            f"(over the plain row's keys) is not reproduced. Use rows of at most {keep} tokens with this model."
        )
    if widest > keep:
        raise ValueError(
            f"{name}'s dynamic mask keeps only the top keep_window_size={keep} keys of each query once the keys "
            f"of a forward outnumber it, and a pass here packs {widest} tokens, which would make it select over "
            f"the packed row. Use max_tokens <= {keep}."
        )


def check_calls(model, state: PassState) -> None:
    """Refuse a pass in which the sharedprefix attention did not run in every attention layer."""
    want = num_attention_layers(model)
    got = len(state.seen)
    if got != want:
        raise ValueError(
            f"{type(model).__name__}: the sharedprefix attention ran in {got} of {want} layers; the model's "
            "attention bypasses transformers' attention interface, so prompt sharing cannot be applied exactly. "
            "This model is not supported."
        )


def agree_setup(par, sequence_group, error: BaseException | None, key: int | None, leaves: bool, plan):
    """Before any collective of a call: every rank learns whether one failed (and, in a sequence group, whether the
    ranks' inputs digest to the same ``key``), and all raise together. Returns the round counts a lockstep engine
    (FSDP2) agreed in the same all-reduce: (forward-only, forward+backward) rounds for sp.backward (``leaves``),
    passes for sp.logprobs; ``plan`` is None on a rank that failed."""
    if sequence_group is not None:  # the ranks of a sequence group: the same rows, or all of them raise
        error = sequence.agree(sequence_group, error, key)
    counts = [] if not par.lockstep else [0, 0] if leaves else [0]
    if error is None and par.lockstep and plan is not None:
        counts = list(plan.fsdp_rounds) if leaves else [len(plan.passes)]
    return par.agree_on_error(error, counts=counts)


def stop_every_rank(model, error: BaseException, sequence_group, leaves: bool) -> None:
    """Raise ``error`` on this rank, the call's settings being bad here (``CallOptions.build``), after the agreement
    the other ranks' executors make (``agree_setup``), so that they raise with it instead of waiting."""
    par = detect(model, unwrap(model))
    par.use_sequence(sequence_group)
    par.start()
    agree_setup(par, sequence_group, error, None, leaves, None)
    raise error
