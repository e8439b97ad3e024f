"""sharedprefix's verl engine against verl 0.9.1's own FSDP2 engine, on the same tiny model and batches (CPU).

Runs in the separate verl environment (``scripts/verl-env``; ``scripts/dev test`` runs this file there);
skipped where verl is not installed. Both engines are verl's FSDP2 engine built from the same folder
(float32, SDPA, gradient checkpointing on, as verl defaults); ours overrides only its micro-batch
forward/backward. A float64 plain transformers forward of each row, with verl's own loss on it, is
the yardstick: on log-probs and gradients, our float32 error against it is at most twice verl's own
float32 error (measured: 1.01x on log-probs, 0.71x to 0.96x on gradients, relative to the largest
value), and ours and verl's agree to 1e-5 (measured: log-probs 1.8e-7, entropy 2.0e-6, gradients at
most 2.3e-6; with 2 processes 1.3e-7, 1.4e-6, 1.7e-6). Entropy: 4x (measured 2.15x, 1.6e-6 vs
7.4e-7): H = lse - sum(p * z) cancels two terms of about 40 nats here, which amplifies the rounding
of the hidden states; both stay at float32 rounding. (A deliberate bug moves these by orders of
magnitude: temperature ignored, 0.25; the entropy bonus dropped from the split path, 0.04.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

if os.environ.get("SHAREDPREFIX_REQUIRE_VERL"):  # scripts/dev test-verl: in the verl environment a missing verl fails
    import verl  # noqa: F401
else:
    pytest.importorskip("verl")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # verl_cpu, verl_support: also imported by name in the subprocesses below

import verl_cpu  # noqa: E402  (verl's CPU platform, before verl's engine modules load)
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl_support import (  # noqa: E402
    LOSSES,
    FSDPEngineWithLMHead,
    Spec,
    build,
    configs,
    infer,
    loss_fn,
    masked_rel,
    reference,
    rel,
    responses_of,
    rl_batch,
    save_model,
    train,
)

from sharedprefix.integrations.verl import ENV_MAX_TOKENS, SharedPrefixFSDPEngine  # noqa: E402

verl_cpu.allow_cpu_offload()  # verl's CPUOffloadPolicy, unpinned (pinning needs an accelerator)

pytestmark = pytest.mark.slow  # verl's engine, one and two processes (its own environment: scripts/dev test-verl)
# 3 prompts (a 4-token system prompt shared by all) x 4 completions of 1 to 8 tokens
SPEC = Spec(prompts=[14, 20, 9], responses=[[5, 8, 3, 6], [7, 2, 8, 4], [6, 6, 1, 8]])
SPEC_ROWS = (SPEC.prompts, SPEC.responses)
ROWS = 12
TEMPERATURE = 0.7
AGREE = 1e-5  # ours vs verl, relative to the largest value (float32 rounding is about 1e-6 here)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_model(str(tmp_path_factory.mktemp("verl_model")))


@pytest.fixture(scope="module")
def engines(
    process_group,
    path,
):
    return build(FSDPEngineWithLMHead, path), build(SharedPrefixFSDPEngine, path)


def _batch(dynamic, spec=SPEC, **kw):
    # dynamic: a 128-token budget holds one group (verl counts plain tokens: 57 to 101 per group here)
    return lambda: rl_batch(spec, temperature=TEMPERATURE, dynamic=dynamic, micro=4, max_tokens=128, **kw)


def _resp(td):
    return td["attention_mask"][:, -td["responses"].shape[1] :].bool()


def _check_values(theirs, ours, td, path):
    ref_lp, ref_ent, _ = reference(path, td, temperature=TEMPERATURE)
    resp = _resp(td)
    for key, ref, factor in (("log_probs", ref_lp, 2.0), ("entropy", ref_ent, 4.0)):
        a = responses_of(theirs["model_output"][key], td)
        b = responses_of(ours["model_output"][key], td)
        assert masked_rel(b, a, resp) <= AGREE, key
        assert masked_rel(b, ref, resp) <= factor * masked_rel(a, ref, resp), key


def _check_grads(g_verl, g_ours, path, td, loss):
    _, _, g_ref = reference(path, td, loss, temperature=TEMPERATURE)
    assert min(float(g.abs().max()) for g in g_ref.values()) > 0  # every parameter gets a gradient
    assert rel(g_ours, g_verl) <= AGREE
    assert rel(g_ours, g_ref) <= 2.0 * rel(g_verl, g_ref)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_infer_batch_matches_verl(engines, path, dynamic):
    ev, es = engines
    make = _batch(dynamic)
    theirs, ours = infer(ev, make()), infer(es, make())
    _check_values(theirs, ours, make(), path)
    # prompt positions: zero (verl fills them, no loss reads them); the row's last entry predicts nothing
    lp = ours["model_output"]["log_probs"]
    td = make()
    plen = td["input_ids"].offsets().diff() - _resp(td).sum(1)
    for row, p in zip(lp.unbind(), plen):
        assert bool((row[: p - 1] == 0).all()) and float(row[-1]) == 0.0
    # one call over the mini-batch (its tokens reported in the first micro-batch): every prompt once, the system
    # prompt the three share once, every response token once; vs G full rows per group in each micro-batch
    computed = ours["metrics"]["sharedprefix/tokens_computed"]
    assert sum(computed) == sum(p + sum(r) for p, r in zip(SPEC.prompts, SPEC.responses)) - 2 * SPEC.shared_system
    assert sum(ours["metrics"]["sharedprefix/tokens_plain"]) == sum(len(r) * p + sum(r) for p, r in zip(*SPEC_ROWS))


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_gradients_match_verl(engines, path, dynamic, loss):
    ev, es = engines
    make, lf = _batch(dynamic), loss_fn(loss, ROWS)
    (out_v, g_v), (out_s, g_s) = train(ev, make(), lf), train(es, make(), lf)
    _check_grads(g_v, g_s, path, make(), lf)
    assert sum(out_s["loss"]) == pytest.approx(sum(out_v["loss"]), rel=AGREE)
    m_v, m_s = out_v["metrics"], out_s["metrics"]
    assert m_v["actor/pg_clipfrac"].aggregate() > 0  # clipping is active in this batch
    if LOSSES[loss].get("use_kl_loss"):
        assert m_v["kl_loss"].aggregate() > 0
    for key, value in m_v.items():  # verl's own micro-batches: every metric of verl's loss agrees too
        a = value.aggregate() if hasattr(value, "aggregate") else value
        b = m_s[key].aggregate() if hasattr(m_s[key], "aggregate") else m_s[key]
        assert b == pytest.approx(a, rel=AGREE, abs=1e-6), key


def test_budget_that_splits_groups(process_group, path, monkeypatch):
    """SHAREDPREFIX_MAX_TOKENS below a group's tokens: the prompt runs once, its completions in several passes."""
    monkeypatch.setenv(ENV_MAX_TOKENS, "24")  # groups need 30 to 41 tokens; the longest row is 28
    es = build(SharedPrefixFSDPEngine, path)
    monkeypatch.delenv(ENV_MAX_TOKENS)
    assert es.sp_max_tokens == 24
    ev = build(FSDPEngineWithLMHead, path)
    make, lf = _batch(False), loss_fn("clip_kl_entropy", ROWS)
    _check_values(infer(ev, make()), infer(es, make()), make(), path)
    (out_v, g_v), (out_s, g_s) = train(ev, make(), lf), train(es, make(), lf)
    _check_grads(g_v, g_s, path, make(), lf)
    assert sum(out_s["loss"]) == pytest.approx(sum(out_v["loss"]), rel=AGREE)
    # each micro-batch (one group) is its prompt's pass, recorded without a graph, then its completions in one pass
    # (21 or 22 tokens), where verl's loss is evaluated, then the prompt's backward, recomputed with grad: with grad,
    # every token once; without, every prompt once (the system prompt the three share, recorded by the step)
    unique = sum(p + sum(r) for p, r in zip(*SPEC_ROWS)) - 2 * SPEC.shared_system
    metrics = out_s["metrics"]
    assert sum(metrics["sharedprefix/tokens_computed"]) == unique
    assert sum(metrics["sharedprefix/tokens_no_grad"]) == sum(SPEC.prompts) - 2 * SPEC.shared_system


