"""SharedPrefixGRPOTrainer's optimizer steps (``sharedprefix_step``, ``integrations.trl_step``) at the edges of TRL's
and transformers' schedule: an epoch whose micro-steps are not a multiple of ``gradient_accumulation_steps``
(transformers runs a shorter last optimizer step), ``max_steps`` ending inside a generation batch, two epochs,
evaluation between the optimizer steps of one generation batch, a callback reading the gradients before the
optimizer step with clipping that bites, resuming from a checkpoint saved inside a generation batch (TRL's ``_step``
restarts at 0 there, so its generation batches straddle the epoch boundary), and PEFT variants (DoRA,
``modules_to_save``, ``trainable_token_indices``, tied word embeddings).

Each case trains a tiny float64 Qwen3 (groups of 4, 4 rows a microbatch, the 8 prompts of ``dataset()``: a
generation batch of ``steps_per_generation`` prompts, ``8 // steps_per_generation`` of them an epoch) with TRL's
trainer and a plain per-row float64 hook (the exact run, ``plain_rows``) and with ours, from the same weights, seed
and data: the parameters (or, for PEFT, the trainable ones) must agree to 1e-9 of the largest update (measured: at
most 2.6e-15), every update larger than 1e-3, and the steps the trainer planned are the windows TRL's micro-steps form
(``window_of``).
"""

import glob
import types

import pytest
import torch
from transformers import TrainerCallback

import sharedprefix as sp

pytest.importorskip("trl")
pytest.importorskip("datasets")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import (  # noqa: E402
    dataset,
    float64_qwen3_norms,
    plain_rows,
    qwen3_model,
    reward,
    train,
    train_two_steps,
    two_step_args,
)

