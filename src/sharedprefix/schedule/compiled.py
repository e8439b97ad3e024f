"""Which passes of a call run through the user's compiled decoder layers, and which run them eager (with a warning).

A model whose decoder layers were compiled in place (``layer.compile()``, or ``torch.compile(layer)`` put in the
layer list) runs them compiled: the attention inside is one registered operator (``attention.compiled``), with no
graph break and the same traced code for every pass. A model compiled as a whole (``torch.compile(model)``, as
accelerate and TRL's ``torch_compile=True`` do, or ``model.compile()``, also on its decoder) is never run through its
own forward (sharedprefix runs the decoder and the head itself), so for the duration of each call its decoder layers
are compiled with the user's own compile context, the one ``torch.compile`` built from the user's options
(``whole_compiled``): the same backend, mode and dynamic setting. Where that path is not built (the features listed
in ``_eager_reasons``), the layers run eager under ``torch.compiler.set_stance("force_eager")``, and one warning says
why.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from sharedprefix.attention import compiled, probe
from sharedprefix.model import mixers
from sharedprefix.model.adapter import decoder, wrappers


def compiled_path(
    given: torch.nn.Module, model, engine, findings, kernel, frames, reasons: list[str]
) -> tuple[list | None, bool, tuple | None]:
    """(attention modules, force_eager, whole) for a call on the causal LM ``model`` as the user ``given`` it, under
    the parallel ``engine``, with the probe's ``findings``, the attention ``kernel`` and a multi-stream model's
    ``frames``: the modules when the compiled layers run compiled, None when nothing is compiled or they run eager
    (then force_eager is True, after one warning naming why, ``reasons`` among them); ``whole``: (the user's compile
    context, the decoder layers it compiles for the call) for a model compiled as a whole, else None."""
    ctx = user_context(given, model)
    if ctx is None and not compiled_modules(model):
        return None, False, None
    reasons = reasons + _eager_reasons(model, engine, findings, kernel, frames)
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
        return None, True, None
    if ctx is None:
        return layers, False, None
    outer = [m for m in (model, decoder(model)) if getattr(m, "_compiled_call_impl", None) is not None]
    return layers, False, (ctx, [b for b in decoder_blocks(model) if not compiled_modules(b)], outer)


def _eager_reasons(model, engine, findings, kernel, frames) -> list[str]:
    """What the compiled path does not take (each runs exact in eager mode); ``findings``: the probe's
    (``call_plan.Findings``)."""
    out = []
    if engine.sequence is not None:
        out.append("sequence parallelism exchanges heads inside attention")
    if (why := engine.compiled_refusal()) is not None:  # FSDP2, tensor parallelism
        out.append(why)
    if frames is not None:
        out.append("multi-stream (MusicGen) decoders are not yet run through compiled layers")
    if mixers.on_packed_path(model):
        out.append("token mixers outside attention (hybrid layers) are not yet run through compiled layers")
    if findings.indexed:
        out.append("indexed (DeepSeek sparse) attention needs the row's mask")
    if findings.calls > 1:
        out.append("a layer runs attention several times per forward")
    if findings.keep is not None:
        out.append("a dynamic-mask (Doge) layer folds its mask into the keys")
    if findings.nope_rescale:
        out.append("Llama 4's NoPE layers rescale queries by their row index")
    if getattr(model.config.get_text_config(), "attn_logit_softcapping", None) is not None and not kernel.SOFTCAP:
        out.append(
            f"attention-score soft-capping on the {kernel.name!r} backend runs FlexAttention, not inside compiled "
            "layers"
        )
    if not isinstance(getattr(model, "get_input_embeddings", lambda: None)(), torch.nn.Module):
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


def user_context(given: torch.nn.Module, model: torch.nn.Module):
    """The compile context (``torch._dynamo``'s ``OptimizeContext``, built by ``torch.compile`` from the user's
    options) of a model compiled as a whole: ``torch.compile`` around the model or one of its wrappers (an
    ``OptimizedModule``), or ``module.compile()`` on a wrapper, the causal LM ``model`` or its decoder; None where
    none is. A whole-model compile whose context cannot be read is refused, naming the fix."""
    from torch._dynamo.eval_frame import OptimizedModule, _TorchDynamoContext

    found: list = []
    for m in [*wrappers(given), decoder(model)]:  # the model as given, its wrappers, the causal LM, its decoder
        if isinstance(m, OptimizedModule):
            found.append(m.dynamo_ctx)
        elif (fn := getattr(m, "_compiled_call_impl", None)) is not None:  # module.compile(): torch.compile(fn)
            cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if _filled(c)]
            found += [v for v in cells if isinstance(v, _TorchDynamoContext)] or [None]
    ctx = next((c for c in found if c is not None), None)
    if found and ctx is None:
        raise TypeError(
            f"{type(model).__name__} was compiled as a whole (module.compile()), and its compile options cannot be "
            f"read under torch {torch.__version__}; sharedprefix runs the decoder's layers and the LM head itself, "
            "so that compiled forward would never run and the layers would silently run eager. Compile the decoder "
            "layers instead, as torchtitan and verl do: `for layer in model.model.layers: layer.compile()`."
        )
    return ctx


def _filled(cell) -> bool:
    try:
        return cell.cell_contents is not None
    except ValueError:  # an empty cell
        return False


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of ``model``: the entries of its decoder's outermost layer lists (``nn.ModuleList``) that
    hold an attention module the probe found."""
    out: list[tuple[str, torch.nn.Module]] = []
    for name, lst in decoder(model).named_modules():
        if not isinstance(lst, torch.nn.ModuleList) or any(name.startswith(f"{b}.") for b, _ in out):
            continue
        out += [
            (f"{name}.{i}", block)
            for i, block in enumerate(lst)
            if any(probe.pattern(m) is not None for m in block.modules())
        ]
    return [block for _, block in out]


@contextmanager
def whole_compiled(whole: tuple | None):
    """For a model compiled as a whole: its decoder layers compiled with the user's context (as ``layer.compile()``
    does with the options given to it) for the duration, and the compiled forward of the causal LM and its decoder
    (``module.compile()``) set aside, since the decoder's would trace the pass's own hooks; all restored on exit.
    Nothing for ``None``."""
    if whole is None:
        yield
        return
    ctx, blocks, outer = whole
    saved = [(m, m._compiled_call_impl) for m in outer + blocks]
    for m in outer:
        m._compiled_call_impl = None
    for b in blocks:
        b._compiled_call_impl = ctx(b._call_impl)
    try:
        yield
    finally:
        for m, fn in saved:
            m._compiled_call_impl = fn


@contextmanager
def removed(hook):
    """Remove the hook handle (or nothing) on exit."""
    try:
        yield
    finally:
        if hook is not None:
            hook.remove()
