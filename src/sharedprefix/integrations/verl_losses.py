"""Which of verl's losses depend on the rows that share a micro-batch: pure functions, no verl import.

sharedprefix's verl engine computes verl's own micro-batches (one ``sp.plan_step`` step per mini-batch,
``verl_step``), where every loss reads the rows verl's does; this module serves its two paths that keep a call per
micro-batch, Ulysses and vision-language rows. There the engine regroups each rank's rows by prompt and, with dynamic
batch sizes, sets verl's ``force_group_size`` so that every group lands in one micro-batch; its micro-batches
therefore hold other rows than the ones verl's engine forms on its own. That changes nothing for a loss that is a sum
over rows with global normalisers. verl 0.9.1's ``ppo_loss`` (``verl/workers/utils/losses.py:57``) is one: its
policy, entropy and KL terms go through ``agg_loss`` (``verl/trainer/ppo/core_algos.py:1140``) with the mini-batch's
``batch_num_tokens`` (token-mean), ``global_batch_size`` (the seq-mean modes), ``dp_size`` and, for
seq-mean-token-sum-norm without ``loss_scale_factor``, the padded width of ``response_mask`` (the mini-batch's longest
response: verl keeps that mask padded, ``verl/workers/utils/padding.py:23``, and the engine's row selection keeps its
width).

Four policy losses of verl 0.9.1 are not sums over rows (``core_algos.py``):

- ``geo_mean`` (GMPO): ``pg_loss = torch.mean(pg_losses)`` over the micro-batch's rows (line 2000), with no global
  normaliser: a row weighs 1 / (rows of its micro-batch).
- ``clip_cov``: the covariance is centred on the micro-batch's means of advantages and log-probs (line 1812), the
  number of clipped tokens is a fraction of the micro-batch's tokens (line 1818), and the clipped tokens are drawn
  with ``torch.randperm`` over the micro-batch's candidates (line 1823).
- ``kl_cov``: the KL penalty goes to the top ``kl_cov_ratio`` tokens of the micro-batch by covariance, centred on the
  micro-batch's means (lines 1905-1907).
- ``bypass_mode`` with ``rollout_correction.loss_type='reinforce'``, ``rollout_is`` set and
  ``rollout_is_batch_normalize=True``: the importance weights are divided by their mean over the micro-batch
  (``verl/trainer/ppo/rollout_corr_helper.py:628``). (With ``loss_type='ppo_clip'`` the weights are computed for
  metrics only.)

For these the engine's regrouping paths compare their micro-batches with verl's own and raise where they differ
(``verl.py``), as far
as the loss can tell them apart (``signature``): geo_mean only by the size of each row's micro-batch (a sum of means
of equally large micro-batches weighs every row alike, so static micro-batches of whole groups give verl's gradient),
kl_cov and the normalised importance weights by which rows share one, clip_cov by the rows and their order (its
random draw runs over the candidates in row order).

Notation: B = rows of the batch; a micro-batching is a list of row-index lists, in the order they run.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

__all__ = ["Dependence", "micro_batch_dependent", "signature"]


class Dependence(NamedTuple):
    """A loss setting whose value depends on the micro-batches: ``setting`` says which and why; ``on`` is what of
    the micro-batching it reads: ``"sizes"`` (each row's micro-batch size), ``"members"`` (which rows share one) or
    ``"order"`` (the rows of each, in order, and the order of the micro-batches)."""

    setting: str
    on: str


_POLICY_LOSSES = {
    "geo_mean": (
        "averages its policy loss over the rows of each micro-batch (torch.mean, no global normaliser)",
        "sizes",
    ),
    "clip_cov": (
        "centres its covariance on each micro-batch's means and clips a fraction of each micro-batch's tokens, drawn "
        "at random among them",
        "order",
    ),
    "kl_cov": (
        "penalises the top kl_cov_ratio tokens of each micro-batch by a covariance centred on its means",
        "members",
    ),
}


def signature(micro_batches: list[list[int]], on: str):
    """What a loss of ``Dependence.on`` reads of a micro-batching (equal signatures: equal losses and gradients).

    >>> signature([[2, 0], [1, 3]], "sizes") == signature([[0, 1], [2, 3]], "sizes")
    True
    >>> signature([[2, 0], [1, 3]], "members") == signature([[0, 2], [3, 1]], "members")
    True
    >>> signature([[2, 0], [1, 3]], "order") == signature([[0, 2], [3, 1]], "order")
    False
    """
    if on == "sizes":
        return sorted((row, len(mb)) for mb in micro_batches for row in mb)
    if on == "members":
        return sorted(sorted(mb) for mb in micro_batches)
    return [list(mb) for mb in micro_batches]


def _get(config, name, default=None):
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def micro_batch_dependent(loss_function) -> Dependence | None:
    """The setting of verl's loss whose value depends on which rows share a micro-batch, with the reason; None when
    the loss is additive over rows with global normalisers, or is not verl's ``ppo_loss`` bound to its actor config
    (``functools.partial(ppo_loss, config=...)``, as verl's worker binds it: anything else cannot be read).

    >>> micro_batch_dependent(functools.partial(print, config={"policy_loss": {"loss_mode": "geo_mean"}})).on
    'sizes'
    >>> micro_batch_dependent(functools.partial(print, config={"policy_loss": {"loss_mode": "vanilla"}})) is None
    True
    """
    if not isinstance(loss_function, functools.partial):
        return None
    config = loss_function.keywords.get("config")
    policy = _get(config, "policy_loss")
    mode = _get(policy, "loss_mode", "vanilla")
    if mode in _POLICY_LOSSES:
        why, on = _POLICY_LOSSES[mode]
        return Dependence(f"policy_loss.loss_mode={mode!r} {why}", on)
    if mode == "bypass_mode":
        corr = _get(policy, "rollout_correction")
        if (
            _get(corr, "loss_type", "ppo_clip") == "reinforce"
            and _get(corr, "rollout_is") is not None
            and _get(corr, "rollout_is_batch_normalize", False)
        ):
            return Dependence(
                "policy_loss.loss_mode='bypass_mode' with rollout_correction.loss_type='reinforce' and "
                "rollout_is_batch_normalize=True divides its importance weights by their mean over each micro-batch",
                "members",
            )
    return None
