"""Comparing the model folders ``sharedprefix train`` writes."""

from __future__ import annotations

import torch
from safetensors.torch import load_file


def weights(folder) -> dict[str, torch.Tensor]:
    """The tensors of a save_pretrained folder: a full model's, or a PEFT adapter's."""
    name = "adapter_model.safetensors" if (folder / "adapter_config.json").exists() else "model.safetensors"
    return load_file(folder / name)


def assert_same_weights(a, b):
    """Bit-identical tensors under the same names."""
    wa, wb = weights(a), weights(b)
    assert sorted(wa) == sorted(wb) and wa
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{len(different)} of {len(wa)} tensors differ, e.g. {different[:3]}"
