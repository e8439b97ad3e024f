"""The LM head on the predicting positions only: chunked log-probs (and entropies) of the completion tokens.

``token_logprobs`` applies the model's head (``model.adapter.head_logits``: its output embedding and post-processing,
verified once per model) to (M, d) hidden states in chunks of about 4M logits, so that no (M, V) matrix exists at
once. Under grad the chunks' logits are kept for the backward, as the plain run keeps them, when all of them fit
under a cap (``logit_cap``: a quarter of the free device memory on CUDA, ``CPU_KEEP_BYTES`` on the CPU); otherwise each
chunk is recomputed in the backward (``torch.utils.checkpoint``), so that only a few chunks' logits are ever held.
``SHAREDPREFIX_KEEP_LOGITS`` (``auto``, ``always``, ``never``) or ``with keep_logits(...)`` forces either way; both are
exact. On CUDA a chunk holds at least 1024 rows (smaller chunks made the head memory-bound on the GPU).

``with compiled_head():`` runs each chunk's log-probs and entropies (``_TokenLogprob``, forward and backward) through
``torch.compile(dynamic=True)``, as verl compiles its ``entropy_from_logits`` under ``use_torch_compile`` (the verl
engine enters it then); a chunk recomputed in the backward runs the same way as its forward.

A model with K token streams per position (``streams``: MusicGen) takes (M, K) code targets: each head's log-prob
of its code, summed over the codebooks whose code is not ``ignore`` (the delay pattern's pad), and likewise the
entropies.

Notation: M = predicted tokens, d = hidden size, V = vocabulary, K = streams.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from sharedprefix import settings
from sharedprefix.model.adapter import head_logits
from sharedprefix.model.streams import head_vocab

KEEP_MODES = ("auto", "always", "never")
_KEEP: dict = {"mode": None}  # None: as SHAREDPREFIX_KEEP_LOGITS says now (``settings``); set inside ``keep_logits``
_COMPILED: dict = {"on": False, "fn": None}  # inside ``compiled_head``; the compiled chunk function, made once
# The CPU default: logits of up to 256 MiB are kept (a host's memory is large next to it; keeping them saves one head
# matmul per chunk in the backward, about a third of the head's time); larger ones are recomputed chunk by chunk.
CPU_KEEP_BYTES = 256 * 2**20
# On CUDA: a quarter of the free device memory (the driver's free memory plus what the caching allocator holds
# unused); the backward forms one chunk's softmax beside the kept logits.
CUDA_KEEP_FRACTION = 0.25


def _check_mode(mode) -> str:
    if mode not in KEEP_MODES:
        raise ValueError(
            f"keep_logits mode {mode!r} (or SHAREDPREFIX_KEEP_LOGITS) is unknown; expected one of {KEEP_MODES}: 'auto' "
            "keeps the completion tokens' logits for the backward when they fit under head.logit_cap, 'always' keeps "
            "them, 'never' recomputes them chunk by chunk in the backward."
        )
    return mode


@contextmanager
def keep_logits(mode: str):
    """Inside the block the head keeps its logits for the backward per ``mode`` ("auto", "always", "never")."""
    before = _KEEP["mode"]
    _KEEP["mode"] = _check_mode(mode)
    try:
        yield
    finally:
        _KEEP["mode"] = before


@contextmanager
def compiled_head(on: bool = True):
    """Inside the block (with ``on``) the head's chunks run compiled (module docstring); restored on exit."""
    before = _COMPILED["on"]
    _COMPILED["on"] = bool(on)
    try:
        yield
    finally:
        _COMPILED["on"] = before


def _token_logprob(z, targets, want_entropy: bool, compiled: bool):
    if not compiled:
        return _TokenLogprob.apply(z, targets, want_entropy)
    if _COMPILED["fn"] is None:
        _COMPILED["fn"] = torch.compile(_TokenLogprob.apply, dynamic=True)
    return _COMPILED["fn"](z, targets, want_entropy)


