"""Compiled decoder layers (``attention.compiled``): no graph break, no recompilation across layouts after a warm-up,
and results equal to the plain eager forward per row (float64: log-probs 1e-9, gradients relative 1e-9).

Each test compiles the layers of its own tiny model in place (``layer.compile()``, as torchtitan and verl compile
blocks) and counts with ``torch._dynamo.utils.counters`` from a ``torch._dynamo.reset()``; the plain reference runs on
an uncompiled copy with the same weights. CPU inductor, float64.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import sharedprefix as sp
from tests.helpers import assert_grads_close, grads_of, plain_logprobs, random_groups, tiny_model
from tests.support.schedule import microbatch_weights, split_groups

# (groups, prompt lengths, completion lengths, max_tokens): group counts, lengths and budgets that split groups
# change from step to step; no pass is one token long (a row of one token is dynamo's 0/1 specialisation)
LAYOUTS = [
    (1, [7], [[3, 4]], None),
    (2, [5, 9], [[2, 6, 3], [4]], None),
    (1, [11], [[5, 2, 7, 3]], 12),
    (3, [4, 6, 8], [[3], [2, 2], [5, 1]], None),
    (2, [10, 6], [[4, 3, 2], [6, 5]], 16),
    (2, [9, 12], [[3, 5], [2, 2, 4]], 14),
]


def _counts() -> tuple[int, int]:
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def _compiled_pair(arch="qwen3", **kw):
    torch._dynamo.reset()
    counters.clear()
    model, ref = tiny_model(arch, torch.float64, **kw), tiny_model(arch, torch.float64, **kw)
    for layer in model.model.layers:
        layer.compile()
    return model, ref


def _step(model, ref, groups, budget, kind):
    """One step of ``kind`` on the compiled ``model``, checked against one plain forward per row of ``ref``."""
    want = plain_logprobs(ref, groups)[0].detach()
    if kind == "logprobs":
        with torch.no_grad():
            got = sp.logprobs(model, groups, max_tokens=budget).logprobs
        assert (got - want).abs().max() <= 1e-9
        return
    w = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref_grads = grads_of(ref, lambda: (plain_logprobs(ref, groups)[0] * w).sum())
    if kind == "backward":
        loss = lambda b: (b.logprobs * w[b.index]).sum()  # noqa: E731
        got = grads_of(model, lambda: sp.backward(model, groups, loss, max_tokens=budget) and None)
    else:  # defer=True: values without a graph now, sp.backward under the budget when the loss backpropagates
        got = grads_of(model, lambda: (sp.logprobs(model, groups, max_tokens=budget, defer=True).logprobs * w).sum())
    got = {n.replace("_orig_mod.", ""): g for n, g in got.items()}  # modules wrapped by torch.compile
    assert_grads_close(got, ref_grads, 1e-9)


def _run(model, ref, kind, layouts):
    per_step = []
    for i, (n, p, c, budget) in enumerate(layouts):
        before = _counts()
        _step(model, ref, random_groups(i, n, p, c), budget, kind)
        per_step.append(tuple(a - b for a, b in zip(_counts(), before)))
    return per_step


def test_compiled_layers_backward_no_break_no_recompile_exact():
    """sp.backward under budgets that split groups (the prefix cache's K/V read and their gradient) on compiled
    layers: no graph break at all, no graph compiled after the second step, gradients equal to the plain run's."""
    model, ref = _compiled_pair()
    per_step = _run(model, ref, "backward", LAYOUTS[:3])  # the third splits its group: the cache's first use
    assert all(b == 0 for b, _ in per_step), per_step
    assert all(g == 0 for _, g in per_step[2:]), per_step
    assert sum(g for _, g in per_step) >= 1, "the layers did not run compiled"
    # a grad-enabled sp.logprobs returns a graph whose backward runs after the call ended (the pass kept alive by it)
    groups = random_groups(7, 2, [6, 8], [[3, 2], [4]])
    w = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out = sp.logprobs(model, groups, defer=False).logprobs
    gc.collect()
    got = grads_of(model, lambda: (out * w).sum())
    assert_grads_close(got, grads_of(ref, lambda: (plain_logprobs(ref, groups)[0] * w).sum()), 1e-9)
    assert _counts()[1] == sum(g for _, g in per_step), "grad-enabled sp.logprobs compiled again"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["logprobs", "backward", "defer"])
