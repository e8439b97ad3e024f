"""The oldest transformers release each model type was verified exact with, and the refusal below it.

pyproject.toml allows ``transformers>=5.4``, the floor a CI job runs (``scripts/dev test-floor``), but that job runs
the core path on a few families only; the other families were verified on newer releases, and some of them are
known to differ from the plain forward on older ones (Doge's dynamic mask, Gemma 3's image blocks on 5.4 and 5.10).
A model type is therefore taken on the installed transformers only from the release it was verified on:

- ``AT_FLOOR`` (``FLOOR``): the families of the floor job's exactness tests (``tests/attention/test_exact.py``);
- ``AT_VERL`` (``VERL``): the families verl's tests run in verl's environment (its transformers, pinned below 5.11 by
  verl: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, Qwen3-Next, LFM2), and the families exact in the zoo
  (``python -m sharedprefix.tools.zoo``, float64 log-probs and gradients against the plain rows) run on that release
  when this table was written (2026-12-03), less Doge and Gemma 3 (with images), whose own tests fail there;
- every other type: ``CI``, the release of the main test environment (``scripts/constraints.txt``).

``tests/test_versions.py`` checks that ``FLOOR`` and ``CI`` are the releases those environments install.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

FLOOR = "5.4.0"
# tests/helpers.TEST_SETTINGS, and the families of the floor job's other exactness tests (tests/attention/test_exact.py)
AT_FLOOR = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "granite", "cohere", "qwen2_moe", "exaone4"}
)
VERL = "5.10.4"
AT_VERL = frozenset(
    {
        "afmoe",
        "apertus",
        "arcee",
        "aria_text",
        "bart",
        "bert",
        "bert-generation",
        "bigbird_pegasus",
        "biogpt",
        "bitnet",
        "blenderbot",
        "blenderbot-small",
        "camembert",
        "cohere2",
        "cohere2_moe",
        "cwm",
        "data2vec-text",
        "deepseek_v2",
        "deepseek_v3",
        "dots1",
        "electra",
        "emu3",
        "ernie",
        "ernie4_5",
        "ernie4_5_moe",
        "exaone_moe",
        "flex_olmo",
        "fuyu",
        "gemma3_text",
        "gemma3n_text",
        "gemma4",
        "gemma4_text",
        "gemma4_unified",
        "gemma4_unified_text",
        "glm",
        "glm4",
        "glm4_moe",
        "glm4_moe_lite",
        "got_ocr2",
        "gpt-sw3",
        "gpt_bigcode",
        "gpt_neox",
        "gpt_oss",
        "granitemoe",
        "granitemoeshared",
        "helium",
        "hrm_text",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "hy_v3",
        "hyperclovax",
        "jais2",
        "jetmoe",
        "laguna",
        "lfm2",
        "lfm2_moe",
        "llama4",
        "llama4_text",
        "longcat_flash",
        "marian",
        "mbart",
        "mellum",
        "minimax_m2",
        "ministral",
        "ministral3",
        "mixtral",
        "mllama",
        "modernbert-decoder",
        "nanochat",
        "olmo",
        "olmo2",
        "olmo3",
        "olmoe",
        "opt",
        "pegasus",
        "persimmon",
        "phi",
        "phi4_multimodal",
        "phimoe",
        "plbart",
        "qwen2_5_vl",
        "qwen2_vl",
        "qwen3_5_text",
        "qwen3_moe",
        "qwen3_next",
        "qwen3_vl",
        "roberta",
        "roberta-prelayernorm",
        "roc_bert",
        "seed_oss",
        "smollm3",
        "solar_open",
        "stablelm",
        "starcoder2",
        "whisper",
        "xlm-roberta",
        "xlm-roberta-xl",
        "xmod",
        "youtu",
    }
)
CI = "5.25.0"


def verified_from(model_type: str | None) -> str:
    """The oldest transformers release ``model_type`` was verified exact with."""
    if model_type in AT_FLOOR:
        return FLOOR
    if model_type in AT_VERL:
        return VERL
    return CI


def check_version(model, installed: str | None = None) -> None:
    """Raise ValueError when the installed transformers (or ``installed``) is older than the release ``model``'s
    model type was verified exact with."""
    installed = installed or transformers.__version__
    model_type = getattr(model.config, "model_type", None)
    need = verified_from(model_type)
    if Version(installed).release < Version(need).release:
        raise ValueError(
            f"{type(model).__name__} (model type {model_type!r}) was verified exact with transformers {need} and "
            f"later, and transformers {installed} is installed; on older releases some families differ from the "
            f"plain forward (their modeling code changed), so sharedprefix does not run it there. Upgrade "
            f"transformers to >= {need} (pip install 'transformers>={need},<6')."
        )