def logit_cap(device: torch.device) -> int:
    """Bytes of logits the head keeps for the backward under "auto" on ``device``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int((free + unused) * CUDA_KEEP_FRACTION)
    return CPU_KEEP_BYTES


def _keeps(hidden: torch.Tensor, logits_per_row: int, out_dtype: torch.dtype) -> bool:
    mode = _check_mode(_KEEP["mode"] or settings.read("SHAREDPREFIX_KEEP_LOGITS"))
    if mode != "auto":
        return mode == "always"
    return hidden.shape[0] * logits_per_row * out_dtype.itemsize <= logit_cap(hidden.device)


class _TokenLogprob(torch.autograd.Function):
    """(M, V) logits -> (M,) log p(target) and (M,) entropy, with a one-pass exact backward.

    Saves the logits and the (M,) log-sum-exp only; the backward forms
    d/dz [g_tok * log p_t + g_ent * H] = g_tok * (onehot_t - p) - g_ent * p * (log p + H)
    directly instead of going through log_softmax and a scattered zero matrix. An output no loss uses gets no
    gradient (None, not a zero matrix): entropies computed for logging cost no (M, V) term in the backward.
    """

    @staticmethod
    def forward(ctx, z, targets, want_entropy):
        ctx.set_materialize_grads(False)
        lse = torch.logsumexp(z, dim=-1)
        tok = z.gather(-1, targets[:, None])[:, 0] - lse
        if want_entropy:
            p = torch.exp(z - lse[:, None])
            ent = lse - (p * z).sum(-1)
        else:
            ent = z.new_zeros(0)
        ctx.save_for_backward(z, targets, lse, ent)
        ctx.want_entropy = want_entropy
        return tok, ent

    @staticmethod
    def backward(ctx, g_tok, g_ent):
        z, targets, lse, ent = ctx.saved_tensors
        if g_tok is None and (g_ent is None or not ctx.want_entropy):
            return None, None, None
        p = (z - lse[:, None]).exp_()  # softmax; at most two (M, V) temporaries live below
        if ctx.want_entropy and g_ent is not None:
            e = (z - lse[:, None]).add_(ent[:, None]).mul_(p).mul_(g_ent[:, None])  # g_ent * p * (log p + H)
            grad = p.mul_(-g_tok[:, None]).sub_(e) if g_tok is not None else e.neg_()
        else:
            grad = p.mul_(-g_tok[:, None])
        if g_tok is not None:
            grad.scatter_add_(-1, targets[:, None], g_tok[:, None])
        return grad, None, None


def _logprob_chunk(model, hidden, targets, temperature: float, want_entropy: bool, out_dtype, ignore, compiled):
    logits = head_logits(model, hidden).to(out_dtype)  # (M, V), or (K, M, V) for (M, K) targets
    if temperature != 1.0:
        logits = logits / temperature
    if targets.dim() == 1:
        return _token_logprob(logits, targets, want_entropy, compiled)
    tok: torch.Tensor | float = 0.0
    ent: torch.Tensor | float = 0.0
    for k in range(targets.shape[1]):  # one head per stream; a pad target adds exactly nothing
        t = targets[:, k]
        keep = t.ne(ignore) if ignore is not None else torch.ones_like(t, dtype=torch.bool)
        tok_k, ent_k = _token_logprob(logits[k], t.where(keep, 0), want_entropy, compiled)
        tok = tok + torch.where(keep, tok_k, 0.0)
        if want_entropy:
            ent = ent + torch.where(keep, ent_k, 0.0)
    return tok, ent if want_entropy else logits.new_zeros(0)


def token_logprobs(
    model: PreTrainedModel,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int | None = None,
    ignore: int | None = None,
):
    """Log-probs (and entropy) of ``targets`` under the head applied to ``hidden``.

    Args:
        hidden: (M, d) final hidden states of the predicting positions.
        targets: (M,) int64 token ids, or (M, K) int64 codes for a model with K heads (``streams``).
        ignore: with (M, K) targets, the code that contributes nothing (the delay pattern's pad).
        temperature: logits are divided by it before the softmax (as TRL does).
        chunk_tokens: rows of the head computed at once (default: 4M logits per chunk, but never fewer
            than 256 rows, 1024 on a GPU); under grad, where the logits are not kept (module docstring), each
            chunk is recomputed in backward, so only a few (chunk_tokens, V) matrices are ever held.

    Returns:
        (M,) natural-log probabilities and (M,) entropies in nats (or None), float32, or
        float64 for a float64 model.
    """
    out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    vocab = head_vocab(model) * (targets.shape[1] if targets.dim() == 2 else 1)  # logits per row of a chunk
    if chunk_tokens is None:
        # at least 256 rows: on two CPU cores, chunks of 131 rows (32K vocabulary) made the head's forward and
        # backward 1.3x slower than with 256 to 1024 (the head weight is streamed once per chunk and pass)
        chunk_tokens = max(256, 2**22 // vocab)
        if hidden.is_cuda:
            # Every chunk reads the (V, d) head weight three times and reads and writes its gradient once:
            # a chunk of c rows does about c FLOP per byte of that traffic, and a GPU needs a few hundred
            # (an H200: 790 TFLOP/s of bf16 over 4.8 TB/s). 27-row chunks (4M logits of a 152K
            # vocabulary) made the head of the GPU benchmark memory-bound and slower than the whole plain
            # run.
            chunk_tokens = max(1024, chunk_tokens)
    toks, ents = [], []
    head_params = model.get_output_embeddings().parameters()  # (a ModuleList's: every head's)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head_params))
    recompute = grad and not _keeps(hidden, vocab, out_dtype)
    for s in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[s : s + chunk_tokens], targets[s : s + chunk_tokens]
        args = (model, h, t, temperature, entropy, out_dtype, ignore, _COMPILED["on"])
        if recompute:
            tok, ent = checkpoint(_logprob_chunk, *args, use_reentrant=False)
        else:
            tok, ent = _logprob_chunk(*args)
        toks.append(tok)
        ents.append(ent)
    tok = torch.cat(toks) if toks else hidden.new_zeros(0, dtype=out_dtype)
    ent = torch.cat(ents) if entropy and ents else None
    return tok, ent
