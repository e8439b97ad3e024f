"""DeepSeek sparse attention (indexer-selected keys): exact against one plain forward per row, in float64.

The tiny models keep ``index_topk = 4`` keys per query while most tokens see more (rows of up to 13 tokens), so the
selection changes the result (``test_the_selection_bites``); dense MLPs instead of the MoE layers, whose float32
routers would hold gradients to float32 accuracy. The mutation tests break the attention on purpose (selection
ignored, visibility ignored) and require a mismatch, so that the exactness tests can fail.
"""

import pytest
import torch
import transformers

import sharedprefix as sp
from helpers import (
    assert_grads_close,
    assert_matches_plain_rows,
    grads_of,
    plain_logprobs,
    random_groups,
    tree_mask,
)
from sharedprefix.attention import indexed, interface, switch
from sharedprefix.layout.packing import pack_row
from sharedprefix.layout.tree import SegmentTree
from sharedprefix.tools.reference import Float64Inside
from sharedprefix.tools.zoo.configs import tiny_config
from support.models import dsa_model

# three groups in one row; the first prompt sees 7 keys at its end, its completions up to 13
GROUPS = random_groups(0, 3, [7, 3, 5], [[4, 6, 2], [5], [3, 3]])


MODEL = dsa_model()


def _set_topk(model, k):
    for m in model.modules():
        if hasattr(m, "index_topk"):
            m.index_topk = k


def test_visible_mask_is_the_tree_mask():
    tree = SegmentTree(GROUPS)
    layout = pack_row(tree, list(range(len(tree.segments))), set())
    # tree_mask numbers tokens by segment id; the row lays them out level by level
    off = torch.tensor([0] + [s.length for s in tree.segments]).cumsum(0)
    order = torch.cat([torch.arange(off[s], off[s] + tree.segments[s].length) for s in layout.segments])
    want = tree_mask(tree)[order][:, order]
    assert torch.equal(indexed.visible_mask(layout, "cpu")[0, 0], want)


