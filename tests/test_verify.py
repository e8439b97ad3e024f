"""sp.verify / SHAREDPREFIX_SELF_CHECK: a user's own model checked against its plain forward before training."""

import pytest
import torch

import sharedprefix as sp
from helpers import tiny_model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_verify_passes_on_an_exact_model(dtype):
    report = sp.verify(tiny_model("qwen3", dtype=dtype))
    assert report.ok and report.refusal is None and len(report.checks) == 2
    assert "exact by the 2x rule" in str(report)


def test_verify_reports_a_refusal_with_its_reason():
    model = tiny_model("llama")
    model.config.output_router_logits = True
    report = sp.verify(model)
    assert not report.ok and "output_router_logits" in report.refusal and str(report).startswith("refused:")


def test_verify_and_the_self_check_catch_a_silent_mismatch(monkeypatch):
    from sharedprefix.attention import cascade

    orig = cascade.cascade_attention

    def off_by_a_bit(impl, casc, query, *a, **k):  # a wrong attention: what verify exists to catch
        return orig(impl, casc, query, *a, **k) * 1.01

    monkeypatch.setattr("sharedprefix.attention.interface.cascade_attention", off_by_a_bit)
    model = tiny_model("qwen3")
    report = sp.verify(model)
    assert not report.ok and "MISMATCH" in str(report)
    groups = [sp.Group([1, 2, 3], [[4, 5], [6]])]
    monkeypatch.setenv("SHAREDPREFIX_SELF_CHECK", "1")
    with pytest.raises(ValueError, match="SHAREDPREFIX_SELF_CHECK: sharedprefix does not reproduce"):
        sp.logprobs(model, groups)
    monkeypatch.setattr("sharedprefix.attention.interface.cascade_attention", orig)
    out = sp.logprobs(model, groups)  # exact again: the check runs, passes, and the call proceeds
    assert out.logprobs.shape == (2, 2)


