"""Every sharedprefix TRL trainer takes TRL's own config class, as a user swapping only the trainer class writes
(``SharedPrefixGRPOTrainer(..., args=GRPOConfig(...))``): our settings at their defaults, and one training step gives
the parameters of the same step with our config (before: ``AttributeError: 'GRPOConfig' object has no attribute
'sharedprefix_group_microbatches'`` when built). And ``neftune_noise_alpha``, a setting of every TRL config, is
refused when built, naming the setting (before: at the first training step, after the first generation, with advice
for module hooks rather than the setting)."""

import types

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from trl import GRPOConfig, RLOOConfig  # noqa: E402
from trl.experimental.async_grpo import AsyncGRPOConfig  # noqa: E402

from sharedprefix.integrations.trl import (  # noqa: E402
    SharedPrefixGRPOConfig,
    SharedPrefixGRPOTrainer,
    SharedPrefixRLOOConfig,
    SharedPrefixRLOOTrainer,
)
from sharedprefix.integrations.trl_async import SharedPrefixAsyncGRPOConfig, SharedPrefixAsyncGRPOTrainer  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support import trl_async as stub  # noqa: E402
from support.grpo import build_trainer, qwen3_model, train_two_steps  # noqa: E402

SYNC = {
    "grpo": (SharedPrefixGRPOTrainer, GRPOConfig, SharedPrefixGRPOConfig),
    "rloo": (SharedPrefixRLOOTrainer, RLOOConfig, SharedPrefixRLOOConfig),
}
EXTRA = {"grpo": {}, "rloo": {"beta": 0.0}}  # RLOO with beta > 0 loads its reference by the model's name


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _same(a, b):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("kind", list(SYNC))
def test_trl_own_config_builds(tmp_path, kind):
    cls, trl_cfg, _ = SYNC[kind]
    tok = build_tokenizer()
    trainer = build_trainer(qwen3_model(tok), tok, tmp_path, trainer_cls=cls, config_cls=trl_cfg, **EXTRA[kind])
    assert type(trainer.args) is trl_cfg and trainer._sp_budget is None and trainer._sp_mode == "keep"


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(SYNC))
def test_trl_own_config_trains_as_ours(tmp_path, kind):
    """One step with TRL's own config: the same parameters as with ours at its defaults, and they moved."""
    cls, trl_cfg, our_cfg = SYNC[kind]
    tok = build_tokenizer()
    init = _params(types.SimpleNamespace(model=qwen3_model(tok)))
    step = dict(max_steps=1, **EXTRA[kind])
    got = _params(train_two_steps(cls, trl_cfg, qwen3_model(tok), tok, tmp_path / "trl", **step))
    want = _params(train_two_steps(cls, our_cfg, qwen3_model(tok), tok, tmp_path / "ours", **step))
    assert max(float((got[n] - init[n]).abs().max()) for n in got) > 1e-3  # a step was taken
    _same(got, want)


@pytest.fixture(scope="module")
def async_setup(tmp_path_factory):
    """The tokenizer, a tiny Qwen3 saved for the asynchronous trainer, and 4 groups of 4 rollouts."""
    tok = build_tokenizer()
    path = stub.save_tiny_qwen3(tmp_path_factory.mktemp("init"), len(tok))
    return types.SimpleNamespace(tok=tok, path=path, samples=stub.rollouts(len(tok), 4, 4, 12, (2, 6)))


def _async_step(setup, cfg_cls, out):
    trainer = stub.build(
        SharedPrefixAsyncGRPOTrainer, cfg_cls, setup.path, setup.tok, out, setup.samples, max_steps=1,
        gradient_accumulation_steps=1,
    )  # fmt: skip
    init = _params(trainer)
    return init, _params(stub.train(trainer))


@pytest.mark.slow
def test_async_trainer_takes_trl_own_config(async_setup, tmp_path):
    """``AsyncGRPOConfig`` for SharedPrefixAsyncGRPOTrainer: one step, the parameters of the same step with ours."""
    init, got = _async_step(async_setup, AsyncGRPOConfig, tmp_path / "trl")
    _, want = _async_step(async_setup, SharedPrefixAsyncGRPOConfig, tmp_path / "ours")
    assert max(float((got[n] - init[n]).abs().max()) for n in got) > 1e-3
    _same(got, want)


NEFTUNE = r"neftune_noise_alpha=5\.0: .*one draw per token of each row.*Set neftune_noise_alpha=None \(the default\)"


@pytest.mark.parametrize("kind", list(SYNC))
@pytest.mark.parametrize("config", ["trl", "ours"])
def test_neftune_is_refused_when_built(tmp_path, kind, config):
    """Refused in the constructor, with TRL's config and ours; the control: the default (None) builds."""
    cls, trl_cfg, our_cfg = SYNC[kind]
    cfg = trl_cfg if config == "trl" else our_cfg
    tok = build_tokenizer()
    kw = dict(trainer_cls=cls, config_cls=cfg, **EXTRA[kind])
    with pytest.raises(ValueError, match=NEFTUNE):
        build_trainer(qwen3_model(tok), tok, tmp_path, neftune_noise_alpha=5.0, **kw)
    assert build_trainer(qwen3_model(tok), tok, tmp_path, **kw)


def test_neftune_is_refused_when_the_async_trainer_is_built(async_setup, tmp_path):
    build = lambda cfg, **kw: stub.build(  # noqa: E731
        SharedPrefixAsyncGRPOTrainer, cfg, async_setup.path, async_setup.tok, tmp_path / "out", [], **kw
    )
    for cfg in (AsyncGRPOConfig, SharedPrefixAsyncGRPOConfig):  # building with AsyncGRPOConfig: the fast check of it
        with pytest.raises(ValueError, match=NEFTUNE):
            build(cfg, neftune_noise_alpha=5.0)
        assert type(build(cfg).args) is cfg
