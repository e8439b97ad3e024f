"""Module hooks: refused unless they are known to give on sharedprefix's packed rows what they give on plain rows.

sharedprefix calls a model's modules in pieces: the decoder once per pass on one packed row (a prompt with the
completions of its group, or a cached prompt's completions alone), the head on the predicted positions only, the
vision tower per pass, and never the causal LM's own ``forward``. A module hook (``register_forward_hook``,
``register_forward_pre_hook``, ``register_full_backward_hook``, ``register_full_backward_pre_hook``, and their
global ``torch.nn.modules.module.register_module_*`` forms) therefore sees other tensors than in a plain forward of
the rows: other shapes, the prompt once instead of G times, a gradient in several parts, or no call at all. Its
result can differ in ways no check can see, so each call refuses any module hook of the model (wrappers included)
that is not one of these, naming the hook and the module:

- hooks of torch itself (``torch.*``: FSDP2's unshard and reshard, DTensor's ``distribute_module`` that
  transformers' tensor parallelism uses, the module trackers of FlopCounterMode and the memory tracker): they move
  parameters or observe, and the parallel tests run them;
- transformers' tensor-parallel hooks, its output-capturing hooks (dormant: sharedprefix asks for no hidden states)
  and ``enable_input_require_grads`` (``requires_grad_`` on the embedding's output, per token);
- PEFT's and TRL's copies of that input hook, and TRL's ``cast_outputs_to_original_dtype`` (``cast_lm_head_to_fp32``
  with tied embeddings: a dtype cast of the embedding's output, per token);
- DeepSpeed's engine hooks (its forward prologue and epilogue: timers, profilers, ZeRO-3's parameter discovery) and
  ZeRO's parameter gathering (``parallel.engines.deepspeed`` refuses what it cannot run exactly);
- sharedprefix's own (registered for the duration of a call);
- any hook the user declared token-wise with ``sharedprefix.allow_hook(fn)``: it acts on each token alone, whatever
  the batch's shape (an activation-steering vector added to every position, a cast), and a backward hook is linear
  in the gradient.

Parameter hooks (``p.register_hook``, ``register_post_accumulate_grad_hook``) are not refused: they get the plain
run's semantics (``parallel.grad_hooks``).
"""

from __future__ import annotations

import functools
import types

import torch

_ALLOWED_FUNCTIONS = {  # (module of the function, its name): known token-wise hooks of other libraries
    ("transformers.modeling_utils", "make_inputs_require_grads"),
    ("transformers.utils.output_capturing", "output_capturing_hook"),
    ("peft.utils.other", "make_inputs_require_grad"),
    ("peft.peft_model", "make_inputs_require_grad"),
    ("trl.experimental.utils", "make_inputs_require_grad"),
    ("trl.trainer.grpo_trainer", "cast_outputs_to_original_dtype"),
}
_ALLOWED_MODULES = (
    "torch.",
    "sharedprefix.",
    "transformers.distributed.tensor_parallel",
    "transformers.integrations.tensor_parallel",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero",
    "deepspeed.utils.nvtx",  # DeepSpeed's instrumentation wrapper around its ZeRO-3 hooks
)
# ``_calls(fn)`` -> fn, of each hook declared with ``allow_hook`` (kept alive, so that the ids in the key stay its own)
_USER_ALLOWED: dict[tuple, object] = {}

_KINDS = (
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_forward_hooks", "forward hook"),
    ("_backward_pre_hooks", "full backward pre-hook"),
    ("_backward_hooks", "backward hook"),
)
_GLOBALS = (
    ("_global_forward_pre_hooks", "global forward pre-hook"),
    ("_global_forward_hooks", "global forward hook"),
    ("_global_backward_pre_hooks", "global backward pre-hook"),
    ("_global_backward_hooks", "global backward hook"),
)