def test_scattered_rows_in_one_micro_batch(engines, path):
    """Rows of a group scattered over the batch, one micro-batch: computed where verl puts them, in verl's order."""
    ev, es = engines
    order = [5, 0, 11, 2, 7, 1, 9, 4, 3, 10, 6, 8]
    spec = Spec(prompts=SPEC.prompts, responses=SPEC.responses, order=order)
    make = lambda: rl_batch(spec, temperature=TEMPERATURE, micro=ROWS)  # noqa: E731
    theirs, ours = infer(ev, make()), infer(es, make())
    _check_values(theirs, ours, make(), path)
    lf = loss_fn("clip_kl_entropy", ROWS)
    (out_v, g_v), (out_s, g_s) = train(ev, make(), lf), train(es, make(), lf)
    assert rel(g_s, g_v) <= AGREE
    assert sum(out_s["loss"]) == pytest.approx(sum(out_v["loss"]), rel=AGREE)


REFUSED_BUILDS = [
    (dict(strategy="fsdp"), {}, "FSDP1"),
    (dict(pad_to_length=True), {}, "pad_to_length"),
    (dict(mixed_precision={"param_dtype": "fp16"}), {}, "fp16"),
    ({}, dict(use_fused_kernels=True), "fused kernels"),
    ({}, dict(use_liger=True), "Liger.s Triton kernels.*GPUs only"),
    ({}, dict(vision_config=True), "vision-language"),
    ({}, dict(vision_config=True, model_type="llava"), "turns verl's multi_modal_inputs into prompt_inputs for"),
    (
        dict(ulysses_sequence_parallel_size=2),
        dict(vision_config=True, model_type="qwen2_vl"),
        "ulysses_sequence_parallel_size=2 with the vision-language",
    ),
    (
        {},
        dict(model_type_hf="zaya"),
        "hybrid model.*cache path.*FSDP2",
    ),  # a cache-path hybrid (LFM2, Falcon-H1 are packed)
    ({}, dict(enable_activation_offload=True), "activation offloader.*layer window fails"),
    ({}, dict(model_type="value_model"), "value or reward heads"),
]