@pytest.mark.parametrize("sinks", [False, True])
def test_sparse_attention_against_explicit_math(sinks):
    """GQA (4 query heads over 2), value head dim unlike the query's, selected keys that are invisible (masked) and
    repeated: each query's softmax over exactly its visible selected keys (and the sink logit), values and
    gradients."""
    g = torch.Generator().manual_seed(0)
    H, Hkv, L, D, Dv, topk = 4, 2, 9, 5, 3, 4
    q, k, v = (
        torch.randn(1, h, L, d, generator=g, dtype=torch.float64, requires_grad=True)
        for h, d in ((H, D), (Hkv, D), (Hkv, Dv))
    )
    s = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True) if sinks else None
    tree = SegmentTree(random_groups(1, 2, [3, 2], [[2, 1], [1]]))
    vis = tree_mask(tree)[None, None]
    idx = torch.randint(0, L, (1, L, topk), generator=g)
    idx[0, :, 0] = torch.arange(L)  # every query keeps at least itself
    out = indexed.sparse_attention(q, k, v, vis, idx, 0.7, s)
    want = torch.zeros(1, L, H, Dv, dtype=torch.float64)
    for h in range(H):
        for i in range(L):
            keys = sorted(j for j in set(idx[0, i].tolist()) if vis[0, 0, i, j])
            logits = torch.stack([q[0, h, i] @ k[0, h // 2, j] * 0.7 for j in keys])
            if sinks:
                logits = torch.cat([logits, s[h : h + 1]])
            p = torch.softmax(logits, 0)[: len(keys)]
            want[0, i, h] = sum(p[n] * v[0, h // 2, j] for n, j in enumerate(keys))
    assert (out - want).abs().max() <= 1e-13
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    params = [q, k, v] + ([s] if sinks else [])
    got = torch.autograd.grad((out * w).sum(), params)
    ref = torch.autograd.grad((want * w).sum(), params)
    for a, b in zip(got, ref):
        assert (a - b).abs().max() <= 1e-13


def test_only_models_with_indexed_layers_get_a_mask():
    from helpers import tiny_model

    assert switch.implementation(MODEL) == indexed.NAME
    assert switch.implementation(tiny_model("llama")) == interface.NAME


def test_the_selection_bites():
    with torch.no_grad():
        sparse = plain_logprobs(MODEL, GROUPS)[0]
        _set_topk(MODEL, 1000)
        try:
            dense = plain_logprobs(MODEL, GROUPS)[0]
        finally:
            _set_topk(MODEL, 4)
    assert (sparse - dense).abs().max() > 1e-3


@pytest.mark.slow
def test_deepseek_v32_several_groups_per_row_exact():
    """Log-probs (1e-9) and gradients (relative 1e-9) of three groups in one row, with the indexer's float32 scores
    as the model computes them."""
    assert_matches_plain_rows(MODEL, GROUPS)


def _plain_rows(model, rows):
    """(N, L) log p(row[t] | row[:t]) for t >= 1 (zero at t = 0 and past the row), one plain forward per row."""
    L = max(len(r) for r in rows)
    out = []
    for r in rows:
        ids = torch.tensor(r)[None]
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1], -1)
        out.append(torch.nn.functional.pad(logp.gather(-1, ids[0, 1:, None])[:, 0], (1, L - len(r))))
    return torch.stack(out)


TRIE_ROWS = [[5, 9, 11, 3, 4, 8, 2], [5, 9, 11, 3, 7, 7, 1, 6], [5, 9, 11, 3, 7, 7, 2], [5, 9, 40, 41, 42, 43, 44, 45]]


@pytest.mark.parametrize(
    "budget", [None, pytest.param(8, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)]
)
def test_deepseek_v32_prefix_tree_exact(budget):
    """Rows sharing prefixes at several depths (segments with up to 3 ancestors): each token sees its ancestors' tokens,
    in one pass and with budgets that cache inner segments (and chunks of them) for later passes."""
    tree = sp.Tree.from_rows(TRIE_ROWS)
    segs = SegmentTree.from_trie(list(tree.rows), list(tree.trained))
    assert max(len(segs.ancestors(s.id)) for s in segs.segments) == 3
    assert_matches_plain_rows(MODEL, tree, budget=budget, plain=lambda m, _: _plain_rows(m, TRIE_ROWS))


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 12])
def test_gradient_checkpointing_exact(budget):
    """The checkpointed layers' recomputation (during backward) gets the same mask and reselects the same keys, also
    over a cached prompt's indexer keys."""
    model = dsa_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    w = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))  # 6 completions, T = 6
    want = grads_of(model, lambda: (plain_logprobs(model, GROUPS)[0] * w).sum())
    got = grads_of(
        model, lambda: sp.backward(model, GROUPS, lambda b: (b.logprobs * w[b.index]).sum(), max_tokens=budget) and None
    )
    assert_grads_close(got, want, 1e-9)


@pytest.mark.slow
def test_sinks_and_a_shared_indexer_layer_exact():
    """HY-V4: attention sinks, and a layer that reuses the previous layer's selection (indexer_types 'shared'). Its
    hyper-connections compute in float32, so both runs keep them float64 (``Float64Inside``)."""
    model = dsa_model("hy_v4")
    assert "shared" in model.config.indexer_types and isinstance(model.model.layers[0].self_attn.sinks, torch.Tensor)
    with Float64Inside():
        assert_matches_plain_rows(model, GROUPS)


@pytest.mark.parametrize("broken", ["selection ignored", "visibility ignored"])
def test_a_broken_sparse_attention_is_caught(monkeypatch, broken):
    """Attending to every visible key, or to every selected key (also the invisible ones top-k returns when a query
    sees fewer than topk keys), must not pass the exactness check."""
    real = indexed.sparse_attention

    def fake(q, k, v, visible, indices, scale, sinks=None):
        L = q.shape[2]
        if broken == "selection ignored":
            indices = torch.arange(L)[None, None].expand(1, L, L)
        else:
            visible = torch.ones_like(visible)
        return real(q, k, v, visible, indices, scale, sinks)

    ref = plain_logprobs(MODEL, GROUPS)[0].detach()
    monkeypatch.setattr(indexed, "sparse_attention", fake)
    with torch.no_grad():
        out = sp.logprobs(MODEL, GROUPS)
    assert (out.logprobs - ref).abs().max() > 1e-4


