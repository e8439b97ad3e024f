"""A parameter's gradient hooks run once per call, on the call's whole gradient, as in the plain run's one backward.

A plain step runs one backward, so a parameter's tensor hooks (``p.register_hook``) run once on the step's
gradient before it is accumulated, and its ``register_post_accumulate_grad_hook`` hooks once after. sharedprefix runs
several backwards into the same parameters (one per pass under a budget; a cached prompt's deferred backward; the
MoE aux-loss term): a hook that is not linear (a clamp), or that transforms ``.grad`` in place, would then run on
every pass's share. transformers' tensor parallelism is such a hook (``replicated_with_grad_allreduce``: Qwen3's
``q_norm`` / ``k_norm`` see only this rank's heads, and their gradient is all-reduced in place after accumulation):
reduced once per backward, the first pass's share is multiplied by the TP degree for each later backward. So are
optimizers stepped in the backward, gradient clipping per parameter and transformers' Trainer gradient averaging.

``DeferredGradHooks`` sets both kinds aside during each backward of a call (a recorder notes which parameters
received a gradient); ``schedule.grads`` runs the tensor hooks once on the call's contribution when it delivers it
(``run_tensor_hooks``), and ``fire`` runs each post-accumulate hook of each noted parameter once after, in parameter
order (the same order on every rank, so hooks that run collectives pair up). A hook registered *during* a backward
(by a forward recomputed inside it) ran on a partial gradient: that is refused at once, never run on.

Uses ``Tensor._post_accumulate_grad_hooks`` and ``Tensor._backward_hooks`` (private: docs/internals.md): the dicts
autograd reads at each accumulation, emptied and refilled in place so that the user's hook handles stay valid.
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
        """Run one backward with every parameter's post-accumulate-grad hooks replaced by a recorder and its tensor
        hooks set aside (``run_tensor_hooks`` runs them once, on the call's contribution, when it is delivered).
        Under FSDP2 the call's ``last`` backward keeps the post-accumulate hooks, with a recorder after them: they run
        there, on the call's whole gradient, before FSDP2 reduce-scatters it; FSDP2's tensor hooks are left alone
        (its sharded parameters get their gradient from the reduce-scatter, which runs none in a plain run either)."""
        params = self._params()
        natural = self.fsdp and last
        post = _SetAside("_post_accumulate_grad_hooks", params, keep=natural)
        for p in post.params_with_hooks:
            p._post_accumulate_grad_hooks[_KEY] = self._ran_last if natural else self._recorder
        tensor = _SetAside("_backward_hooks", params, keep=self.fsdp)
        try:
            yield
        finally:
            late = post.restore() + tensor.restore()
        if late:
            raise RuntimeError(
                f"{len(late)} parameter(s) gained a gradient hook during a sharedprefix backward (a forward recomputed "
                "inside the backward registered it, as transformers' tensor parallelism does at a module's first "
                "forward with grad), so that hook already ran on one pass's share of the gradient instead of the "
                "call's total. Turn off reentrant gradient checkpointing "
                "(gradient_checkpointing_kwargs={'use_reentrant': False}), whose forward runs without grad."
            )

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


class _SetAside:
    """One kind of a parameter's hooks (the dict autograd reads: ``attr``) set aside for one backward: emptied in
    place, so that the user's handles stay valid, unless ``keep``; ``restore`` puts them back and returns the
    parameters that gained a hook meanwhile (besides our recorder)."""

    def __init__(self, attr: str, params: list[torch.Tensor], keep: bool):
        self.attr, self.params = attr, params
        self.held: dict[int, list] = {}  # id -> the parameter's own hooks, as (key, hook) pairs
        self.sizes: dict[int, int] = {}
        self.params_with_hooks = []
        for p in params:
            hooks = getattr(p, attr)
            self.sizes[id(p)] = len(hooks) if hooks else 0
            if hooks:
                self.held[id(p)] = list(hooks.items())
                self.params_with_hooks.append(p)
                if not keep:
                    hooks.clear()

    def restore(self) -> list[torch.Tensor]:
        late = []
        for p in self.params:
            hooks = getattr(p, self.attr)
            if id(p) in self.held:
                own = {k for k, _ in self.held[id(p)]}
                extra = [(k, h) for k, h in hooks.items() if k != _KEY and k not in own]
                hooks.clear()
                hooks.update(self.held[id(p)])
                hooks.update(extra)
                if extra:
                    late.append(p)
            elif hooks and len(hooks) > self.sizes[id(p)]:
                late.append(p)
        return late


def run_tensor_hooks(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``p``'s tensor hooks (``p.register_hook``) on ``grad``, in registration order, each given the previous one's
    result, as autograd runs them on a leaf's incoming gradient before accumulating it. Returns the result."""
    for hook in list((p._backward_hooks or {}).values()):
        out = hook(grad)
        if out is not None:
            if not isinstance(out, torch.Tensor) or out.shape != grad.shape or out.dtype != grad.dtype:
                got = (
                    f"a {out.dtype} tensor of shape {tuple(out.shape)}"
                    if isinstance(out, torch.Tensor)
                    else type(out).__name__
                )
                raise RuntimeError(
                    f"a tensor hook of a parameter of shape {tuple(p.shape)} returned {got}; expected None or a "
                    f"{grad.dtype} tensor of shape {tuple(grad.shape)}, as autograd requires."
                )
            grad = out
    return grad
