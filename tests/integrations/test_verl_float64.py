"""sharedprefix's verl engine against verl 0.9.1's own FSDP2 engine, both in float64, to 1e-9 relative (CPU).

Both engines are built with float64 parameters (verl knows no "fp64": its ``PrecisionType.to_dtype`` is taught it for
this module) and Qwen3's RMSNorm computing in its input dtype (transformers' casts to float32 even in a float64 model,
which would leave float32 rounding, differently grouped in the two engines, around 1e-7). What is left is float64
rounding: the comparisons below measured at most 7e-15 on gradients, 2e-14 on the metrics (each micro-batch's value,
in float64), and 4e-12 on the parameters after six and eight AdamW steps (whose updates divide by the gradients'
running norms). The float32 tests (1e-5) cannot see an error of 1e-8; these can. One such is verl's own: it divides
the logits by the temperature as a float32 tensor (``transformer_impl.py:1176``), so at 0.7 (0.69999999 in float32)
its float64 log-probs are 1.5e-8 from ours; the temperature here, 0.75, is exact in float32.

Covered here, each against verl on the same batch (gradients, the summed loss, every metric verl reports, and for
the last test the parameters after verl's optimizer steps): every ``loss_agg_mode`` on static micro-batches below
rollout.n (3 rows for groups of 4, rows scattered; two modes on 2 rows too) and on dynamic ones; ``kl_loss_type`` k1,
abs, k2, k3, k3+; dual clip (``clip_ratio_c``) biting; a negative entropy bonus; a token budget of the longest row
(micro-batches of one or two rows of different groups); groups of unequal sizes interleaved in the batch; rows whose
response mask is all zero (a whole micro-batch of them); responses of one token; duplicate rows; multi-turn rows (a
row's prompt holds another row's response); ``use_no_sync_for_gradient_accumulation=False``; several mini-batches,
two and three epochs, shuffled, as verl's ``train_mini_batch`` runs them; verl's LoRA (the adapters' gradients,
log-probs with the adapters on and off).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import pytest
import torch

if os.environ.get("SHAREDPREFIX_REQUIRE_VERL"):
    import verl  # noqa: F401
else:
    pytest.importorskip("verl")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import verl_cpu  # noqa: E402,F401  (verl's CPU platform, before verl's engine modules load)
import verl_support as vs  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl_support import FSDPEngineWithLMHead, Spec, build, loss_fn, rel, rl_batch, save_model, train  # noqa: E402

from sharedprefix.integrations.verl import ENV_MAX_TOKENS, SharedPrefixFSDPEngine  # noqa: E402

pytestmark = pytest.mark.slow
EXACT = 1e-9
TEMPERATURE = 0.75  # exact in float32, as verl's engine holds it
F64 = dict(model_dtype="fp64", mixed_precision={"param_dtype": "fp64", "reduce_dtype": "fp64", "buffer_dtype": "fp64"})
SPEC = Spec(prompts=[14, 20, 9], responses=[[5, 8, 3, 6], [7, 2, 3, 4], [6, 2, 1, 5]])
SCATTERED = Spec(prompts=SPEC.prompts, responses=SPEC.responses, order=[5, 0, 11, 2, 7, 1, 9, 4, 3, 10, 6, 8])
# 4 groups of 1, 6, 3 and 2 rows, interleaved; a group of one-token responses
UNEQUAL = Spec(
    prompts=[14, 20, 9, 11],
    responses=[[5], [7, 2, 3, 4, 1, 6], [6, 2, 1], [3, 3]],
    order=[3, 7, 0, 10, 1, 4, 11, 8, 2, 5, 9, 6],
)
ONE_TOKEN = Spec(prompts=[14, 20, 9], responses=[[1, 1, 1, 1], [7, 1, 3, 1], [6, 2, 1, 5]])


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_model(str(tmp_path_factory.mktemp("verl_model64")))


@pytest.fixture(scope="module")
def float64(process_group):
    """verl's dtype table with "fp64", and Qwen3's RMSNorm in its input dtype, for this module's engines."""
    import transformers.models.qwen3.modeling_qwen3 as qwen3
    from verl.utils import torch_dtypes

    to_dtype = torch_dtypes.PrecisionType.to_dtype

    def rms(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            torch_dtypes.PrecisionType,
            "to_dtype",
            staticmethod(lambda p: torch.float64 if p == "fp64" else to_dtype(p)),
        )
        mp.setattr(qwen3.Qwen3RMSNorm, "forward", rms)
        yield


