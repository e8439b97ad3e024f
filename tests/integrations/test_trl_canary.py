"""Canary: the TRL code SharedPrefixGRPOTrainer, SharedPrefixRLOOTrainer and SharedPrefixAsyncGRPOTrainer mirror
or rely on is the code they were checked against.

Each entry is the SHA-256 (first 16 hex digits) of ``inspect.getsource`` of one TRL function in the tested release
(``trl`` extra of pyproject.toml), with what to re-check when it changes. A failure is no bug by itself: re-read the
new source, re-run tests/integrations/test_trl*.py (slow ones included), then update the hash and the pin.
"""

import hashlib
import inspect

import pytest

trl = pytest.importorskip("trl")

from trl import GRPOTrainer, RLOOTrainer  # noqa: E402
from trl.experimental.async_grpo import async_grpo_trainer, packing  # noqa: E402
from trl.trainer import utils  # noqa: E402

MIRRORED = {
    GRPOTrainer._prepare_inputs: (
        "f824e7fb07147956",
        "by default SharedPrefixHooks._prepare_inputs calls this one; under sharedprefix_group_microbatches=True it "
        "copies its buffering and replaces shuffle_sequence_dict by a group-preserving shuffle drawing the same "
        "permutation, and membership_matters reads its micro-step schedule (which rows each micro-step trains)",
    ),
    GRPOTrainer._compute_loss: (
        "80295546bbdbf6f7",
        "how it calls the log-prob hook (compute_entropy, compute_aux_loss, image keys), adds "
        "router_aux_loss_coef * aux_loss and uses the entropies (bonus on/off): _get_per_token_logps_and_entropies; "
        "which terms are normalised per microbatch (bnpo, entropy bonus, top_entropy_quantile, aux loss): "
        "membership_matters",
    ),
    GRPOTrainer._get_per_token_logps_and_entropies: (
        "ea73c3909275851d",
        "the hook we override: its signature, the (logps, entropies, aux_loss) it returns, the image layouts it slices",
    ),
    GRPOTrainer.training_step: (
        "9e18632f7dd8e8d8",
        "integrations.trl_step: _prepare_inputs runs inside it before self._step += 1, so the window of micro-step "
        "self._step is planned there; SharedPrefixHooks.training_step wraps it, and integrations.trl_after runs the "
        "policy backward after it returns (it has run the loss's backward, transformers' Trainer.training_step)",
    ),
    RLOOTrainer.training_step: ("9e18632f7dd8e8d8", "the same as GRPOTrainer.training_step (integrations.trl_step)"),
    RLOOTrainer._prepare_inputs: (
        "f824e7fb07147956",
        "SharedPrefixHooks._prepare_inputs, shared with GRPO, mirrors this body too: it must stay GRPOTrainer's",
    ),
    RLOOTrainer._compute_loss: (
        "c1f9fa0cd5a6948c",
        "how RLOO calls the log-prob hook (compute_entropy=True for a metric only, so SharedPrefixRLOOTrainer detaches "
        "the entropies; compute_aux_loss, image keys) and adds router_aux_loss_coef * aux_loss (per microbatch: "
        "membership_matters)",
    ),
    RLOOTrainer._get_per_token_logps_and_entropies: (
        "ea73c3909275851d",
        "the hook we override, shared with GRPO: its signature, the (logps, entropies, aux_loss) it returns",
    ),
    utils.shuffle_sequence_dict: (
        "bab038755e57ed2b",
        "the single torch.randperm draw _group_preserving_shuffle repeats (sharedprefix_group_microbatches=True)",
    ),
    utils.split_pixel_values_by_grid: (
        "3aca66e33a7978d3",
        "the per-row image lists _group_preserving_shuffle permutes",
    ),
    utils.unsplit_pixel_values_by_grid: ("9d31b407fc5f4399", "the inverse, used after the shuffle"),
    utils.split_tensor_dict: ("b61a5760a03e95db", "the split into steps_per_generation microbatches after the shuffle"),
    async_grpo_trainer.AsyncGRPOTrainer.compute_loss: (
        "5c0c485d130acb07",
        "SharedPrefixAsyncGRPOTrainer's PackedForward: the keyword arguments compute_loss calls its model with and the "
        "output fields it reads (log_probs, entropy, aux_loss); trl_async_layout.packed_inputs builds them from a "
        "batch as it does (the step of an optimizer step is planned from them)",
    ),
    async_grpo_trainer.AsyncGRPOTrainer.training_step: (
        "6232f9f9ba0198bf",
        "SharedPrefixAsyncGRPOTrainer.training_step wraps it (one micro-step of an optimizer step's window, "
        "integrations.trl_step): it must run one compute_loss and one backward per call",
    ),
    async_grpo_trainer.AsyncGRPOTrainer.get_train_dataloader: (
        "2950938428f1c183",
        "one micro-batch per dataloader item, fresh samples each (no generation batch reused over micro-steps): "
        "why an async optimizer step's micro-steps are one window (integrations.trl_async)",
    ),
    packing.TreeRow.pack: (
        "c33de3e4ab8253f0",
        "the layout trl_async_layout.packed_tree reads (segments in DFS order, root-to-segment paths, trie-depth "
        "positions, next-token shift_labels, every sample ending on a leaf)",
    ),
    packing.TreeRow.add: ("59d788cfc6cfe1fd", "the trie keyed on (token, next token) that pack lays out"),
    async_grpo_trainer.get_peak_flops_per_device: (
        "7882526cfca95cf0",
        "it reads the CUDA device name; SharedPrefixAsyncGRPOTrainer answers None for it during __init__ without CUDA",
    ),
}