def test_compiled_layers_over_layouts(kind):
    model, ref = _compiled_pair()
    per_step = _run(model, ref, kind, LAYOUTS)
    assert all(b == 0 for b, _ in per_step), per_step
    assert all(g == 0 for _, g in per_step[2:]), per_step


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, kw",
    [
        ("mistral", dict(sliding_window=5)),  # a window that bites: one gathered call per row
        ("gemma", {}),  # MQA
        ("llama", dict(num_key_value_heads=1)),
    ],
)
def test_compiled_layers_features(arch, kw):
    model, ref = _compiled_pair(arch, **kw)
    per_step = _run(model, ref, "backward", LAYOUTS[:4])
    assert all(b == 0 for b, _ in per_step), per_step
    assert all(g == 0 for _, g in per_step[2:]), per_step


@pytest.mark.slow
def test_compiled_layers_with_checkpointing():
    """transformers' checkpointed layers break dynamo's checkpoint operator with a context variable of the ``kernels``
    hub (a plain compiled model too: "HOP: Unsafe side effect"); with dynamo's own switch for that side effect, the
    recomputation runs the operator again, exact, without a break."""
    model, ref = _compiled_pair()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ref.train()
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        per_step = _run(model, ref, "backward", LAYOUTS[:4])
    assert all(b == 0 for b, _ in per_step), per_step
    assert all(g == 0 for _, g in per_step[2:]), per_step
    assert sum(g for _, g in per_step) >= 1, "the layers did not run compiled"