def _engines(path, **engine):
    return build(FSDPEngineWithLMHead, path, **F64, **engine), build(SharedPrefixFSDPEngine, path, **F64, **engine)


@pytest.fixture(scope="module")
def engines(float64, path):
    return _engines(path)


def _value(m):
    return m.aggregate() if hasattr(m, "aggregate") else m


def _metrics_error(ours: dict, theirs: dict) -> float:
    """Largest relative difference of verl's metrics (relative to max(|verl's|, 1e-12)), in float64, on every key of
    verl's and every micro-batch's value (a ``Metric``'s values, not only their aggregate)."""
    worst = 0.0
    for key, value in theirs.items():
        assert getattr(ours[key], "aggregation", None) == getattr(value, "aggregation", None), key
        a, b = (getattr(m, "values", m) for m in (ours[key], value))
        a, b = (
            torch.tensor([float(x) for x in (v if isinstance(v, (list, tuple)) else [v])], dtype=torch.float64)
            for v in (a, b)
        )
        assert a.shape == b.shape, key
        worst = max(worst, float(((a - b).abs() / b.abs().clamp(min=1e-12)).max()))
    return worst


def test_metrics_error_sees_float64_and_each_micro_batch():
    """The metrics comparison itself (no engine): a relative difference of 1e-12, below float32's resolution, and two
    micro-batches' values swapped (the same mean) both count (before: compared as float32 aggregates, neither did)."""
    from verl.utils.metric import Metric

    def metric(*values):
        m = Metric("mean")
        m.extend(list(values))
        return {"actor/ppo_kl": m}

    assert _metrics_error(metric(1.0 + 1e-12, 2.0), metric(1.0, 2.0)) > 1e-13
    assert _metrics_error(metric(2.0, 1.0), metric(1.0, 2.0)) > 0.1
    assert _metrics_error(metric(1.0, 2.0), metric(1.0, 2.0)) == 0.0


def _zero_masks(rows):
    def change(td):
        mask = td["response_mask"].clone()
        mask[rows] = 0
        td["response_mask"] = mask
        td["loss_mask"] = mask

    return change


def _rows_batch(rows, micro):
    """A batch of explicit (prompt, response) rows, micro-batches of ``micro`` rows."""
    prompts, responses, attn = vs._left_padded(rows)
    flags = dict(remove_padding=True, dynamic=False, temperature=TEMPERATURE, entropy=True)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    mask = attn[:, prompts.shape[1] :].clone()
    return vs._tensordict(prompts, responses, attn, pos, mask, torch.Generator().manual_seed(0), micro, None, flags)


def _multi_turn_rows():
    g = torch.Generator().manual_seed(1)
    p, a, b, c = (torch.randint(1, vs.VOCAB, (n,), generator=g) for n in (10, 6, 5, 4))
    # duplicates, and rows whose prompts hold another row's response (trained there, prompt here)
    return [(p, a), (p, a), (torch.cat([p, a, c]), b), (p, b), (torch.cat([p, a]), c), (torch.cat([p, a[:3]]), a[3:])]


