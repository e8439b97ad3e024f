"""CPU tests of what gpu-check runs and parses, so that a GPU session's single run cannot fail on a formatting bug:
the summary line assembled from recorded benchmark output, and the long-prompt benchmark's code path on tiny shapes
(not timed: it only has to run and report in the format that gpu-check reads)."""

import importlib.util
import math
import pathlib

import pytest
import torch

from helpers import float64_faithful
from sharedprefix.cli.main import main as cli_main
from sharedprefix.tools import bench_long

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _script(path: str):
    """The module of the script at ``path`` (from the repository's root), loaded from its file."""
    spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _gpu_check():
    return _script("scripts/gpu_check.py")


BENCH = """\
model: Qwen3-4B layer shapes (hidden 2560, 32/8 heads, head_dim 128, intermediate 9728), 4 layers, vocab 151936, bf16
    P     T   G |  plain s     PG s   ours s | x plain   x PG FLOP x 0.8 FLOP | mem plain  mem PG mem ours ours/plain
 4096   512   8 |    0.289    0.121    0.120 |   2.40x  1.01x  3.34x       NO |     32822    8231     7722      0.235
 8192   512  16 |    1.190    0.279    0.270 |   4.41x  1.03x  6.02x       NO |    109175   15713    13206      0.121
 8192  1024  16 |    1.322    0.463    0.455 |   2.91x  1.02x  4.00x       NO |     65640   20793    18730      0.285\
  (plain: 8 rows)

dense dispatch at P=8192, T=512, G=16 (dense kernel: cudnn): on 0.270 s, off (SHAREDPREFIX_DENSE=0, \
every call varlen) 0.301 s
      mode |       s x one pass | peak MiB x one pass
  one pass |   0.458       1.00 |    18732      1.000
""".splitlines()

LONG = """\
long prompts: Llama layer shapes (hidden 4096, 32/8 heads, head_dim 128, intermediate 14336, vocab 128256), 2 layers
     P     T   G run               s  peak MiB  x keep
 16384  1024   8 plain         4.000     20000   2.00x
 16384  1024   8 in_pass       5.000     21000   2.50x
 16384  1024   8 keep          2.000     19000   1.00x
 16384  1024   8 offload       2.200      8000   1.10x
 16384  1024   8 recompute     2.100      8000   1.05x
 32768  1024  16 plain        20.000     40000   4.00x
 32768  1024  16 in_pass       9.000     41000   1.80x
 32768  1024  16 keep          5.000     39000   1.00x
 32768  1024  16 offload       6.000     12000   1.20x
 32768  1024  16 recompute     5.000     10000   1.00x
""".splitlines()

HYBRID = """\
model: Qwen3.5-style, hidden 4096, 8 layers (linear_attention, linear_attention, linear_attention, full_attention, \
linear_attention, linear_attention, linear_attention, full_attention), vocab 248320, bfloat16, NVIDIA H200
packed tree over plain rows 9.50x | ratio of tokens computed 12.67x | speed-up / token ratio 0.75 (target >= 0.9)
FLOP ratio plain / tree 10.10x (estimate: layers per token, attention per pair on the attention layers, LM head per \
predicted token; scans not counted) | speed-up / FLOP ratio 0.94
FLOP ratio / token ratio: 0.797 for this model (its LM head and attention do not shrink with the tokens; scans not \
counted); \
0.906 at transformers' default Qwen3.5 dimensions (Qwen3.5-style, hidden 4096, 32 layers, vocab 248320; \
no weights built)
""".splitlines()  # made-up figures in the format of tools.bench_hybrid.tree

COMPILE = """\
model: Qwen3-4B layer shapes, bf16, 4 layers, NVIDIA H200; group: prompt 4096, G=8 completions of 512; forward+backward
           run |        s | compile s |           loss
   eager plain |    0.300 |         - |   1.000000e+05
compiled plain |    0.250 |      40.0 |   1.000000e+05
    eager ours |    0.120 |         - |   1.000000e+05
 compiled ours |    0.110 |      30.0 |   1.000000e+05
speed-up: eager ours over eager plain 2.50x | compiled ours over compiled plain 2.27x | compiled / eager 0.909 (target \
>= 1)
compiling: plain 1.20x faster, ours 1.09x faster
timed rounds: graphs compiled 0, graph breaks 1 | warm-up: graphs compiled 2, graph breaks 0
""".splitlines()  # made-up figures in the format of tools.bench_compile.run