def allow_hook(fn):
    """Declare the module hook ``fn`` token-wise (see the module docstring), so that sharedprefix runs models that
    carry it; returns ``fn``, so it also works as a decorator. The declaration is yours: nothing can check it.

    A hook is recognised by what it calls (``_calls``): ``allow_hook(obj.method)`` allows the bound method that a
    later ``register_forward_hook(obj.method)`` gets (a new object each time ``obj.method`` is read), and
    ``allow_hook(functools.partial(f, *args, **kw))`` a partial of the same function, arguments and keywords. A plain
    function allowed allows every bound method and partial of it."""
    if not callable(fn):
        raise TypeError(f"allow_hook takes the hook function itself; got a {type(fn).__name__}.")
    _USER_ALLOWED[_calls(fn)] = fn
    return fn


def _calls(fn) -> tuple:
    """What ``fn`` calls, as a key: a bound method by its function and its instance (the same object), a partial by
    its function, its arguments and its keywords (each by value where it hashes, else the same object), anything
    else as the same object."""
    if isinstance(fn, functools.partial):
        keywords = tuple(sorted((k, _value(v)) for k, v in fn.keywords.items()))
        return ("partial", _calls(fn.func), tuple(_value(a) for a in fn.args), keywords)
    if isinstance(fn, types.MethodType):
        return ("method", _calls(fn.__func__), id(fn.__self__))
    return ("object", id(fn))


def _value(x) -> tuple:
    try:
        hash(x)
    except TypeError:
        return ("object", id(x))
    return ("value", type(x), x)


def _function(hook):
    """The plain function behind ``hook`` (through partials, bound methods and ``functools.wraps`` decorators), or
    the callable itself."""
    for _ in range(8):
        if isinstance(hook, functools.partial):
            hook = hook.func
        elif hasattr(hook, "__func__"):
            hook = hook.__func__
        elif hasattr(hook, "__wrapped__"):
            hook = hook.__wrapped__
        else:
            break
    return hook


def allowed(hook) -> bool:
    if _calls(hook) in _USER_ALLOWED:
        return True
    fn = _function(hook)
    if _calls(fn) in _USER_ALLOWED:
        return True
    module = getattr(fn, "__module__", None) or type(fn).__module__ or ""
    name = getattr(fn, "__name__", type(fn).__name__)
    return (module, name) in _ALLOWED_FUNCTIONS or module.startswith(_ALLOWED_MODULES)


def _describe(hook) -> str:
    fn = _function(hook)
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def check_module_hooks(model: torch.nn.Module) -> None:
    """Refuse a module hook of ``model`` (any submodule, wrappers included) or a global module hook that is not known
    to be token-wise (see the module docstring)."""
    from torch.nn.modules import module as nn_module

    for attr, kind in _GLOBALS:
        for hook in getattr(nn_module, attr, {}).values():
            if not allowed(hook):
                _refuse(kind, hook, "every module (registered globally)")
    for name, m in model.named_modules():
        for attr, kind in _KINDS:
            hooks = getattr(m, attr, None)
            if not hooks:
                continue
            if attr == "_backward_hooks" and not getattr(m, "_is_full_backward_hook", True):
                kind = "backward hook (register_backward_hook)"
            for hook in hooks.values():
                if not allowed(hook):
                    _refuse(kind, hook, f"{name or 'the model'} ({type(m).__name__})")


def _refuse(kind: str, hook, where: str) -> None:
    raise ValueError(
        f"a {kind} {_describe(hook)} is registered on {where}. sharedprefix calls the model's modules on packed rows "
        "(each prompt once, its completions after it, the head on the predicted positions only, a split group in "
        "several passes), so a module hook sees other tensors than in a plain forward of each row, and what it "
        "computes or changes could differ silently. Remove it for sharedprefix's calls (handle.remove()); observe "
        "gradients with parameter hooks instead (p.register_hook, p.register_post_accumulate_grad_hook: they run "
        "once per call on its whole gradient, as in one plain backward); or, if it acts on each token alone whatever "
        "the batch's shape (and, for a backward hook, linearly in the gradient), declare it with "
        "sharedprefix.allow_hook(fn)."
    )
