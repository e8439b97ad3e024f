"""SharedPrefixGRPOTrainer against TRL's GRPOTrainer: same seed, same data, same parameters after 2 steps."""

import warnings

import pytest
import torch

import sharedprefix as sp
from tests.helpers import call_source

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import transformers as tf  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer, tree_rows  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import dataset, lfm2_model, qwen3_model, reward, train_two_steps  # noqa: E402


@pytest.mark.slow  # TRL's real train(), twice
@pytest.mark.parametrize("loss_type, beta", [("grpo", 0.0), ("dapo", 0.0), ("grpo", 0.1), ("dapo", 0.1)])
def test_same_parameters_as_grpo_trainer(tmp_path, loss_type, beta):
    tok = build_tokenizer()
    base = qwen3_model(tok)
    init = {n: p.detach().clone() for n, p in base.named_parameters()}
    # from a saved folder, so that TRL can load its reference model (beta > 0) the same way for both trainers
    base.save_pretrained(tmp_path / "init")
    plain = train_two_steps(
        GRPOTrainer, GRPOConfig, str(tmp_path / "init"), tok, tmp_path / "plain", loss_type=loss_type, beta=beta
    )
    ours = train_two_steps(
        SharedPrefixGRPOTrainer,
        SharedPrefixGRPOConfig,
        str(tmp_path / "init"),
        tok,
        tmp_path / "sp",
        loss_type=loss_type,
        beta=beta,
    )
    delta_plain = torch.cat([(p.detach() - init[n]).flatten() for n, p in plain.model.named_parameters()])
    delta_ours = torch.cat([(p.detach() - init[n]).flatten() for n, p in ours.model.named_parameters()])
    scale = float(delta_plain.abs().max())
    assert scale > 1e-3  # the parameters really moved, so the comparison is not vacuous
    # float32: both runs compute the same sums in another order (G rows vs one packed row), so the two
    # updates agree to float32 rounding of the gradients (measured 1.8e-7 to 2.9e-7 of the largest update
    # here); 1e-4 is far above that and below what a real difference gives (a 5% temperature error
    # moves the updates by 4e-4 of their size and fails this check).
    err = float((delta_ours - delta_plain).abs().max())
    assert err <= 1e-4 * scale, (err, scale)


@pytest.mark.slow  # TRL's real train(), twice
def test_budget_schedule_matches_unscheduled(tmp_path):
    """With a token budget that splits groups, the policy step runs through sp.backward and still matches."""
    tok = build_tokenizer()
    qwen3_model(tok).save_pretrained(tmp_path / "init")
    init = str(tmp_path / "init")
    a = train_two_steps(SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, init, tok, tmp_path / "a", beta=0.1)
    b = train_two_steps(
        SharedPrefixGRPOTrainer,
        SharedPrefixGRPOConfig,
        init,
        tok,
        tmp_path / "b",
        beta=0.1,
        sharedprefix_max_tokens=32,
        sharedprefix_prefix_activations="recompute",
    )
    init_state = tf.Qwen3ForCausalLM.from_pretrained(init).state_dict()
    da = torch.cat([(p.detach() - init_state[n]).flatten() for n, p in a.model.named_parameters()])
    db = torch.cat([(p.detach() - init_state[n]).flatten() for n, p in b.model.named_parameters()])
    assert float(da.abs().max()) > 1e-3
    assert float((da - db).abs().max()) <= 1e-4 * float(da.abs().max())


def test_tree_rows_keep_every_completion_and_share_every_prefix():
    ids = torch.tensor([[0, 5, 6, 9, 2], [0, 5, 6, 8, 0], [7, 7, 7, 9, 9], [0, 5, 7, 1, 2], [0, 5, 6, 0, 0]])
    att = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    tr = tree_rows(ids, att, 2)
    # row 4's completion is masked: it stays as its prompt alone, nothing trained (TRL's forward counts its prompt)
    assert tr.row_of == [0, 1, 2, 3, 4] and tr.prompt_len == [2, 2, 3, 2, 2] and tr.lengths == [2, 1, 2, 2, 0]
    assert [r.tolist() for r in tr.tree.rows] == [[5, 6, 9, 2], [5, 6, 8], [7, 7, 7, 9, 9], [5, 7, 1, 2], [5, 6]]
    # prompts [5, 6] and [5, 7] share the token 5: the trie computes it once; row 4 adds no token
    assert sp.plan(tr.tree).tokens_computed == 1 + 1 + 2 + 1 + 5 + 3
    with pytest.raises(ValueError, match="mask with holes"):
        tree_rows(ids, torch.tensor([[1, 1, 1, 0, 1]] * 5), 2)


