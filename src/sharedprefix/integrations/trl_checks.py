"""Checks the TRL trainers make when built, for settings where TRL's own trainer computes something the log-prob hook
cannot, or should not, reproduce (``integrations.trl`` calls them from ``SharedPrefixHooks.__init__``,
``integrations.trl_async`` from ``SharedPrefixAsyncGRPOTrainer.__init__``).

- ``check_training_noise`` (in place of ``check_supported``): TRL trains in training mode with its default
  ``disable_dropout=False`` (TRL 1.16), so every dropout of the model draws, LoRA's ``lora_dropout`` included; its
  ``disable_dropout=True`` sets only the ``torch.nn.Dropout`` modules to p=0, so attention dropout
  (``config.attention_dropout``, applied functionally by the attention code) and layerdrop still draw. A prompt
  shared by G completions would share one draw where TRL's G rows draw G, so the model's own check
  (``check_supported`` in training mode) refuses it; made here at construction, not at the first training
  step, with TRL's settings named. TRL's ``AsyncGRPOTrainer`` has no ``disable_dropout``: there the fix named is the
  model's own dropout settings.
- ``check_neftune``: transformers' ``neftune_noise_alpha`` (a setting of every TRL config, from ``TrainingArguments``)
  adds uniform noise to the input embeddings in training, one draw per token of each row, through a forward hook on
  the embedding module that ``Trainer.train()`` registers. A prompt shared by G completions would share one draw
  where TRL's G rows draw G, and sharedprefix refuses the hook at the first training step (after the first
  generation); refused here, when built, with the setting named.
- ``check_reentrant_budget``: reentrant gradient checkpointing (``use_reentrant=True``) with a
  ``sharedprefix_max_tokens`` budget. A pass that splits a group is refused under reentrant checkpointing, and
  whether a step splits one depends on the lengths of its prompts and completions, unknown when the trainer is built;
  refused then, rather than at the first step that brings a group over the budget.
- ``check_fsdp``: accelerate's FSDP plugin (``is_fsdp_enabled``; the model is sharded only when ``train()`` starts).
  FSDP1 is refused (sharedprefix runs FSDP2 only); under FSDP2 the policy pass runs its backward after TRL's
  (``integrations.trl_after``), on the text path, with the prompts recomputed (FSDP2's prefix mode). What that path has
  not been run against TRL's trainer with, or cannot compute, is refused: vision-language models, hybrid models
  (their cache path is refused under FSDP2), the MoE load-balancing loss (its per-pass term is refused under FSDP2),
  and ``sharedprefix_prefix_activations="offload"``.
- ``warn_if_padding_moves_logits``: TRL's hook runs its (B, L) rows ``[left-padded prompt | completion]`` through
  the model with an attention mask and no ``position_ids``, so a model that numbers positions ``0..L-1`` over the
  padded row and embeds them absolutely (GPT-2's ``wpe``) scores a padded prompt at other positions than generation
  sampled it at (transformers' ``generate`` numbers positions from each row's first real token). sharedprefix scores
  each row from its first token, as generation does, so the two trainers differ wherever prompts of one generation
  batch differ in length. Rotary and ALiBi models, and OPT's learned positions (numbered from the mask), are not
  affected. Found by a probe, not by a list of model types: one forward of a 4-token row alone and left-padded.

Notation: n = probe row length (4 tokens), k = left padding of the probe (2 tokens), V = vocabulary.
"""

from __future__ import annotations

import math
import warnings

import torch

from sharedprefix.model.streams import embedding_size
from sharedprefix.model.support import check_supported

__all__ = [
    "check_fsdp",
    "check_neftune",
    "check_reentrant_budget",
    "check_training_noise",
    "padding_moves_logits",
    "warn_if_padding_moves_logits",
]

# |delta log p| above which the padded row's log-probs differ from the row's own beyond rounding: rotary models give
# 1e-15 to 3e-8 (float64 models whose norms round to float32: Gemma 3, OLMo 2), absolute positions 0.08 (BioGPT) to
# 0.35 (GPT-Neo) on the zoo's tiny random models, far more on trained ones; 16-bit rounding alone can reach 1e-2
_TOLERANCE = {torch.float64: 1e-3, torch.float32: 1e-3}
_LOW_PRECISION_TOLERANCE = 5e-2


