"""One mini-batch of a rank as one ``sp.plan_step`` step over verl's own micro-batches (text and vision-language
models, with or without Ulysses).

``SharedPrefixFSDPEngine.forward_backward_batch`` hands this module the micro-batches verl's ``prepare_micro_batches``
formed (static ``micro_batch_size_per_gpu`` of any size, rollout.n or not; dynamic token-budget micro-batches, with
verl's ``force_group_size`` left alone), so that every loss of verl's, however it depends on the rows of a micro-batch
(``geo_mean``, ``kl_cov``, ``clip_cov``, batch-normalised importance weights), reads the rows verl reads, and every
per-micro-batch metric (``actor/ppo_kl``, ``actor/pg_clipfrac``, ...) is verl's.

- **Training**: the micro-batches' rows are planned as one step (``sp.plan_step``, one ``sp.Tree`` per micro-batch,
  or for a vision-language model its ``sp.Group``s with ``prompt_inputs``, which the step merges by prompt tokens
  and inputs across micro-batches; ``prefix_activations="recompute"``, FSDP2's mode; with Ulysses, verl's sequence
  group, every rank of it planning the same step): each prompt that rows of two or more micro-batches share is
  computed once for the mini-batch (recorded without a graph by the first micro-batch's call, read by every
  micro-batch's passes, run again with grad and backpropagated once inside the last micro-batch's call, before
  FSDP2's gradient reduction at the accumulation boundary); a prompt whose rows all lie in one micro-batch is computed
  there, once. Micro-batch k's backward is ``sp.backward(model, step.microbatch(k), loss_fn)``: if each micro-batch
  is one pass (no ``SHAREDPREFIX_MAX_TOKENS``, or it fits), ``loss_fn`` is verl's ``loss_function`` on the
  micro-batch's log-probs; if the budget splits one, the values of every row are computed first, without a graph, in
  one ``sp.logprobs`` call over the whole mini-batch (each prompt once), verl's loss of each micro-batch is evaluated
  and differentiated with respect to them, and ``loss_fn`` is the linear loss ``sum(dL/dlogp * logp + dL/dH * H)``
  (exact by the chain rule). Gradients are averaged over the ranks (``grad_reduction="mean"``) and reduced in the
  micro-batches verl reduces them in.
- **Forward only** (old-policy and reference log-probs, entropy): one no-grad ``sp.logprobs`` call over every row of
  the mini-batch (each prompt once), under a budget of verl's largest micro-batch in plain tokens (or
  ``SHAREDPREFIX_MAX_TOKENS``), so that no pass holds more tokens than a micro-batch of verl's; its values are cut
  back into verl's micro-batches (and ``loss_function``, if any, evaluated on each).

What a step holds between its micro-batches: the K/V (per layer) and last hidden state of the shared prompts as leaves,
and the gradients the finished micro-batches accumulated on them: about ``2 * layers * shared tokens * kv_heads *
head_dim`` values, twice that with their gradients; no activations (they are recomputed at the end, one pass per level
of shared segments). Failure: an error in a micro-batch (in sharedprefix's call or in verl's loss) ends the step before
it propagates, as ``schedule.step`` ends a step whose call fails: the shared prompts' share of the micro-batches that
finished is delivered (``Step.finish``) and the step's cache released, so that the gradients left behind are the ones
verl's engine leaves after the same error (the finished micro-batches', accumulated) and the model's next mini-batch
plans a step of its own.

Metrics per micro-batch: ``sharedprefix/tokens_computed`` (tokens computed with grad by the micro-batch's call: its
own segments, and in the last micro-batch the shared prompts' recomputation; forward only: the whole call's tokens, in
the first micro-batch), ``sharedprefix/tokens_no_grad`` (training: tokens computed without a graph, the step's
recording of its shared prompts and the values-first forward) and ``sharedprefix/tokens_plain`` (the micro-batch's
tokens as plain rows).

Notation: K = micro-batches of the mini-batch, n_k = rows of micro-batch k, W_k = its longest row, N = rows of the
mini-batch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.engine.utils import detach_tree

import sharedprefix as sp
from sharedprefix.integrations import verl_vl
from sharedprefix.integrations.verl_layout import Rows, check_positions, response_lengths, rows_of, to_verl
from sharedprefix.schedule.planner import Pass, PrefixBackward

__all__ = ["MicroBatch", "forward_only", "micro_batches_of", "train"]


@dataclass
class MicroBatch:
    """One of verl's micro-batches: ``data`` (its TensorDict, on the compute device), its ``rows`` (a tree whose
    trained tokens are the response tokens) and ``offsets`` (its jagged layout, for the outputs). A vision-language
    model's micro-batch is also ``groups`` (``sp.Group``s with ``prompt_inputs``, which a tree does not carry: rows
    with the same prompt tokens and inputs, wherever verl put them), ``members`` (each group's rows) and ``inputs``
    (each row's ``multi_modal_inputs``); a text model's has None there."""

    data: object
    rows: Rows
    offsets: torch.Tensor
    groups: list[sp.Group] | None = None
    members: list[list[int]] | None = None
    inputs: list | None = None

    @property
    def n(self) -> int:
        return len(self.rows.lengths)

    @property
    def width(self) -> int:
        return int(self.rows.lengths.max())

    @property
    def source(self):
        """What sharedprefix computes: the tree of the rows, or the VL groups. Their results ("native" values) are
        (n_k, W_k) aligned with the rows for the tree, (n_k, longest completion) in group order for the groups."""
        return self.rows.tree if self.groups is None else self.groups

    def to_rows(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """Native values -> (n_k, >= W_k) aligned with the rows (differentiable)."""
        if values is None or self.groups is None:
            return values
        return verl_vl.to_rows(values, self.groups, self.members, self.rows.lengths, self.rows.prompt_lengths)

    def from_rows(self, values: torch.Tensor) -> torch.Tensor:
        """(n_k, >= W_k) values aligned with the rows -> native values (``to_rows``' inverse on the response tokens)."""
        if self.groups is None:
            return values
        return verl_vl.from_rows(values, self.groups, self.members, self.rows.prompt_lengths)

    def model_output(self, lp: torch.Tensor, ent: torch.Tensor | None) -> dict:
        """(n_k, >= W_k) values aligned with the rows -> verl's jagged, shifted ``log_probs`` / ``entropy``."""
        lengths = self.rows.lengths
        out = {"log_probs": torch.nested.nested_tensor_from_jagged(to_verl(lp[:, : self.width], lengths), self.offsets)}
        if ent is not None:
            out["entropy"] = torch.nested.nested_tensor_from_jagged(
                to_verl(ent[:, : self.width], lengths), self.offsets
            )
        return out


def micro_batches_of(micro_batches, device, vl_module=None) -> list[MicroBatch]:
    """verl's micro-batches, on ``device``, with their rows (verl's position ids checked against the rows'). With
    ``vl_module`` (a vision-language model) each micro-batch's rows also become groups with ``prompt_inputs``
    (``verl_vl.vl_groups``), and verl's M-RoPE position ids are checked against the model's own."""
    out = []
    for mb in micro_batches:
        mb = mb.to(device)
        rows = rows_of(mb["input_ids"], response_lengths(mb["responses"], mb.get("attention_mask", None)))
        if vl_module is None:
            check_positions(mb["position_ids"], rows.lengths)
            out.append(MicroBatch(mb, rows, mb["input_ids"].offsets()))
            continue
        inputs = verl_vl.row_inputs(mb, len(rows.lengths))
        groups, members = verl_vl.vl_groups(list(rows.tree.rows), rows.prompt_lengths, inputs, vl_module.config)
        verl_vl.check_mrope_positions(vl_module, mb["position_ids"], groups, members, rows.lengths)
        out.append(MicroBatch(mb, rows, mb["input_ids"].offsets(), groups, members, inputs))
    return out


def _whole(mbs: list[MicroBatch], config) -> tuple:
    """Every row of the mini-batch, micro-batch after micro-batch, as one source (a tree; VL: the groups of every
    row, each prompt with its images once), and a function from its results to (N, L) values aligned with the rows."""
    rows = [r for mb in mbs for r in mb.rows.tree.rows]
    if mbs[0].groups is None:
        return sp.Tree.from_rows(rows, [t for mb in mbs for t in mb.rows.tree.trained]), lambda values: values
    plen = torch.cat([mb.rows.prompt_lengths for mb in mbs])
    lengths = torch.cat([mb.rows.lengths for mb in mbs])
    groups, members = verl_vl.vl_groups(rows, plen, [x for mb in mbs for x in mb.inputs], config)
    return groups, lambda values: verl_vl.to_rows(values, groups, members, lengths, plen)


def _cut(values: torch.Tensor | None, mbs: list[MicroBatch]) -> list:
    """(N, L) values of ``_whole``'s rows -> each micro-batch's (n_k, W_k) (None -> Nones)."""
    out, a = [], 0
    for mb in mbs:
        out.append(None if values is None else values[a : a + mb.n, : mb.width])
        a += mb.n
    return out


def whole_values(engine, mbs: list[MicroBatch], max_tokens: int | None, entropy: bool, kw: dict):
    """No-grad log-probs (and entropies) of every row of the mini-batch in one call (each prompt once), aligned with
    the rows and cut back into the micro-batches; and the tokens it computed."""
    source, align = _whole(mbs, engine.module.config)
    with torch.no_grad():
        res = sp.logprobs(engine.module, source, entropy=entropy, max_tokens=max_tokens, **kw)
        lp = align(res.logprobs)
        ent = align(res.entropy) if res.entropy is not None else None
    return _cut(lp, mbs), _cut(ent, mbs), sp.plan(source, max_tokens).tokens_computed


def forward_only(engine, mbs: list[MicroBatch], loss_function, entropy: bool, kw: dict) -> list[dict]:
    """verl's forward-only micro-batch outputs, from one call over the mini-batch (module docstring)."""
    budget = engine.sp_max_tokens or max(int(mb.rows.lengths.sum()) for mb in mbs)
    lps, ents, computed = whole_values(engine, mbs, budget, entropy, kw)
    outputs = []
    for k, (mb, lp, ent) in enumerate(zip(mbs, lps, ents)):
        outs = mb.model_output(lp, ent)
        with torch.no_grad():
            loss, metrics = (
                loss_function(model_output=outs, data=mb.data, dp_group=engine.get_data_parallel_group())
                if loss_function is not None
                else (torch.tensor(1.0), {})
            )
        metrics = dict(metrics)
        metrics["sharedprefix/tokens_computed"] = float(computed if k == 0 else 0)
        metrics["sharedprefix/tokens_plain"] = float(mb.rows.lengths.sum())
        outputs.append({"loss": float(loss.detach().item()), "metrics": metrics, "model_output": detach_tree(outs)})
    return outputs


def train(engine, mbs: list[MicroBatch], loss_function, entropy: bool, syncs: list[bool], kw: dict) -> list[dict]:
    """verl's training micro-batch outputs: the micro-batches as one step (module docstring); ``syncs[k]``: reduce
    the gradients at the end of micro-batch k's call."""
    step = sp.plan_step(
        engine.module,
        [mb.source for mb in mbs],
        max_tokens=engine.sp_max_tokens,
        prefix_activations="recompute",
        sequence_group=kw["sequence_group"],
    )
    try:
        return _run(engine, step, mbs, loss_function, entropy, syncs, kw)
    except Exception:  # ended as a failing call of the step ends it (a no-op where one did): the share of the
        step.finish(engine.module)  # finished micro-batches delivered, as verl's engine leaves their gradients
        raise
    finally:
        step.release()  # never left open for the model's next step


PROMPT_POSITIONS = (
    "return_model_output=True (verl's Tinker worker returns the training call's per-token outputs to its client): "
    "SharedPrefixFSDPEngine computes log-probs and entropies at the response positions only, and its outputs hold 0 at "
    "the prompt positions, where verl's own engine holds the prompt tokens' values. Read only the response positions "
    "(verl's trainer does), or use verl's FSDPEngineWithLMHead where a client reads the prompts' log-probs."
)


def _run(engine, step, mbs, loss_function, entropy, syncs, kw) -> list[dict]:
    grad_tokens, no_grad_tokens, passes = _tokens(step)
    chain = engine._agree_max(max(passes)) > 1  # every rank takes the same path (its collectives differ)
    lps = ents = None
    if chain:
        lps, ents, computed = whole_values(engine, mbs, engine.sp_max_tokens, entropy, kw)
        no_grad_tokens[0] += computed
    return_output = tu.get_non_tensor_data(data=mbs[0].data, key="return_model_output", default=False)
    if return_output:
        warnings.warn(PROMPT_POSITIONS, stacklevel=2)
    outputs = []
    for k, mb in enumerate(mbs):
        with torch.profiler.record_function(f"micro_batch{k}"):
            if chain:
                loss, metrics, outs = _linear(engine, step, k, mb, lps[k], ents[k], loss_function, syncs[k], kw)
            else:
                loss, metrics, outs = _one_pass(engine, step, k, mb, loss_function, entropy, syncs[k], kw)
        metrics = dict(metrics)
        metrics["sharedprefix/tokens_computed"] = float(grad_tokens[k])
        metrics["sharedprefix/tokens_no_grad"] = float(no_grad_tokens[k])
        metrics["sharedprefix/tokens_plain"] = float(mb.rows.lengths.sum())
        out = {"loss": float(loss.item()), "metrics": metrics}
        if return_output:
            out["model_output"] = detach_tree(outs)  # training drops it, as verl does (train_batch discards it)
        outputs.append(out)
    return outputs


def _tokens(step) -> tuple[list[int], list[int], list[int]]:
    """Per micro-batch of ``step`` (prefix mode "recompute"): tokens computed with grad, tokens computed without (the
    recording of cached segments, which their backward computes again with grad), and passes that report rows."""
    plan = step.splan
    length = [s.length for s in plan.tree.segments]
    grad, no_grad, passes = [], [], []
    for steps in plan.microbatches:
        g = n = p = 0
        for st in steps:
            tokens = sum(length[s] for s in st.segments)
            if isinstance(st, PrefixBackward):
                g += tokens
            elif isinstance(st, Pass) and st.record:
                n += tokens
            elif isinstance(st, Pass):
                g, p = g + tokens, p + 1
        grad.append(g)
        no_grad.append(n)
        passes.append(p)
    shared = sum(length[s] for s in plan.shared)
    no_grad[0] += shared  # recorded by the first micro-batch's call
    grad[-1] += shared  # recomputed with grad and backpropagated inside the last one's
    return grad, no_grad, passes


def _one_pass(engine, step, k, mb: MicroBatch, loss_function, entropy, sync, kw):
    """Micro-batch k in one pass: verl's loss on its log-probs, inside ``sp.backward``."""
    seen = {}

    def loss_fn(batch):
        if batch.index.numel() != mb.n:
            raise RuntimeError(f"expected one pass with all {mb.n} rows, got {batch.index.numel()} (internal error).")
        lp = batch.logprobs.new_zeros(mb.n, batch.logprobs.shape[1]).index_copy(0, batch.index, batch.logprobs)
        ent = (
            batch.entropy.new_zeros(mb.n, batch.entropy.shape[1]).index_copy(0, batch.index, batch.entropy)
            if entropy
            else None
        )
        outs = mb.model_output(mb.to_rows(lp), mb.to_rows(ent))  # VL: from group order onto the rows
        loss, metrics = loss_function(model_output=outs, data=mb.data, dp_group=engine.get_data_parallel_group())
        seen.update(loss=loss.detach(), metrics=metrics, outs=detach_tree(outs))
        return loss

    sp.backward(engine.module, step.microbatch(k), loss_fn, entropy=entropy, sync=sync, grad_reduction="mean", **kw)
    return seen["loss"], seen["metrics"], seen["outs"]


def _linear(engine, step, k, mb: MicroBatch, lp, ent, loss_function, sync, kw):
    """Micro-batch k under a budget that splits it: verl's loss on the values computed first, its gradient through
    ``sp.backward`` as a linear loss."""
    lp = lp.detach().clone().requires_grad_(True)
    ent = ent.detach().clone().requires_grad_(True) if ent is not None else None
    outs = mb.model_output(lp, ent)
    loss, metrics = loss_function(model_output=outs, data=mb.data, dp_group=engine.get_data_parallel_group())
    leaves = [lp] + ([ent] if ent is not None else [])
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    g_lp = mb.from_rows(grads[0] if grads[0] is not None else torch.zeros_like(lp))  # VL: in group order
    g_ent = mb.from_rows(grads[1]) if ent is not None and grads[1] is not None else None

    def linear(batch):
        w = batch.logprobs.shape[1]
        total = (batch.logprobs * g_lp[batch.index, :w].to(batch.logprobs.dtype)).sum()
        if g_ent is not None:
            total = total + (batch.entropy * g_ent[batch.index, :w].to(batch.entropy.dtype)).sum()
        return total

    sp.backward(
        engine.module, step.microbatch(k), linear, entropy=g_ent is not None, sync=sync, grad_reduction="mean", **kw
    )
    return loss.detach(), metrics, detach_tree(outs)
