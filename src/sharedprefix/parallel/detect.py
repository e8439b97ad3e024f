"""Which parallelism a call runs under: DDP, FSDP2 (on the causal LM or on a wrapper of it as a whole), tensor
parallelism (``parallel.tensor``), or none; ``detect`` returns the call's ``strategy.Parallel``.

Reads FSDP2's private ``_fsdp_param_group.mesh_info`` (the ranks it averages over) and DDP's
``require_backward_grad_sync`` / ``process_group`` (docs/internals.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sharedprefix.model.adapter import peel_compiled
from sharedprefix.parallel.strategy import Parallel
from sharedprefix.parallel.tensor import tensor_parallel_size


def _fsdp_module_cls():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    return FSDPModule


def ddp_sync_enabled(model: torch.nn.Module) -> bool:
    """False inside a DDP model's ``no_sync()`` context (DDP's public flag ``require_backward_grad_sync``)."""
    from torch.nn.parallel import DistributedDataParallel

    model = peel_compiled(model)
    return not isinstance(model, DistributedDataParallel) or bool(getattr(model, "require_backward_grad_sync", True))


def _outer_fsdp(model: torch.nn.Module, root: torch.nn.Module, fsdp_cls) -> torch.nn.Module | None:
    """The outermost FSDP2 module among the wrappers between ``model`` and the causal LM ``root`` (PEFT's
    ``PeftModel`` and its ``LoraModel``), or None (none, or ``root`` itself is the first FSDP2 module)."""
    if fsdp_cls is None:
        return None
    m = model
    for _ in range(8):
        if m is root or m is None:
            return None
        if isinstance(m, fsdp_cls):
            return m
        m = (
            m.get_base_model()
            if hasattr(m, "get_base_model")
            else getattr(m, "base_model", None) or getattr(m, "module", None)
        )
    return None


def _fsdp_data_size(root: torch.nn.Module, world: int) -> int:
    """The number of ranks FSDP2 averages gradients over: the size of the mesh of an FSDP2 parameter group (its
    private ``mesh_info``, docs/internals.md); every rank when no group is found (FSDP2 on a 1-D mesh of the world)."""
    fsdp_cls = _fsdp_module_cls()
    for m in root.modules():
        if fsdp_cls is not None and isinstance(m, fsdp_cls):
            info = getattr(getattr(m._get_fsdp_state(), "_fsdp_param_group", None), "mesh_info", None)
            mesh = getattr(info, "mesh", None)
            if mesh is not None:
                return int(mesh.size())
    return world


def detect(model: torch.nn.Module, root: torch.nn.Module) -> Parallel:
    """How ``model`` (as the user passed it) and its transformers ``root`` are parallelised; a layout sharedprefix is
    not verified exact on raises ``ValueError`` (``parallel.tensor``)."""
    from torch.nn.parallel import DistributedDataParallel

    model = peel_compiled(model)  # torch.compile around the model (accelerate's torch_compile): what is inside
    tp = tensor_parallel_size(root, model)

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:
        FSDP1 = ()
    m = model
    while m is not None:
        if FSDP1 and isinstance(m, FSDP1):
            raise ValueError(
                "the model is wrapped in FullyShardedDataParallel (FSDP1), whose flat sharded parameters sharedprefix "
                "cannot run; shard it with torch.distributed.fsdp.fully_shard (FSDP2) instead."
            )
        m = getattr(m, "module", None)
    fsdp_cls = _fsdp_module_cls()
    outer = _outer_fsdp(model, root, fsdp_cls)
    if outer is not None:  # FSDP2 applied to a wrapper of the causal LM as a whole (a PEFT model): that is the root
        root = outer
    if fsdp_cls is not None and isinstance(root, fsdp_cls):
        state = root._get_fsdp_state() if hasattr(root, "_get_fsdp_state") else None
        if not (hasattr(state, "_pre_forward") and hasattr(state, "_post_forward")):
            raise ValueError(
                f"torch {torch.__version__}'s FSDP2 root state has no _pre_forward / _post_forward, which sharedprefix "
                "runs around each pass (the FSDP2 root's own hooks); use a torch version that has them (torch 2.13, "
                "which this was tested with, does)."
            )
        return Parallel("fsdp", root, world, tensor=tp, data_size=_fsdp_data_size(root, world))
    if fsdp_cls is not None and any(isinstance(m, fsdp_cls) for m in root.modules()):
        raise ValueError(
            "the model has fully_shard (FSDP2) submodules but its root is not sharded; apply fully_shard to the "
            "causal LM itself too (after its layers), so that its embedding and LM head are managed by FSDP2."
        )
    if isinstance(model, DistributedDataParallel):
        if tp > 1:
            raise ValueError(
                f"the model is wrapped in DistributedDataParallel and tensor-parallel (tp_size={tp}); sharedprefix is "
                "verified exact with tensor parallelism alone or under FSDP2 over a second mesh dimension "
                "(fully_shard, or transformers' DistributedConfig(tp_size=..., fsdp_size=...)), not under DDP. Shard "
                "the data dimension with FSDP2 instead."
            )
        group = getattr(model, "process_group", None)
        return Parallel(
            "ddp", root, world, tensor=tp, data_size=dist.get_world_size(group) if world > 1 else 1, data_group=group
        )
    return Parallel("none", root, world, tensor=tp)