@pytest.mark.parametrize("engine_kw, model_kw, match", REFUSED_BUILDS, ids=[m for *_, m in REFUSED_BUILDS])
def test_unsupported_settings_refused_at_build(path, engine_kw, model_kw, match):
    model, eng, optim, ckpt = configs(path)
    for k, v in engine_kw.items():
        object.__setattr__(eng, k, v)
    for k, v in model_kw.items():
        if k == "model_type" and "vision_config" in model_kw or k == "model_type_hf":
            object.__setattr__(model.hf_config, "model_type", v)
        else:
            object.__setattr__(model.hf_config if k == "vision_config" else model, k, v)
    with pytest.raises(ValueError, match=match):
        SharedPrefixFSDPEngine(model_config=model, engine_config=eng, optimizer_config=optim, checkpoint_config=ckpt)


def test_olmo_hybrid_refused_when_built(process_group, tmp_path):
    """OLMo-hybrid (a packed-path hybrid in the core): in verl's transformers (5.10) its gated delta-net convolves
    q, k and v with three ``nn.Conv1d`` subclasses of its own forward (activation and cache inside), and its modeling
    module has no ``causal_conv1d_fn``: no convolution seam the core's packed path can reach, so the engine refuses
    the model once verl has built it. (Its delta rule, bound on the instance, would be reached, as Qwen3-Next's and
    Qwen3.5's are: test_verl_hybrid.py.)"""
    import transformers as tf

    cfg = tf.OlmoHybridConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        architectures=["OlmoHybridForCausalLM"],
    )
    tf.OlmoHybridForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"OlmoHybridGatedDeltaNet's modeling module \S+ has no \['causal_conv1d_fn'\].*transformers 5\.10.*"
        r"refuses it when the engine is built",
    ):
        build(SharedPrefixFSDPEngine, str(tmp_path))


def test_qat_refused_and_offloaded_engines_accepted_on_accelerators(path, monkeypatch):
    import sharedprefix.integrations.verl as integration

    model, eng, optim, ckpt = configs(path)
    object.__setattr__(eng.qat, "enable", True)
    with pytest.raises(ValueError, match="quantisation-aware training"):
        integration.check_config(model, eng)
    monkeypatch.setattr(integration, "get_device_name", lambda: "cuda")  # the passes run on FSDP2's compute device
    for kw in (dict(forward_only=True), dict(offload_policy=True)):
        integration.check_config(*configs(path, **kw)[:2])


