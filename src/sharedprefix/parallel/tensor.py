"""Tensor parallelism: the layouts verified exact are found at the first call; every other DTensor layout is refused.

Verified (``tests/parallel/test_tensor_parallel.py``, float64 against one process): a model distributed by
transformers' own tensor parallelism (``from_pretrained(..., tp_plan="auto")`` or
``distributed_config=DistributedConfig(tp_size=N)``) whose plan uses only the styles in ``VERIFIED_STYLES``, alone or
with FSDP2 (``fully_shard``) over another mesh dimension. Each rank of a tensor-parallel group runs the same rows
(the same groups on every rank of the group, as in the plain run); transformers' module wrappers do the collectives,
and the gradient of a replicated parameter (``replicated_with_grad_allreduce``) is summed by transformers' own hook,
which ``parallel.grad_hooks`` runs once per call.

Refused, each with what was found: a model type not in ``VERIFIED_MODEL_TYPES``, the MoE load-balancing loss, a
DTensor parameter placed by anything else (a user's own ``parallelize_module``
plan), a mesh of more than two dimensions, a plan style not in ``VERIFIED_STYLES``, transformers' sequence, expert
or pipeline parallelism, attention heads or K/V heads that the TP degree does not divide, and tensor parallelism
together with ``sequence_group=``.

Reads transformers' private ``model._tp_size`` and each module's ``_is_hooked`` (set where its plan was applied),
listed in docs/internals.md.
"""

from __future__ import annotations

import torch

# the plan styles of the tested models (Llama, Qwen3, Gemma 3, Qwen3-MoE, GPT-OSS): any other is refused
VERIFIED_STYLES = frozenset(
    {
        "colwise",
        "rowwise",
        "colwise_gather_output",
        "embedding_rowwise",
        "replicated_with_grad_allreduce",
        "packed_colwise",
        "moe_tp_experts",
    }
)
# model types whose tensor-parallel runs were compared with one process (tests/parallel/test_tensor_parallel.py, and
# the held-out sweep tests/parallel/tp_sweep.py): exact. Any other is refused, because transformers' own plan can
# be wrong for a model (Gemma 3n's plain tensor-parallel forward differs from one process by 2e-2 in float64)
VERIFIED_MODEL_TYPES = frozenset(
    {
        "llama", "qwen3", "gemma3_text", "qwen3_moe", "gpt_oss", "mistral", "qwen2", "gemma2", "cohere", "cohere2",
        "granite", "starcoder2", "gpt_neox", "gptj", "codegen", "mixtral", "qwen2_moe", "exaone4", "smollm3",
        "nemotron", "lfm2", "falcon_h1", "qwen3_next", "qwen3_5_text",
    }
)  # fmt: skip
_FIX = (
    "Load the model with transformers' own tensor parallelism (from_pretrained(..., tp_plan='auto') or "
    "distributed_config=DistributedConfig(tp_size=N)), optionally with fully_shard (FSDP2) over a second mesh "
    "dimension: the layouts sharedprefix is verified exact on (docs/distributed.md)."
)


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (by name: no distributed import on the common path)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "device_mesh")