class _Backend:
    """A ``torch.compile`` backend that counts the graphs it compiles and runs them as traced (no inductor)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _whole(how: str, backend):
    """A tiny float64 Qwen3 compiled as a whole, the way ``how`` says, and an uncompiled reference."""
    torch._dynamo.reset()
    counters.clear()
    model, ref = tiny_model("qwen3", torch.float64), tiny_model("qwen3", torch.float64)
    if how == "torch.compile(model)":  # accelerate's prepare with a dynamo backend, so TRL's torch_compile=True
        return torch.compile(model, backend=backend, dynamic=None), model, ref
    (model if how == "model.compile()" else model.model).compile(backend=backend)
    return model, model, ref


@pytest.mark.parametrize(
    "how",
    [
        "torch.compile(model)",
        pytest.param("model.compile()", marks=pytest.mark.slow),
        pytest.param("model.model.compile()", marks=pytest.mark.slow),
    ],
)
def test_whole_model_compile_runs_layers_with_the_users_options(how):
    """A model compiled as a whole never runs its own forward under sharedprefix: its decoder layers run compiled with
    the user's compile context (here the user's own backend, which counts what it compiles) for the call, and are
    restored after it; no graph break, nothing compiled after the second step, exact."""
    backend = _Backend()
    given, inner, ref = _whole(how, backend)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="sharedprefix")  # no eager fallback, no warning of ours
        per_step = _run(given, ref, "backward", LAYOUTS[:3])
        with torch.no_grad():  # the forward-only path too, on a layout seen before: nothing compiles again
            groups = random_groups(0, *LAYOUTS[0][:3])
            got = sp.logprobs(given, groups).logprobs
    assert (got - plain_logprobs(ref, groups)[0]).abs().max() <= 1e-9
    assert all(b == 0 for b, _ in per_step), per_step
    assert all(g == 0 for _, g in per_step[2:]), per_step
    assert backend.graphs >= 1, "the layers did not run through the user's backend"
    assert all(layer._compiled_call_impl is None for layer in inner.model.layers), "layers left compiled"


def test_whole_model_compile_of_unknown_form_refused():
    """A ``_compiled_call_impl`` that torch.compile did not build (its options unreadable) is refused, naming the
    fix, rather than run eager in silence; a hybrid model on the cache path compiled as a whole is refused too."""
    model = tiny_model("qwen3", torch.float64)
    model._compiled_call_impl = lambda *a, **k: model._call_impl(*a, **k)
    groups = random_groups(0, 1, [5], [[2, 3]])
    with pytest.raises(TypeError, match=r"compiled as a whole .*cannot be read.*layer.compile\(\)"):
        sp.logprobs(model, groups)
    hybrid = torch.compile(tiny_model("zaya", torch.float64))
    with pytest.raises(TypeError, match=r"cache path and was compiled as a whole.*Pass the uncompiled model"):
        sp.logprobs(hybrid, groups)


def test_compiled_layers_that_cannot_run_compiled_warn_and_run_eager():
    """A grad-enabled sp.logprobs split by a budget keeps the prompt's K/V in the completions' graph, which the
    compiled path does not build: the layers run eager (nothing compiled), exact, after one warning that says why."""
    model, ref = _compiled_pair()
    groups = random_groups(0, 1, [9], [[3, 4], [2]])
    with pytest.warns(UserWarning, match=r"compiled layers, but they run eager in this call because a grad-enabled"):
        got = sp.logprobs(model, groups, max_tokens=8, defer=False).logprobs
    assert _counts() == (0, 0)
    assert (got.detach() - plain_logprobs(ref, groups)[0]).abs().max() <= 1e-9


def test_a_steps_graph_kept_microbatches_run_compiled_exact():
    """A step's shared prompts are cached as leaves, outside the completions' graph, so a graph-kept microbatch
    (``sp.logprobs(defer=False)``, TRL's path in one process without checkpointing) that records them runs the
    compiled layers too (it ran them eager, with the budget split's warning, before): no eager warning, the first
    microbatch compiled, no graph break, gradients equal to the plain accumulation's."""
    model, ref = _compiled_pair()
    mbs = split_groups()
    ws = microbatch_weights(mbs)
    want = grads_of(ref, lambda: sum((plain_logprobs(ref, mb)[0] * w).sum() for mb, w in zip(mbs, ws)))
    first = []

    def run():
        step = sp.plan_step(model, mbs)
        for k, w in enumerate(ws):
            out = sp.logprobs(model, step.microbatch(k), defer=False)
            first.append(_counts()[1])
            (out.logprobs * w).sum().backward()
        assert step.state == "finished"

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = grads_of(model, run)
    assert not [w for w in caught if "run eager" in str(w.message)], [str(w.message) for w in caught]
    assert first[0] >= 1 and _counts()[0] == 0, (first, _counts())
    assert_grads_close(got, want, 1e-9)


@pytest.mark.slow
def test_compiled_layers_without_grad_run_compiled_silently():
    model, _ = _compiled_pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            sp.logprobs(model, random_groups(0, 1, [9], [[3, 4], [2]]), max_tokens=8)
    assert _counts()[1] >= 1


def _built(entry, n_compiled):
    from sharedprefix.model.adapter import decoder
    from sharedprefix.tools.zoo.configs import build

    torch._dynamo.reset()
    counters.clear()
    models = [build(entry)[0] for _ in range(n_compiled + 1)]
    for m in models[:n_compiled]:
        for layer in decoder(m).layers:
            layer.compile()
    return models


def _backward_grads(model, groups, w, budget):
    loss = lambda b: (b.logprobs * w[b.index]).sum()  # noqa: E731
    return grads_of(model, lambda: sp.backward(model, groups, loss, max_tokens=budget) and None)


def _plain_grads(model, groups, w):
    return grads_of(model, lambda: (plain_logprobs(model, groups)[0] * w).sum())


def _rel(got: dict, want: dict) -> float:
    floor = 1e-6 * max(float(x.abs().max()) for x in want.values())
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(floor)) for n in want)


