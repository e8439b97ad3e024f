"""Data-parallel settings users bring, each exact against the plain run or refused at the first call (2 CPU
processes, gloo; ``layouts_worker.py``, one launch per engine).

Every cell runs sp.backward under a budget that splits a group (DDP: ``keep`` and ``recompute``; FSDP2: its default
and ``recompute``), and under DDP a grad-enabled sp.logprobs (deferred) then the caller's backward; each is compared
in float64 to 1e-9 with one process's plain gradient of every row, and so is the plain per-row run through the same
wrapper and settings (so the two agree with each other too).
DDP: ``static_graph=True`` (refused: sharedprefix's backwards corrupt the reducer's first-iteration count, and a
later plain DDP backward reduced wrong gradients, 1.55 relative error), ``broadcast_buffers=False``, torch's
non-reentrant checkpoint wrappers on every layer (accelerate's ``activation_checkpointing``), and an auxiliary loss
through the DDP module mixed with an sp.backward call before one step, in each order, inside and outside
``no_sync()`` (and refused where the auxiliary forward's backward is still to come when the call runs, or is the
backward of a deferred sp.logprobs' loss). FSDP2: the checkpoint wrappers applied before and after ``fully_shard``,
``set_reduce_scatter_divide_factor`` 1, 2 and 4 (and refused when the modules disagree), ``reshard_after_forward``
as an int, ``set_requires_gradient_sync(False)`` for the first of two calls, and ``set_reshard_after_backward(False)``
(two calls, a step); HSDP (a 2-D replicate x shard mesh) on 4 ranks.
"""

import os

import pytest
import torch
from parallel.layouts_worker import aux_loss
from parallel.worker import groups_and_weights, present

from helpers import assert_grads_close, grads_of, plain_logprobs, tiny_model
from support.torchrun import torchrun

pytestmark = pytest.mark.slow  # torchrun, 2 processes

WORKER = os.path.join(os.path.dirname(__file__), "layouts_worker.py")


def launch(kind, tmp_path_factory):
    out = tmp_path_factory.mktemp(kind) / f"{kind}.pt"
    torchrun(WORKER, [kind, str(out)], timeout=300)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return launch("ddp", tmp_path_factory)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return launch("fsdp", tmp_path_factory)


@pytest.fixture(scope="module")
def want():
    """One process's plain float64 gradient of every row; with the auxiliary loss averaged over the 2 ranks; and of
    that auxiliary loss alone."""
    groups, W = groups_and_weights()
    model = tiny_model("qwen3")
    rows = lambda: (plain_logprobs(model, groups)[0] * W).sum()  # noqa: E731
    aux = lambda: 0.5 * (aux_loss(model, 0) + aux_loss(model, 1))  # noqa: E731
    return grads_of(model, rows), grads_of(model, lambda: rows() + aux()), grads_of(model, aux)


def exact(got, want):
    assert not isinstance(got, str), got  # a cell that raised holds its message
    assert_grads_close(present(got), want, 1e-9)


@pytest.mark.parametrize("layout", ["no_broadcast_buffers", "checkpoint_wrapped"])
@pytest.mark.parametrize("call", ["keep", "recompute", "logprobs", "plain"])
def test_ddp_layouts_are_exact(ddp, want, layout, call):
    exact(ddp[f"{layout}/{call}"], want[0])


def test_ddp_static_graph_is_refused_at_the_first_call(ddp, want):
    for call in ("keep", "recompute", "logprobs"):
        assert ddp[f"static_graph/{call}"].startswith("ValueError"), call
        assert "static_graph=True" in ddp[f"static_graph/{call}"]
    exact(ddp["static_graph/plain"], want[0])  # and DDP's own run after the refusals is untouched


@pytest.mark.parametrize("order", ["aux_first", "sp_first", "aux_no_sync_first", "sp_no_sync_first"])
def test_ddp_an_auxiliary_loss_through_ddp_and_a_call_in_one_step(ddp, want, order):
    """aux_no_sync_first: DDP's unsynchronised gradient was kept as synchronised (0.26 relative error before);
    sp_no_sync_first: DDP's backward averaged the call's summed contribution (0.53 before)."""
    exact(ddp[f"mixed/{order}"], want[1])
    exact(ddp[f"mixed/{order}/plain"], want[1])