def test_reference_engine_with_cpu_offload_matches_verl(process_group, path, monkeypatch):
    """A forward-only engine (verl's reference model), which verl shards with FSDP2's CPUOffloadPolicy: its
    parameters live in host memory and FSDP2 brings them to its compute device for each forward, where
    sharedprefix's passes run (``Parallel.compute_device``)."""
    ev, es = (
        build(FSDPEngineWithLMHead, path, forward_only=True),
        build(SharedPrefixFSDPEngine, path, forward_only=True),
    )
    assert es._uses_fsdp2_cpu_offload_policy and ev._uses_fsdp2_cpu_offload_policy
    assert all(p.device.type == "cpu" for p in es.module.parameters())
    # on CPU compute and host memory are one device: the choice itself, with the compute device moved elsewhere
    from sharedprefix.parallel.detect import detect

    monkeypatch.setattr(es.module._get_fsdp_state(), "_device", torch.device("meta"))
    assert detect(es.module, es.module).compute_device(torch.device("cpu")) == torch.device("meta")
    monkeypatch.undo()
    for dynamic in (False, True):
        make = _batch(dynamic)
        _check_values(infer(ev, make()), infer(es, make()), make(), path)


def test_offload_policy_training_matches_verl(process_group, path):
    """``offload_policy=True`` on a training engine: gradients (and the loss) as verl's, under CPUOffloadPolicy."""
    ev, es = (
        build(FSDPEngineWithLMHead, path, offload_policy=True),
        build(SharedPrefixFSDPEngine, path, offload_policy=True),
    )
    assert es._uses_fsdp2_cpu_offload_policy
    make, lf = _batch(False), loss_fn("clip_kl_entropy", ROWS)
    (out_v, g_v), (out_s, g_s) = train(ev, make(), lf), train(es, make(), lf)
    _check_grads(g_v, g_s, path, make(), lf)
    assert sum(out_s["loss"]) == pytest.approx(sum(out_v["loss"]), rel=AGREE)


def test_activation_offload_refusal_reason(process_group, path, monkeypatch):
    """The refusal's reason, kept true: without it, verl's activation offloader (which verl's own engine runs
    here, see verl_cpu.allow_cpu_offload) breaks on sharedprefix's forward without a backward. If a verl release
    makes this pass, the refusal can go."""
    import sharedprefix.integrations.verl as integration

    def offloaded(cls):
        model, eng, optim, ckpt = configs(path)
        object.__setattr__(model, "enable_activation_offload", True)
        e = cls(model_config=model, engine_config=eng, optimizer_config=optim, checkpoint_config=ckpt)
        e.initialize()
        return e

    lf = loss_fn("clip_kl_entropy", ROWS)
    _, grads = train(offloaded(FSDPEngineWithLMHead), _batch(False)(), lf)  # verl's own engine runs it
    assert max(float(g.abs().max()) for g in grads.values()) > 0
    monkeypatch.setattr(integration, "check_config", lambda *a: None)
    try:
        with pytest.raises(KeyError):
            train(offloaded(SharedPrefixFSDPEngine), _batch(False)(), lf)
    finally:  # verl's offloader raised inside its saved-tensor hooks and never left them: pop what it left pushed
        while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()


def test_bad_budget_refused(path, monkeypatch):
    monkeypatch.setenv(ENV_MAX_TOKENS, "lots")
    model, eng, optim, ckpt = configs(path)
    with pytest.raises(ValueError, match="SHAREDPREFIX_MAX_TOKENS='lots'; expected a positive integer"):
        SharedPrefixFSDPEngine(model_config=model, engine_config=eng, optimizer_config=optim, checkpoint_config=ckpt)


def _per_sample_temperature(td):
    tu.assign_non_tensor(td, temperature=torch.linspace(0.5, 1.0, len(td)))


def _sft(td):
    del td["prompts"]


def _shifted_positions(td):
    pos = td["position_ids"]
    td["position_ids"] = torch.nested.nested_tensor_from_jagged(pos.values() + 1, pos.offsets())


def _routed_experts(td):
    ids = td["input_ids"]
    td["routed_experts"] = torch.nested.nested_tensor_from_jagged(torch.zeros_like(ids.values()), ids.offsets())


REFUSED_BATCHES = [
    (_per_sample_temperature, "per-sample temperatures"),
    (_shifted_positions, "position_ids are not 0, 1"),
    (_routed_experts, "routed_experts"),
    (lambda td: tu.assign_non_tensor(td, distillation_use_topk=True), "distillation_use_topk"),
    (lambda td: tu.assign_non_tensor(td, calculate_sum_pi_squared=True), "calculate_sum_pi_squared"),
    (
        lambda td: tu.assign_non_tensor_stack(td, "multi_modal_inputs", [{"pixel_values": torch.zeros(1)}] * len(td)),
        "multi_modal_inputs but the model is not a vision-language model",
    ),
    (_sft, "RL batches"),
]


