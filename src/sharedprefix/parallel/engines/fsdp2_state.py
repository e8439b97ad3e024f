"""What sharedprefix reads of FSDP2's module state (privates named in docs/internals.md): which modules are FSDP2's,
the ranks it averages gradients over and what it divides them by, the dtype it keeps the sharded parameters in."""

from __future__ import annotations

import torch

from sharedprefix.parallel.walks import memo


def fsdp_module_cls():
    """torch's ``FSDPModule`` (None: a torch without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    return FSDPModule


def outer_fsdp(model: torch.nn.Module, root: torch.nn.Module, fsdp_cls) -> torch.nn.Module | None:
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


def fsdp_modules(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every FSDP2 module in ``root``, itself included (walked once per call, ``walks``)."""
    cls = fsdp_module_cls()
    if cls is None:
        return []
    return memo(("fsdp", id(root)), lambda: [(n, m) for n, m in root.named_modules() if isinstance(m, cls)])


def fsdp_data_size(root: torch.nn.Module, world: int) -> int:
    """The number of ranks FSDP2 averages gradients over: the size of the mesh of an FSDP2 parameter group (its
    private ``mesh_info``, docs/internals.md); every rank when no group is found (FSDP2 on a 1-D mesh of the world)."""
    for _, m in fsdp_modules(root):
        info = getattr(getattr(m._get_fsdp_state(), "_fsdp_param_group", None), "mesh_info", None)
        if (mesh := getattr(info, "mesh", None)) is not None:
            return int(mesh.size())
    return world


def gradient_divide_factor(root: torch.nn.Module, data_size: int) -> float:
    """What FSDP2 divides the summed gradient by: ``data_size``, or the factor set with FSDP2's
    ``set_gradient_divide_factor`` / ``set_reduce_scatter_divide_factor`` (private ``gradient_divide_factor`` of each
    parameter group, docs/internals.md). Refused when the model's parameter groups disagree: no one scale of the loss
    gives every group the call's gradient."""
    factors: dict[float, str] = {}
    for name, m in fsdp_modules(root):
        for group in getattr(m._get_fsdp_state(), "_fsdp_param_groups", None) or []:
            f = getattr(group, "gradient_divide_factor", None)
            factors.setdefault(float(data_size) if f is None else float(f), name or "the root")
    if len(factors) > 1:
        listed = ", ".join(f"{f:g} ({n})" for f, n in factors.items())
        raise ValueError(
            f"the FSDP2 modules divide their gradients by different factors ({listed}; set_gradient_divide_factor "
            "or set_reduce_scatter_divide_factor on some modules only); sharedprefix scales a call's loss by one "
            "factor so that the reduced gradient is the sum over ranks (or the mean with grad_reduction='mean'), "
            "which no one factor does here. Set the same divide factor on every FSDP2 module, or none."
        )
    return next(iter(factors), float(data_size))


def sharded_dtype(root: torch.nn.Module, fallback: torch.dtype) -> torch.dtype:
    """The dtype FSDP2 keeps its sharded parameters in (private ``FSDPParam.sharded_param`` of the first parameter of
    an FSDP2 module's groups), whether or not a unit has registered its unsharded ones (in a ``MixedPrecisionPolicy``'s
    ``param_dtype``); ``fallback`` where there is none."""
    groups = [g for _, m in fsdp_modules(root) for g in getattr(m._get_fsdp_state(), "_fsdp_param_groups", None) or []]
    return next((p.sharded_param.dtype for g in groups for p in g.fsdp_params), fallback)
