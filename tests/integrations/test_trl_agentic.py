"""Two-turn tool rollouts through SharedPrefixGRPOTrainer: every turn the rows of a group have in common is computed
once, and the update is GRPOTrainer's.

TRL's own tool loop (``tools=`` / ``environment_factory=``) needs a chat template with a tool-call parser, which the
local word-level tokenizer here has not, so the rollout is shaped after generation as TRL's loop shapes it: each
completion is [assistant turn 1 | tool result | assistant turn 2], the tool result marked ``tool_mask`` 0 (attended
to, not trained). Within a group, turn 1 and the tool result are the same for every row (the same tool call and
answer), turn 2 is each row's own sample: the token trie shares prompt, turn 1 and tool result.
"""

import pytest
import torch

import sharedprefix as sp
from tests.helpers import call_source

pytest.importorskip("trl")
pytest.importorskip("datasets")

import transformers as tf  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from sharedprefix.integrations.trl import SharedPrefixGRPOConfig, SharedPrefixGRPOTrainer  # noqa: E402
from sharedprefix.recipes.grpo.tasks import build_tokenizer  # noqa: E402
from support.grpo import moe_model, qwen3_model, train_two_steps  # noqa: E402

SHARED = 3  # tokens of turn 1 (2) and the tool result (1) that the rows of a group share


def _two_turn(cls):
    class TwoTurn(cls):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            ids, G = out["completion_ids"].clone(), self.num_generations
            first = ids[::G, :SHARED].repeat_interleave(G, 0)  # one tool call and result per prompt group
            ids[:, :SHARED] = first
            out["completion_ids"] = ids
            tool_mask = torch.ones_like(ids, dtype=torch.int)
            tool_mask[:, SHARED - 1] = 0  # the tool's answer: in the row, not trained
            out["tool_mask"] = tool_mask
            return out

    return TwoTurn


def _check(tmp_path, tok, init, state, monkeypatch):
    sources = []
    logprobs = sp.logprobs
    monkeypatch.setattr(
        sp, "logprobs", lambda model, source, **kw: sources.append(call_source(source)) or logprobs(model, source, **kw)
    )
    kw = dict(beta=0.0, max_completion_length=6, generation_kwargs={"suppress_tokens": [tok.eos_token_id]})
    plain = train_two_steps(_two_turn(GRPOTrainer), GRPOConfig, init, tok, tmp_path / "plain", **kw)
    ours = train_two_steps(_two_turn(SharedPrefixGRPOTrainer), SharedPrefixGRPOConfig, init, tok, tmp_path / "sp", **kw)

    def delta(t):
        return torch.cat([(p.detach().float() - state[n].float()).flatten() for n, p in t.model.named_parameters()])

    dp = delta(plain)
    scale = float(dp.abs().max())
    assert scale > 1e-3
    assert float((delta(ours) - dp).abs().max()) <= 1e-5 * scale
    policy = [s for s in sources if isinstance(s, sp.Tree)]
    assert policy
    for tree in policy:
        rows = tree.rows
        plan = sp.plan(tree)
        prompts = {tuple(r[: len(r) - 6].tolist()) for r in rows}  # each row: prompt + 6 completion tokens
        prompt_only = sum(len(p) for p in prompts) + 6 * len(rows)  # what sharing the prompt alone computes
        assert plan.tokens_computed < prompt_only < plan.plain_tokens
        assert plan.tokens_computed <= prompt_only - (SHARED * (len(rows) - len(prompts)))  # turns shared too


@pytest.mark.slow
def test_two_turn_tool_rollout_shares_its_common_turns_dense(tmp_path, monkeypatch):
    tok = build_tokenizer()
    qwen3_model(tok).save_pretrained(tmp_path / "init")
    init = str(tmp_path / "init")
    _check(tmp_path, tok, init, tf.Qwen3ForCausalLM.from_pretrained(init).state_dict(), monkeypatch)


@pytest.mark.slow
def test_two_turn_tool_rollout_shares_its_common_turns_moe(tmp_path, monkeypatch):
    """The same with Qwen3-MoE and its load-balancing loss (tool tokens count in it, as in TRL's forward)."""
    tok = build_tokenizer()
    init, state = moe_model(tmp_path, tok, "qwen3_moe")
    _check(tmp_path, tok, init, state, monkeypatch)