def test_visible_mask_over_cached_segments_is_the_tree_mask():
    """A pass that reads cached ancestors: its keys are the cached segments' tokens (``cached_reads`` order), then the
    row's; each query sees exactly its ancestors' keys and its own segment's up to itself."""
    t = sp.Tree.from_rows(TRIE_ROWS)
    tree = SegmentTree.from_trie(list(t.rows), list(t.trained))
    n = len(tree.segments)
    # a row of the leaves, every inner segment (up to 3 per leaf) cached
    rows = [s.id for s in tree.segments if not tree.children[s.id]]
    cached = {a for s in rows for a in tree.ancestors(s)}
    assert len(cached) >= 3 and max(len(tree.ancestors(s)) for s in rows) == 3
    layout = pack_row(tree, rows, cached)
    off = torch.tensor([0] + [s.length for s in tree.segments]).cumsum(0)
    tok = lambda segs: torch.cat([torch.arange(off[s], off[s] + tree.segments[s].length) for s in segs])  # noqa: E731
    want = tree_mask(tree)[tok(layout.segments)][:, tok(list(layout.cached_reads) + layout.segments)]
    assert torch.equal(indexed.visible_mask(layout, "cpu")[0, 0], want)
    assert n > len(rows)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["keep", "offload", "recompute"])
@pytest.mark.parametrize("entry", ["deepseek_v32", "hy_v4"])
def test_a_budget_that_splits_a_group_exact(entry, mode):
    """Prompts cached across passes: the completions' indexers score the cached prompt's indexer keys too (kept
    beside its K/V), and their selected keys index the cached K/V followed by the row's. Log-probs 1e-9 and
    gradients relative 1e-9 in every prefix_activations mode; HY-V4 with its sinks and shared-indexer layer."""
    model = dsa_model(entry)
    with Float64Inside():
        assert_matches_plain_rows(model, GROUPS, budget=12, mode=mode)


@pytest.mark.slow
def test_a_long_prompt_in_chunks_exact():
    """A prompt longer than the budget is computed in chunks, each reading the cached chunks before it: the indexer
    keys of several cached segments, in order."""
    model = dsa_model()
    groups = [sp.Group(list(range(3, 20)), [[5, 6, 7, 1], [8]]), GROUPS[1]]
    steps = sp.plan(groups, 6).steps
    assert sum(isinstance(s, sp.schedule.PrefixBackward) for s in steps) >= 3
    assert_matches_plain_rows(model, groups, budget=6, mode="keep")


@pytest.mark.parametrize(
    "broken", [pytest.param("cached indexer keys zeroed", marks=pytest.mark.slow), "cached keys invisible"]
)
def test_a_split_without_the_cached_prompt_is_caught(monkeypatch, broken):
    """Controls for the split: the completions' indexers scoring zeros instead of the cached prompt's keys, or their
    attention not seeing the cached keys, must not pass."""
    real_update, real_mask = indexed.IndexerKeys.update_indexer, indexed.visible_mask

    def zeroed(self, keys, layer_idx=None):
        out = real_update(self, keys, layer_idx)
        out = out.clone()
        out[:, : out.shape[1] - keys.shape[1]] = 0
        return out

    def invisible(layout, device):
        vis = real_mask(layout, device).clone()
        vis[..., : vis.shape[-1] - layout.length] = False
        vis[..., torch.arange(layout.length), torch.arange(layout.length) + vis.shape[-1] - layout.length] = True
        return vis

    ref = plain_logprobs(MODEL, GROUPS)[0].detach()
    if broken == "cached indexer keys zeroed":
        monkeypatch.setattr(indexed.IndexerKeys, "update_indexer", zeroed)
    else:
        monkeypatch.setattr(indexed, "visible_mask", invisible)
    with torch.no_grad():
        out = sp.logprobs(MODEL, GROUPS, max_tokens=12)
    assert (out.logprobs - ref).abs().max() > 1e-4


