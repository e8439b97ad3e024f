"""The aten ops one ``sp.backward`` step dispatches stay within a bound of the plain per-row step's (issue 41's target:
1.5x), at 4 and 16 layers of the tests' tiny Qwen3 (``tools.opcount``). On a GPU every op is a launch, and a small
model's step is all launches: this keeps the per-layer and per-call overhead of the cascade from growing back.

Measured (Dec 2026, torch 2.13 CPU, transformers 5.x, float64, one group of a 48-token prompt and 8 completions),
ours / plain ops at 4 and 16 layers:

- "ragged" (completions of 6-14 tokens): before issue 41, 2504 / 1420 (1.76x) and 8648 / 4768 (1.81x); after the
  per-layer cuts, 1877 / 1420 (1.32x) and 6245 / 4768 (1.31x); after the host-built packing indices (one op per
  index tensor, one vocabulary check per call), 1587 / 1420 (1.12x) and 5955 / 4768 (1.25x).
- "equal" (8 x 8 tokens, nothing padded in the plain step): after the per-layer cuts, 1830 / 1185 (1.54x) and
  6066 / 4317 (1.41x); after the host-built indices, 1540 / 1185 (1.30x) and 5776 / 4317 (1.34x).

Per call ours is now about 130 ops against plain's 141-304; what is left is per layer (353-364 against 261-279)."""

import pytest
import torch

from sharedprefix.tools import opcount

# what the code reaches (1.25x ragged, 1.34x equal, both at 16 layers), with a small margin; the target is 1.5x
BOUND = {"ragged": 1.3, "equal": 1.4}


@pytest.mark.parametrize("name", sorted(opcount.GROUPS))
def test_backward_step_dispatches_at_most_bound_times_the_plain_steps_ops(name):
    res = opcount.measure((4, 16), group=opcount.one_group(**opcount.GROUPS[name]), dtype=torch.float64)
    print("\n" + opcount.report(res, top=10))
    for layers, (ours, plain) in res.items():
        ratio = ours.total / plain.total
        assert ratio <= BOUND[name], (name, layers, ours.total, plain.total, opcount.report(res, top=15))
        assert ours.ops["_scaled_dot_product_flash_attention_for_cpu"] == 3 * layers  # the counter sees the cascade


def test_counter_attributes_ops_to_their_place():
    model = opcount.tiny_qwen3(2)
    ours = opcount.count(model, opcount.one_group(12, (3, 5)), "ours")
    assert ours.where["attention.merge:merge_state"] > 0 and ours.total == sum(ours.where.values())
    assert any(p.startswith("backward:") for p in ours.where)
