"""Reference computations for tests and demos: the plain per-row forward sharedprefix must match.

``plain_logprobs`` runs one transformers forward per ``[prompt + completion]`` row, exactly
what a trainer without sharedprefix does, and reads the completion log-probs from the
model's own logits. ``dtype_faithful_norms`` makes a float64 model really float64 (see its
docstring); both the plain run and sharedprefix then use the same patched model. ``Float64Inside``
keeps a float64 model's own float32 casts in float64 (Mamba2 scans, gated delta rules, routers).
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.nn.functional as F

from sharedprefix.layout.groups import Group


def plain_logprobs(model, groups: list[Group], temperature: float = 1.0, entropy: bool = False):
    """(N, T) log-probs (and entropies) from one plain forward per row; zero on padding.

    Groups of (K, length) frames (a model with K token streams, MusicGen): the row is the (K, P + T) codes, the
    model's logits (K, P + T, V) one row per codebook, and a frame's value the sum over its codebooks of the
    per-codebook log-prob (entropy), codebooks whose code is ``config.pad_token_id`` left out (``streams``)."""
    rows, ents = [], []
    T = max(c.shape[-1] for g in groups for c in g.completions)
    dev = next(model.parameters()).device
    pad = getattr(model.config.get_text_config(), "pad_token_id", None)
    for g in groups:
        for c in g.completions:
            framed = c.dim() == 2
            ids = torch.cat([g.prompt, c], -1).to(dev)  # (K, P + T) codes, or (P + T,) ids
            logits = model(input_ids=ids if framed else ids[None], use_cache=False).logits
            logits = (logits if framed else logits[:1])[:, g.prompt.shape[-1] - 1 : -1]  # (K or 1, T, V)
            dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
            logp = torch.log_softmax(logits.to(dt) / temperature, -1)
            tgt = c.to(dev) if framed else c.to(dev)[None]
            keep = tgt.ne(pad) if framed and pad is not None else torch.ones_like(tgt, dtype=torch.bool)
            tok = logp.gather(-1, tgt.where(keep, 0)[..., None])[..., 0]
            rows.append(F.pad(torch.where(keep, tok, 0.0).sum(0), (0, T - c.shape[-1])))
            if entropy:
                ent = torch.where(keep, -(logp.exp() * logp).sum(-1), 0.0).sum(0)
                ents.append(F.pad(ent, (0, T - c.shape[-1])))
    return torch.stack(rows), (torch.stack(ents) if entropy else None)


def _eps(mod):
    return getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6))


def _rms(mod, x):
    return mod.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _eps(mod)))


def _rms_one_plus(mod, x):  # Gemma: scale by (1 + weight)
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _eps(mod))) * (1.0 + mod.weight)


def _layernorm_no_bias(mod, x):  # Cohere
    x = x - x.mean(-1, keepdim=True)
    return mod.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _eps(mod)))


def _required_beyond_input(mod) -> list[str]:
    """The parameters of ``mod.forward`` besides its first (the input) that have no default."""
    try:
        params = list(inspect.signature(mod.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params[1:] if p.kind in kinds and p.default is inspect.Parameter.empty]


def dtype_faithful_norms(model):
    """Make every custom norm of ``model`` compute in its input dtype.

    transformers' RMSNorm (and Cohere's LayerNorm) cast to float32 even in a float64 model, so
    a "float64" run is only float32-accurate there and a 1e-9 comparison would measure that
    rounding (gradients of G completions summed before vs after a float32 op), not
    sharedprefix. Each replacement is checked against the original forward before it is
    installed; nothing else of the model changes.
    """
    for name, mod in model.named_modules():
        if (
            isinstance(mod, torch.nn.LayerNorm)
            or not type(mod).__name__.endswith("Norm")
            or not isinstance(getattr(mod, "weight", None), torch.Tensor)
        ):  # a norm without a weight stays as it is
            continue
        extra = _required_beyond_input(mod)
        if extra:  # a per-expert norm (Ergo's: weight (E, d), forward(x, expert_ids))
            raise ValueError(
                f"no dtype-faithful norm matches {name} ({type(mod).__name__}): its forward needs {', '.join(extra)} "
                f"besides the input (weight of shape {tuple(mod.weight.shape)}), where the replacements compute a norm "
                "of the input alone; leave it as it is (its float32 rounding stays) or reproduce it in float64 in the "
                "model's own code."
            )
        with torch.no_grad():
            x = torch.randn(3, mod.weight.shape[0], dtype=mod.weight.dtype, device=mod.weight.device)
            ref = mod(x)
            for fn in (_rms, _rms_one_plus, _layernorm_no_bias):
                if torch.allclose(fn(mod, x), ref, rtol=1e-5, atol=1e-6):
                    mod.forward = types.MethodType(fn, mod)
                    break
            else:
                raise ValueError(f"no dtype-faithful norm matches {name} ({type(mod).__name__})")
    return model


class Float64Inside(torch.overrides.TorchFunctionMode):
    """Keep float64 tensors float64 where a model casts them to float32 (``x.float()``, ``x.to(torch.float32)``,
    ``x.type(torch.float32)``, ``dtype=torch.float32`` arguments such as a router's softmax).

    Falcon-H1's Mamba2 scan and Qwen3-Next's gated delta rule cast their inputs to float32 even in a float64 model,
    so its float64 forward is only float32-accurate there, and two computations of the same values round
    differently wherever their chunks differ. Under this mode the model computes those layers in float64 (the same
    code): the float64 reference such a model's float32 error is measured against. Tensors of other dtypes
    (integer positions of the rotary embeddings) are cast as the model says.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
            if func is torch.Tensor.float:
                return x
            if func in (torch.Tensor.to, torch.Tensor.type):  # .to(torch.float32), .type(torch.float32) of routers
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:  # .to(dtype=...), softmax(..., dtype=torch.float) of routers
                kwargs = dict(kwargs, dtype=torch.float64)
        return func(*args, **kwargs)
