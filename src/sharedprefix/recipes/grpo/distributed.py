"""Data parallelism for ``sharedprefix train`` on torch.distributed (torchrun), CPU (gloo) or GPU (nccl).

Each rank samples and trains on its own share of the step's prompts (whole groups, so every
prompt is computed once on one rank); the loss normalisers are global, so summing the ranks'
gradients gives the gradient of the whole batch. Without torchrun this is a no-op context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass
class Context:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: list) -> list[int]:
        """Indices of ``items`` this rank handles (round-robin over prompts)."""
        return list(range(self.rank, len(items), self.world_size))

    def all_sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        tdist.all_reduce(t)
        return t.tolist()

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model on this rank's device, with rank 0's weights (LoRA adapters included)."""
        if self.world_size == 1:
            return model
        if tdist.get_backend() == "nccl":
            model = model.cuda()
        with torch.no_grad():
            for p in model.parameters():
                tdist.broadcast(p.data, 0)
        return model

    def sync(self, model: torch.nn.Module) -> None:
        """Sum gradients over ranks (one all-reduce per parameter, once per optimizer step)."""
        if self.world_size == 1:
            return
        for p in model.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                tdist.all_reduce(p.grad)

    def barrier(self) -> None:
        if self.world_size > 1:
            tdist.barrier()

    def close(self) -> None:
        if self.world_size > 1 and tdist.is_initialized():
            tdist.destroy_process_group()


def setup() -> Context:
    """Join the process group when launched by torchrun (nccl with CUDA, else gloo); else a one-process context."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Context()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not tdist.is_initialized():
        tdist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return Context(tdist.get_rank(), tdist.get_world_size())
