"""A step's microbatches with the MoE load-balancing loss (``tests/schedule/test_step_aux.py``,
``tests/parallel/aux_step_worker.py``): a float64 Mixtral computing in float64 outside transformers' loss function
(which computes in float32 in any model), the microbatches and their loss (weights: ``support.schedule``)."""

import contextlib

import torch
import transformers.models.mixtral.modeling_mixtral as modeling_mixtral

from sharedprefix.tools.reference import Float64Inside
from sharedprefix.tools.zoo.configs import build
from support.schedule import split_groups

COEF = 3.0


class Float64OutsideTheLoss(Float64Inside):
    """``Float64Inside`` except inside the model's load-balancing loss function, which stays transformers' own."""

    paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if Float64OutsideTheLoss.paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


@contextlib.contextmanager
def mixtral_float64_outside_the_loss():
    """A float64 Mixtral with output_router_logits=True, computing in float64 outside its loss function for the
    duration."""
    own = modeling_mixtral.load_balancing_loss_func

    def loss(*args, **kw):
        Float64OutsideTheLoss.paused = True
        try:
            return own(*args, **kw)
        finally:
            Float64OutsideTheLoss.paused = False

    modeling_mixtral.load_balancing_loss_func = loss
    try:
        with Float64OutsideTheLoss():
            m, _ = build("mixtral+router_aux_loss")
            assert m.config.output_router_logits and next(m.parameters()).dtype == torch.float64
            yield m
    finally:
        modeling_mixtral.load_balancing_loss_func = own


def microbatches():
    """Group 0's six rows over all three microbatches; microbatches 0 and 2 hold rows of both prompts."""
    return split_groups(vocab=97)


def loss(W):
    return lambda b: (b.logprobs * W[b.index]).sum()
