"""The model zoo: every causal LM transformers registers is exact against its own plain forward, or refused with
its reason before any computation, or not buildable for a reason written down here; never silently wrong.

Each entry is built and checked once per test process (``_result``); the table of ``docs/models.md`` must be what
these results render to. The coverage tests break sharedprefix on purpose (a window dropped, a window applied to every
layer, sinks ignored) and require the zoo to report it, so that a silent mismatch of these kinds cannot pass.
"""

import os

import pytest
import torch
import transformers

from sharedprefix.attention import checks, interface
from sharedprefix.tools import zoo
from sharedprefix.tools.zoo import readme

pytestmark = pytest.mark.slow  # every architecture transformers registers


PAGE = os.path.join(os.path.dirname(__file__), "..", "..", readme.PAGE)
_RESULTS: dict = {}


def _result(entry):
    if entry not in _RESULTS:
        _RESULTS[entry] = zoo.check(entry)
    return _RESULTS[entry]


@pytest.mark.parametrize("entry", list(zoo.entries()))
def test_entry_is_exact_or_refused_or_explained(entry):
    r = _result(entry)
    assert r.status != "failed", f"{entry} ({r.model_class}): {r.detail}"
    if r.status == "not buildable":
        assert entry in zoo.EXPECTED_NOT_BUILDABLE, (
            f"{entry} is newly not buildable ({r.detail}); make its tiny config build (zoo.configs.ARCH) or say why "
            "in zoo.EXPECTED_NOT_BUILDABLE"
        )
    elif r.status == "exact":
        assert r.logprob_err is not None and r.grad_err is not None
    else:
        assert r.category and r.detail


def test_the_features_this_zoo_exists_for_are_exercised():
    """Windows, sinks, latent attention, chunks and MoE really occur among the exact entries (a config change that
    quietly turned them off would leave their tests vacuous)."""
    feats = {f for e in zoo.entries() for f in _result(e).features}
    assert {
        "sliding window",
        "attention sinks",
        "chunked attention",
        "MoE",
        "MoE load-balancing loss",
        "attention-score soft-capping",
        "latent attention (value head dim != query head dim)",
    } <= feats
    assert {"gpt_oss", "deepseek_v3", "phimoe", "exaone4", "gemma3_text", "llama4_text+chunk_4"} <= {
        e for e in zoo.entries() if _result(e).status == "exact"
    }


@pytest.mark.parametrize(
    "entry, category",
    [
        ("bloom", "attention outside transformers' attention interface"),  # ALiBi in its own attention; was "positions"
        ("rwkv", "token mixing outside attention"),  # a recurrence; was "positions numbered by the model itself"
        ("mamba", "token mixing outside attention"),
        ("deepseek_v4", "token mixing outside attention"),  # its compressors pool blocks of the row into keys
        ("qwen4_exp_text", "token mixing outside attention"),  # linear-attention layers (next to its indexed ones)
        ("blt", "token mixing outside attention"),  # bytes pooled into patches; was "attention masks"
        # LSH attention; was "fails on a probe row"
        (
            "reformer",
            "attention outside transformers' attention interface",
        ),
    ],
)
def test_refusals_name_the_feature(entry, category):
    r = _result(entry)
    assert r.status == "refused" and r.category.startswith(category), (r.status, r.category, r.detail)


def test_falcon_is_exact_where_its_attention_goes_through_the_interface():
    """transformers 5.25 moved Falcon's attention into transformers' attention interface: exact there (with ALiBi
    it lays the bias onto a mask of its own, which the probe refuses); before, attention of its own, refused."""
    from transformers.models.falcon import modeling_falcon

    r = _result("falcon")
    if "ALL_ATTENTION_FUNCTIONS" in vars(modeling_falcon):
        assert r.status == "exact" and r.grad_err is not None, (r.status, r.detail)
    else:  # was a TypeError
        assert r.status == "refused" and r.category.startswith("attention outside transformers' attention interface"), (
            r.status,
            r.category,
            r.detail,
        )


def test_several_token_streams_per_position_are_exact_also_when_split():
    """MusicGen's codebooks: groups of frames, a frame's log-prob summed over its codebooks (was refused)."""
    for entry in ("musicgen", "musicgen_melody"):
        r = _result(entry)
        assert r.status == "exact" and not r.split_refusal and r.grad_err is not None, (entry, r.status, r.detail)


def test_several_attention_calls_per_layer_are_exact_also_when_split():
    """Looped layers and differential attention cache one prompt K/V per attention call of a layer."""
    for entry in ("hrm_text", "diffllama", "dory"):
        r = _result(entry)
        assert r.status == "exact" and not r.split_refusal and r.grad_err is not None, (
            entry,
            r.status,
            r.split_refusal,
        )


DSA_ENTRIES = ("deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4", "dots3_note_text", "dots3_note")


def test_deepseek_sparse_attention_is_exact_also_when_split():
    for entry in DSA_ENTRIES:
        r = _result(entry)
        assert r.status == "exact" and "keys selected by an indexer (DeepSeek sparse attention)" in r.features, (
            entry,
            r.status,
            r.detail,
        )
        assert not r.split_refusal and r.grad_err is not None, (entry, r.split_refusal)


@pytest.mark.parametrize("entry", ["deepseek_v32", "hy_v4"])
def test_zoo_catches_an_ignored_indexer_selection(entry, monkeypatch):
    """The zoo's index_topk (4) is below what most tokens of its rows see: attending to every visible key fails."""
    from sharedprefix.attention import indexed

    orig = indexed.sparse_attention
    monkeypatch.setattr(
        indexed,
        "sparse_attention",
        lambda q, k, v, vis, idx, *a: orig(
            q, k, v, vis, torch.arange(q.shape[2])[None, None].expand(1, q.shape[2], -1), *a
        ),
    )
    r = zoo.check(entry, grads=False)
    assert r.status == "failed" and "silent mismatch" in r.detail, (r.status, r.detail)


