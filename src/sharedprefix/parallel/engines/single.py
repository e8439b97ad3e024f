"""One process (or processes that share no model wrapper): passes run on the module directly, no collective, the
call's gradient delivered into ``.grad`` as one plain backward would deliver it. Tensor parallelism alone (a
transformers ``tp_plan`` model without DDP or FSDP2) runs here too: its collectives are inside the model's own
forward and backward, and its gradient all-reduce is a post-accumulate-grad hook (``parallel.grad_hooks``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sharedprefix.parallel.engine import Engine


class Single(Engine):
    name = "one process"
    lockstep = False
    backward_through_outputs = False
    default_prefix_mode = "keep"
    replays_tensor_hooks = True
    must_defer: str | None = None

    @classmethod
    def match(cls, model: torch.nn.Module, root: torch.nn.Module, world: int, tensor: int) -> Engine | None:
        return cls(root, world, tensor=tensor)

    def agree_on_error(
        self, error: BaseException | None, where: str = "before any computation of", counts: Sequence[int] = ()
    ) -> list[int]:
        """No collective between the processes of this engine: an error is raised here, on its own rank."""
        if error is not None:
            raise error
        return list(counts)
