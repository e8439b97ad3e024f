"""Follow a call's groups through the package: every sharedprefix function that receives them, in call order.

    PYTHONPATH=src python scripts/callwalk.py          # sp.logprobs, sp.backward, sp.plan_call on a tiny Qwen3

A stop is a call of a function of ``sharedprefix`` that gets, among its arguments, the groups the user passed in any
form: as they are or validated (a list of ``Group`` or a ``Tree`` a stop returned), or wrapped: inside a tuple, list
or dict, or held as an attribute by an object (a ``CallPlan``, the executor, a deferred node's spec), which then
carries them too, as does what a stop returns holding them and the ``self`` a constructor stop filled with them.
Consecutive calls in one file count once. A climb is a stop called from a function on a lower floor (floors: ``api``
0, ``schedule`` 1, ``model`` / ``layout`` / ``attention`` / ``parallel`` 2, ``attention.kernels`` 3); a return is a
stop in a file already visited, not the one just before. Issue 29 asks for at most 12 stops, at most 1 climb and no
return; issue 41 the same, counting the groups in any form.
"""

from __future__ import annotations

import copy
import sys

import torch

import sharedprefix as sp
from sharedprefix.layout.groups import Group
from sharedprefix.layout.rows import Tree

FLOORS = {"api": 0, "schedule": 1, "model": 2, "layout": 2, "attention": 2, "parallel": 2}


def _floor(module: str) -> int:
    parts = module.split(".")
    if parts[1:3] == ["attention", "kernels"]:
        return 3
    return FLOORS.get(parts[1], 2) if len(parts) > 1 else 0


def _is_source(x) -> bool:
    return isinstance(x, Tree) or (isinstance(x, list) and bool(x) and all(isinstance(g, Group) for g in x))


_PLAIN = (type(None), bool, int, float, str, bytes, torch.Tensor, torch.nn.Module, torch.device, torch.dtype)


def _carries(x, tracked: set[int]) -> bool:
    """``x`` is a carrier, or holds one (then it becomes one): as an element of a tuple, list or dict, or as an
    attribute."""
    if id(x) in tracked:
        return True
    if isinstance(x, _PLAIN):
        return False
    if isinstance(x, (tuple, list)):
        held = list(x)
    elif isinstance(x, dict):
        held = list(x.values())
    else:
        attrs = getattr(x, "__dict__", None)
        held = list(attrs.values()) if isinstance(attrs, dict) else []
    if any(id(v) in tracked for v in held):
        tracked.add(id(x))
        return True
    return False


def _ours(module: str) -> bool:
    return module.startswith("sharedprefix.") and not module.startswith("sharedprefix.tools")


def walk(fn, groups) -> tuple[list[str], list[str]]:
    """(the stops of ``fn()`` as 'module.function' in call order, consecutive calls in one module merged; the
    climbs as 'caller module -> callee module')."""
    tracked = {id(groups)}
    keep: list = []
    climbs: list[str] = []
    frames: dict[int, bool] = {}
    stops: list[str] = []

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if not _ours(module):
            return
        if event == "call":
            code = frame.f_code
            args = [frame.f_locals.get(n) for n in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]]
            hit = any([_carries(a, tracked) for a in args])
            keep.extend(a for a in args if id(a) in tracked)
            frames[id(frame)] = hit
            if hit:
                stops.append(f"{module}.{code.co_name}")
                caller = frame.f_back
                while caller is not None and not _ours(caller.f_globals.get("__name__", "")):
                    caller = caller.f_back
                if caller is not None and _floor(module) < _floor(caller.f_globals["__name__"]):
                    climbs.append(f"{caller.f_globals['__name__']} -> {module}")
        elif event == "return" and frames.pop(id(frame), False):
            if _is_source(arg) or _carries(arg, tracked):
                tracked.add(id(arg))
                keep.append(arg)  # alive for the walk: ids are not reused
            if frame.f_code.co_name == "__init__" and _carries(frame.f_locals.get("self"), tracked):
                keep.append(frame.f_locals["self"])

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    merged: list[str] = []
    for s in stops:
        if not merged or merged[-1].rsplit(".", 1)[0] != s.rsplit(".", 1)[0]:
            merged.append(s)
    return merged, climbs


def returns(stops: list[str]) -> int:
    modules = [s.rsplit(".", 1)[0] for s in stops]
    return sum(m in modules[: i - 1] for i, m in enumerate(modules) if i >= 1 and m != modules[i - 1])


def main() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    groups = [sp.Group([1, 2, 3, 4, 5, 6, 7, 8, 9], [[10, 11], [12], [13, 14, 15]]), sp.Group([5, 6], [[7, 8]])]
    from sharedprefix.tools import zoo

    checkpointed = copy.deepcopy(model).train()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cache_path_model = zoo.build("zaya")[0]  # a hybrid on the cache path (its prompts through the model's own cache)
    cp = sp.plan_call(model, groups, max_tokens=8)  # (the walks of a plan follow the plan itself)
    calls = {
        "sp.logprobs": (False, lambda: sp.logprobs(model, groups, max_tokens=8)),
        "sp.logprobs, grad enabled": (True, lambda: sp.logprobs(model, groups, max_tokens=8)),
        "sp.logprobs, checkpointed model (deferred backward)": (
            True,
            lambda: sp.logprobs(checkpointed, groups, max_tokens=8),
        ),
        "sp.backward": (True, lambda: sp.backward(model, groups, lambda b: b.logprobs.sum(), max_tokens=8)),
        "sp.plan_call": (False, lambda: sp.plan_call(model, groups, max_tokens=8)),
        "sp.logprobs of a CallPlan": (False, lambda: sp.logprobs(model, cp)),
        "sp.backward of a CallPlan": (True, lambda: sp.backward(model, cp, lambda b: b.logprobs.sum())),
        "sp.logprobs, cache-path hybrid (Zaya)": (False, lambda: sp.logprobs(cache_path_model, groups, max_tokens=8)),
        "sp.backward, cache-path hybrid (Zaya)": (
            True,
            lambda: sp.backward(cache_path_model, groups, lambda b: b.logprobs.sum(), max_tokens=8),
        ),
    }
    for name, (grad, fn) in calls.items():
        with torch.set_grad_enabled(grad):
            stops, climbs = walk(fn, cp if "CallPlan" in name else groups)
        print(f"{name}: {len(stops)} stops, {len(climbs)} climbs, {returns(stops)} returns")
        for s in stops:
            print(f"    {s}")
        for c in climbs:
            print(f"    climb: {c}")


if __name__ == "__main__":
    main()
