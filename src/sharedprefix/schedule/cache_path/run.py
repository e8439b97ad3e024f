"""Hybrid models: each prompt runs once, and every completion starts from the prompt's final layer state.

A hybrid model mixes tokens outside attention too (here: lightning linear attention, convolutions and recurrences
computed inline). Their state at the end of a prompt is not a set of per-token K/V that the packed-row cascade could
read, so these take a separate, simpler path built on the model's own cache-aware forward (its torch code on CPU,
its kernels where installed), with no change to its code:

1. the prompt runs once through the decoder with a fresh cache of the model's own class
   (``DynamicCache(config=...)``, or the cache class its modeling module defines: MiniMax's): attention layers
   fill K/V (a sliding layer its last ``window - 1``), convolution layers their last ``kernel - 1`` inputs,
   recurrent layers their final state; positions continue the prompt's (a decoder without ``position_ids``,
   a pure state-space model, has none);
2. the cache's tensors (and the prompt's last hidden state, which predicts every completion's first
   token) become the state of the group; under ``sp.backward`` they are detached leaves that require grad;
3. the completions run in batches of rows, right-padded (a causal model's padding after a row's last
   token never reaches that row's tokens: attention is causal, convolutions and recurrences run forward
   in time), each batch from a copy of the prompt's cache repeated once per row, positions continuing
   at the prompt's length; the log-probs come from the library's chunked head;
4. the gradients that reach the state's leaves are summed over the batches, then pushed once through
   the prompt's own graph (kept, offloaded, or recomputed at the end: ``prefix_activations``).

Only the model types the registry puts on this path run here (``model.mixers.FAMILIES``, path ``CACHE``: MiniMax
and Zaya, whose token mixing is computed inline, with no function to wrap; the refusals below say so:
``model.support.inline_mixer_reason``); every other hybrid takes the packed path (``model.mixers``) or is refused.
Every batch is at least 2 tokens wide, so that the models' single-token decode kernels (which update states in
place) never run.

Notation: G = completions of a group, P = prompt length, n = rows of one batch, t = its width
(longest completion of the batch, at least 2), W = longest completion overall, d = hidden size.
"""

from __future__ import annotations

import inspect

import torch

from sharedprefix.layout.groups import validate_groups
from sharedprefix.layout.rows import Tree
from sharedprefix.model.adapter import decoder
from sharedprefix.model.checks import verify_head
from sharedprefix.model.forward_mode import uses_checkpointing
from sharedprefix.model.head import token_logprobs
from sharedprefix.model.streams import embedding_size, head_vocab
from sharedprefix.model.support import inline_mixer_reason
from sharedprefix.parallel.grad_hooks import DeferredGradHooks
from sharedprefix.schedule.cache_path.state import (
    cache_arg_name,
    check_filled,
    new_cache,
    prompt_chunks,
    read_states,
    repeated_states,
    state_slots,
)
from sharedprefix.schedule.offload import OffloadHooks
from sharedprefix.schedule.options import CallOptions
from sharedprefix.schedule.results import Batch

MIN_WIDTH = 2  # a batch of width 1 would take the models' in-place single-token decode kernels


# -- one group ----------------------------------------------------------------------------------------------------