@pytest.mark.parametrize("fn", list(MIRRORED), ids=lambda f: f.__qualname__)
def test_mirrored_trl_code_is_unchanged(fn):
    want, recheck = MIRRORED[fn]
    got = hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    assert got == want, (
        f"TRL {trl.__version__} changed {fn.__module__}.{fn.__qualname__} (source hash {got}, checked: {want}). "
        f"Re-check {recheck}; then re-run tests/integrations/test_trl*.py and update this hash and the trl pin."
    )


@pytest.mark.parametrize(
    "trainer, names",
    [
        (GRPOTrainer, ("aux_loss_enabled", "router_aux_loss_coef", "_entropy_bonus_enabled", "temperature")),
        (RLOOTrainer, ("aux_loss_enabled", "router_aux_loss_coef", "temperature")),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_trainer_attributes_we_read_exist(trainer, names):
    """The trainer attributes our hooks read after TRL's __init__ (their names are not part of TRL's API)."""
    src = inspect.getsource(trainer.__init__)
    for name in names:
        assert f"self.{name} =" in src, (
            f"{trainer.__name__}.__init__ no longer sets {name}; SharedPrefixHooks reads it."
        )


def test_async_trainer_attributes_we_read_exist():
    """The AsyncGRPOTrainer attributes SharedPrefixAsyncGRPOTrainer reads after TRL's __init__, and the module-level
    name it replaces during it without CUDA."""
    src = inspect.getsource(async_grpo_trainer.AsyncGRPOTrainer.__init__)
    for name in ("self.aux_loss_enabled", "self.router_aux_loss_coef", "self.temperature"):
        assert f"{name} =" in src, (
            f"AsyncGRPOTrainer.__init__ no longer sets {name}; SharedPrefixAsyncGRPOTrainer reads it."
        )
    assert "get_peak_flops_per_device(self.accelerator" in src


def test_transformers_fetches_an_optimizer_steps_batches_before_its_micro_steps():
    """SharedPrefixAsyncGRPOTrainer plans an optimizer step's micro-steps from the batches transformers'
    ``get_batch_samples`` fetched for it, which must come before the step's first ``training_step``."""
    import transformers

    src = inspect.getsource(transformers.Trainer._run_epoch)
    fetch, step = src.find("self.get_batch_samples(epoch_iterator, num_batches"), src.find("self.training_step(")
    assert 0 <= fetch < step, (
        f"transformers {transformers.__version__}'s Trainer._run_epoch no longer fetches an optimizer step's batches "
        "with get_batch_samples before its training_step calls; re-check "
        "SharedPrefixAsyncGRPOTrainer.get_batch_samples "
        "and re-run tests/integrations/test_trl_async.py."
    )
