"""TRL's own tool loop (``GRPOTrainer(tools=[...])`` and ``environment_factory=``) with SharedPrefixGRPOTrainer, a
dense and an MoE model.

A byte-level tokenizer carries TRL's Qwen3 chat template, which TRL recognises and parses tool calls with. A tiny
random model never writes a valid tool call, so the first assistant turn of every completion is parsed as a call
of ``multiply`` (TRL's ``parse_response`` wrapped): TRL then runs the tool, appends its answer (``tool_mask`` 0)
and generates the second turn, exactly as in a real two-turn rollout. Both trainers run the same rollouts and must
reach the same parameters (float32, 1e-5 of the largest update); the trees the hook builds compute fewer tokens
than the plain rows.
"""

import importlib.resources

import pytest
import torch

import sharedprefix as sp
from tests.helpers import call_source

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import transformers as tf  # noqa: E402
import trl.trainer.grpo_trainer as grpo  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer  # noqa: E402
from sharedprefix.tools.zoo.configs import tiny_config  # noqa: E402
from support.grpo import train, two_step_args  # noqa: E402

SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
]


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


class MultiplyEnv:
    """An environment as TRL's environment_factory takes it: reset, and its public methods as tools."""

    def reset(self, **kwargs):
        self.calls = 0

    def multiply(self, a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        self.calls += 1
        return a * b


def _tokenizer():
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[:1] + SPECIALS[2:]})
    tok.chat_template = (importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text()
    return tok


def _model(tmp_path, tok, kind):
    cfg = tiny_config(kind)
    cfg.vocab_size, cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = (
        len(tok),
        tok.pad_token_id,
        tok.eos_token_id,
        None,
    )
    cfg.max_position_embeddings = 1024
    if kind == "qwen3_moe":
        cfg.router_aux_loss_coef = 0.5
    torch.manual_seed(0)
    model = {"qwen3": tf.Qwen3ForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM}[kind]._from_config(
        cfg, attn_implementation="sdpa"
    )
    model.save_pretrained(tmp_path / "init")
    return str(tmp_path / "init"), model.state_dict()


def _first_turn_calls_the_tool(tok):
    """TRL's parse_response, except that a first assistant turn (no tool answer in its prefix yet) is a call."""
    own, answered = grpo.parse_response, tok.convert_tokens_to_ids("<tool_response>")

    def parse(tokenizer, ids, prefix=None, tools=None):
        if prefix is not None and answered not in list(prefix):
            call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
            return {"role": "assistant", "content": "", "tool_calls": [call]}
        return own(tokenizer, ids, prefix=prefix, tools=tools)

    return parse


def _train(cls, cfg_cls, init, tok, out, source):
    args = two_step_args(cfg_cls, out, num_generations=4, per_device_train_batch_size=8, max_completion_length=24)
    prompts = [[{"role": "user", "content": f"What is {i} times 3?"}] for i in range(4)]
    return train(
        cls,
        args,
        model=init,
        reward_funcs=lambda completions, completion_ids, **kw: [float(sum(ids) % 7) for ids in completion_ids],
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        **({"tools": [multiply]} if source == "tools" else {"environment_factory": MultiplyEnv}),
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("source", ["tools", "environment_factory"])
def test_trl_tool_loop_trains_as_grpo_trainer(tmp_path, monkeypatch, kind, source):
    tok = _tokenizer()
    init, state = _model(tmp_path, tok, kind)
    monkeypatch.setattr(grpo, "parse_response", _first_turn_calls_the_tool(tok))
    trees = []
    logprobs = sp.logprobs
    monkeypatch.setattr(
        sp, "logprobs", lambda model, source, **kw: trees.append(call_source(source)) or logprobs(model, source, **kw)
    )
    plain = _train(GRPOTrainer, GRPOConfig, init, tok, tmp_path / "plain", source)
    ours = _train(SharedPrefixGRPOTrainer, SharedPrefixGRPOConfig, init, tok, tmp_path / "sp", source)
    calls = [h["tools/call_frequency"] for h in plain.state.log_history if "tools/call_frequency" in h]
    assert calls and min(calls) > 0  # the rollouts really are two turns
    assert plain.aux_loss_enabled == (kind == "qwen3_moe")
    delta = lambda t: torch.cat([(p.detach() - state[n]).flatten() for n, p in t.model.named_parameters()])  # noqa: E731
    dp = delta(plain)
    scale = float(dp.abs().max())
    assert scale > 1e-3
    assert float((delta(ours) - dp).abs().max()) <= 1e-5 * scale
    assert trees and all(sp.plan(t).tokens_computed < sp.plan(t).plain_tokens for t in trees)