def check_training_noise(trainer, inner, hybrid: bool) -> None:
    """``check_supported`` of ``inner`` (the unwrapped policy) in eval mode, then in training mode, where TRL trains it:
    what it draws there (dropout, attention dropout, layerdrop), which a shared prompt cannot reproduce, is refused
    with TRL's settings named. The model's mode is kept."""
    was = inner.training
    try:
        inner.train(False)
        check_supported(inner, hybrid=hybrid)  # what is refused in any mode, as it is
        inner.train(True)
        check_supported(inner, hybrid=hybrid)
    except ValueError as e:
        if not hasattr(trainer.args, "disable_dropout"):  # AsyncGRPOTrainer: the model's own settings only
            raise ValueError(
                f"{e} TRL's {_trl_name(trainer)} trains the model in training mode and has no disable_dropout "
                "setting, so every dropout of the model draws. Set the model's dropout to 0: attention_dropout=0.0 "
                "(and any *_dropout and layerdrop) in its config (model_init_kwargs={'attention_dropout': 0.0} when "
                "TRL loads the model), lora_dropout=0.0 in a LoRA adapter's config."
            ) from e
        raise ValueError(
            f"{e} TRL's {_trl_name(trainer)} trains the model in training mode (disable_dropout="
            f"{trainer.args.disable_dropout}; TRL's default is False); its disable_dropout=True sets the "
            "torch.nn.Dropout modules to p=0 but leaves config.attention_dropout and layerdrop as they are. Set "
            "disable_dropout=True and attention_dropout=0.0 (and layerdrop=0.0) in the model's config "
            "(model_init_kwargs={'attention_dropout': 0.0} when TRL loads the model)."
        ) from e
    finally:
        inner.train(was)


def check_neftune(trainer) -> None:
    """Refuse ``neftune_noise_alpha`` (NEFTune's embedding noise, which transformers' ``Trainer.train()`` adds through a
    forward hook on the input embeddings): a shared prompt would draw its noise once for its G completions."""
    alpha = getattr(trainer.args, "neftune_noise_alpha", None)
    if alpha is None:
        return
    raise ValueError(
        f"neftune_noise_alpha={alpha!r}: transformers' Trainer adds NEFTune noise to the input embeddings in training "
        "(a forward hook on the embedding module, registered by train()), one draw per token of each row. "
        f"{type(trainer).__name__} computes a prompt shared by a group's completions once, so it would draw one noise "
        f"sample where TRL's {_trl_name(trainer)} draws one per completion, and it refuses the hook at the first "
        "training step anyway. Expected neftune_noise_alpha=None. Set neftune_noise_alpha=None (the default) in the "
        "config; NEFTune is a supervised fine-tuning technique and TRL's RL trainers do not need it."
    )