EXACT = (plain_rows(GRPOTrainer), GRPOConfig)
OURS = (SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = build_tokenizer()
    paths, inits = {}, {}
    for tied in (False, True):
        model = qwen3_model(tok, tie_word_embeddings=tied)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        paths[tied] = str(tmp_path_factory.mktemp("init"))
        model.save_pretrained(paths[tied])
        inits[tied] = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    return types.SimpleNamespace(tok=tok, paths=paths, inits=inits, out=tmp_path_factory)


def _settings(setup, **settings):
    eos = {"sequence_bias": [[[setup.tok.eos_token_id], 3.0]]}  # completions of 1 to 3 tokens, some truncated
    common = dict(num_generations=4, per_device_train_batch_size=4, generation_kwargs=eos)
    return {**common, "model_init_kwargs": {"dtype": torch.float64}, **settings}


def _run(setup, pair, tied=False, **settings):
    cls, cfg_cls = pair
    return train_two_steps(cls, cfg_cls, setup.paths[tied], setup.tok, setup.out.mktemp("run"), **settings)


def _delta(trainer, init):
    model = trainer.accelerator.unwrap_model(trainer.model)
    return torch.cat([(p.detach().double() - init[n]).flatten() for n, p in model.named_parameters()])


def _planning(monkeypatch) -> list:
    """The number of micro-steps of each step ``sp.plan_step`` plans from now on."""
    planned, plan_step = [], sp.plan_step
    monkeypatch.setattr(sp, "plan_step", lambda model, trees, **kw: planned.append(len(trees)) or plan_step(
        model, trees, **kw
    ))  # fmt: skip
    return planned


def _assert_equal(got, want):
    scale = float(want.abs().max())
    assert scale > 1e-3, scale  # the parameters moved: the comparison is not vacuous
    assert float((got - want).abs().max()) <= 1e-9 * scale, (float((got - want).abs().max()), scale)


# (settings, micro-steps of each planned step): windows of one optimizer step from one generation batch
SCHEDULES = {
    # an epoch of 8 micro-steps (2 generation batches of 4) in optimizer steps of 3, 3 and 2: windows [0, 3),
    # [3, 4) (per microbatch), [4, 6), [6, 8)
    "spg4-ga3-short-last-step": (dict(steps_per_generation=4, gradient_accumulation_steps=3), [3, 2, 2]),
    # 8 micro-steps (4 generation batches of 2) in steps of 3, 3, 2: [0, 2), [2, 3), [3, 4), [4, 6), [6, 8)
    "spg2-ga3-short-last-step": (dict(steps_per_generation=2, gradient_accumulation_steps=3), [2, 2, 2]),
    # 6 micro-steps (2 generation batches of 3) in steps of 5 and 1: [0, 3), [3, 5), [5, 6)
    "spg3-ga5-short-last-step": (dict(steps_per_generation=3, gradient_accumulation_steps=5), [3, 2]),
    # 16 micro-steps (4 generation batches of 2, each trained twice) in steps of 3 and a last of 1
    "spg2-iter2-ga3-short-last-step": (
        dict(steps_per_generation=2, num_iterations=2, gradient_accumulation_steps=3),
        [3, 2, 2, 3, 3],
    ),
    # two epochs of 6 micro-steps (2 generation batches of 3), each in steps of 4 and 2
    "spg3-ga4-two-epochs": (
        dict(steps_per_generation=3, gradient_accumulation_steps=4, num_train_epochs=2),
        [3, 2] * 2,
    ),
    # max_steps ends inside a generation batch: its last micro-step never runs
    "spg4-ga3-max_steps1": (dict(steps_per_generation=4, gradient_accumulation_steps=3, max_steps=1), [3]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SCHEDULES))
def test_epoch_and_length_edges_equal_the_exact_run(setup, monkeypatch, case):
    """Whole epochs (``max_steps=-1``) with a shorter last optimizer step, two epochs, and ``max_steps`` inside a
    generation batch: the parameters equal the exact run's, and the planned steps are the expected windows."""
    float64_qwen3_norms(monkeypatch)
    settings, windows = SCHEDULES[case]
    settings = _settings(setup, **{"max_steps": -1, "num_train_epochs": 1, **settings})
    want = _delta(_run(setup, EXACT, **settings), setup.inits[False])
    planned = _planning(monkeypatch)
    got = _delta(_run(setup, OURS, **settings), setup.inits[False])
    _assert_equal(got, want)
    assert planned == windows


class _Gradients(TrainerCallback):
    """Keeps the gradient at each ``on_pre_optimizer_step`` (after transformers' clipping)."""

    def __init__(self):
        self.seen = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        grads = [p.grad.detach().double().flatten() for p in model.parameters() if p.grad is not None]
        self.seen.append(torch.cat(grads))


@pytest.mark.slow
def test_evaluation_and_a_gradient_callback_between_optimizer_steps(setup, monkeypatch):
    """``steps_per_generation=4`` over ``gradient_accumulation_steps=2`` (two optimizer steps per generation batch),
    TRL's evaluation after every optimizer step (between the two), ``max_grad_norm=0.05`` (below every step's norm, so
    clipping rescales each) and a callback reading the gradients at ``on_pre_optimizer_step``: the gradients it sees,
    the eval losses and the parameters equal the exact run's (measured: 7e-16, 2.9e-15 and 1.4e-15 relative)."""
    float64_qwen3_norms(monkeypatch)
    settings = _settings(
        setup,
        steps_per_generation=4,
        gradient_accumulation_steps=2,
        max_steps=3,
        max_grad_norm=0.05,
        eval_strategy="steps",
        eval_steps=1,
        num_generations_eval=2,
        per_device_eval_batch_size=4,
        beta=0.04,
    )
    runs = {}
    for name, pair in (("exact", EXACT), ("ours", OURS)):
        callback = _Gradients()

        class WithCallback(pair[0]):
            def __init__(self, *a, callback=callback, **kw):
                super().__init__(*a, **kw)
                self.add_callback(callback)

        planned = _planning(monkeypatch)
        t = _run(setup, (WithCallback, pair[1]), eval_data=dataset().select(range(4)), **settings)
        evals = [h["eval_loss"] for h in t.state.log_history if "eval_loss" in h]
        norms = [h["grad_norm"] for h in t.state.log_history if "grad_norm" in h]
        runs[name] = (_delta(t, setup.inits[False]), callback.seen, evals, norms, list(planned))
    want, want_grads, want_evals, norms, _ = runs["exact"]
    got, got_grads, got_evals, got_norms, planned = runs["ours"]
    _assert_equal(got, want)
    assert planned == [2, 2, 2] and len(want_grads) == len(got_grads) == 3 and min(norms) > 0.1, (planned, norms)
    for g, w in zip(got_grads, want_grads):
        assert float((g - w).abs().max()) <= 1e-9 * float(w.abs().max())
    assert len(want_evals) == len(got_evals) == 3
    for e, w in zip(got_evals, want_evals):
        assert abs(e - w) <= 1e-9 * abs(w)
    for n, w in zip(got_norms, norms):  # the norm before clipping: the prompts' share included
        assert abs(n - w) <= 1e-9 * w


class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            control.should_training_stop = True


def _resumed(setup, pair, settings):
    """``pair``'s trainer stopped after its first optimizer step (a checkpoint each step), then a new trainer resumed
    from that checkpoint to ``settings["max_steps"]``."""
    cls, cfg_cls = pair
    out = setup.out.mktemp("resume")
    args = two_step_args(cfg_cls, out, **{**settings, "save_strategy": "steps", "save_steps": 1})
    kw = dict(model=setup.paths[False], reward_funcs=reward, train_dataset=dataset(), processing_class=setup.tok)
    train(cls, args, callbacks=[_StopAt(1)], **kw)
    (checkpoint,) = glob.glob(str(out / "checkpoint-*"))
    trainer = cls(args=args, **kw)
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer


@pytest.mark.slow
def test_resuming_inside_a_generation_batch_equals_the_exact_run(setup, monkeypatch):
    """A checkpoint after the first of two optimizer steps of a generation batch (``steps_per_generation=4``,
    ``gradient_accumulation_steps=2``), resumed by a new trainer to 6 steps: TRL regenerates at the resumed trainer's
    first micro-step (its ``_step`` starts again at 0), so its generation batches end two micro-steps before each
    epoch's, one straddling the epoch boundary. The parameters equal the exact run resumed the same way (measured:
    1.2e-15)."""
    float64_qwen3_norms(monkeypatch)
    settings = _settings(setup, steps_per_generation=4, gradient_accumulation_steps=2, max_steps=6)
    want = _delta(_resumed(setup, EXACT, settings), setup.inits[False])
    planned = _planning(monkeypatch)
    trainer = _resumed(setup, OURS, settings)
    _assert_equal(_delta(trainer, setup.inits[False]), want)
    assert trainer.state.epoch == 1.5 and trainer._step == 10  # resumed at micro-step 2 of 8 an epoch
    assert planned == [2] * 6


class _StopInside(TrainerCallback):
    """Stops training after the first micro-step, inside its optimizer step (once)."""

    def __init__(self):
        self.stopped = False

    def on_substep_end(self, args, state, control, **kw):
        if not self.stopped:
            self.stopped = control.should_training_stop = True


def test_training_again_after_a_stop_inside_an_optimizer_step(setup, monkeypatch):
    """``train()`` stopped by a callback after micro-step 0 of an optimizer step (``steps_per_generation=4``,
    ``gradient_accumulation_steps=2``), then ``train()`` again on the same trainer: transformers zeroes the stopped
    step's gradients and starts an optimizer step at TRL's next micro-step (1), so the step of micro-steps [0, 2) is
    released and [1, 3) planned; the parameters equal the exact run's (measured 1e-15). Before, the second ``train()``
    raised at its first micro-step (the optimizer step was inferred from the last synchronised micro-step, 0 here:
    ``accelerator.sync_gradients=False`` at micro-step 1 against a planned end there)."""
    float64_qwen3_norms(monkeypatch)
    settings = _settings(setup, steps_per_generation=4, gradient_accumulation_steps=2)
    deltas = {}
    for name, (cls, cfg_cls) in (("exact", EXACT), ("ours", OURS)):
        planned = _planning(monkeypatch)
        args = two_step_args(cfg_cls, setup.out.mktemp("again"), **settings)
        kw = dict(model=setup.paths[False], reward_funcs=reward, train_dataset=dataset(), processing_class=setup.tok)
        trainer = train(cls, args, callbacks=[_StopInside()], **kw)
        assert (trainer.state.global_step, trainer._step) == (0, 1)
        trainer.train()
        assert (trainer.state.global_step, trainer._step) == (2, 5)
        deltas[name] = _delta(trainer, setup.inits[False])
    _assert_equal(deltas["ours"], deltas["exact"])
    assert planned == [2, 2]  # [0, 2) (stopped, released), then [1, 3); [3, 4) and [4, 5) per microbatch


def _lora(**extra):
    peft = pytest.importorskip("peft")
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    return peft.LoraConfig(**{**lora, **extra})


PEFT = {
    "dora": dict(use_dora=True),
    "modules_to_save-lm_head": dict(modules_to_save=["lm_head"]),
    "trainable_token_indices": dict(trainable_token_indices=[1, 2, 3, 5]),
}


@pytest.mark.parametrize(
    "case, tied",
    [
        pytest.param("dora", False, marks=pytest.mark.slow),
        pytest.param("modules_to_save-lm_head", True, marks=pytest.mark.slow),
        ("trainable_token_indices", False),
        pytest.param("trainable_token_indices", True, marks=pytest.mark.slow),
    ],
)
def test_peft_variants_with_steps_equal_the_exact_run(setup, monkeypatch, case, tied):
    """DoRA, ``modules_to_save=["lm_head"]`` (on a model with tied word embeddings) and ``trainable_token_indices``
    (PEFT's TrainableTokensWrapper around the input embedding, and the head when tied), ``beta`` 0.1 (the reference
    is the adapter disabled), ``steps_per_generation = gradient_accumulation_steps = 2``: the trainable parameters'
    update equals the exact run's (measured: at most 1.9e-15). ``trainable_token_indices`` crashed before when the
    trainer was built (``AttributeError: 'TrainableTokensWrapper' object has no attribute 'num_embeddings'``, in the
    padding probe)."""
    import transformers as tf

    peft = pytest.importorskip("peft")
    float64_qwen3_norms(monkeypatch)
    settings = _settings(setup, steps_per_generation=2, gradient_accumulation_steps=2, beta=0.1)
    torch.manual_seed(0)  # the adapters' initial values, as the trainers (seed 0) draw them
    base = tf.AutoModelForCausalLM.from_pretrained(setup.paths[tied], dtype=torch.float64)
    initial = {n: p.detach().clone() for n, p in peft.get_peft_model(base, _lora(**PEFT[case])).named_parameters()}

    def update(pair):
        t = _run(setup, pair, tied=tied, peft_config=_lora(**PEFT[case]), **settings)
        trained = [(n, p) for n, p in t.model.named_parameters() if p.requires_grad]
        assert any("lora_" not in n for n, _ in trained) or case == "dora"  # the variant's own parameters train
        return torch.cat([(p.detach().double() - initial[n]).flatten() for n, p in trained])

    want = update(EXACT)
    planned = _planning(monkeypatch)
    _assert_equal(update(OURS), want)
    assert planned == [2, 2]