def test_docs_table_is_the_zoo_results():
    with open(PAGE, encoding="utf-8") as f:
        current = readme.current_block(f.read())
    assert current is not None, f"{readme.PAGE} lost its zoo block markers"
    if f"transformers {transformers.__version__} registers" not in current:
        pytest.skip(
            f"the zoo table of {readme.PAGE} was generated with another transformers than {transformers.__version__}"
        )
    block = readme.render([_result(e) for e in zoo.entries()], transformers.__version__)
    assert current == block, (
        f"the zoo table of {readme.PAGE} is stale: run python -m sharedprefix.tools.zoo --write-docs"
    )


@pytest.mark.parametrize("entry", ["phimoe", "mistral", "exaone4", "gemma3_text", "gpt_oss"])
def test_zoo_catches_a_window_that_is_not_applied(entry, monkeypatch):
    monkeypatch.setattr(checks, "layer_window", lambda module, passed: None)
    r = zoo.check(entry, grads=False)
    assert r.status == "failed" and "silent mismatch" in r.detail, (r.status, r.detail)


@pytest.mark.parametrize("entry", ["exaone4", "gemma3_text", "gpt_oss"])
def test_zoo_catches_a_window_applied_to_full_attention_layers(entry, monkeypatch):
    """The bug class of issue 10: a module's window attribute applied on layers whose masks are full."""
    monkeypatch.setattr(checks, "layer_window", lambda module, passed: zoo.configs.WINDOW)
    r = zoo.check(entry, grads=False)
    assert r.status == "failed" and "silent mismatch" in r.detail, (r.status, r.detail)


def test_zoo_catches_chunks_that_are_not_applied(monkeypatch):
    """llama4_text+chunk_4's rows cross chunk boundaries (was refused as a state-space layer, then as chunks
    beyond the first)."""
    monkeypatch.setattr(checks, "layer_chunk", lambda module: None)
    r = zoo.check("llama4_text+chunk_4", grads=False)
    assert r.status == "failed" and "silent mismatch" in r.detail, (r.status, r.detail)


def test_zoo_catches_a_load_balancing_loss_that_counts_a_shared_prompt_once(monkeypatch):
    from sharedprefix.model import router

    own = router.multiplicity
    monkeypatch.setattr(router, "multiplicity", lambda layout: own(layout) * 0 + 1)
    r = zoo.check("mixtral+router_aux_loss", grads=False)
    assert r.status == "failed" and "silent mismatch of the load-balancing loss" in r.detail, (r.status, r.detail)


@pytest.mark.parametrize("entry", ["gemma2", "vaultgemma"])
def test_zoo_catches_ignored_attention_softcapping(entry, monkeypatch):
    orig = interface.cascade_attention
    monkeypatch.setattr(interface, "cascade_attention", lambda *a: orig(*a[:8], None))
    r = zoo.check(entry, grads=False)
    assert r.status == "failed" and "silent mismatch" in r.detail, (r.status, r.detail)


@pytest.mark.parametrize("entry", ["llama4_text", "llama4"])
def test_zoo_catches_a_query_temperature_of_the_row_index(entry, monkeypatch):
    """Llama 4's NoPE layers scale queries by a function of the row index; sharedprefix rescales it to positions."""
    monkeypatch.setattr(checks, "index_to_position_temperature", lambda module, q, pos: q)
    r = zoo.check(entry, grads=False)
    assert r.status == "failed" and "silent mismatch" in r.detail, (r.status, r.detail)


@pytest.mark.parametrize("entry", ["bart", "marian"])
def test_zoo_catches_a_position_module_that_is_not_renumbered(entry, monkeypatch):
    """BART-family decoders number their rows themselves (was silently wrong, then refused; now renumbered)."""
    from contextlib import contextmanager

    from sharedprefix.schedule import executor

    @contextmanager
    def unhooked(model, dec, position_ids):  # the decoder's own numbering 0..L-1 along the packed row
        yield {}

    monkeypatch.setattr(executor, "renumbered", unhooked)
    r = zoo.check(entry, grads=False)
    assert r.status == "failed" and "silent mismatch" in r.detail, (r.status, r.detail)


@pytest.mark.parametrize("entry", ["roberta", "xlm-roberta"])
def test_zoo_catches_roberta_positions_given_as_0_to_l(entry, monkeypatch):
    """RoBERTa numbers positions from padding index + 1 (was silently wrong, then refused; now reproduced)."""
    from sharedprefix.schedule import executor

    monkeypatch.setattr(executor, "decoder_position_ids", lambda model, layout: layout.position_ids)
    r = zoo.check(entry, grads=False)
    assert r.status == "failed" and "silent mismatch" in r.detail, (r.status, r.detail)


def test_zoo_catches_ignored_attention_sinks(monkeypatch):
    orig = interface.cascade_attention
    monkeypatch.setattr(interface, "cascade_attention", lambda *a: orig(*a[:7], None))
    r = zoo.check("gpt_oss", grads=False)
    assert r.status == "failed" and "silent mismatch" in r.detail, (r.status, r.detail)


def test_zoo_fails_a_refusal_that_names_no_known_feature(monkeypatch):
    monkeypatch.setattr("sharedprefix.tools.zoo.checks.REFUSALS", [])
    r = zoo.check("mamba")
    assert r.status == "failed" and "in no category" in r.detail
