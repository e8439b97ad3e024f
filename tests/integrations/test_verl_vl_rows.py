"""verl's vision-language rows -> sharedprefix groups, and the undoing of verl's class patches: pure logic, no verl
import (runs in the main environment; test_verl_vl.py compares whole engines in the verl one)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_vl import modeling_qwen2_vl as m

from sharedprefix.integrations import verl_vl

IMAGE, VIDEO = 100, 101


class _Config:
    image_token_id = IMAGE
    video_token_id = VIDEO


def _image(seed):
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(16, 24, generator=g), "image_grid_thw": torch.tensor([[1, 4, 4]])}


def test_groups_by_prompt_tokens_and_images():
    prompt = torch.tensor([5, IMAGE, IMAGE, IMAGE, IMAGE, 6])
    rows = [torch.cat([prompt, torch.tensor(r)]) for r in ([7, 8], [9], [7], [3, 4, 2])]
    plen = torch.tensor([6, 6, 6, 6])
    a, b = _image(0), _image(1)
    inputs = [dict(a, images_seqlens=torch.tensor([16])), dict(a), dict(b), dict(b)]
    inputs = [{k: v for k, v in x.items() if k not in verl_vl._NOT_INPUTS} for x in inputs]  # as row_inputs drops it
    groups, members = verl_vl.vl_groups(rows, plen, inputs, _Config)
    assert members == [[0, 1], [2, 3]]  # the same tokens, other images: two groups
    assert [len(g.completions) for g in groups] == [2, 2]
    assert torch.equal(groups[0].prompt_inputs["pixel_values"], a["pixel_values"])
    assert torch.equal(groups[1].prompt_inputs["pixel_values"], b["pixel_values"])
    assert groups[0].prompt_inputs["mm_token_type_ids"].tolist() == [0, 1, 1, 1, 1, 0]
    # (N, T) completion values in group order back onto (B, L) rows, zero on prompt tokens and past each row
    values = torch.arange(1.0, 1.0 + 4 * 3).reshape(4, 3)
    lengths = torch.tensor([len(r) for r in rows])
    out = verl_vl.to_rows(values, groups, members, lengths, plen)
    assert out.shape == (4, 9)
    assert out[0].tolist() == [0, 0, 0, 0, 0, 0, 1, 2, 0]
    assert out[3].tolist() == [0, 0, 0, 0, 0, 0, 10, 11, 12]
    assert verl_vl.image_keys([a])[0] != verl_vl.image_keys([b])[0]
    assert verl_vl.image_keys([a])[0] == verl_vl.image_keys([{k: v.clone() for k, v in a.items()}])[0]
    bf16 = {"pixel_values": a["pixel_values"].bfloat16()}
    assert verl_vl.image_keys([bf16])[0] != verl_vl.image_keys([{"pixel_values": b["pixel_values"].bfloat16()}])[0]


def test_scattered_rows_grouped_and_values_back_and_forth():
    """verl's micro-batches hold rows in verl's order: a group's rows need not be adjacent. Its groups are in the
    order of their first rows, its members in row order; ``from_rows`` inverts ``to_rows`` on the response tokens."""
    prompt = torch.tensor([5, IMAGE, IMAGE, 6])
    text = torch.tensor([7, 8])
    rows = [
        torch.cat([prompt, torch.tensor([1, 2])]),
        torch.cat([text, torch.tensor([3])]),
        torch.cat([prompt, torch.tensor([4])]),
        torch.cat([prompt, torch.tensor([5, 6, 7])]),
        torch.cat([text, torch.tensor([8, 9])]),
    ]
    plen = torch.tensor([4, 2, 4, 4, 2])
    a, b = _image(0), _image(1)
    groups, members = verl_vl.vl_groups(rows, plen, [a, None, a, b, None], _Config)
    assert members == [[0, 2], [1, 4], [3]]  # the same tokens, another image: row 3 is a group of its own
    assert groups[1].prompt_inputs is None and torch.equal(groups[1].prompt, text)
    assert [[c.tolist() for c in g.completions] for g in groups] == [[[1, 2], [4]], [[3], [8, 9]], [[5, 6, 7]]]
    lengths = torch.tensor([len(r) for r in rows])
    native = torch.arange(1.0, 1.0 + 5 * 3).reshape(5, 3) * torch.tensor(
        [[1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]]
    )  # zero past each completion (lengths 2, 1, 1, 2, 3 in group order)
    on_rows = verl_vl.to_rows(native, groups, members, lengths, plen)
    assert on_rows[3].tolist() == [0, 0, 0, 0, 13, 14, 15]
    assert on_rows[4].tolist() == [0, 0, 10, 11, 0, 0, 0]
    assert torch.equal(verl_vl.from_rows(on_rows, groups, members, plen), native)


def test_image_token_in_a_response_refused():
    rows = [torch.tensor([5, IMAGE, 6, 7, IMAGE])]
    with pytest.raises(ValueError, match=r"row 0's response holds image/video token ids \[100\]"):
        verl_vl.vl_groups(rows, torch.tensor([3]), [_image(0)], _Config)


def test_own_forward_undoes_a_patch_and_puts_it_back_also_on_error():
    own = verl_vl.ORIGINALS[(m.Qwen2VLAttention, "forward")]
    assert own.__module__ == m.__name__

    def patched(self, *args, **kwargs):  # what verl's apply_monkey_patch does to the class
        raise AssertionError("verl's forward ran")

    saved = m.Qwen2VLAttention.forward
    m.Qwen2VLAttention.forward = patched
    try:
        with verl_vl.own_forward():
            assert m.Qwen2VLAttention.forward is own
        assert m.Qwen2VLAttention.forward is patched
        with pytest.raises(RuntimeError, match="inside"):
            with verl_vl.own_forward():
                assert m.Qwen2VLAttention.forward is own
                raise RuntimeError("inside")
        assert m.Qwen2VLAttention.forward is patched
    finally:
        m.Qwen2VLAttention.forward = saved


def test_vl_config_refusals():
    class Cfg:
        model_type = "llava"

    with pytest.raises(ValueError, match="model_type='llava' is a vision-language model.*prompt_inputs for"):
        verl_vl.check_vl_config(Cfg, 1)
    for model_type in verl_vl.VL_MODULES:  # their classes as transformers ships them (kernels' wrappers included)
        Cfg.model_type = model_type
        verl_vl.check_vl_config(Cfg, 1)
    Cfg.model_type = "qwen2_vl"
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=2 with the vision-language model 'qwen2_vl'"):
        verl_vl.check_vl_config(Cfg, 2)


def _foreign_init(self, *args, **kwargs):  # a replacement made before sharedprefix's import, e.g. verl's
    raise AssertionError("not the model's own __init__")


def _refused_by_record(monkeypatch, replacement) -> str:
    monkeypatch.setattr(m.Qwen2VLAttention, "__init__", replacement)
    originals, missing = verl_vl._record()
    assert originals[(m.Qwen2VLAttention, "__init__")] is replacement
    return missing["qwen2_vl"]


def test_record_refuses_an_earlier_replacement(monkeypatch):
    why = _refused_by_record(monkeypatch, _foreign_init)
    assert f"Qwen2VLAttention.__init__ (by {__name__}._foreign_init)" in why  # verl's own may be listed too
    assert why.endswith(
        "already replaced when sharedprefix.integrations.verl was imported (expected functions of "
        f"{m.__name__} or of its own kernels decoration), so the model's own functions are unknown; import it first, "
        "through VERL_USE_EXTERNAL_MODULES=sharedprefix.integrations.verl"
    )


def test_record_refuses_a_kernels_lookalike(monkeypatch):
    # the module and name of kernels' wrapper, not its code: still not the model's own
    def new_init(self, *args, **kwargs):
        raise AssertionError("not the model's own __init__")

    new_init.__module__ = "kernels._internals.layer.layer"
    new_init.__qualname__ = "use_kernelized_func.<locals>.decorator.<locals>.new_init"
    why = _refused_by_record(monkeypatch, new_init)
    assert f"Qwen2VLAttention.__init__ (by kernels._internals.layer.layer.{new_init.__qualname__})" in why


def test_record_refuses_the_decoration_around_a_replacement(monkeypatch):
    # the modeling module's own kernels decoration (a no-op without kernels) wrapped around a foreign __init__
    class Other(torch.nn.Module):
        __init__ = _foreign_init

        def forward(self, x):
            return x

    decorate = getattr(m, "use_kernelized_func", None)  # absent from transformers 5.10's module: no decoration
    decorated = decorate(m.apply_rotary_pos_emb)(Other).__init__ if decorate else Other.__init__
    assert (decorated is not _foreign_init) == bool(verl_vl._decoration_code(m))  # wrapped where kernels decorates
    why = _refused_by_record(monkeypatch, decorated)
    assert f"Qwen2VLAttention.__init__ (by {__name__}._foreign_init)" in why
