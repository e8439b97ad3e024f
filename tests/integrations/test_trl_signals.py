"""SharedPrefixGRPOTrainer where the learning signal is empty, where entropies are only logged, and with TRL's
float32 LM head: each as GRPOTrainer computes it."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sharedprefix as sp
from helpers import float64_faithful, plain_logprobs, tiny_model
from sharedprefix.model.adapter import mark_float32_head
from sharedprefix.model.head import token_logprobs

pytest.importorskip("trl")
pytest.importorskip("datasets")

import transformers as tf  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import qwen3_model, train_two_steps  # noqa: E402


def _saved(tmp_path):
    tok = build_tokenizer()
    qwen3_model(tok).save_pretrained(tmp_path / "init")
    init = str(tmp_path / "init")
    return tok, init, tf.Qwen3ForCausalLM.from_pretrained(init).state_dict()


def _delta(trainer, init):
    return torch.cat([(p.detach() - init[n]).flatten() for n, p in trainer.model.named_parameters()])


@pytest.mark.slow
def test_all_completions_masked_is_a_zero_loss_that_moves_nothing(tmp_path):
    """mask_truncated_completions=True with EOS suppressed: every completion is truncated, so every token is masked.
    GRPOTrainer's loss is a zero connected to the graph; ours crashed in backward ("element 0 of tensors does not
    require grad"). Both now train two steps and leave every parameter exactly where it was (plain SGD)."""
    tok, init, state = _saved(tmp_path)
    no_eos = {"suppress_tokens": [tok.eos_token_id]}
    for cls, cfg, name in ((GRPOTrainer, GRPOConfig, "plain"), (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, "sp")):
        t = train_two_steps(
            cls, cfg, init, tok, tmp_path / name, beta=0.1, mask_truncated_completions=True, generation_kwargs=no_eos
        )
        assert t.state.global_step == 2
        assert float(_delta(t, state).abs().max()) == 0.0, name
        assert all(h["loss"] == 0.0 for h in t.state.log_history if "loss" in h)


def test_hook_on_all_masked_rows_returns_zeros_with_a_graph(tmp_path):
    """The hook itself, on a microbatch whose completion masks are all zero, with and without a budget."""
    tok, init, _ = _saved(tmp_path)
    args = SharedPrefixGRPOConfig(
        output_dir=str(tmp_path / "o"), report_to=[], use_cpu=True, bf16=False, num_generations=2
    )
    trainer = SharedPrefixGRPOTrainer(
        model=init,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        processing_class=tok,
        train_dataset=_dataset_of(["a b", "c d"]),
    )
    trainer.model.train()
    ids = torch.tensor([[0, 5, 6, 7, 8], [5, 6, 7, 9, 9]])
    att = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    for budget in (None, 2):
        trainer._sp_budget = budget
        lp, ent, aux = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, 2, compute_entropy=True)
        assert lp.shape == (2, 2) and bool((lp == 0).all()) and lp.requires_grad and aux is None
        trainer.model.zero_grad(set_to_none=True)
        (lp.sum() * 1.0).backward()  # no "does not require grad"
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        assert grads and all(float(g.abs().max()) == 0.0 for g in grads)


def _dataset_of(prompts):
    import datasets

    return datasets.Dataset.from_dict({"prompt": prompts})


def test_backward_of_an_all_masked_tree_is_zero_gradients():
    """sp.backward on rows with no trained token: loss_fn gets zeros with a graph, no crash, and .grad holds zeros
    (created where it was None) for every parameter the passes reached, under budgets and prefix modes."""
    model = tiny_model()
    tree = sp.Tree.from_rows([[1, 2, 3, 5, 6], [1, 2, 4, 7, 8, 9]], [[False] * 5, [False] * 6])
    for budget, mode in ((None, "keep"), (3, "keep"), (2, "offload"), (2, "recompute")):
        model.zero_grad(set_to_none=True)
        seen = []
        loss_fn = lambda b, seen=seen: seen.append(b) or (b.logprobs * 2.0).sum()  # noqa: E731
        res = sp.backward(model, tree, loss_fn, max_tokens=budget, prefix_activations=mode)
        assert res.loss == 0.0 and seen and all(not b.mask.any() and b.logprobs.requires_grad for b in seen)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert len(grads) >= len(list(model.parameters())) - 1  # all but the tied / unused head weight at most
        assert all(float(g.abs().max()) == 0.0 for g in grads)


