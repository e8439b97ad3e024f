"""Models with K token streams per position (MusicGen's audio codebooks): exact on groups of frames.

A group holds a (K, P) prompt and (K, T) completions; the log-prob of a completion frame is the sum over codebooks
of log p_k(code_k), codebooks whose code is the delay pattern's pad left out (``sharedprefix.model.streams``). Held to a
plain ``MusicgenForCausalLM`` forward of each (K, P + T) row of codes, written here with the per-codebook cross
entropy MusicGen's own loss uses (``ignore_index`` = pad), in float64: log-probs to 1e-9, gradients to a relative
1e-9, in one pass, under budgets that split a group (every prefix_activations mode) and a long prompt in chunks.
Controls break the renumbered positions, a codebook, and the pads' exclusion, and the checks fail. K-stream input
that sharedprefix does not take (a wrong K, 1-D groups, sp.Tree) is refused before any computation.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

import sharedprefix as sp
from helpers import assert_matches_plain_rows, grads_of, tiny_model
from sharedprefix.layout import frames
from sharedprefix.model import positions, streams
from sharedprefix.tools.reference import plain_logprobs
from sharedprefix.tools.zoo.configs import tiny_config

K = 4  # the zoo's tiny MusicGen: 4 codebooks of 97 codes (embeddings of 98)


def _model(entry="musicgen", pad_in_vocab=False, seed=0, **settings):
    """float64 tiny MusicGen; the pad / BOS code is ``vocab_size`` (MusicGen's own setup: the heads cannot predict
    it) unless ``pad_in_vocab`` (the zoo's tiny config: pad 0, a code the heads predict, so not excluding it is
    a silent difference)."""
    cfg = tiny_config(entry)
    cfg = getattr(cfg, "decoder", cfg)
    if not pad_in_vocab:
        cfg.pad_token_id = cfg.bos_token_id = cfg.vocab_size
    for k, v in settings.items():
        setattr(cfg, k, v)
    cfg._attn_implementation = "sdpa"
    cls = tf.MusicgenForCausalLM if entry == "musicgen" else tf.MusicgenMelodyForCausalLM
    torch.manual_seed(seed)
    return cls(cfg).to(torch.float64).eval()


@pytest.fixture(
    scope="module",
    params=[("musicgen", False), ("musicgen", True), ("musicgen_melody", False)],
    ids=["musicgen", "musicgen-pad-in-vocab", "musicgen_melody"],
)
def model(request):
    return _model(*request.param)


def _groups(model, prompt_len=9, seed=0):
    """A BOS frame of pads opening each prompt; completions with the delay pattern's pads at their end (stream i
    over its last i frames), at their start (stream i over its first i frames) and a frame of pads only."""
    cfg = model.config
    pad, v = cfg.pad_token_id, cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    codes = lambda n: torch.randint(3, v, (K, n), generator=g)  # noqa: E731
    prompt = codes(prompt_len)
    prompt[:, 0] = cfg.bos_token_id
    ends, starts, padded = codes(5), codes(3), codes(6)
    for i in range(1, K):
        ends[i, -i:] = pad
        starts[i, :i] = pad
    padded[:, 2] = pad
    return [sp.Group(prompt, [ends, starts, padded]), sp.Group(codes(3), [codes(4)])]


def _plain(model, groups, temperature=1.0, entropy=False):
    """(N, T) plain log-probs (or entropies): one forward of each (K, P + T) row of codes, per-codebook cross
    entropy with the pad ignored, summed over codebooks."""
    pad, rows = model.config.pad_token_id, []
    T = max(c.shape[1] for g in groups for c in g.completions)
    for g in groups:
        P = g.prompt.shape[1]
        for c in g.completions:
            logits = model(input_ids=torch.cat([g.prompt, c], 1), use_cache=False).logits  # (K, P + T, V)
            logits = logits[:, P - 1 : -1] / temperature
            if entropy:
                logp = logits.log_softmax(-1)
                val = torch.where(c.ne(pad), -(logp.exp() * logp).sum(-1), 0.0)
            else:
                val = -F.cross_entropy(logits.transpose(1, 2), c, ignore_index=pad, reduction="none")
            rows.append(F.pad(val.sum(0), (0, T - c.shape[1])))
    return torch.stack(rows)


@pytest.mark.parametrize("budget", [None, 12, 8])
def test_frames_match_plain_rows(model, budget):
    """12 splits the first group (prompt cached, completions later), 8 also puts each completion in its own pass."""
    assert_matches_plain_rows(model, _groups(model), budget, plain=_plain)


@pytest.mark.parametrize("mode", ["keep", "offload", "recompute"])
def test_every_prefix_mode_is_exact(mode):
    model = _model(seed=1)
    assert_matches_plain_rows(model, _groups(model), 12, mode, plain=_plain)


def test_a_long_prompt_in_chunks():
    model = _model(seed=2)
    groups = _groups(model, prompt_len=23)
    assert sum(bool(p.record) for p in sp.plan(groups, 8).passes) >= 3  # the prompt as a chain of chunks
    assert_matches_plain_rows(model, groups, 8, "keep", plain=_plain)


def test_entropy_and_temperature(model):
    groups = _groups(model)
    with torch.no_grad():
        out = sp.logprobs(model, groups, temperature=0.7, entropy=True, max_tokens=12)
        lp, ent = _plain(model, groups, 0.7), _plain(model, groups, 0.7, entropy=True)
    assert (out.logprobs - lp).abs().max() <= 1e-9 and (out.entropy - ent).abs().max() <= 1e-9
    assert (out.logprobs - _plain(model, groups)).abs().max() > 1e-3  # the temperature does act
    w = torch.randn(lp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want = grads_of(model, lambda: ((_plain(model, groups, 0.7) + _plain(model, groups, 0.7, True)) * w).sum())
    got = grads_of(
        model,
        lambda: (
            sp.backward(
                model,
                groups,
                lambda b: ((b.logprobs + b.entropy) * w[b.index]).sum(),
                max_tokens=12,
                temperature=0.7,
                entropy=True,
            )
            and None
        ),
    )
    for n in want:
        assert (got[n] - want[n]).abs().max() <= 1e-9 * want[n].abs().max().clamp_min(1e-12), n


def test_the_zoo_reference_reads_frames_as_this_one_does(model):
    groups = _groups(model)
    with torch.no_grad():
        assert (plain_logprobs(model, groups)[0] - _plain(model, groups)).abs().max() <= 1e-12
        assert (
            plain_logprobs(model, groups, 0.7, entropy=True)[1] - _plain(model, groups, 0.7, True)
        ).abs().max() <= 1e-12


def test_no_hook_stays_on_the_model(model):
    mods = list(model.modules())
    before = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in mods]
    with torch.no_grad():
        sp.logprobs(model, _groups(model), max_tokens=12)
    assert before == [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in mods]


# controls: each breaks one part of the mechanism, and the comparison catches it


def _mismatch(model, groups, budget=12) -> float:
    with torch.no_grad():
        return float((sp.logprobs(model, groups, max_tokens=budget).logprobs - _plain(model, groups)).abs().max())


def test_control_positions_not_renumbered(monkeypatch):
    model = _model()
    groups = _groups(model)
    assert _mismatch(model, groups) <= 1e-9  # verified with the real renumbering before it is broken
    real = positions._hooked
    monkeypatch.setattr(positions, "_hooked", lambda modules, position_ids: real(modules, None))
    assert _mismatch(model, groups) > 1e-3


def test_control_one_codebook_dropped(monkeypatch):
    model = _model()
    groups = _groups(model)
    real = frames.Frames.codes

    def without_last(self, ids):  # the last codebook's targets read as pads: left out of every frame
        out = real(self, ids).clone()
        out[..., -1] = model.config.pad_token_id
        return out

    monkeypatch.setattr(frames.Frames, "codes", without_last)
    # (the decoder's inputs lose that codebook too; the head-only break below keeps them)
    assert _mismatch(model, groups) > 1e-3


def test_control_one_codebook_dropped_in_the_head_only(monkeypatch):
    from sharedprefix.model import head

    model = _model()
    groups = _groups(model)
    real = head._logprob_chunk
    pad = model.config.pad_token_id

    def chunk(model_, hidden, targets, *args):
        if targets.dim() == 2:
            targets = targets.clone()
            targets[:, 0] = pad
        return real(model_, hidden, targets, *args)

    monkeypatch.setattr(head, "_logprob_chunk", chunk)
    assert _mismatch(model, groups) > 1e-3


def test_control_pads_not_excluded(monkeypatch):
    model = _model(pad_in_vocab=True)  # pad 0: a code the heads predict, so counting it is a silent difference
    groups = _groups(model)
    assert _mismatch(model, groups) <= 1e-9
    monkeypatch.setattr(streams, "pad_id", lambda m: None)
    assert _mismatch(model, groups) > 1e-3


# refusals: before any computation (no decoder call, no gradient)


def _refused(model, source, match):
    calls = []
    hook = model.get_decoder().register_forward_pre_hook(sp.allow_hook(lambda *a: calls.append(1)))
    try:
        with pytest.raises(ValueError, match=match):
            sp.logprobs(model, source)
        with pytest.raises(ValueError, match=match):
            sp.backward(model, source, lambda b: b.logprobs.sum(), max_tokens=12)
    finally:
        hook.remove()
    assert not calls and all(p.grad is None for p in model.parameters())


def test_wrong_number_of_streams_is_refused():
    model = _model(seed=5)
    three = sp.Group(torch.zeros(3, 4, dtype=torch.long) + 5, [torch.zeros(3, 2, dtype=torch.long) + 6])
    _refused(model, [three], r"groups\[0\] holds frames of 3 streams .* reads 4 token streams per position")


def test_one_stream_groups_are_refused_for_frames():
    model = _model(seed=5)
    _refused(model, [sp.Group([5, 6, 7], [[8, 9]])], r"groups\[0\] holds 1-D token ids .* reads 4 token streams")


def test_a_tree_is_refused():
    model = _model(seed=5)
    _refused(model, sp.Tree.from_rows([[5, 6, 7], [5, 6, 8]]), r"got an sp.Tree .* Pass groups")


def test_codes_outside_the_embeddings_or_heads_are_refused():
    model = _model(seed=5)
    v = model.config.vocab_size
    g = _groups(model)[1]
    prompt = g.prompt.clone()
    prompt[2, 1] = v + 1
    _refused(model, [sp.Group(prompt, g.completions)], rf"prompt holds code {v + 1} in stream 2 at position 1")
    low = _model(pad_in_vocab=True, seed=5)  # pad 0: the code vocab_size is an input, never a prediction
    comp = g.completions[0].clone()
    comp[1, 0] = v
    _refused(low, [sp.Group(g.prompt, [comp])], rf"completions\[0\] holds code {v} in stream 1 .* not the pad id 0")


def test_frames_for_a_one_stream_model_are_refused():
    model = tiny_model("llama")
    calls = []
    hook = model.get_decoder().register_forward_pre_hook(sp.allow_hook(lambda *a: calls.append(1)))
    frames_group = sp.Group(torch.ones(2, 3, dtype=torch.long), [torch.ones(2, 2, dtype=torch.long)])
    with pytest.raises(ValueError, match=r"holds frames of 2 token streams .* reads one token per position"):
        sp.logprobs(model, [frames_group])
    hook.remove()
    assert not calls


def test_malformed_frames_are_refused_at_the_group():
    with pytest.raises(ValueError, match=r"4 token streams of lengths \[2, 3\]"):
        sp.Group([[1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 3]], [[[1]] * 4])
    with pytest.raises(ValueError, match=r"completions\[0\] has shape \(3, 2\) and the prompt shape \(4, 3\)"):
        sp.Group(torch.ones(4, 3, dtype=torch.long), [torch.ones(3, 2, dtype=torch.long)])
    with pytest.raises(ValueError, match=r"completions\[0\] has shape \(2,\)"):
        sp.Group(torch.ones(4, 3, dtype=torch.long), [[1, 2]])


def test_sp_verify_takes_a_k_stream_model():
    """``sp.verify`` draws frames for such a model, and holds both budgets to the float64 plain run."""
    model = _model(seed=6)
    report = sp.verify(model)
    assert report.ok and report.refusal is None and len(report.checks) == 2, report


def test_training_mode_with_gradient_checkpointing():
    model = _model(seed=7, dropout=0.0)
    model.activation_checkpointing_enable()  # non-reentrant, the transformers default
    model.train()
    try:
        assert_matches_plain_rows(model, _groups(model), 12, "recompute", plain=_plain)
    finally:
        model.eval()


def test_dropout_in_training_is_refused():
    """The tiny config's dropout=0.1, applied by the decoder's own F.dropout (no nn.Dropout module to see)."""
    model = _model(seed=7)
    model.train()
    with pytest.raises(ValueError, match=r"in training mode draws random numbers"):
        sp.logprobs(model, [_groups(model)[1]])
    assert all(p.grad is None for p in model.parameters())


def test_layerdrop_in_training_is_refused():
    model = _model(seed=7, dropout=0.0)
    model.model.decoder.layerdrop = 0.5  # MusicGen skips layers by Python's random.uniform, one draw per forward
    model.train()
    _refused(model, [_groups(model)[1]], r"training mode with layerdrop=0.5")


def test_one_codebook_is_an_ordinary_token_stream():
    """num_codebooks=1: one embedding and one head in lists of one; its rows are ordinary token ids (1-D groups), exact
    in one pass and split, log-probs and gradients."""
    model = _model(num_codebooks=1)
    assert streams.num_streams(model) == 1
    groups = [sp.Group([5, 6, 7, 8, 9, 10], [[1, 2, 3], [4, 5]]), sp.Group([3, 4], [[9, 9, 9, 9]])]
    assert_matches_plain_rows(model, groups, budget=5)