@pytest.mark.slow  # sharedprefix verify on a saved checkpoint, end to end
def test_cli_verify_own_model(tmp_path):
    import subprocess
    import sys

    tiny_model("qwen3", dtype=torch.float32).save_pretrained(tmp_path / "m")
    proc = subprocess.run(
        [sys.executable, "-m", "sharedprefix.cli.main", "verify", "--model", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exact by the 2x rule" in proc.stdout and "speed of the check's forward" in proc.stdout


def test_verify_checks_deepseek_sparse_attention_split_too():
    from support.models import dsa_model

    report = sp.verify(dsa_model())
    assert report.ok and report.refusal is None and report.split_refusal is None and len(report.checks) == 2


def test_verify_reports_a_model_exact_in_one_pass_only(monkeypatch):
    """A DeepSeek sparse attention model whose indexers sharedprefix cannot reach is exact in one pass and refuses a
    split budget: verify says so, and counts the model as exact (the split call would refuse, never mismatch)."""
    from sharedprefix.attention import indexed
    from support.models import dsa_model

    monkeypatch.setattr(indexed, "indexers", lambda m: {})
    report = sp.verify(dsa_model())
    assert report.ok and report.refusal is None and len(report.checks) == 1
    assert "cannot split a group" in report.split_refusal
    assert "exact by the 2x rule in one pass; a budget that splits a group is refused" in str(report)


def test_verify_reports_a_budget_refusal_as_a_refusal():
    """A budget the groups cannot use (a completion longer than it) is not blamed on the model."""
    groups = [sp.Group(list(range(1, 9)), [list(range(1, 7)), [3]])]
    report = sp.verify(tiny_model("qwen3"), groups, max_tokens=4)
    assert not report.ok and report.refusal.startswith("with max_tokens=4:") and report.split_refusal is None


def _moe(dtype=torch.float32):
    from sharedprefix.tools.zoo.configs import build

    return build("qwen3_moe")[0].to(dtype)


def _perturb_low_precision(monkeypatch, where):
    """Move the shared-prefix attention's output in float32 only (a float64 run is untouched): at one query of
    each row (``where="one token"``, the second-to-last of the row: as a flipped routing choice moves one token) or
    at every query (``"every token"``, as a low-precision error of the computation itself would)."""
    from sharedprefix.attention import interface

    orig = interface.cascade_attention

    def moved(impl, casc, query, *a, **k):
        out = orig(impl, casc, query, *a, **k)
        if out.dtype != torch.float32:
            return out
        if where == "every token":
            return out * 1.01
        out = out.clone()
        out[:, -2] += 0.5
        return out

    monkeypatch.setattr(interface, "cascade_attention", moved)


def test_verify_builds_its_float64_copy_of_a_grouped_mm_moe_model():
    """A bfloat16 MoE model whose experts run transformers' grouped_mm (its default in a loaded checkpoint), which has
    no float64 kernel: verify's float64 copy computes its experts eagerly, and the user's model keeps grouped_mm."""
    model = _moe(torch.bfloat16)
    model.config._experts_implementation = "grouped_mm"
    groups = [sp.Group(list(range(3, 30)), [list(range(5, 20)), [7, 8, 9]]), sp.Group([4, 5], [[6] * 6])]
    report = sp.verify(model, groups)
    assert report.refusal is None and len(report.checks) == 2, str(report)
    assert all(plain > 0 for _, _, plain in report.checks)  # the bf16 run is compared with a real float64 one
    assert model.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("tied", [True, False])
def test_verify_judges_a_flipped_choice_of_a_moe_model_on_its_float64_copy(monkeypatch, tied):
    """A low-precision MoE model failing the 2x rule at one token per row, exact on its float64 copy: excused where
    the plain run's own routing at the predicting position nearly ties (``tools.ties``), never elsewhere."""
    from sharedprefix.tools import ties

    _perturb_low_precision(monkeypatch, "one token")
    real = ties.tie_margins
    monkeypatch.setattr(
        ties,
        "tie_margins",
        lambda m, g: [x * (0.0 if tied else float("inf")) + (0.0 if tied else 1.0) for x in real(m, g)],
    )
    report = sp.verify(_moe(), max_tokens=10_000)
    assert report.checks[0][1] > 2 * report.checks[0][2]  # the 2x rule alone would fail
    assert report.choices == "top-k expert routing" and report.float64 <= 1e-9 and report.beyond <= 2
    assert report.ok == tied and report.untied == (0 if tied else report.beyond)
    if not tied:
        assert "NOT EXACT" in str(report)
        return
    assert "flipped choices" in str(report) and "token(s) beyond twice the plain error" in str(report)
    # the self-check lets the call proceed with such a verdict, and says why
    monkeypatch.setattr("sharedprefix.tools.verify.verify", lambda m, g: report)
    monkeypatch.setenv("SHAREDPREFIX_SELF_CHECK", "1")
    with pytest.warns(UserWarning, match="flipped choices"):
        sp.logprobs(_moe(), [sp.Group(list(range(3, 40)), [list(range(5, 30)), [7, 8]])])


def test_a_real_routing_flip_sits_at_a_near_tie():
    """A tiny GPT-OSS in bf16 (seed 2 of verify's groups) flips one token's expert choice against the plain bf16 run
    (5x the plain error there, exact in float64): verify finds the plain run's routing within the tie margin at the
    position predicting it, and calls the model exact."""
    from sharedprefix.tools.zoo.configs import build

    report = sp.verify(build("gpt_oss")[0].to(torch.bfloat16), seed=2)
    if report.float64 is None:
        pytest.skip("no routing flip on this platform's bf16 kernels (the 2x rule held)")
    assert report.ok and report.beyond >= 1 and report.untied == 0, str(report)


def test_verify_excuses_no_error_at_a_dozen_tokens(monkeypatch):
    """A low-precision error at 12 of the 183 tokens (a wrong cached hidden state would move the first token of each
    of the 12 completions) is more than flipped choices explain, even on a MoE model exact in float64."""
    from sharedprefix.schedule import executor

    orig = executor.token_logprobs

    def moved(model, hidden, targets, *a, **k):
        lp, ent = orig(model, hidden, targets, *a, **k)
        if lp.dtype == torch.float32:
            lp = torch.cat([lp[:12] + 0.7, lp[12:]])
        return lp, ent

    monkeypatch.setattr(executor, "token_logprobs", moved)
    report = sp.verify(_moe(), max_tokens=10_000)
    assert not report.ok and report.float64 is not None and report.beyond >= 12 and report.untied is None


@pytest.mark.parametrize("case", ["every token of a MoE model", "one token of a dense model"])
def test_verify_does_not_excuse_other_low_precision_errors(monkeypatch, case):
    """An error at every token is no flipped choice, even where the float64 copy is exact; a model without discrete
    choices gets no second opinion."""
    _perturb_low_precision(monkeypatch, "every token" if case.startswith("every") else "one token")
    model = _moe() if "MoE" in case else tiny_model("qwen3", dtype=torch.float32)
    report = sp.verify(model, max_tokens=10_000)
    assert not report.ok and "NOT EXACT" in str(report)
    assert (report.float64 is not None) == ("MoE" in case)


def test_verify_names_the_indexer_tie_caveat_when_a_dsa_model_is_not_exact(monkeypatch):
    """Not excused, but explained: the indexer's float32 scores tie at its top-k boundary in any layout-dependent
    order, also on the float64 copy."""
    from support.models import dsa_model

    _perturb_low_precision(monkeypatch, "every token")
    model = dsa_model().float()
    monkeypatch.setattr("sharedprefix.attention.indexed.sparse_attention", _moved_sparse(monkeypatch))
    report = sp.verify(model, max_tokens=10_000)
    assert not report.ok and "an indexer's top-k keys" in report.choices
    assert "tie exactly at its top-k boundary" in str(report) and "NOT EXACT" in str(report)


def _moved_sparse(monkeypatch):
    from sharedprefix.attention import indexed

    orig = indexed.sparse_attention

    def moved(q, *a, **k):
        out = orig(q, *a, **k)
        return out * 1.01 if out.dtype == torch.float32 else out

    return moved


def test_a_model_without_an_lm_head_is_refused_with_the_class_to_load():
    """A model with a decoder but no output embeddings (a checkpoint loaded without its language-modeling head, as
    Nemotron-H Omni's composite class is) is refused before any pass, naming the fix."""
    model = tiny_model("qwen3")
    model.get_output_embeddings = lambda: None  # on this instance only
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM has no LM head .*AutoModelForCausalLM"):
        sp.logprobs(model, [sp.Group([1, 2, 3], [[4, 5]])])
