"""Which passes of a call run through the user's compiled decoder layers, and which run them eager (with a warning).

A model whose decoder layers were compiled in place (``layer.compile()``, or ``torch.compile(layer)`` put in the
layer list) runs them compiled: the attention inside is one registered operator (``attention.compiled``), with no
graph break and the same traced code for every pass. Where that path is not built (the features listed in
``_eager_reasons``), the layers run eager under ``torch.compiler.set_stance("force_eager")``, and one warning says
why; a model compiled as a whole (``model.compile()``) is refused, since its compiled forward would never run.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from sharedprefix.attention import compiled
from sharedprefix.attention.dynamic_mask import has_dynamic_mask
from sharedprefix.model import mixers
from sharedprefix.model.adapter import decoder


def compiled_path(run, pats: dict) -> tuple[list | None, bool]:
    """(attention modules, force_eager) for the executor ``run``: the modules when the compiled layers run compiled,
    None when nothing is compiled or they run eager (then force_eager is True, after one warning)."""
    model = run.model
    if (why := whole_model_refusal(model, decoder(model))) is not None:
        raise TypeError(why)
    if not compiled_modules(model):
        return None, False
    reasons = _eager_reasons(run, pats)
    layers = None
    if not reasons:
        try:
            layers = compiled.attention_modules(model)
        except ValueError as e:
            reasons = [str(e)]
    if reasons:
        warnings.warn(
            f"sharedprefix: {type(model).__name__} has compiled layers, but they run eager in this call because "
            f"{'; '.join(reasons)}. The results are exact; only the compiled speed is lost.",
            stacklevel=4,
        )
        return None, True
    return layers, False


def _eager_reasons(run, pats: dict) -> list[str]:
    """What the compiled path does not take (each runs exact in eager mode)."""
    out = []
    if run.par.sequence is not None:
        out.append("sequence parallelism exchanges heads inside attention")
    if run.par.fsdp or run.par.tensor > 1:
        out.append("FSDP2 and tensor parallelism are not yet run through compiled layers")
    if run.mm is not None:
        out.append("prompts with images run the model's own multimodal forward")
    if run.frames is not None:
        out.append("multi-stream (MusicGen) decoders are not yet run through compiled layers")
    if mixers.on_packed_path(run.model):
        out.append("token mixers outside attention (hybrid layers) are not yet run through compiled layers")
    if any(p.indexed for p in pats.values()):
        out.append("indexed (DeepSeek sparse) attention needs the row's mask")
    if any(p.calls > 1 for p in pats.values()):
        out.append("a layer runs attention several times per forward")
    if any(has_dynamic_mask(m) for m in pats):
        out.append("a dynamic-mask (Doge) layer folds its mask into the keys")
    if any(getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True) for m in pats):
        out.append("Llama 4's NoPE layers rescale queries by their row index")
    if not run.cache.leaves and torch.is_grad_enabled() and any(p.record for p in run.plan.passes):
        out.append(
            "a grad-enabled sp.logprobs split under max_tokens keeps the prompt's K/V in one graph with the "
            "completions' (sp.backward, or defer=True, runs compiled)"
        )
    if not isinstance(getattr(run.model, "get_input_embeddings", lambda: None)(), torch.nn.Module):
        out.append("the model has no input embedding module to route the cached keys' gradients through")
    return out


def compiled_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that run compiled: ``module.compile()`` (its ``_compiled_call_impl``) or
    ``torch.compile(module)`` put in place of a submodule (an ``OptimizedModule``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return [
        m
        for m in model.modules()
        if getattr(m, "_compiled_call_impl", None) is not None or isinstance(m, OptimizedModule)
    ]


def whole_model_refusal(model: torch.nn.Module, dec: torch.nn.Module) -> str | None:
    """Why a compiled ``model`` or decoder (``model.compile()``) would run eager under sharedprefix, which calls the
    decoder's layers and the head itself; None where neither is compiled as a whole."""
    whole = [
        name
        for name, m in (("model", model), ("its decoder", dec))
        if getattr(m, "_compiled_call_impl", None) is not None
    ]
    if not whole:
        return None
    return (
        f"{type(model).__name__}: {' and '.join(whole)} was compiled as a whole (module.compile()); sharedprefix runs "
        "the decoder's layers and the LM head itself, so that compiled forward would never run and the layers would "
        "silently run eager. Compile the decoder layers instead, as torchtitan and verl do: "
        "`for layer in model.model.layers: layer.compile()` (sharedprefix runs them compiled, without graph breaks)."
    )


@contextmanager
def removed(hook):
    """Remove the hook handle (or nothing) on exit."""
    try:
        yield
    finally:
        if hook is not None:
            hook.remove()