STEP = """\
sp.plan_step against the plain per-row run of the same microbatches; bench model (Qwen3, hidden 512, 4 layers, vocab \
32000), bfloat16, NVIDIA H200; torch 2.11.0+cu130; best of 2, interleaved
| groups x P / T / G / rows (microbatches) | setting | s/step | tokens / ideal | plain / it | of FLOP ratio | peak MiB |
|---|---|---|---|---|---|---|
| 8 x 1024 / 16 / 8 / 8 (8) | plain | 1.000 | 7.27 | 1.00 | 0.14 | 900 |
| 8 x 1024 / 16 / 8 / 8 (8) | per microbatch | 0.500 | 5.00 | 2.00 | 0.28 | 300 |
| 8 x 1024 / 16 / 8 / 8 (8) | step | 0.200 | 1.00 | 5.00 | 0.70 | 400 |
| 8 x 1024 / 16 / 8 / 8 (8) | whole groups | 0.160 | 1.00 | 6.25 | 0.87 | 200 |
8 x 1024 / 16 / 8 / 8: FLOP ratio plain / step 7.14; step / whole groups 1.25x
| 4 x 8192 / 512 / 16 / 4 (16) | plain | 10.000 | 10.1 | 1.00 | 0.10 | 9000 |
| 4 x 8192 / 512 / 16 / 4 (16) | per microbatch | 4.000 | 4.00 | 2.50 | 0.25 | 3000 |
| 4 x 8192 / 512 / 16 / 4 (16) | step | 1.100 | 1.00 | 9.09 | 0.91 | 4000 |
| 4 x 8192 / 512 / 16 / 4 (16) | whole groups | 1.000 | 1.00 | 10.00 | 1.00 | 2000 |
4 x 8192 / 512 / 16 / 4: FLOP ratio plain / step 10.00; step / whole groups 1.10x
""".splitlines()  # made-up figures in the format of benchmarks/step_speed.py

CAPACITY = ["capacity (longest prompt that trains; G=16, T=1024, 8 layers, doubling from 16384 up to 131072): "
            "plain 65536 | in_pass 32768 | ours 131072 (the search's limit)"]  # fmt: skip


def test_summary_line_from_recorded_output():
    line = _gpu_check().summary_line(True, BENCH, LONG, CAPACITY, HYBRID, COMPILE, STEP)
    assert line == (
        "gpu-summary gpu_tests=pass flop_eff_8192_512_16=0.733 flop_eff_min=0.719 long_vs_inpass_min=1.800 "
        "long_peak_vs_plain_max=0.400 capacity_vs_plain=2.000 offload_vs_recompute_max=1.200 "
        "hybrid_tree_vs_tokens=0.750 hybrid_tree_vs_flops=0.940 hybrid_tree_flops_vs_tokens=0.797 "
        "compile_eager_x=2.500 compile_compiled_x=2.270 compile_vs_eager=0.909 compile_timed_recompiles=1.000 "
        "step_vs_whole_max=1.250 step_flop_frac_min=0.700"
    )


def test_summary_line_says_nan_for_what_a_failed_step_did_not_report():
    line = _gpu_check().summary_line(False, BENCH[:3], LONG[:5], [], HYBRID[:2], COMPILE[:6], STEP[:6])
    figures = dict(kv.split("=") for kv in line.split()[1:])
    assert figures["gpu_tests"] == "fail" and figures["flop_eff_min"] == "0.719"
    assert figures["hybrid_tree_vs_tokens"] == "0.750" and figures["hybrid_tree_flops_vs_tokens"] == "nan"
    assert "gpu_tests=not_run " in _gpu_check().summary_line(None, BENCH, LONG, CAPACITY)
    assert figures["flop_eff_8192_512_16"] == figures["capacity_vs_plain"] == "nan"
    assert figures["long_vs_inpass_min"] == "2.500"  # the one shape with both runs
    assert figures["long_peak_vs_plain_max"] == figures["offload_vs_recompute_max"] == "nan"  # recompute never ran
    assert figures["compile_eager_x"] == figures["compile_timed_recompiles"] == "nan"  # the step stopped in its table
    assert figures["step_vs_whole_max"] == "nan" and figures["step_flop_frac_min"] == "0.700"  # whole groups never ran


def _step_speed():
    return _script("benchmarks/step_speed.py")