@pytest.mark.slow  # TRL's real train(), twice
def test_lora_trainer_matches_grpo_trainer(tmp_path):
    """PEFT/LoRA (and TRL's default gradient checkpointing, on in all these runs) give the same update."""
    peft = pytest.importorskip("peft")
    tok = build_tokenizer()
    qwen3_model(tok).save_pretrained(tmp_path / "init")
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    runs = []
    for cls, cfg_cls, name in [
        (GRPOTrainer, GRPOConfig, "plain"),
        (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, "sp"),
    ]:
        args = cfg_cls(
            output_dir=str(tmp_path / name),
            num_generations=4,
            per_device_train_batch_size=8,
            max_steps=2,
            max_completion_length=3,
            learning_rate=0.5,
            optim="sgd",
            lr_scheduler_type="constant",
            report_to=[],
            save_strategy="no",
            seed=0,
            use_cpu=True,
            bf16=False,
            beta=0.1,
        )
        assert args.gradient_checkpointing
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = cls(
                model=str(tmp_path / "init"),
                reward_funcs=reward,
                args=args,
                train_dataset=dataset(),
                processing_class=tok,
                peft_config=peft.LoraConfig(**lora),
            )
            t.train()
        runs.append({n: p.detach().clone() for n, p in t.model.named_parameters() if "lora_" in n})
    plain, ours = runs
    assert plain and set(plain) == set(ours)
    scale = max(float(v.abs().max()) for v in plain.values())
    for n in plain:
        assert (plain[n] - ours[n]).abs().max() <= 1e-4 * scale, n


def _with_tool_mask(cls):
    """``cls`` whose rollouts are multi-turn as TRL's tool loop marks them: some completion tokens are tool results
    (tool_mask 0: in the row, attended to, but not trained), here every token id divisible by 3 after the first."""

    class WithToolMask(cls):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            tool_mask = (out["completion_ids"] % 3 != 0).int()
            tool_mask[:, 0] = 1
            out["tool_mask"] = tool_mask
            return out

    return WithToolMask


@pytest.mark.slow  # TRL's real train(), twice
def test_multi_turn_tool_mask_trains_as_grpo_trainer(tmp_path):
    """Rows with tool results inside the completion (TRL's ``tool_mask``) give the same update as GRPOTrainer:
    sharedprefix computes every completion token's log-prob, TRL's loss masks the tool tokens, and whole-group
    shuffling keeps ``tool_mask`` aligned with its rows."""
    tok = build_tokenizer()
    qwen3_model(tok).save_pretrained(tmp_path / "init")
    init = str(tmp_path / "init")
    init_state = tf.Qwen3ForCausalLM.from_pretrained(init).state_dict()

    def delta(trainer):
        return torch.cat([(p.detach() - init_state[n]).flatten() for n, p in trainer.model.named_parameters()])

    plain = delta(train_two_steps(_with_tool_mask(GRPOTrainer), GRPOConfig, init, tok, tmp_path / "plain", beta=0.1))
    ours = delta(
        train_two_steps(
            _with_tool_mask(SharedPrefixGRPOTrainer), SharedPrefixGRPOConfig, init, tok, tmp_path / "sp", beta=0.1
        )
    )
    unmasked = delta(train_two_steps(GRPOTrainer, GRPOConfig, init, tok, tmp_path / "unmasked", beta=0.1))
    scale = float(plain.abs().max())
    assert float((plain - unmasked).abs().max()) > 0.05 * scale  # the tool mask changes the update
    assert float((ours - plain).abs().max()) <= 1e-4 * scale


@pytest.mark.slow  # TRL's real train(), twice
def test_hybrid_model_trains_as_grpo_trainer(tmp_path, monkeypatch):
    """A hybrid model (LFM2) through the real train(), as TRL runs it by default (gradient checkpointing on), its rows
    as tree batches, with a budget that splits them: the same parameters as GRPOTrainer."""
    tok = build_tokenizer()
    lfm2_model(tok).save_pretrained(tmp_path / "init")
    init = str(tmp_path / "init")
    init_state = tf.Lfm2ForCausalLM.from_pretrained(init).state_dict()
    calls = []
    logprobs = sp.logprobs
    monkeypatch.setattr(
        sp, "logprobs", lambda model, source, **kw: calls.append(call_source(source)) or logprobs(model, source, **kw)
    )
    plain = train_two_steps(
        GRPOTrainer, GRPOConfig, init, tok, tmp_path / "plain", beta=0.1, gradient_checkpointing=True
    )
    ours = train_two_steps(
        SharedPrefixGRPOTrainer,
        SharedPrefixGRPOConfig,
        init,
        tok,
        tmp_path / "sp",
        beta=0.1,
        sharedprefix_max_tokens=24,
        sharedprefix_prefix_activations="recompute",
        gradient_checkpointing=True,
    )
    assert calls and all(isinstance(s, sp.Tree) and sp.plan(s, 24).splits for s in calls)  # trees, split by the budget
    dp = torch.cat([(p.detach() - init_state[n]).flatten() for n, p in plain.model.named_parameters()])
    do = torch.cat([(p.detach() - init_state[n]).flatten() for n, p in ours.model.named_parameters()])
    scale = float(dp.abs().max())
    assert scale > 1e-3
    assert float((do - dp).abs().max()) <= 1e-4 * scale, (float((do - dp).abs().max()), scale)