class HybridRun:
    """One call's state on the hybrid path: the model, the groups, the budget and the statistics."""

    def __init__(self, model, groups, options: CallOptions):
        max_tokens, temperature, entropy = options.max_tokens, options.temperature, options.entropy
        from sharedprefix.model.support import check_supported

        self.model = model
        name = type(model).__name__
        check_supported(model, hybrid=True)
        why = inline_mixer_reason(getattr(model.config, "model_type", None))
        if isinstance(groups, Tree):
            raise ValueError(
                f"{name} is a hybrid model (layers that mix tokens outside attention); sharedprefix runs it group by "
                "group from each prompt's cached layer state (its cache path) and does not take an sp.Tree. Pass a "
                f"list of sp.Group.{why}"
            )
        vocab = min(embedding_size(model), head_vocab(model))
        self.groups = validate_groups(groups, vocab)
        if any(g.prompt_inputs for g in self.groups):
            raise ValueError(
                f"{name} is a hybrid text model on sharedprefix's cache path; prompt_inputs (images, videos) are not "
                f"supported for it. Pass groups without prompt_inputs.{why}"
            )
        if uses_checkpointing(model):
            raise ValueError(
                f"{name} is a hybrid model in training mode with gradient checkpointing on: transformers turns its "
                "cache off under gradient checkpointing, and sharedprefix carries each prompt's convolution and "
                "recurrent state to its completions through that cache (its cache path). Disable gradient "
                f"checkpointing for this model.{why}"
            )
        if max_tokens is not None:
            if max_tokens < MIN_WIDTH + 1:
                raise ValueError(
                    f"max_tokens={max_tokens!r}; expected None or an int >= {MIN_WIDTH + 1} for a hybrid model, whose "
                    "prompt chunks and completion batches are at least 2 tokens wide."
                )
            for gi, g in enumerate(self.groups):
                need = max(max(c.numel() for c in g.completions), MIN_WIDTH)
                if need > max_tokens:
                    raise ValueError(
                        f"max_tokens={max_tokens} is below groups[{gi}]'s longest completion ({need} tokens) on a "
                        f"hybrid model ({name}), where each completion runs whole from its prompt's state. Raise "
                        f"max_tokens to at least {need}."
                    )
        self.max_tokens = max_tokens
        self.temperature = float(temperature)
        self.entropy = entropy
        self.device = model.get_input_embeddings().weight.device
        self.dec = decoder(model)
        self.cache_arg = cache_arg_name(self.dec)
        # a decoder without position_ids (a pure state-space model) has no positions to continue
        self.positioned = "position_ids" in inspect.signature(self.dec.forward).parameters
        self.W = max(c.numel() for g in self.groups for c in g.completions)
        self.tokens = 0
        self.passes = 0
        self.plain_tokens = sum(
            g.prompt.numel() * len(g.completions) + sum(c.numel() for c in g.completions) for g in self.groups
        )
        verify_head(model, hybrid=True)

    def batches(self, g) -> list[list[int]]:
        """The completions of ``g`` in batches (in order) whose padded size n * t fits the budget."""
        out: list[list[int]] = []
        cur: list[int] = []
        width = 0
        for i, c in enumerate(g.completions):
            w = max(width, c.numel(), MIN_WIDTH)
            if cur and self.max_tokens is not None and (len(cur) + 1) * w > self.max_tokens:
                out.append(cur)
                cur, w = [], max(c.numel(), MIN_WIDTH)
            cur.append(i)
            width = w
        out.append(cur)
        return out

    def prompt(self, g):
        """(cache, slots, tensors, (d,) last hidden state) of the prompt, as the model's own forward leaves them.

        A prompt longer than the budget runs in consecutive chunks, each continuing the cache of the last.
        """
        cache = new_cache(self.model)
        ids = g.prompt.to(self.device)[None]
        for a, b in prompt_chunks(ids.shape[1], self.max_tokens):
            out = self.dec(
                input_ids=ids[:, a:b],
                use_cache=True,
                **self._positions(torch.arange(a, b, device=self.device)[None]),
                **{self.cache_arg: cache},
            )
            self.tokens += b - a
            self.passes += 1
        slots = state_slots(cache)
        check_filled(type(self.model).__name__, cache, slots, ids.shape[1])
        return cache, slots, read_states(cache, slots), out.last_hidden_state[0, -1]

    def completions(self, g, rows: list[int], cache, slots, tensors, h_last):
        """(n, W) log-probs and entropies (or None) of completions ``rows`` of ``g``, from the prompt's state."""
        P = g.prompt.numel()
        cs = [g.completions[i] for i in rows]
        n, t = len(cs), max(max(c.numel() for c in cs), MIN_WIDTH)
        ids = torch.zeros(n, t, dtype=torch.int64)
        mask = torch.zeros(n, t, dtype=torch.bool)
        for r, c in enumerate(cs):  # right padding: after a row's last token, it never reaches the row's tokens
            ids[r, : c.numel()] = c
            ids[r, c.numel() :] = c[-1]
            mask[r, : c.numel()] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (P + torch.arange(t, device=self.device))[None].expand(n, t)
        out = self.dec(
            input_ids=ids,
            use_cache=True,
            **self._positions(pos),
            **{self.cache_arg: repeated_states(cache, slots, tensors, n)},
        )
        self.tokens += n * t
        self.passes += 1
        hidden = out.last_hidden_state  # (n, t, d)
        pred = torch.cat([h_last.expand(n, 1, -1), hidden[:, :-1]], 1)  # token j is predicted at j - 1
        lp, ent = token_logprobs(self.model, pred[mask], ids[mask], self.temperature, self.entropy)
        return self._rows(lp, mask), (self._rows(ent, mask) if self.entropy else None)

    def _positions(self, pos: torch.Tensor) -> dict:
        return {"position_ids": pos} if self.positioned else {}

    def _rows(self, values, mask):
        n, t = mask.shape
        full = torch.zeros(n, max(self.W, t), dtype=values.dtype, device=values.device)
        m = torch.zeros(n, full.shape[1], dtype=torch.bool, device=mask.device)
        m[:, :t] = mask
        return full.masked_scatter(m, values)[:, : self.W]

    def mask(self, g, rows) -> torch.Tensor:
        m = torch.zeros(len(rows), self.W, dtype=torch.bool)
        for r, i in enumerate(rows):
            m[r, : g.completions[i].numel()] = True
        return m.to(self.device)

    def offsets(self) -> list[int]:
        out, k = [], 0
        for g in self.groups:
            out.append(k)
            k += len(g.completions)
        return out