def _fsdp_managed(root: torch.nn.Module) -> set[int]:
    """ids of the parameters of every FSDP2 (``fully_shard``) module of ``root``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return set()
    return {id(p) for m in root.modules() if isinstance(m, FSDPModule) for p in m.parameters()}


def tensor_parallel_size(root: torch.nn.Module, model: torch.nn.Module | None = None) -> int:
    """The tensor-parallel degree of ``root`` (1 without tensor parallelism); raises ``ValueError`` for a layout that
    is not verified exact. ``model``: what the user passed, which may hold ``root`` (a PEFT model, FSDP2 applied to
    it as a whole)."""
    tp = getattr(root, "_tp_size", None) or 1
    fsdp: set[int] | None = None  # the FSDP2 parameters, gathered at the first DTensor (none on the common path)
    for mname, module in root.named_modules():
        for pname, p in module._parameters.items():  # this module's own (named_parameters' per-module walk: slow)
            if p is not None and is_dtensor(p):
                fsdp = _fsdp_managed(model if model is not None else root) if fsdp is None else fsdp
                _check_param(f"{mname}.{pname}" if mname else pname, p, module, id(p) in fsdp, tp)
    if tp > 1:
        _check_transformers_plan(root, tp)
    return tp


def _hsdp(placements: tuple) -> bool:
    """FSDP2's HSDP placements: replicated over the mesh's first dimension, sharded on dim 0 over its second."""
    kinds = [type(x).__name__ for x in placements]
    return kinds == ["Replicate", "Shard"] and getattr(placements[1], "dim", None) == 0


def _check_param(name: str, p, module, fsdp: bool, tp: int) -> None:
    mesh = p.device_mesh
    placements = tuple(p.placements)
    by_transformers = tp > 1 and getattr(module, "_is_hooked", False)
    sharded_model_axis = any(type(x).__name__ != "Replicate" for x in placements[1:]) if fsdp else True
    if mesh.ndim > 2 or (mesh.ndim == 2 and not fsdp):
        why = f"a {mesh.ndim}-dimensional device mesh {tuple(mesh.mesh_dim_names or ())}"
    elif not fsdp and not by_transformers:
        why = "a DTensor that neither transformers' tensor parallelism nor FSDP2 placed (a parallelize_module plan?)"
    elif fsdp and mesh.ndim == 2 and _hsdp(placements) and not by_transformers:
        return  # HSDP: FSDP2 on a (replicate, shard) mesh, every rank a data-parallel rank (test_layouts.py)
    elif fsdp and mesh.ndim == 2 and sharded_model_axis and not by_transformers:
        why = "sharded along a second mesh dimension by something other than transformers' tensor parallelism"
    else:
        return
    raise ValueError(
        f"parameter {name} is a DTensor with placements {placements} on {mesh}: {why}. sharedprefix runs only "
        f"parallel layouts it was verified exact on, and this one is not. {_FIX}"
    )


def _check_transformers_plan(root: torch.nn.Module, tp: int) -> None:
    dc = getattr(root.config, "distributed_config", None)
    for flag, what in (
        ("enable_sequence_parallel", "sequence parallelism"),
        ("enable_expert_parallel", "expert parallelism"),
    ):
        if getattr(dc, flag, False):
            raise ValueError(
                f"the model was loaded with transformers' {what} ({flag}=True) beside tp_size={tp}; " + _UNVERIFIED
            )
    for size in ("ep_size", "pp_size"):
        if (getattr(dc, size, 1) or 1) > 1:
            raise ValueError(
                f"the model was loaded with {size}={getattr(dc, size)} beside tp_size={tp}; " + _UNVERIFIED
            )
    cfg = root.config.get_text_config() if hasattr(root.config, "get_text_config") else root.config
    model_type = getattr(cfg, "model_type", None)
    if model_type not in VERIFIED_MODEL_TYPES:
        raise ValueError(
            f"{type(root).__name__} (model_type={model_type!r}) is loaded with tensor parallelism (tp_size={tp}), and "
            "sharedprefix has not compared this model type's tensor-parallel run with one process; transformers' own "
            "plan is not exact for every model (Gemma 3n's plain tensor-parallel forward differs from one process). "
            f"Verified: {sorted(VERIFIED_MODEL_TYPES)}. Load it without tp_plan, or add it to the tensor-parallel "
            "tests (tests/parallel/tp_sweep.py compares a model type in a few minutes)."
        )
    if getattr(cfg, "output_router_logits", False):
        raise ValueError(
            f"{type(root).__name__} has output_router_logits=True (the MoE load-balancing loss) and is loaded with "
            f"tensor parallelism (tp_size={tp}); that combination has not been compared with one process. Set "
            "output_router_logits=False, or load the model without tp_plan."
        )
    plan = getattr(root, "tp_plan", None) or {}
    odd = sorted({style for style in plan.values() if style not in VERIFIED_STYLES})
    if odd:
        raise ValueError(
            f"the model's tp_plan uses the style(s) {odd}, which sharedprefix has not been verified exact with "
            f"(verified: {sorted(VERIFIED_STYLES)}). Use the model's own plan (tp_plan='auto') or a plan of the "
            "verified styles; a new style needs its test in tests/parallel/test_tensor_parallel.py first."
        )
    heads_sharded = any(
        k.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "qkv_proj") and s == "colwise" for k, s in plan.items()
    )
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(cfg, field, None)
        if heads_sharded and isinstance(heads, int) and heads % tp:
            raise ValueError(
                f"{field}={heads} is not a multiple of the tensor-parallel degree {tp}, and the model's tp_plan shards "
                "attention heads over the ranks (colwise q/k/v projections): each rank would hold part of a head, "
                "which no attention computes correctly. Use a tensor-parallel degree that divides "
                f"{field} ({heads}), or a tp_plan that leaves the attention projections replicated."
            )


_UNVERIFIED = (
    "sharedprefix is verified exact with transformers' tensor parallelism alone (and FSDP2 over another mesh "
    "dimension), not with that. Load the model without it."
)


def refuse_with_sequence_group(tp: int) -> None:
    raise ValueError(
        f"sequence_group= was given for a tensor-parallel model (tp_size={tp}): the Ulysses split of heads across the "
        "sequence group would split heads that tensor parallelism already split, a combination sharedprefix has not "
        "been verified exact on. Use one of the two: tensor parallelism within a node, or sequence_group= on a model "
        "that is not tensor-parallel (with FSDP2 or DDP over the ranks)."
    )


def step_refusal(engine) -> str | None:
    """Why ``sp.plan_step``'s steps cannot run under ``engine``'s tensor parallelism, or None: its gradient all-reduce
    is a post-accumulate-grad hook, which a step would run once per microbatch on another gradient."""
    return (
        f"tensor parallelism (tp_size={engine.tensor}), whose gradient all-reduce is a hook"
        if engine.tensor > 1
        else None
    )