@pytest.mark.slow
@pytest.mark.parametrize(
    "entry",
    [
        "gpt_oss",  # attention sinks, sliding-window layers, MoE
        "qwen3_moe",  # MoE
        "gemma2",  # attention-score soft-capping, sliding-window layers
    ],
)
def test_compiled_against_eager_ours(entry):
    """Compiled against eager sharedprefix on the same float64 model, over layouts with budgets that split groups: no
    graph break, no graph compiled after the second step, and log-probs (gradients) within 1e-9 (relative 1e-9) or
    twice what compiling does to the plain forward of these models, whichever is larger (their routers and
    activations keep float32 steps, which inductor rounds differently: ~5e-8 on the plain forward). The MoE blocks'
    own routing breaks their graphs (data-dependent expert loops); every break reason must be one that the plain
    compiled forward of the same model shows too."""
    model, plain_compiled, eager = _built(entry, 2)
    vocab = model.get_input_embeddings().weight.shape[0]
    per_step, ours, theirs = [], set(), set()
    for i, (n, p, c, budget) in enumerate(LAYOUTS[:4]):
        groups = random_groups(i, n, p, c, vocab=min(vocab, 97))
        before, reasons = _counts(), dict(counters["graph_break"])
        with torch.no_grad():
            got, want = (sp.logprobs(m, groups, max_tokens=budget).logprobs for m in (model, eager))
        w = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        grads = [_backward_grads(m, groups, w, budget) for m in (model, eager)]
        per_step.append(tuple(a - b for a, b in zip(_counts(), before)))
        ours |= {r for r, k in counters["graph_break"].items() if k > reasons.get(r, 0)}
        reasons = dict(counters["graph_break"])
        with torch.no_grad():
            plain = [plain_logprobs(m, groups)[0] for m in (plain_compiled, eager)]
        tol = max(1e-9, 2 * float((plain[0] - plain[1]).abs().max()))
        assert (got - want).abs().max() <= tol
        gtol = max(1e-9, 2 * _rel(*(_plain_grads(m, groups, w) for m in (plain_compiled, eager))))
        assert _rel(*grads) <= gtol
        theirs |= {r for r, k in counters["graph_break"].items() if k > reasons.get(r, 0)}
    assert ours <= theirs, sorted(r.splitlines()[0] for r in ours - theirs)
    assert all(b == 0 for b, _ in per_step) or theirs, per_step
    assert all(g == 0 for _, g in per_step[2:]), per_step
    assert sum(g for _, g in per_step) >= 1, "the layers did not run compiled"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_low_precision_within_twice_plain_error(dtype):
    """float32 and bf16 compiled layers: the error against float64 at most twice the plain same-dtype run's."""
    torch._dynamo.reset()
    model64 = tiny_model("qwen3", dtype=torch.float64)
    model, plain = tiny_model("qwen3", dtype=dtype), tiny_model("qwen3", dtype=dtype)
    for m in (model, plain):
        m.load_state_dict({k: v.to(dtype) for k, v in model64.state_dict().items()})
    for layer in model.model.layers:
        layer.compile()
    for i, (n, p, c, budget) in enumerate(LAYOUTS[:3]):
        groups = random_groups(i, n, p, c)
        with torch.no_grad():
            exact = plain_logprobs(model64, groups)[0]
            plain_err = (plain_logprobs(plain, groups)[0].double() - exact).abs().max()
            ours = sp.logprobs(model, groups, max_tokens=budget).logprobs
        our_err = (ours.double() - exact).abs().max()
        assert our_err <= 2 * plain_err + 1e-6, (float(our_err), float(plain_err))


@pytest.mark.slow
def test_layers_replaced_by_torch_compile():
    """``model.model.layers[i] = torch.compile(layer)`` (an OptimizedModule in the layer list) runs compiled too."""
    torch._dynamo.reset()
    counters.clear()
    model, ref = tiny_model("qwen3", torch.float64), tiny_model("qwen3", torch.float64)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer)
    per_step = _run(model, ref, "backward", LAYOUTS[:3])
    assert all(b == 0 for b, _ in per_step), per_step
    assert all(g == 0 for _, g in per_step[2:]), per_step
    assert sum(g for _, g in per_step) >= 1, "the layers did not run compiled"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torch.compile(peft_model)", "accelerate.compile_regions"])