@pytest.mark.parametrize("order", ["aux_forward_before_sp", "aux_with_deferred_logprobs"])
def test_ddp_a_forward_through_ddp_pending_across_a_call_is_refused(ddp, want, order):
    """``aux = ddp(...)`` whose backward runs after the call's (``aux_forward_before_sp``) or is the backward of a
    deferred sp.logprobs' loss (``aux_with_deferred_logprobs``): DDP's reducer, armed by that forward, fired in the
    call's backward and the auxiliary term reached ``.grad`` unaveraged (before: 0.26 and 0.12 relative error of the
    whole gradient, silently). Refused on every rank; the plain run of the same step stays exact (the control for the
    orders that are not refused is ``test_ddp_an_auxiliary_loss_through_ddp_and_a_call_in_one_step``)."""
    assert ddp[f"mixed/{order}"].startswith("ValueError: DistributedDataParallel's reducer fired during"), ddp[
        f"mixed/{order}"
    ]
    assert "aux.backward(); sp.backward(...)" in ddp[f"mixed/{order}"]
    exact(ddp[f"mixed/{order}/plain"], want[1])


def test_ddp_the_refusal_leaves_grad_as_it_was(ddp, want):
    """An averaged auxiliary backward, then a pending auxiliary forward across a refused call: ``.grad`` holds the
    first auxiliary term alone (without the refusal: that term plus the call's, 0.99 away)."""
    exact(ddp["mixed/refused_keeps_grad"], want[2])


@pytest.mark.parametrize("layout", ["ac_before_shard", "ac_after_shard"])
@pytest.mark.parametrize("call", ["None", "recompute", "plain"])
def test_fsdp_checkpoint_wrappers_before_and_after_sharding(fsdp, want, layout, call):
    exact(fsdp[f"{layout}/{call}"], want[0])
    assert "not supported on an FSDP2 model" in fsdp[f"{layout}/logprobs"]


@pytest.mark.parametrize("factor", ["1", "2", "4"])
def test_fsdp_divide_factor_keeps_the_sum(fsdp, want, factor):
    """The call's gradient is the sum whatever FSDP2 divides by (before: scaled by 2 / factor); the plain run is the
    rows' loss times the factor."""
    exact(fsdp[f"divide_factor={factor}/None"], want[0])
    exact(fsdp[f"divide_factor={factor}/plain"], want[0])


def test_fsdp_divide_factors_that_disagree_are_refused(fsdp):
    assert fsdp["divide_factor_mixed"].startswith("ValueError: the FSDP2 modules divide their gradients by different")


@pytest.mark.parametrize(
    "cell", ["reshard_int=1/None", "reshard_int=1/plain", "reshard_int=2/None", "no_sync/two_calls", "no_sync/plain"]
)
def test_fsdp_reshard_int_and_no_sync(fsdp, want, cell):
    exact(fsdp[cell], want[0])


@pytest.mark.parametrize("cell", ["two_calls", "plain_then_call", "step", "plain"])
def test_fsdp_units_not_resharded_after_backward(fsdp, want, cell):
    """``set_reshard_after_backward(False)`` on every module: after a call's last backward the unsharded parameters
    stay registered and the reduced gradient sits on the sharded ones, so the call's gradient transaction dropped the
    gradient held before it (before: relative error 1.08 after two reducing calls or a reducing plain backward then a
    call, 1.21 after a step of two microbatches whose first reduces)."""
    exact(fsdp[f"no_reshard_after_backward/{cell}"], want[0])


def test_hsdp_on_four_ranks(tmp_path, want):
    """FSDP2 on a 2-D (replicate, shard) mesh, 4 ranks (one with no group, which joins with a zero loss): exact (it was
    refused as "sharded along a second mesh dimension by something other than transformers' tensor parallelism")."""
    out = tmp_path / "hsdp.pt"
    torchrun(WORKER, ["hsdp", str(out)], nproc=4, timeout=300)
    got = torch.load(out, weights_only=False)
    for call in ("None", "recompute", "plain"):
        exact(got[f"hsdp/{call}"], want[0])
    assert "not supported on an FSDP2 model" in got["hsdp/logprobs"]
