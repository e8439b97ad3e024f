"""A CPU device platform for verl 0.9.1, so that its FSDP2 engine runs in CPU-only tests.

verl resolves its platform once (``verl.plugin.platform.get_platform``) and ships CUDA, NPU and
ROCm platforms only; on a machine without an accelerator it falls back to CUDA and fails. Importing
this module registers a ``cpu`` platform and makes it the current one. It must be imported before
``verl.workers.engine`` (whose modules read the device name at import time): tests import it first,
and worker processes list it first in ``VERL_USE_EXTERNAL_MODULES``.

Test support only: nothing here is part of sharedprefix.
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform, set_platform
from verl.plugin.platform import platform_manager as _manager


def _device_module():
    """``torch.cpu`` plus the memory statistics verl reads from a device module (0 on CPU)."""
    mod = types.SimpleNamespace()
    for name in (
        "synchronize",
        "current_device",
        "device_count",
        "is_available",
        "Stream",
        "stream",
        "current_stream",
        "Event",
    ):
        if hasattr(torch.cpu, name):
            setattr(mod, name, getattr(torch.cpu, name))
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        setattr(mod, name, lambda *a, **k: 0)
    mod.empty_cache = lambda: None
    mod.reset_peak_memory_stats = lambda *a, **k: None
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    mod.mem_get_info = lambda *a, **k: (0, 0)
    return mod


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _device_module()

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # never auto-detected; set explicitly below

    def current_device(self):
        return "cpu"  # verl moves micro-batches with .to(get_device_id())

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


if _manager._current_platform is None or _manager._current_platform.device_name != "cpu":
    set_platform(PlatformCPU())
assert get_platform().device_name == "cpu"


def _unpinned_offload(*args, pin_memory=True, **kwargs):
    """FSDP2's ``CPUOffloadPolicy`` without pinned memory, which needs an accelerator: verl's engine offloads a
    forward-only (reference) engine, and any engine with ``offload_policy=True``, with ``pin_memory=True``."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(*args, pin_memory=False, **kwargs)


def allow_cpu_offload() -> None:
    """Let verl build CPU-offloaded FSDP2 engines and offload activations here (its offload policy and its
    activation offloader, unpinned); the engine module is imported only now, after the platform is set."""
    from verl.utils import activation_offload
    from verl.workers.engine.fsdp import transformer_impl

    transformer_impl.CPUOffloadPolicy = _unpinned_offload
    handler = activation_offload.SynchronizedGroupOffloadHandler
    pinned = handler.__dict__["offload"].__func__
    handler.offload = staticmethod(lambda src_tensor, pin_memory=True: pinned(src_tensor, pin_memory=False))


# -- verl's Ulysses attention on CPU ------------------------------------------------------------------------------
ULYSSES_ATTENTION = "cpu_varlen_ulysses"  # no "flash" in it: transformers would look for a flash kernel


def _varlen_causal(q, k, v, attention_mask, query_length, *args, position_ids=None, softmax_scale=None, **kwargs):
    """What flash-attention's varlen call computes for verl's packed rows, on CPU: causal attention within each
    sequence (a sequence starts where ``position_ids`` is 0). q (1, L, H, D), k / v (1, L, Hkv, D) -> (1, L, H, D)."""
    if attention_mask is not None or position_ids is None:
        raise NotImplementedError("the CPU varlen stand-in takes packed rows with position_ids and no mask only")
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero()[:, 0].tolist() + [pos.numel()]
    outs = []
    for a, b in zip(starts[:-1], starts[1:]):
        qs, ks, vs = (t[:, a:b].transpose(1, 2) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=softmax_scale, enable_gqa=True
        )
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1)


def _ulysses_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None, **kwargs
):
    """transformers' attention signature (query (1, H, Ls, D)) around verl's own Ulysses wrapper
    (``_ulysses_flash_attention_forward``: all-to-all, kv-head replication, position gathering), whose inner
    flash-attention call is ``_varlen_causal`` here."""
    from verl.models.transformers import monkey_patch

    out = monkey_patch._ulysses_flash_attention_forward(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        None,
        query.shape[2],
        position_ids=position_ids,
        softmax_scale=scaling,
    )
    return out, None


def allow_ulysses() -> None:
    """Register ``ULYSSES_ATTENTION``: verl's Ulysses attention path (which only wraps flash-attention) with a CPU
    varlen kernel under it, so that verl's own engine runs with ``ulysses_sequence_parallel_size > 1`` here."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from verl.models.transformers import monkey_patch

    monkey_patch._flash_attention_forward = _varlen_causal
    AttentionInterface.register(ULYSSES_ATTENTION, _ulysses_attention)
    AttentionMaskInterface.register(ULYSSES_ATTENTION, lambda *args, **kwargs: None)
