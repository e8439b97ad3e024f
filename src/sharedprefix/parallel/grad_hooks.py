"""Post-accumulate-grad hooks fired once per call, as in the plain run's one backward.

A plain step runs one backward, so a parameter's ``register_post_accumulate_grad_hook`` hooks fire once, on the
step's whole gradient. sharedprefix runs several backwards into the same ``.grad`` (one per pass under a budget; a
cached prompt's deferred backward; the MoE aux-loss term): a hook that transforms ``.grad`` in place would then run
on every earlier pass's share again. transformers' tensor parallelism is such a hook
(``replicated_with_grad_allreduce``: Qwen3's ``q_norm`` / ``k_norm`` see only this rank's heads, and their gradient is
all-reduced in place after accumulation): reduced once per backward, the first pass's share is multiplied by the TP
degree for each later backward. So are optimizers stepped in the backward and transformers' Trainer gradient averaging.

``DeferredGradHooks`` makes every such hook see what the plain run gives it: during each backward of a call, a
parameter's hooks are set aside and a recorder notes that it received a gradient; after the call's gradients are
complete (the ones present before the call given back), each hook of each noted parameter runs once, in parameter
order (the same order on every rank, so hooks that run collectives pair up). A hook registered *during* a backward
(by a forward recomputed inside it) ran on a partial gradient: that is refused at once, never run on.

Uses ``Tensor._post_accumulate_grad_hooks`` (private: docs/internals.md): the dict autograd reads at each
accumulation, emptied and refilled in place so that the user's hook handles stay valid.
"""

from __future__ import annotations

import contextlib

import torch

_KEY = "sharedprefix/deferred"  # our recorder's key in a parameter's hook dict during a backward


class DeferredGradHooks:
    """One call's hooks: ``during_backward()`` around each backward, ``fire()`` once the call's gradients are in.

    ``fsdp``: the module is FSDP2-sharded. Its hooks sit on FSDP2's unsharded parameters, whose gradient FSDP2
    reduce-scatters (and frees) inside the last backward, so they cannot run after the call: they run in the call's
    last backward instead (``during_backward(last=True)``), on the gradient accumulated unhooked over the call, once."""

    def __init__(self, module: torch.nn.Module, fsdp: bool = False):
        self.module, self.fsdp = module, fsdp
        self.touched: dict[int, torch.Tensor] = {}  # id -> parameter that received a gradient during the call
        self.hooked_last: dict[int, torch.Tensor] = {}  # FSDP2: parameters whose hooks ran in the last backward

    def _params(self) -> list[torch.Tensor]:
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self.fsdp:  # FSDP2's unsharded parameters (private: docs/internals.md), where modules' forwards hook
            from torch.distributed.fsdp import FSDPModule

            for m in self.module.modules():
                group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
                for fp in getattr(group, "fsdp_params", ()):
                    p = getattr(fp, "_unsharded_param", None)
                    if p is not None and p.requires_grad:
                        params.append(p)
        return list({id(p): p for p in params}.values())  # once each (unsharded parameters may be registered too)

    @contextlib.contextmanager
    def during_backward(self, last: bool = False):
        """Run one backward with every parameter's post-accumulate-grad hooks replaced by a recorder. Under FSDP2 the
        call's ``last`` backward keeps them, with a recorder after them: they run there, on the call's whole
        gradient, before FSDP2 reduce-scatters it."""
        params = self._params()
        held: dict[int, list] = {}  # id -> the parameter's own hooks, as (key, hook) pairs
        sizes: dict[int, int] = {}
        natural = self.fsdp and last
        for p in params:
            hooks = p._post_accumulate_grad_hooks
            sizes[id(p)] = len(hooks) if hooks else 0
            if hooks:
                held[id(p)] = list(hooks.items())
                if not natural:
                    hooks.clear()
                hooks[_KEY] = self._ran_last if natural else self._recorder
        try:
            yield
        finally:
            late = self._restore(params, held, sizes)
        if late:
            raise RuntimeError(
                f"{len(late)} parameter(s) gained a post-accumulate-grad hook during a sharedprefix backward (a "
                "forward recomputed inside the backward registered it, as transformers' tensor parallelism does at "
                "a module's first forward with grad), so that hook already ran on one pass's share of the gradient "
                "instead of the call's total. Turn off reentrant gradient checkpointing "
                "(gradient_checkpointing_kwargs={'use_reentrant': False}), whose forward runs without grad."
            )

    @staticmethod
    def _restore(params: list, held: dict, sizes: dict) -> list[torch.Tensor]:
        """Every set-aside hook back in place; returns the parameters that gained a hook during the backward."""
        late = []
        for p in params:
            hooks = p._post_accumulate_grad_hooks
            if id(p) in held:
                own = {k for k, _ in held[id(p)]}
                extra = [(k, h) for k, h in hooks.items() if k != _KEY and k not in own]
                hooks.clear()
                hooks.update(held[id(p)])
                hooks.update(extra)
                if extra:
                    late.append(p)
            elif hooks and len(hooks) > sizes[id(p)]:
                late.append(p)
        return late

    def _recorder(self, p: torch.Tensor) -> None:
        self.touched[id(p)] = p

    def _ran_last(self, p: torch.Tensor) -> None:
        self.hooked_last[id(p)] = p

    def fire(self) -> None:
        """Each hook of each parameter that received a gradient during the call, once, on its complete ``.grad``
        (under FSDP2: check that each ran in the last backward)."""
        touched, self.touched = self.touched, {}
        if self.fsdp:
            missed = [p for i, p in touched.items() if i not in self.hooked_last and p._post_accumulate_grad_hooks]
            self.hooked_last = {}
            if missed:
                raise RuntimeError(
                    f"{len(missed)} FSDP2 parameter(s) with a post-accumulate-grad hook (transformers' tensor "
                    "parallelism hooks replicated parameters such as q_norm) received a gradient in this call but none "
                    "in its last backward, where their hooks must run before FSDP2 reduce-scatters the gradient; the "
                    "call is rolled back. Run the call without a budget that splits groups (max_tokens=None), or "
                    "without FSDP2."
                )
            return
        with torch.no_grad():
            for p in self._params():
                if id(p) in touched and p.grad is not None and p._post_accumulate_grad_hooks:
                    for hook in list(p._post_accumulate_grad_hooks.values()):
                        hook(p)