def check_fsdp(trainer, inner, hybrid: bool, mode: str) -> str:
    """Refuse accelerate's FSDP settings the trainer cannot run exactly (see the module docstring); returns the prefix
    mode its policy passes run in (``mode``, the trainer's setting; "recompute" under FSDP2)."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if not getattr(trainer, "is_fsdp_enabled", False) or plugin is None:
        return mode
    name, trl_name = type(trainer).__name__, _trl_name(trainer)
    version = getattr(plugin, "fsdp_version", 1)
    if version != 2:
        raise ValueError(
            f"accelerate's FSDP plugin with fsdp_version={version}: sharedprefix runs under FSDP2 (fully_shard) only; "
            f"FSDP1 (FullyShardedDataParallel) flattens the parameters, which its calls cannot run. Set "
            "fsdp_config={'fsdp_version': 2} (accelerate: fsdp_version: 2)."
        )
    why = None
    if inner.config.get_text_config() is not inner.config:
        why = (
            f"{type(inner).__name__} is a vision-language model; under FSDP2 {name} runs the text path only (image "
            "rows have not been run against TRL's trainer under FSDP2)"
        )
    elif hybrid:
        why = (
            f"{type(inner).__name__} is a hybrid model on sharedprefix's cache path, which does not run inside "
            "FSDP2's unshard and reshard hooks"
        )
    elif getattr(trainer, "aux_loss_enabled", False):
        why = (
            f"the MoE load-balancing loss (router_aux_loss_coef={trainer.router_aux_loss_coef}) adds a per-pass term "
            "to a tensor FSDP2 registers no hooks on"
        )
    elif mode == "offload":
        why = (
            "sharedprefix_prefix_activations='offload': under FSDP2 a prompt's backward runs inside the root "
            "module's call, where only 'recompute' runs it (set 'recompute', or leave the default, which runs as "
            "'recompute' under FSDP2)"
        )
    if why is not None:
        raise ValueError(
            f"FSDP2 (accelerate's fsdp_plugin) with {why}, so {name} would not train as TRL's {trl_name} does; it is "
            "refused when built. Train it with DDP or in one process, or drop the setting named."
        )
    return "recompute"


def check_reentrant_budget(trainer, budget: int | None) -> None:
    """Refuse reentrant gradient checkpointing together with a ``sharedprefix_max_tokens`` ``budget`` (the trainer's
    checked one): a grad-enabled pass that splits a group is refused under it (``schedule.refusals.check_call``), and
    whether a step's groups fit the budget is known only at that step. The rule for "reentrant" is
    ``model.forward_mode.uses_reentrant_checkpointing``'s, read from the config: transformers enables checkpointing with
    ``gradient_checkpointing_kwargs`` as given, ``{"use_reentrant": False}`` when None, and torch's checkpoint is
    reentrant when the key is missing."""
    a = trainer.args
    kwargs = getattr(a, "gradient_checkpointing_kwargs", None)
    if budget is None or not getattr(a, "gradient_checkpointing", False) or kwargs is None:
        return
    if not kwargs.get("use_reentrant", True):
        return
    why = (
        "reentrant"
        if "use_reentrant" in kwargs
        else "reentrant: torch's checkpoint is where use_reentrant is not given"
    )
    raise ValueError(
        f"gradient_checkpointing=True with gradient_checkpointing_kwargs={kwargs!r} ({why}) and "
        f"sharedprefix_max_tokens={budget}: a group (a prompt and its completions) larger than {budget} tokens is "
        "split across passes, and reentrant checkpointing returns gradients only to a layer's explicit inputs, so the "
        "cached prompt K/V would get none; the step that brings such a group would be refused. Which steps do depends "
        f"on the lengths of the prompts and completions, unknown now, so {_trl_name(trainer)} with these settings is "
        "refused when built. Expected use_reentrant=False with a budget. Set "
        "gradient_checkpointing_kwargs={'use_reentrant': False} (transformers' default; TRL forces True only for "
        "PEFT under DeepSpeed ZeRO-3), or sharedprefix_max_tokens=None (each microbatch one pass), or "
        "gradient_checkpointing=False."
    )


def padding_moves_logits(inner, pad_token_id: int | None) -> float | None:
    """max |delta log p| over the vocabulary at the last token of a 4-token row, between the row alone and the row
    behind 2 masked pad tokens, as TRL's hook feeds it (an attention mask, no ``position_ids``); None where the
    parameters are not materialised here (DeepSpeed ZeRO-3 partitions, a meta device), or the padded row's values
    are not finite (a model whose fully masked pad rows give NaN, as eager Gemma 2 and BLOOM do here), so nothing was
    measured."""
    params = list(inner.parameters())
    if not params or any(p.numel() == 0 or p.device.type == "meta" for p in params):
        return None
    device = params[0].device
    ids = torch.tensor(_plain_tokens(inner, 4), device=device)  # (n,)
    pad = torch.full((2,), pad_token_id if pad_token_id is not None else 0, device=device, dtype=ids.dtype)
    padded = torch.cat([pad, ids])[None]  # (1, k + n)
    mask = torch.cat([torch.zeros_like(pad), torch.ones_like(ids)])[None]
    was = inner.training
    inner.eval()
    try:
        with torch.no_grad():
            alone = inner(input_ids=ids[None], use_cache=False).logits[0, -1].double().log_softmax(-1)  # (V,)
            behind = inner(input_ids=padded, attention_mask=mask, use_cache=False).logits[0, -1]
    finally:
        inner.train(was)
    moved = float((behind.double().log_softmax(-1) - alone).abs().max())
    return moved if math.isfinite(moved) else None


def _plain_tokens(inner, n: int) -> list[int]:
    """``n`` token ids from the middle of the vocabulary that no ``*token_id`` / ``*token_index`` of the model's
    configs names (an image or audio placeholder would make the text-only probe fail)."""
    special = set()
    for cfg in {id(c): c for c in (inner.config, inner.config.get_text_config())}.values():
        for key, value in cfg.to_dict().items():
            if key.endswith(("token_id", "token_index", "token_ids")):
                special.update(value if isinstance(value, list) else [value])
    vocab = embedding_size(inner)  # (read through PEFT's wrappers: trainable_token_indices' has no num_embeddings)
    return [t for t in range(vocab // 2, vocab) if t not in special][:n]


def warn_if_padding_moves_logits(trainer, inner) -> None:
    """Warn when TRL's own trainer would score a left-padded prompt at other positions than generation sampled it
    (``padding_moves_logits`` beyond the model dtype's rounding): the sharedprefix trainer then trains on other (the
    sampled) log-probs than TRL's wherever prompts differ in length."""
    tok = getattr(trainer, "_tokenizer", None) or getattr(trainer, "processing_class", None)
    moved = padding_moves_logits(inner, getattr(tok, "pad_token_id", None))
    dtype = next(inner.parameters()).dtype
    if moved is None or moved <= _TOLERANCE.get(dtype, _LOW_PRECISION_TOLERANCE):
        return
    trl_name = _trl_name(trainer)
    warnings.warn(
        f"{type(inner).__name__} gives a left-padded row other log-probs than the row alone (max |delta log p| = "
        f"{moved:.3g} on a 4-token probe behind 2 pad tokens): it numbers positions over the padding, with absolute "
        f"position embeddings (as GPT-2 does). TRL's {trl_name} scores its left-padded prompts that way, not at the "
        "positions transformers' generate sampled them at; this trainer scores every row from its first token, as "
        f"generation does. So wherever the prompts of a generation batch differ in length, the two train to "
        f"different parameters (measured on a tiny GPT-2: 0.25 of the update). To have both agree, give every prompt "
        "the same number of tokens, or use a model with rotary positions.",
        UserWarning,
        stacklevel=3,
    )


def _trl_name(trainer) -> str:
    """The name of the TRL trainer class ``trainer`` extends (``GRPOTrainer``, ``RLOOTrainer``)."""
    return next(c.__name__ for c in type(trainer).__mro__ if c.__module__.startswith("trl."))