def test_lora_model_compiled_whole_or_by_regions(how):
    """A LoRA model compiled as a whole, and accelerate's regional compilation (each repeated block and each leaf
    outside them compiled on its own, accelerate's ``use_regional_compilation``): gradients exact in float64 under
    budgets that split groups, no graph break, nothing compiled after the warm-up. Regional compilation's warm-up is
    one step longer: its checkpointed blocks guard on whether their input requires grad, and the first step whose
    budget splits a group runs a no-grad pass of the prompt (``TORCH_LOGS=recompiles``: "requires_grad mismatch")."""
    peft = pytest.importorskip("peft")
    accelerate_utils = pytest.importorskip("accelerate.utils")
    torch._dynamo.reset()
    counters.clear()
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    pair = []
    for _ in range(2):
        torch.manual_seed(3)  # the same LoRA weights in both
        pair.append(peft.get_peft_model(tiny_model("qwen3", torch.float64), config))
    model, ref = pair
    if how == "torch.compile(peft_model)":
        model = torch.compile(model, backend="aot_eager")
    else:
        model = accelerate_utils.compile_regions(model, backend="aot_eager")
    per_step = _run(model, ref, "backward", [LAYOUTS[i] for i in (0, 1, 2, 4, 5)])
    warm_up = 2 if how == "torch.compile(peft_model)" else 3
    assert all(b == 0 for b, _ in per_step), per_step
    assert all(g == 0 for _, g in per_step[warm_up:]), per_step
    assert sum(g for _, g in per_step) >= 1, "nothing ran compiled"


def _vl(kind):
    """(model builder, its groups, their plain forward per row, a budget that splits groups) for a tiny float64
    vision-language model (the budgets of tests/multimodal/test_vl.py)."""
    from support import vl

    if kind == "llava":
        groups = lambda: [vl.llava_group(0, [3, 1, 4]), vl.llava_group(1, [2, 5])]  # noqa: E731
        return vl.llava_model, groups, vl.plain_llava, 12
    if kind == "gemma3":  # bidirectional image blocks longer than the window
        return lambda: vl.gemma3_model(4), vl.GEMMA3_GROUPS, vl.plain_gemma3, 40
    return lambda: vl.mrope_model(kind), vl.MROPE_GROUPS, vl.plain_mrope, 16


def _vl_step(model, eager, groups, plain, budget, against_plain):
    """sp.logprobs and sp.backward on the compiled ``model`` against the same calls on ``eager`` (1e-12), and with
    ``against_plain`` against the plain rows (1e-9, as tests/multimodal/test_vl.py)."""
    w = torch.randn(plain(eager, groups).shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss(b):
        return (b.logprobs * w[b.index]).sum()

    def backward(m):
        return grads_of(m, lambda: sp.backward(m, groups, loss, max_tokens=budget) and None)

    with torch.no_grad():
        got, ours = (sp.logprobs(m, groups, max_tokens=budget).logprobs for m in (model, eager))
    got_g = {n.replace("_orig_mod.", ""): g for n, g in backward(model).items()}
    assert (got - ours).abs().max() <= 1e-12
    assert_grads_close(got_g, backward(eager), 1e-12)
    if against_plain:
        with torch.no_grad():
            assert (got - plain(eager, groups)).abs().max() <= 1e-9
        assert_grads_close(got_g, grads_of(eager, lambda: (plain(eager, groups) * w).sum()), 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl", "llava", "gemma3"])
def test_compiled_layers_with_images(kind):
    """Prompts with images through compiled language-model layers (the vision tower once per group, M-RoPE, Qwen3-VL's
    deepstack, Gemma 3's bidirectional image blocks): no graph break, nothing compiled after the second step, and
    against the same model's eager sharedprefix run within 1e-12 (log-probs; gradients relative), and the plain rows
    within the tolerance of tests/multimodal/test_vl.py, under a budget that splits groups."""
    from sharedprefix.model.adapter import decoder

    build, groups_of, plain, split = _vl(kind)
    torch._dynamo.reset()
    counters.clear()
    model, eager = build(), build()
    for layer in decoder(model).layers:
        layer.compile()
    per_step = []
    for step, budget in enumerate([None, split, None, split]):
        before = _counts()
        _vl_step(model, eager, groups_of(), plain, budget, against_plain=step < 2)
        per_step.append(tuple(a - b for a, b in zip(_counts(), before)))
    assert all(b == 0 for b, _ in per_step), per_step
    assert all(g == 0 for _, g in per_step[2:]), per_step
    assert sum(g for _, g in per_step) >= 1, "the layers did not run compiled"