def test_the_indexers_are_the_models_own_again_after_a_call():
    """The hooks that hand the indexers their cached keys live only during a sharedprefix call, also one that fails."""
    ixs = indexed.indexers(MODEL)
    assert len(ixs) == MODEL.config.num_hidden_layers and all(v == ("cache", 5) for v in ixs.values())
    with torch.no_grad():
        sp.logprobs(MODEL, GROUPS, max_tokens=12)
    assert all(not ix._forward_pre_hooks for ix in ixs)
    with pytest.raises(ValueError):
        sp.logprobs(MODEL, GROUPS, max_tokens=12, temperature=-1.0)
    assert all(not ix._forward_pre_hooks for ix in ixs)


def test_a_budget_that_splits_is_refused_when_no_indexer_is_reachable(monkeypatch):
    """An indexed model whose indexers sharedprefix cannot hand cached keys to is refused before any computation under
    a split budget, and stays exact in one pass."""
    model = dsa_model()
    monkeypatch.setattr(indexed, "indexers", lambda m: {})
    match = r"selects the keys of each query with an indexer .* finds no indexer module .* max_tokens=None"
    with pytest.raises(ValueError, match=match):
        sp.backward(model, GROUPS, lambda b: b.logprobs.sum(), max_tokens=12)
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        out = sp.logprobs(model, GROUPS)
    assert (out.logprobs - plain_logprobs(model, GROUPS)[0]).abs().max() <= 1e-9


@pytest.mark.slow
def test_a_nested_call_on_the_same_model_exact():
    """A sharedprefix call inside another on the same model (a loss_fn that computes reference log-probs with the
    policy itself, e.g. PEFT with the adapter off): the outer call's indexer hooks are still installed, and the inner
    call's must take the outer's stand-in for the same pass rather than refuse it as a user's cache."""
    ref = plain_logprobs(MODEL, GROUPS)[0].detach()
    inner = []

    def loss_fn(b):
        with torch.no_grad():
            inner.append(sp.logprobs(MODEL, GROUPS, max_tokens=12).logprobs)
        return b.logprobs.sum()

    sp.backward(MODEL, GROUPS, loss_fn, max_tokens=12)
    MODEL.zero_grad(set_to_none=True)
    assert inner and all((lp - ref).abs().max() <= 1e-9 for lp in inner)
    assert all(not ix._forward_pre_hooks for ix in indexed.indexers(MODEL))


@pytest.mark.skipif(
    not hasattr(transformers, "Kolibri1_1ForCausalLM"), reason="Kolibri 1.1 is new in transformers 5.25"
)
def test_an_indexer_that_overlays_its_own_mask_is_refused():
    """Kolibri 1.1's indexer lays its selection over the visibility mask and hands attention that mask (no
    ``indices``); it counts sink and local keys along the row, which a packed row's other completions shift. With
    its budget far above these rows the 3-token probe sees a causal mask, so the refusal comes from the first pass,
    before any gradient."""
    cfg = tiny_config("kolibri1_1")
    cfg.index_topk, cfg.index_pool_size, cfg.index_num_local_tokens = 2048, 16384, 128
    torch.manual_seed(0)
    model = transformers.Kolibri1_1ForCausalLM._from_config(cfg, attn_implementation="sdpa")
    model.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    model = model.to(torch.float64).eval()
    with pytest.raises(ValueError, match=r"Kolibri1_1Attention attends with a mask .* overlays its own selection"):
        sp.logprobs(model, GROUPS)
    assert all(p.grad is None for p in model.parameters())