def test_step_benchmark_runs_on_cpu_and_gpu_check_reads_it(capsys):
    """``benchmarks/step_speed.py`` on a tiny model and shape: every setting reported in the format gpu-check parses,
    the step computing each prompt once (tokens / ideal 1.00), the calls per microbatch more."""
    _step_speed().main(["--tiny", "--shapes", "2,12,3,4,2", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    table = _gpu_check().parse_step(lines)
    assert list(table) == ["2 x 12 / 3 / 4 / 2 (4)"]
    assert list(table["2 x 12 / 3 / 4 / 2 (4)"]) == ["plain", "per microbatch", "step", "whole groups"]
    assert all(s > 0 and frac > 0 for s, frac in table["2 x 12 / 3 / 4 / 2 (4)"].values())
    ideal = {line.split(" | ")[1]: float(line.split(" | ")[3]) for line in lines if line.startswith("| 2 x 12")}
    assert ideal["step"] == ideal["whole groups"] == 1.0 and ideal["per microbatch"] > 1.0


def test_step_benchmark_settings_agree_on_the_gradient():
    """Every setting of the step table computes the same step (float64, a tiny model, groups split over four
    microbatches): the three of sharedprefix to a relative 1e-9 of each other, the plain rows to 1e-6 (their loss
    takes log_softmax of float32 logits, ``tools.bench``)."""
    mod = _step_speed()
    model = mod.bench_model(dtype=torch.float64, **mod.TINY_MODEL)
    float64_faithful(model)
    groups = mod.make_groups(2, 12, 3, 4, vocab=model.config.vocab_size)
    grads = {}
    for name, fn in mod.runs(model, groups, mod.microbatches(groups, 2)).items():
        model.zero_grad(set_to_none=True)
        fn()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
    for name, g in grads.items():
        err = ((g - grads["step"]).abs().max() / grads["step"].abs().max()).item()
        assert err <= (1e-6 if name == "plain" else 1e-9), (name, err)


def test_longest_doubles_until_it_does_not_fit():
    assert bench_long.longest(lambda P: P <= 70000, 16384, 262144) == 65536
    assert bench_long.longest(lambda P: True, 16384, 262144) == 262144
    assert bench_long.longest(lambda P: False, 16384, 262144) == 0


def test_long_benchmark_runs_on_cpu_and_gpu_check_reads_it(capsys):
    """The CLI path of ``bench --long`` on tiny shapes: a prompt longer than the budget (a chain), every run and the
    capacity line reported in the format gpu-check parses."""
    args = ["bench", "--long", "--tiny", "--device", "cpu", "--prompt", "40", "--completion", "6", "--G", "3"]
    args += [
        "--max-tokens",
        "32",
        "--repeats",
        "1",
        "--capacity-start",
        "16",
        "--capacity-limit",
        "32",
        "--capacity-layers",
        "1",
    ]
    assert cli_main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    gc = _gpu_check()
    table = gc.parse_long(lines)
    assert set(table) == {(40, 6, 3)} and set(table[40, 6, 3]) == set(bench_long.RUNS)
    assert all(t > 0 and math.isnan(peak) for t, peak in table[40, 6, 3].values())  # no peak on the CPU
    assert gc.parse_capacity(lines) == {"plain": 32, "in_pass": 32, "ours": 32}


def test_long_runs_agree_on_the_gradient():
    """Every run of the long table computes the same step (float64, tiny shapes, a prompt chained by the budget):
    in-pass sharing and our three modes to a relative 1e-9; the plain rows to 1e-6, as the benchmark's plain loss
    takes log_softmax of float32 logits (``tools.bench``, made for bf16 models)."""
    model = bench_long.long_model("cpu", torch.float64, **bench_long.TINY_MODEL)
    float64_faithful(model)  # Llama's RMSNorm computes in float32 otherwise
    groups = bench_long.bench.make_groups(1, 40, 6, 3, vocab=model.config.vocab_size)
    grads = {}
    for kind in bench_long.RUNS:
        model.zero_grad(set_to_none=True)
        bench_long.step(kind, model, groups, 32)
        grads[kind] = torch.cat([p.grad.flatten() for p in model.parameters()])
    for kind, g in grads.items():
        err = ((g - grads["keep"]).abs().max() / grads["keep"].abs().max()).item()
        assert err <= (1e-6 if kind == "plain" else 1e-9), (kind, err)


@pytest.mark.parametrize("figure", ["flop_eff_8192_512_16", "capacity_vs_plain"])
def test_summary_figures_are_named_as_the_issue_specifies(figure):
    keys = [kv.split("=")[0] for kv in _gpu_check().summary_line(True, BENCH, LONG, CAPACITY).split()[1:]]
    assert keys == [
        "gpu_tests",
        "flop_eff_8192_512_16",
        "flop_eff_min",
        "long_vs_inpass_min",
        "long_peak_vs_plain_max",
        "capacity_vs_plain",
        "offload_vs_recompute_max",
        "hybrid_tree_vs_tokens",
        "hybrid_tree_vs_flops",
        "hybrid_tree_flops_vs_tokens",
        "compile_eager_x",
        "compile_compiled_x",
        "compile_vs_eager",
        "compile_timed_recompiles",
        "step_vs_whole_max",
        "step_flop_frac_min",
    ]
    assert figure in keys