@pytest.mark.parametrize("change, match", REFUSED_BATCHES, ids=[m for _, m in REFUSED_BATCHES])
def test_unsupported_batches_refused(engines, change, match):
    _, es = engines
    td = rl_batch(SPEC)
    change(td)
    with pytest.raises(ValueError, match=match):
        infer(es, td)


def test_registered_through_verl_external_modules():
    """VERL_USE_EXTERNAL_MODULES, read by every verl process at ``import verl``, swaps in the engine."""
    code = (
        "import verl\n"
        "from verl.workers.engine import EngineRegistry as R\n"
        "from sharedprefix.integrations.verl import SharedPrefixFSDPEngine as S\n"
        "assert all(R.get_engine_cls('language_model', b) is S for b in ('fsdp', 'fsdp2')), R._engines\n"
        "print('registered')\n"
    )
    env = dict(
        os.environ,
        VERL_USE_EXTERNAL_MODULES="verl_cpu,sharedprefix.integrations.verl",
        VERL_ENGINE_DEVICE="cuda",
        PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "registered" in out.stdout, out.stderr[-3000:]


def test_two_processes_torchrun(tmp_path):
    """2 gloo processes: each rank holds whole groups (verl's uid-level balancing), in micro-batches of whole groups
    and of half groups (one step per mini-batch, geo_mean's per-micro-batch means too); same gradients as verl's."""
    result = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        os.path.join(HERE, "verl_worker.py"),
        str(tmp_path),
        str(result),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-5000:]
    res = json.loads(result.read_text())
    for case, errs in res.items():
        for what, err in errs.items():
            assert err <= AGREE, (case, what, err)
    assert set(res) == {"static", "dynamic", "budget", "split", "split_geo_mean"}


@pytest.mark.parametrize("procs, sp_size", [(2, 2), (4, 4), (4, 2)], ids=["2x1dp", "4x1dp", "2x2dp"])
def test_ulysses_sequence_parallel_matches_verl(tmp_path, procs, sp_size):
    """``ulysses_sequence_parallel_size`` 2 and 4 (and 2 data-parallel groups of 2): our engine, on the core's
    ``sequence_group`` (verl's own Ulysses group), against verl's engine with Ulysses on (verl's all-to-all
    attention wrapper, on a CPU varlen kernel: ``verl_cpu.allow_ulysses``); static and dynamic micro-batches and a
    budget that splits groups. Qwen3 here has 4 query and 2 key/value heads: with 4 ranks, Hkv < S. Each mini-batch
    is one step over verl's own micro-batches (each prompt once): static ones below rollout.n (groups split) and
    dynamic ones too, with the four policy losses that read each micro-batch's rows; log-probs, entropies, gradients,
    losses and every per-micro-batch metric equal verl's."""
    result = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    worker = os.path.join(HERE, "verl_ulysses_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", worker]
    out = subprocess.run(
        cmd + [str(tmp_path), str(result), str(sp_size)], env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-5000:]
    res = json.loads(result.read_text())
    assert set(res) == {
        "static",
        "dynamic",
        "budget",
        "split",
        "split_kl_cov",
        "split_clip_cov",
        "dynamic_geo_mean",
        "dynamic_bypass",
    }
    for case, errs in res.items():
        assert errs.pop("grad_scale") > 0.1, case  # the gradients compared are not zero
        for what, err in errs.items():
            assert err <= AGREE, (case, what, err)


def test_use_torch_compile_compiles_the_head_and_matches_verl(process_group, path, monkeypatch):
    """``use_torch_compile=True`` (verl's default) compiles verl's ``entropy_from_logits``; ours, which computes
    entropies in its own head, runs that head's chunks compiled instead (``head.compiled_head``). Values and gradients
    still agree with verl's compiled engine and the float64 reference as in the tests above."""
    from sharedprefix.model import head

    flags = []
    real = head._token_logprob
    monkeypatch.setattr(head, "_token_logprob", lambda *a: flags.append(a[-1]) or real(*a))
    ev, es = (build(cls, path, use_torch_compile=True) for cls in (FSDPEngineWithLMHead, SharedPrefixFSDPEngine))
    make, lf = _batch(False), loss_fn("clip_kl_entropy", ROWS)
    _check_values(infer(ev, make()), infer(es, make()), make(), path)
    (_, g_v), (_, g_s) = train(ev, make(), lf), train(es, make(), lf)
    _check_grads(g_v, g_s, path, make(), lf)
    assert flags and all(flags), "the head did not run compiled"
    assert not head._COMPILED["on"]