def logprobs(model, groups, options: CallOptions):
    """``sp.logprobs`` on a hybrid model: (N, W) log-probs, mask and entropies; with grad enabled, one graph."""
    from sharedprefix.schedule.results import LogProbs

    run = HybridRun(model, groups, options)
    lps, ents, masks = [], [], []
    for g in run.groups:
        cache, slots, tensors, h = run.prompt(g)
        for rows in run.batches(g):
            lp, ent = run.completions(g, rows, cache, slots, tensors, h)
            lps.append(lp)
            ents.append(ent)
            masks.append(run.mask(g, rows))
    return LogProbs(torch.cat(lps), torch.cat(masks), torch.cat(ents) if options.entropy else None)


def backward(model, groups, loss_fn, options: CallOptions, grad_hooks=None):
    """``sp.backward`` on a hybrid model, group by group (see the module docstring); returns the statistics.
    ``grad_hooks``: the call's ``DeferredGradHooks``, whose parameters' hooks are set aside during each backward; the
    caller runs the call inside its gradient transaction (``schedule.grads.synced``), which runs them once."""
    from sharedprefix.schedule.results import BackwardResult
    from sharedprefix.schedule.rounds import check_loss

    run = HybridRun(model, groups, options)
    entropy, mode = options.entropy, options.prefix_activations
    hooks = OffloadHooks(model, options.offload_device) if mode == "offload" else None
    recompute = mode == "recompute"
    deferred = grad_hooks if grad_hooks is not None else DeferredGradHooks(model)
    total, calls = 0.0, 0
    for g, first in zip(run.groups, run.offsets()):
        with torch.set_grad_enabled(not recompute):
            if hooks is not None:
                with hooks():
                    cache, slots, tensors, h = run.prompt(g)
            else:
                cache, slots, tensors, h = run.prompt(g)
        outs = tensors + [h]
        leaves = [x.detach().requires_grad_() for x in outs]
        for rows in run.batches(g):
            lp, ent = run.completions(g, rows, cache, slots, leaves[:-1], leaves[-1])
            batch = Batch(
                logprobs=lp,
                mask=run.mask(g, rows),
                entropy=ent if entropy else None,
                index=torch.tensor([first + i for i in rows], dtype=torch.int64, device=run.device),
            )
            loss = check_loss(loss_fn(batch), calls)
            calls += 1
            with deferred.during_backward():
                loss.backward()
            total += float(loss.detach())
        got = [(o, x.grad) for o, x in zip(outs, leaves) if x.grad is not None]
        if not got:
            continue
        if recompute:  # the prompt again, now with its graph, for its one backward
            cache, slots, tensors, h = run.prompt(g)
            outs = tensors + [h]
            got = [(o, x.grad) for o, x in zip(outs, leaves) if x.grad is not None]
        got = [(o, gr) for o, gr in got if o.requires_grad]  # state of frozen layers only (LoRA, frozen embeddings)
        if not got:
            continue
        with deferred.during_backward():
            torch.autograd.backward([o for o, _ in got], [gr for _, gr in got])
    return BackwardResult(
        loss=total,
        tokens_computed=run.tokens,
        tokens_plain=run.plain_tokens,
        passes=run.passes,
        loss_calls=calls,
        peak_memory_bytes=int(torch.cuda.max_memory_allocated(run.device)) if run.device.type == "cuda" else None,
        offloaded_bytes=hooks.bytes_moved if hooks else 0,
    )