@pytest.mark.slow  # TRL's real train(), twice
def test_bf16_mixed_precision_trains_as_grpo_trainer(tmp_path):
    """bf16=True over float32 weights (accelerate's autocast, as many TRL configs run): the trainer crashed in the
    attention on mixed dtypes before the attention cast as autocast does. Both trainers sample the same completions
    (TRL's generation); their updates agree to bf16 rounding (measured 4.7e-3 of the largest update; a float32 run
    agrees to 3e-7, see above), so this checks bf16-level agreement, not float32 exactness."""
    tok = build_tokenizer()
    base = qwen3_model(tok)
    init = {n: p.detach().clone() for n, p in base.named_parameters()}
    base.save_pretrained(tmp_path / "init")
    runs = [
        train_two_steps(cls, cfg, str(tmp_path / "init"), tok, tmp_path / name, bf16=True)
        for cls, cfg, name in (
            (GRPOTrainer, GRPOConfig, "plain"),
            (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, "sp"),
        )
    ]
    plain, ours = (torch.cat([(p.detach() - init[n]).flatten() for n, p in r.model.named_parameters()]) for r in runs)
    assert next(runs[1].model.parameters()).dtype == torch.float32
    scale = float(plain.abs().max())
    assert scale > 1e-3
    assert float((ours - plain).abs().max()) <= 2e-2 * scale


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        dict(sharedprefix_max_tokens=32),
        pytest.param(
            dict(gradient_accumulation_steps=2, per_device_train_batch_size=4, steps_per_generation=2),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["budget", "steps"],
)
def test_torch_compile_trains_as_grpo_trainer(tmp_path, monkeypatch, layout):
    """``torch_compile=True``: accelerate wraps the model in ``torch.compile``; ours runs its decoder layers compiled
    with that context (graphs compiled, no warning of ours, no graph break the plain compiled trainer does not show)
    under a budget that splits groups, or as optimizer steps whose microbatches split groups (the graph kept: each
    step's first micro-step ran eager, warned, before), and trains to the same parameters as the compiled
    GRPOTrainer (float32 rounding; measured 2.4e-7 to 3.1e-7 of the largest update). Gradient checkpointing is off:
    with it on (TRL's default) dynamo breaks the checkpointed layers of both trainers (docs/compile.md)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from sharedprefix.attention import compiled
    from sharedprefix.schedule import setup as call_setup

    passes = []  # the passes that ran through compiled layers (each registers its handle)
    register = compiled.register
    monkeypatch.setattr(compiled, "register", lambda state, mods: passes.append(state) or register(state, mods))
    eager = []  # the reasons a call of ours gave its compiled path to run eager (TRL's filters may hide the warning)
    path = call_setup.compiled_path
    monkeypatch.setattr(call_setup, "compiled_path", lambda *a: eager.extend(a[-1]) or path(*a))
    tok = build_tokenizer()
    base = qwen3_model(tok)
    init = {n: p.detach().clone() for n, p in base.named_parameters()}
    base.save_pretrained(tmp_path / "init")
    deltas, breaks = [], []
    for cls, cfg, name, kw in (
        (GRPOTrainer, GRPOConfig, "plain", {k: v for k, v in layout.items() if not k.startswith("sharedprefix")}),
        (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, "sp", layout),
    ):
        torch._dynamo.reset()
        counters.clear()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="sharedprefix")
            run = train_two_steps(
                cls,
                cfg,
                str(tmp_path / "init"),
                tok,
                tmp_path / name,
                torch_compile=True,
                gradient_checkpointing=False,
                **kw,
            )
        assert type(run.model_wrapped).__name__ == "OptimizedModule"
        assert counters["stats"]["unique_graphs"] >= 1
        breaks.append({r.splitlines()[0] for r in counters["graph_break"]})
        deltas.append(torch.cat([(p.detach() - init[n]).flatten() for n, p in run.model.named_parameters()]))
    assert breaks[1] <= breaks[0], breaks
    assert passes, "the log-prob passes did not run through compiled layers"
    assert not eager, eager
    scale = float(deltas[0].abs().max())
    assert scale > 1e-3
    assert float((deltas[1] - deltas[0]).abs().max()) <= 1e-4 * scale