AGG = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KL_TYPES = ("k1", "abs", "k2", "k3+")  # k3 itself: every other case ("full": verl raises NotImplementedError)
LAYOUTS = {"static3": (SCATTERED, False, 3), "dynamic": (SCATTERED, True, 4)}  # (static 2: below)
# id: (spec, dynamic, micro rows, token budget, batch change, loss settings)
CASES = {
    **{f"{mode}-{lay}": (*LAYOUTS[lay], 128, None, dict(loss_agg_mode=mode)) for mode in AGG for lay in LAYOUTS},
    **{f"kl-{k}": (SPEC, False, 3, 128, None, dict(kl_loss_type=k, kl_loss_coef=0.5)) for k in KL_TYPES},
    "dual-clip": (SCATTERED, False, 3, 128, None, dict(clip_ratio_c=1.2)),
    "entropy-bonus-negative": (SCATTERED, True, 4, 128, None, dict(entropy_coeff=-0.3)),
    "budget-longest-row": (SCATTERED, True, 4, 27, None, dict(loss_agg_mode="seq-mean-token-mean")),
    "unequal-interleaved-static3": (UNEQUAL, False, 3, 40, None, dict(loss_agg_mode="seq-mean-token-sum")),
    "unequal-interleaved-dynamic": (UNEQUAL, True, 4, 40, None, {}),
    "zero-masks-static2": (SCATTERED, False, 2, 60, _zero_masks([0, 1]), dict(loss_agg_mode="seq-mean-token-mean")),
    "seq-mean-token-sum-norm-static2": (SPEC, False, 2, 128, None, dict(loss_agg_mode="seq-mean-token-sum-norm")),
    "zero-masks-dynamic": (SCATTERED, True, 4, 60, _zero_masks([0, 1]), dict(loss_agg_mode="seq-mean-token-sum-norm")),
    "one-token-responses": (ONE_TOKEN, False, 3, 40, None, dict(loss_agg_mode="seq-mean-token-mean")),
    "multi-turn-duplicates": (None, False, 2, None, None, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_verl_float64(engines, case):
    spec, dynamic, micro, budget, change, settings = CASES[case]
    ev, es = engines

    def make():
        if spec is None:
            return _rows_batch(_multi_turn_rows(), micro)
        td = rl_batch(spec, temperature=TEMPERATURE, dynamic=dynamic, micro=micro, max_tokens=budget)
        if change is not None:
            change(td)
        return td

    rows = len(make())
    lf = loss_fn("clip_kl_entropy", rows, **settings)
    (out_v, g_v), (out_s, g_s) = train(ev, make(), lf), train(es, make(), lf)
    assert len(out_s["loss"]) == len(out_v["loss"]) > 1  # verl's micro-batches, several
    assert max(float(g.abs().max()) for g in g_v.values()) > 0.1
    assert rel(g_s, g_v) <= EXACT
    assert sum(out_s["loss"]) == pytest.approx(sum(out_v["loss"]), rel=EXACT)
    assert _metrics_error(out_s["metrics"], out_v["metrics"]) <= EXACT
    if case == "dual-clip":
        assert _value(out_v["metrics"]["actor/pg_clipfrac_lower"]) > 0  # the dual clip bites


def test_returned_outputs_are_verls_at_the_responses_and_say_so_of_the_prompts(engines):
    """``return_model_output=True`` (verl's Tinker worker hands the training call's per-token outputs to its client):
    the log-probs and entropies at the response positions are verl's (float64, 1e-9); at the prompt positions ours
    hold 0 where verl's hold the prompt tokens' values, and the call warns so, once (a client reading prompt positions
    would otherwise get zeros silently). Without the setting the outputs are dropped, as verl drops them, and nothing
    warns."""
    from sharedprefix.integrations.verl_step import PROMPT_POSITIONS

    ev, es = engines

    def make(keep: bool):
        td = _rows_batch(_multi_turn_rows(), 2)
        if keep:
            tu.assign_non_tensor(td, return_model_output=True)
        return td

    lf = loss_fn("clip_kl_entropy", len(make(False)))
    out_v, _ = train(ev, make(True), lf)
    with pytest.warns(UserWarning, match="holds? 0 at the prompt positions") as caught:
        out_s, _ = train(es, make(True), lf)
    assert [str(w.message) for w in caught if "prompt positions" in str(w.message)] == [PROMPT_POSITIONS]
    td = make(True)
    resp = td["attention_mask"][:, -td["responses"].shape[1] :].bool()
    for key in ("log_probs", "entropy"):
        ours, theirs = out_s["model_output"][key], out_v["model_output"][key]
        assert torch.equal(ours.offsets(), theirs.offsets())  # verl's layout, every position of every row
        assert vs.masked_rel(vs.responses_of(ours, td), vs.responses_of(theirs, td), resp) <= EXACT
        prompt = torch.ones_like(ours.values(), dtype=torch.bool)
        prompt[torch.cat([torch.arange(a, b) for a, b in _response_spans(ours, td)])] = False
        assert ours.values()[prompt].abs().max() == 0 and theirs.values()[prompt].abs().max() > 0.1
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        out, _ = train(es, make(False), lf)
    assert not out["model_output"] and not [w for w in quiet if "prompt positions" in str(w.message)]


def _response_spans(nested, td):
    """(start, end) of each row's response values in ``nested.values()``: verl's rows are prompt then response, and
    position t holds the log-prob of token t + 1 (the last prompt position the first response token's)."""
    lengths = td["attention_mask"][:, -td["responses"].shape[1] :].sum(-1).tolist()
    ends = nested.offsets()[1:].tolist()
    return [(e - n - 1, e - 1) for e, n in zip(ends, lengths)]


def _update(engine, td, lf, mini: int, epochs: int):
    """verl's ``train_mini_batch`` (engine_workers.py): shuffled mini-batches of ``mini`` rows for ``epochs``
    epochs, ``train_batch`` (forward_backward_batch, then the optimizer step) on each. Returns (outputs, params)."""
    from tensordict.tensorclass import NonTensorData

    batches = tu.make_iterator(td, mini_batch_size=mini, epochs=epochs, seed=42, dataloader_kwargs={"shuffle": True})
    outputs = []
    with engine.train_mode():
        for i, mb in enumerate(batches):
            lengths = NonTensorData(mb["input_ids"].offsets().diff().tolist())
            last = i == len(td) // mini * epochs - 1
            tu.assign_non_tensor(mb, global_token_num=lengths, update_lr_scheduler=last, global_batch_size=mini)
            outputs.append(engine.train_batch(mb, lf))
    return outputs, {n: vs._full(p) for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize(
    "dynamic, micro, mini, epochs, no_sync",
    [(True, 4, 8, 3, True), (False, 2, 4, 2, False)],
    ids=["dynamic-mini8-3epochs", "static2-mini4-2epochs-sync-each"],
)
def test_ppo_epochs_shuffled_mini_batches_float64(float64, path, dynamic, micro, mini, epochs, no_sync):
    """Several mini-batches per update, several epochs, shuffled, with verl's optimizer steps between them (16 rows:
    groups of 4 interleaved): every mini-batch's loss and metrics (grad_norm included), and the parameters after the
    last step, as verl's. ``no_sync=False``: ``use_no_sync_for_gradient_accumulation=False`` (a reduction after
    every micro-batch)."""
    spec = Spec(
        prompts=[14, 20, 9, 11],
        responses=[[5, 8, 3, 6], [7, 2, 3, 4], [6, 2, 1, 5], [2, 7, 1, 4]],
        order=[5, 0, 11, 2, 7, 1, 9, 4, 3, 10, 6, 8, 13, 15, 12, 14],
    )
    ev, es = _engines(path, use_no_sync_for_gradient_accumulation=no_sync)
    start = {n: vs._full(p) for n, p in ev.module.named_parameters()}
    lf = loss_fn("clip_kl_entropy", mini, loss_agg_mode="seq-mean-token-mean")
    make = lambda: rl_batch(spec, temperature=TEMPERATURE, dynamic=dynamic, micro=micro, max_tokens=40)  # noqa: E731
    (out_v, p_v), (out_s, p_s) = _update(ev, make(), lf, mini, epochs), _update(es, make(), lf, mini, epochs)
    assert len(out_v) == len(out_s) == 16 // mini * epochs
    for a, b in zip(out_v, out_s):
        assert sum(b["loss"]) == pytest.approx(sum(a["loss"]), rel=EXACT)
        assert _metrics_error(b["metrics"], a["metrics"]) <= EXACT
    step_v = {n: p_v[n] - start[n] for n in start}
    assert min(float(s.abs().max()) for s in step_v.values()) > 1e-4  # every parameter moved
    assert rel({n: p_s[n] - start[n] for n in start}, step_v) <= EXACT


def _lora_engine(cls, path, monkeypatch, budget=None):
    """An engine of ``cls`` with verl's LoRA (``lora_rank=4``, ``target_modules="all-linear"``: verl's worker wraps
    the model in peft's adapters, only they train); ``budget``: ``SHAREDPREFIX_MAX_TOKENS`` while it is built."""
    from verl.workers.config import HFModelConfig

    _, eng, optim, ckpt = vs.configs(path, **F64)
    model = HFModelConfig(
        path=path,
        load_tokenizer=False,
        override_config={"attn_implementation": "sdpa"},
        use_remove_padding=True,
        enable_gradient_checkpointing=True,
        lora_rank=4,
        lora_alpha=8,
        target_modules="all-linear",
    )
    if budget is not None:
        monkeypatch.setenv(ENV_MAX_TOKENS, str(budget))
    engine = cls(model_config=model, engine_config=eng, optimizer_config=optim, checkpoint_config=ckpt)
    engine.initialize()
    monkeypatch.delenv(ENV_MAX_TOKENS, raising=False)
    return engine


def _set_full(p, value):
    """Copy the full tensor ``value`` into the (FSDP2-sharded) parameter ``p``."""
    from torch.distributed.tensor import distribute_tensor

    p.copy_(distribute_tensor(value, p.device_mesh, p.placements) if hasattr(p, "device_mesh") else value)


def test_lora_matches_verl_float64(float64, path, monkeypatch):
    """verl's LoRA (``lora_rank``, all-linear adapters), the same adapter weights in every engine (``lora_B`` nonzero,
    so that the adapters change the log-probs): a training call on verl's micro-batches of 2 rows (multi-turn rows,
    their shared prefixes split across them), one pass and under ``SHAREDPREFIX_MAX_TOKENS=8`` (several passes per
    micro-batch): only the adapters get gradients, as in verl, and theirs are verl's (float64, 1e-9; measured 1.2e-14);
    a forward-only call's log-probs at the responses, and with the adapters disabled (verl's reference log-probs under
    LoRA, ``no_lora_adapter``), are verl's (measured 8e-16 and 3e-16)."""
    ev = _lora_engine(FSDPEngineWithLMHead, path, monkeypatch)
    ours = [_lora_engine(SharedPrefixFSDPEngine, path, monkeypatch, budget) for budget in (None, 8)]
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in ev.module.named_parameters():
            if "lora_B" in n:  # peft starts it at zero
                full = vs._full(p)
                _set_full(p, 0.3 * torch.randn(full.shape, generator=g, dtype=full.dtype))
        theirs = dict(ev.module.named_parameters())
        for es in ours:  # lora_A is drawn from the global generator when an engine is built: verl's in every engine
            for n, p in es.module.named_parameters():
                p.copy_(theirs[n])
    adapters = {n for n, p in ev.module.named_parameters() if "lora_" in n}
    assert len(adapters) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 decoder layers (lm_head: none)

    make = lambda: _rows_batch(_multi_turn_rows(), 2)  # noqa: E731
    td = make()
    resp = td["attention_mask"][:, -td["responses"].shape[1] :].bool()
    lf = loss_fn("clip_kl_entropy", len(td))
    out_v, g_v = train(ev, make(), lf, frozen_ok=True)
    assert set(g_v) == adapters and max(float(g.abs().max()) for g in g_v.values()) > 1e-2

    def log_probs(engine, base: bool):
        with engine.eval_mode(), engine.disable_adapter() if base else contextlib.nullcontext():
            return vs.responses_of(engine.infer_batch(make())["model_output"]["log_probs"], td)

    lp_v, base_v = log_probs(ev, False), log_probs(ev, True)
    assert vs.masked_rel(base_v, lp_v, resp) > 1e-2  # the adapters matter
    no_grad = []
    for es in ours:
        out_s, g_s = train(es, make(), lf, frozen_ok=True)
        assert len(out_s["loss"]) == len(out_v["loss"]) == 3
        no_grad.append(sum(out_s["metrics"]["sharedprefix/tokens_no_grad"]))
        assert set(g_s) == adapters
        assert rel(g_s, g_v) <= EXACT
        assert _metrics_error(out_s["metrics"], out_v["metrics"]) <= EXACT
        assert vs.masked_rel(log_probs(es, False), lp_v, resp) <= EXACT
        assert vs.masked_rel(log_probs(es, True), base_v, resp) <= EXACT
    assert no_grad[1] > no_grad[0]  # under the budget, the values computed first (without a graph)