class _BytesAllocated(TorchDispatchMode):
    """Sums the bytes of every tensor the aten ops under it return (a deterministic allocation count)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not func._schema.is_mutable:
                self.bytes += t.numel() * t.element_size()
        return out


def _backward_bytes(model, groups, use_entropy: bool) -> int:
    out = sp.logprobs(model, groups, entropy=True)
    loss = out.logprobs.sum() + (out.entropy.sum() * 0.0 if use_entropy else 0.0)
    with _BytesAllocated() as counter:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.bytes


def test_unused_entropies_cost_no_backward_memory():
    """Entropies computed for logging only (TRL's bonus off) get no gradient: the head's backward skips the
    (M, V) entropy term it formed before, whose bytes this counts (M = 30 predicted tokens, V = 97)."""
    model = tiny_model()
    groups = [sp.Group(list(range(1, 9)), [list(range(10, 20)), list(range(20, 30)), list(range(30, 40))])]
    used, unused = _backward_bytes(model, groups, True), _backward_bytes(model, groups, False)
    M, V = 30, model.config.vocab_size
    assert used - unused >= M * V * 8  # float64: at least one (M, V) matrix fewer
    print(f"backward bytes with an entropy gradient {used}, without {unused}: {used - unused} saved")


@pytest.mark.slow
def test_entropies_carry_a_graph_only_when_the_bonus_uses_them(tmp_path, monkeypatch):
    """TRL's entropy bonus (entropy_coef != 0) trains as GRPOTrainer, and changes the update; with it off the hook's
    entropies come back detached (no graph kept for logging)."""
    tok, init, state = _saved(tmp_path)
    seen = []
    hook = SharedPrefixGRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, *a, **kw):
        out = hook(self, *a, **kw)
        if torch.is_grad_enabled() and out[1] is not None:
            seen.append((self.entropy_coef, out[1].requires_grad))
        return out

    monkeypatch.setattr(SharedPrefixGRPOTrainer, "_get_per_token_logps_and_entropies", spy)
    plain = train_two_steps(GRPOTrainer, GRPOConfig, init, tok, tmp_path / "plain", entropy_coef=0.5)
    ours = train_two_steps(
        SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, init, tok, tmp_path / "sp", entropy_coef=0.5
    )
    off = train_two_steps(
        SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, init, tok, tmp_path / "off", entropy_coef=0.0
    )
    dp = _delta(plain, state)
    scale = float(dp.abs().max())
    assert float((_delta(ours, state) - dp).abs().max()) <= 1e-4 * scale
    assert float((_delta(off, state) - dp).abs().max()) > 1e-2 * scale  # the bonus moves the update
    assert {s for s in seen} == {(0.5, True), (0.0, False)}


def test_float32_head_runs_outside_autocast():
    """TRL's cast_lm_head_to_fp32: under bf16 autocast the marked head gives float32 log-probs (float32 reference
    to 1e-6); unmarked, autocast runs it in bf16 (off by 8e-4 here), so the check can fail."""
    model = tiny_model(dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(16, model.config.hidden_size, generator=g)
    targets = torch.randint(0, model.config.vocab_size, (16,), generator=g)
    with torch.no_grad():
        want = torch.log_softmax(hidden @ model.lm_head.weight.T, -1).gather(1, targets[:, None])[:, 0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf16, _ = token_logprobs(model, hidden, targets)
        mark_float32_head(model)
        fp32, _ = token_logprobs(model, hidden, targets)
    assert float((bf16 - want).abs().max()) > 1e-4
    assert float((fp32 - want).abs().max()) <= 1e-6


@pytest.mark.slow
def test_cast_lm_head_to_fp32_trains_as_grpo_trainer(tmp_path):
    """bf16 autocast with the head in float32 (TRL's cast_lm_head_to_fp32=True, refused before): the same update as
    GRPOTrainer to bf16 rounding of the decoder (as the bf16 test in test_trl)."""
    tok, init, state = _saved(tmp_path)
    runs = [
        train_two_steps(cls, cfg, init, tok, tmp_path / name, bf16=True, cast_lm_head_to_fp32=True)
        for cls, cfg, name in (
            (GRPOTrainer, GRPOConfig, "plain"),
            (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, "sp"),
        )
    ]
    assert getattr(runs[1].model.lm_head, "_sharedprefix_float32_head", False)
    plain, ours = (_delta(r, state) for r in runs)
    scale = float(plain.abs().max())
    assert scale > 1e-3
    assert float((ours - plain).abs().max()) <= 2e-2 * scale


def _gemma2(dtype):
    """A tiny Gemma 2 (final-logit soft-capping at 30) with embeddings scaled up, so that bf16 and float32 logits
    differ well above the head check's tolerance."""
    # Gemma 2's defaults for the window (4096), the score cap (50) and the positions; eager: its only attention
    model = tiny_model(
        "gemma2",
        dtype=torch.float32,
        attn="eager",
        max_position_embeddings=8192,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        bos_token_id=2,
        eos_token_id=1,
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return float64_faithful(model.double()) if dtype == torch.float64 else model.to(dtype)


def test_float32_head_under_autocast_is_checked_against_a_float32_head():
    """Under bf16 autocast the model's own forward runs TRL's float32 head in bf16 (autocast overrides its cast; so
    does accelerate's autocast wrapper of the forward), so checking our float32 head against it refused such models
    once their logits are large (Gemma 2 and Qwen3 in TRL's suite). The check allows that head's bf16 rounding, and
    the log-probs keep the 2x rule: error against float64 at most twice that of the plain rows computed as TRL's
    fused head does (bf16 decoder, float32 head and soft-capping)."""
    model = _gemma2(torch.bfloat16)
    head = model.lm_head.float()  # as TRL's cast_lm_head_to_fp32 leaves it: float32 weights, a float32 forward,
    head.forward = lambda h: torch.nn.functional.linear(h.float(), head.weight)
    model.model.embed_tokens.register_forward_hook(
        sp.allow_hook(lambda m, a, out: out.to(torch.bfloat16))
    )  # tied: bf16 embeddings
    mark_float32_head(model)
    groups = [sp.Group([3, 17, 5, 9, 2, 44], [[5, 9], [6, 2, 8], [1]]), sp.Group([7, 7, 1], [[4, 4, 4], [9]])]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours = sp.logprobs(model, groups).logprobs.double()
        rows = []
        for g in groups:  # the plain rows, one forward each, the head as TRL's fused one computes it
            for c in g.completions:
                ids = torch.cat([g.prompt, c])[None]
                hidden = model.model(input_ids=ids).last_hidden_state[0, g.prompt.numel() - 1 : -1]
                with torch.autocast("cpu", enabled=False):
                    logits = torch.tanh(hidden.float() @ head.weight.T / 30.0) * 30.0
                rows.append(torch.log_softmax(logits, -1).gather(1, c[:, None])[:, 0].double())
    with torch.no_grad():
        want = plain_logprobs(_gemma2(torch.float64), groups)[0]
    plain = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    err, plain_err = (float((x - want).abs().max()) for x in (ours, plain))  # both zero on padding
    assert plain_err > 1e-4  # bf16 rounding is visible, so the rule can fail
    assert err <= 2 * plain_err, (err, plain_err)
